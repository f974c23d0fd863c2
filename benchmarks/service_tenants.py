"""Many LoRA tenants on one training service: 1, 2, 4 and 8 concurrent SDK clients, side by side in one run.

    python benchmarks/service_tenants.py [--tenants 1,2,4,8] [--steps 3] [--batch 8] [--group 8]
    python benchmarks/service_tenants.py --smoke      # seconds: checks that the script still runs

One ``envhub-train serve`` (the tiny model, LoRA, one torch thread) and one math env server serve every
phase. In a phase, N clients run at once, each with its own API key and its own rank-8 LoRA training
client, each running the GRPO loop of ``examples/tinker_rl.py``, shortened: ``--steps`` steps of
``--batch`` problems x ``--group`` samples through its own ``save_weights_and_get_sampling_client`` ->
``sample`` (one call per problem, all in flight) -> rewards from the env server -> ``forward_backward``
(``importance_sampling`` over every sample: advantages centred per group, so an all-equal group
trains with zero advantage but still costs its pass, which keeps the work per step fixed) ->
``optim_step``. Printed per phase: aggregate sampled tokens/s and training tokens/s (all tenants' tokens
over the phase's wall time), throughput relative to one tenant (target: 4 tenants >= 3x), the median
step time of each tenant, each tenant's mean train reward (from its own samples only), and the
sampler-slot swaps and batches the service reports (``GET /api/v1/service_stats``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from examples.tinker_rl import MathEpisodes, datum, sample_all
from trainer.quickstart import math_server
from trainer.service.serve import local_service


@dataclass
class TenantRun:
    """What one tenant did in a phase."""

    key: str
    step_s: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    sampled_tokens: int = 0
    trained_tokens: int = 0
    sample_s: float = 0.0  # of the steps' time: sampling, rewards (the env server), training
    reward_s: float = 0.0
    train_s: float = 0.0
    error: str | None = None


def grpo_step(tc: Any, episodes: MathEpisodes, indices: list[int], args: argparse.Namespace, run: TenantRun) -> None:
    """One shortened GRPO step of ``examples/tinker_rl.py``, every sample trained on (see the module docstring)."""
    from tinker import types

    began = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompts = [episodes.prompt("train", i) for i in indices]
    groups = sample_all(sampler, prompts, args.group, 1.0, args.max_tokens)
    sampled = time.perf_counter()
    rewards = episodes.rewards([("train", i, s.tokens) for i, g in zip(indices, groups) for s in g])
    rewarded = time.perf_counter()
    rows = []
    for k, (prompt, group) in enumerate(zip(prompts, groups)):
        r = rewards[k * args.group:(k + 1) * args.group]
        mean = sum(r) / len(r)
        rows += [(prompt, seq, reward - mean) for seq, reward in zip(group, r)]
    n_tokens = sum(len(s.tokens) for _, s, _ in rows)
    data = [datum(p, s.tokens, logprobs=s.logprobs, advantages=[a / n_tokens] * len(s.tokens)) for p, s, a in rows]
    fb = tc.forward_backward(data, "importance_sampling")
    tc.optim_step(types.AdamParams(learning_rate=args.lr)).result()
    fb.result()
    run.sample_s += sampled - began
    run.reward_s += rewarded - sampled
    run.train_s += time.perf_counter() - rewarded
    run.rewards.append(sum(rewards) / len(rewards))
    run.sampled_tokens += n_tokens
    run.trained_tokens += sum(len(d.model_input.to_ints()) for d in data)


def tenant(url: str, index: int, episodes: MathEpisodes, args: argparse.Namespace, run: TenantRun,
           start: threading.Barrier) -> None:
    import tinker

    service = tinker.ServiceClient(base_url=url, api_key=run.key)
    try:
        tc = service.create_lora_training_client(base_model="tiny", rank=8, seed=index).result()
        start.wait()
        for step in range(args.steps):
            began = time.perf_counter()
            indices = [(index * 97 + step * args.batch + j) % args.problems for j in range(args.batch)]
            grpo_step(tc, episodes, indices, args, run)
            run.step_s.append(time.perf_counter() - began)
    except Exception as exc:  # reported with the phase; the other tenants carry on
        run.error = f"{type(exc).__name__}: {exc}"
        start.abort()
    finally:
        service.close("success").result(timeout=60)


def phase(url: str, n: int, episodes: MathEpisodes, args: argparse.Namespace) -> dict[str, Any]:
    """N tenants at once; wall time from when all have their training clients to when the last one finishes."""
    runs = [TenantRun(f"tml-tenant-{i}") for i in range(n)]
    start = threading.Barrier(n + 1)
    threads = [threading.Thread(target=tenant, args=(url, i, episodes, args, runs[i], start)) for i in range(n)]
    for t in threads:
        t.start()
    before = stats(url)
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - began
    after = stats(url)
    errors = [r.error for r in runs if r.error]
    if errors:
        raise RuntimeError(f"{n} tenants: {errors}")
    return {"n": n, "wall_s": wall_s, "runs": runs, "sampled_tok_s": sum(r.sampled_tokens for r in runs) / wall_s,
            "trained_tok_s": sum(r.trained_tokens for r in runs) / wall_s,
            "busy": (after["queue"]["busy_s"] - before["queue"]["busy_s"]) / wall_s,
            "swaps": after["sampler_slots"]["swaps"] - before["sampler_slots"]["swaps"],
            "sample_batches": after["queue"]["batches"].get("sample", 0) - before["queue"]["batches"].get("sample", 0),
            "largest_sample_batch": after["queue"]["largest_batch"].get("sample", 0),
            "fwdbwd_batched": (after["queue"]["batched_jobs"].get("forward_backward", 0)
                               - before["queue"]["batched_jobs"].get("forward_backward", 0))}


def stats(url: str) -> dict[str, Any]:
    """The service's scheduler and swap counters (zeros from a service without the stats route: a --baseline)."""
    resp = httpx.get(f"{url}/api/v1/service_stats", headers={"X-API-Key": "tml-bench"}, timeout=30)
    if resp.status_code == 404:
        return {"queue": {"busy_s": 0.0, "batches": {}, "largest_batch": {}, "batched_jobs": {}},
                "sampler_slots": {"swaps": 0}}
    return dict(resp.json())


def report(results: list[dict[str, Any]]) -> None:
    one = results[0]
    print("tenants  wall s  sampled tok/s  trained tok/s  x of 1 tenant  sample batches (largest)  fwd_bwd batched"
          "  swaps")
    for r in results:
        speedup = (r["sampled_tok_s"] + r["trained_tok_s"]) / (one["sampled_tok_s"] + one["trained_tok_s"])
        print(f"{r['n']:7d}  {r['wall_s']:6.1f}  {r['sampled_tok_s']:13.1f}  {r['trained_tok_s']:13.1f}  "
              f"{speedup:13.2f}  {r['sample_batches']:14d} ({r['largest_sample_batch']:3d})  {r['fwdbwd_batched']:15d}"
              f"  {r['swaps']:5d}")
    for r in results:
        runs = r["runs"]
        parts = {k: statistics.fmean(getattr(x, k) / len(x.step_s) for x in runs) for k in ("sample_s", "reward_s", "train_s")}
        print(f"  {r['n']} tenants: service worker busy {100 * r['busy']:.0f}% of the wall time; a step's mean "
              f"sampling {parts['sample_s']:.2f} s, rewards {parts['reward_s']:.2f} s, training {parts['train_s']:.2f} s")
    for r in results:
        per = ", ".join(f"{run.key[4:]}: {statistics.median(run.step_s):.2f} s/step, reward "
                        f"{statistics.fmean(run.rewards):.3f}" for run in r["runs"])
        print(f"  {r['n']} tenants: {per}")
    if len(results) > 1:
        print("(x of 1 tenant: aggregate sampled + trained tokens/s over the 1-tenant phase's; target 4 tenants >= 3)")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", default="1,2,4,8", help="comma-separated tenant counts, one phase each")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per tenant per phase")
    p.add_argument("--batch", type=int, default=8, help="problems per GRPO step")
    p.add_argument("--group", type=int, default=8, help="samples per problem")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--problems", type=int, default=64, help="train problems the tenants draw from")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-window-ms", type=float, default=5.0, help="the service's --batch-window-ms")
    p.add_argument("--baseline", metavar="DIR",
                   help="also run every phase against a service from the source tree in DIR (say `git archive` of "
                        "an earlier commit): before/after in one run")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: checks that the script still runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.tenants, args.steps, args.batch, args.group, args.max_tokens = "1,2", 1, 2, 2, 4
    counts = [int(n) for n in args.tenants.split(",")]
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from trainer.tokenizer import build_tiny_tokenizer

    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        out = Path(tmp)
        env_url = stack.enter_context(math_server(0, out / "math_server.log"))
        episodes = stack.enter_context(closing(MathEpisodes(env_url, build_tiny_tokenizer())))
        args.problems = min(args.problems, episodes.size("train"))
        runs = {"this service": None, **({f"baseline {args.baseline}": args.baseline} if args.baseline else {})}
        results = {}
        for name, source in runs.items():
            serve_args = ["--threads", "1", "--state-dir", str(out / name.replace("/", "_") / "state"),
                          "--max-tenants", str(2 * max(counts))]
            if source is None:
                serve_args += ["--batch-window-ms", str(args.batch_window_ms)]
            with local_service(serve_args, out / f"{name.replace('/', '_')}.log", cwd=source) as url:
                results[name] = [phase(url, n, episodes, args) for n in counts]
    print(f"tiny model, LoRA rank 8, 1 torch thread; {args.steps} GRPO steps per tenant of {args.batch} problems x "
          f"{args.group} samples of <= {args.max_tokens} tokens")
    for name, result in results.items():
        print(f"-- {name}")
        report(result)
    return results["this service"]


if __name__ == "__main__":
    main()
