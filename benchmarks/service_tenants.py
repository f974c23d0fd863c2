"""Many LoRA tenants on one training service: 1, 2, 4 and 8 concurrent SDK clients, side by side in one run.

    python benchmarks/service_tenants.py [--tenants 1,2,4,8] [--steps 8] [--learn-steps 56] [--batch 8] [--group 8]
    python benchmarks/service_tenants.py --smoke      # seconds: checks that the script still runs

One math env server and one ``envhub-train serve`` (LoRA, one torch thread) serve every phase. The served
base is the tiny model warmed up first by SFT in process (``--warmup-target``: greedy train accuracy 0.3,
so GRPO has rewards to raise; ``benchmarks/_tenants/warmup.py``). In a phase, N clients run at once,
each with its own API key and its own rank-8 LoRA training client on that base, each running the GRPO
loop of ``examples/tinker_rl.py``, shortened: ``--steps`` steps of ``--batch`` problems x ``--group``
samples through its own ``save_weights_and_get_sampling_client`` -> ``sample`` (one call per problem,
all in flight) -> rewards from the env server -> ``forward_backward`` (``importance_sampling`` with
tinker_rl's advantages: centred per group, over its std, negative ones dropped; every sample stays in
the batch, an equal-reward group's with advantage 0, which keeps the work per step fixed) ->
``optim_step``, at tinker_rl's learning-rate schedule (5 steps' warm-up to ``--lr``, then linear decay).
Only the first ``--steps`` steps are timed: throughput needs few, learning needs more, so each tenant then
runs ``--learn-steps`` more of the same steps (untimed, still all tenants at once). Before its steps and after
all of them, each tenant scores its own weights on every held-out validation problem, never a train one: the
mean reward of ``--val-samples`` samples (temperature 1) each, with its standard error
(``benchmarks/_tenants/learning.py``); the phase's verdict says whether every tenant's validation rose by more
than twice the standard error of the difference. Rewards are attributed by construction: a tenant's thread
samples only from the sampler its own training client (its own API key) saved, scores those samples' tokens
and records them in its own ``TenantRun``. Printed per phase: aggregate sampled tokens/s and training
tokens/s (all tenants' tokens over the phase's wall time), throughput relative to one tenant (target:
4 tenants >= 3x), the service worker's busy share and its milliseconds per tenant-step by request type,
the median step time of each tenant, each tenant's mean train reward over the first and the last quarter of
its steps (from its own samples only) and its validation reward before -> after, the verdict, and the sample
batches of several requests (with their mean number of requests), merged forward_backward requests and
sampler-slot swaps the service reports (``GET /api/v1/service_stats``);
the CPU time per tenant-step of each process (the clients, the env server, the service and its model worker, the
latter per request type; Linux's /proc), and each ratio split into cores kept busy x CPU per tenant-step x tokens
per tenant-step.
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
import torch

from benchmarks._tenants.learning import Validation, validate, verdict
from benchmarks._tenants.warmup import warmed_base
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
    val_before: Validation | None = None  # this tenant's own sampler on the validation problems, before its steps
    val_after: Validation | None = None  # and after its timed steps and its --learn-steps
    learn_rewards: list[float] = field(default_factory=list)  # the mean train reward of each --learn-steps step
    error: str | None = None


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """``examples/tinker_rl.py``'s schedule over a tenant's timed and learning steps: 5 steps' linear warm-up to
    ``--lr``, then linear decay (a constant rate lets the later steps' noisy 8-problem batches undo the gains)."""
    total = args.steps + args.learn_steps
    return float(args.lr * min(1.0, (step + 1) / 5) * (1 - step / total))


def grpo_step(tc: Any, episodes: MathEpisodes, indices: list[int], args: argparse.Namespace, run: TenantRun,
              lr: float) -> None:
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
        std = statistics.stdev(r) if len(r) > 1 else 0.0
        # examples/tinker_rl.py's advantages (centred, over the group's std, negative ones dropped), but every
        # sample stays in the batch (an equal-reward group's with advantage 0): each step's work is fixed
        rows += [(prompt, seq, max(reward - mean, 0.0) / (std + 1e-6)) for seq, reward in zip(group, r)]
    n_tokens = sum(len(s.tokens) for _, s, _ in rows)
    data = [datum(p, s.tokens, logprobs=s.logprobs, advantages=[a / n_tokens] * len(s.tokens)) for p, s, a in rows]
    fb = tc.forward_backward(data, "importance_sampling")
    tc.optim_step(types.AdamParams(learning_rate=lr, beta2=0.999, grad_clip_norm=1.0)).result()
    fb.result()
    run.sample_s += sampled - began
    run.reward_s += rewarded - sampled
    run.train_s += time.perf_counter() - rewarded
    run.rewards.append(sum(rewards) / len(rewards))
    run.sampled_tokens += n_tokens
    run.trained_tokens += sum(len(d.model_input.to_ints()) for d in data)


def validation_reward(tc: Any, episodes: MathEpisodes, args: argparse.Namespace) -> Validation:
    """This tenant's current weights on every held-out problem, through a sampler of its own training client."""
    return validate(tc.save_weights_and_get_sampling_client().result(), episodes, args.val_samples, args.max_tokens)


def indices_of(index: int, step: int, args: argparse.Namespace) -> list[int]:
    """The train problems of tenant ``index``'s ``step``: each tenant its own stretch of the train problems."""
    return [(index * 97 + step * args.batch + j) % args.problems for j in range(args.batch)]


def tenant(url: str, index: int, episodes: MathEpisodes, args: argparse.Namespace, run: TenantRun,
           start: threading.Barrier, finish: threading.Barrier) -> None:
    import tinker

    service = tinker.ServiceClient(base_url=url, api_key=run.key)
    try:
        tc = service.create_lora_training_client(base_model="tiny", rank=8, seed=index).result()
        run.val_before = validation_reward(tc, episodes, args)
        start.wait()
        for step in range(args.steps):
            began = time.perf_counter()
            grpo_step(tc, episodes, indices_of(index, step, args), args, run, learning_rate(step, args))
            run.step_s.append(time.perf_counter() - began)
        finish.wait()  # the phase's wall time ends here: the learning steps and validation are not part of it
        learning = TenantRun(run.key)  # the same GRPO steps, still concurrent, counted apart from the timed ones
        for step in range(args.steps, args.steps + args.learn_steps):
            grpo_step(tc, episodes, indices_of(index, step, args), args, learning,
                      learning_rate(step, args))
        run.learn_rewards = learning.rewards
        run.val_after = validation_reward(tc, episodes, args)
    except Exception as exc:  # reported with the phase; the other tenants carry on
        run.error = f"{type(exc).__name__}: {exc}"
        start.abort()
        finish.abort()
    finally:
        service.close("success").result(timeout=60)


def phase(url: str, n: int, episodes: MathEpisodes, args: argparse.Namespace) -> dict[str, Any]:
    """N tenants at once; wall time from when all have their training clients to when the last one finishes."""
    runs = [TenantRun(f"tml-tenant-{i}") for i in range(n)]
    marks: dict[str, Any] = {}  # the service's counters and the clock as the timed part starts and ends
    start = threading.Barrier(n, action=lambda: marks.update(before=stats(url), cpu_before=cpu_seconds(),
                                                             began=time.perf_counter()))
    finish = threading.Barrier(n, action=lambda: marks.update(after=stats(url), cpu_after=cpu_seconds(),
                                                              ended=time.perf_counter()))
    threads = [threading.Thread(target=tenant, args=(url, i, episodes, args, runs[i], start, finish))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r.error for r in runs if r.error]
    if errors:
        raise RuntimeError(f"{n} tenants: {errors}")
    before, after, wall_s = marks["before"], marks["after"], marks["ended"] - marks["began"]
    return {"n": n, "wall_s": wall_s, "runs": runs, "sampled_tok_s": sum(r.sampled_tokens for r in runs) / wall_s,
            "trained_tok_s": sum(r.trained_tokens for r in runs) / wall_s,
            "busy": (after["queue"]["busy_s"] - before["queue"]["busy_s"]) / wall_s,
            "worker_cpu_s": after["queue"].get("busy_cpu_s", 0.0) - before["queue"].get("busy_cpu_s", 0.0),
            "cpu_by_type": {k: v - before["queue"].get("busy_cpu_by_type", {}).get(k, 0.0)
                            for k, v in after["queue"].get("busy_cpu_by_type", {}).items()},
            "busy_by_type": {k: v - before["queue"].get("busy_by_type", {}).get(k, 0.0)
                             for k, v in after["queue"].get("busy_by_type", {}).items()},
            "swaps": after["sampler_slots"]["swaps"] - before["sampler_slots"]["swaps"],
            "cpu_s": {k: v - marks["cpu_before"].get(k, 0.0) for k, v in marks["cpu_after"].items()},
            "load": os.getloadavg()[0],
            "sample_batches": after["queue"]["batches"].get("sample", 0) - before["queue"]["batches"].get("sample", 0),
            "sample_batched": (after["queue"]["batched_jobs"].get("sample", 0)
                               - before["queue"]["batched_jobs"].get("sample", 0)),
            "fwdbwd_batched": (after["queue"]["batched_jobs"].get("forward_backward", 0)
                               - before["queue"]["batched_jobs"].get("forward_backward", 0))}


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process (the clients), the service and the env server (Linux's
    /proc; empty elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, float, str]] = {}  # pid -> (parent, cpu seconds, command line)
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # a process that just ended
            continue
        procs[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmdline)
    me = os.getpid()
    out = {"clients": procs[me][1]} if me in procs else {}
    family = {me}
    for pid in sorted(procs):  # children start after their parent: ascending ids find them (barring wrap-around)
        parent, cpu_s, cmdline = procs[pid]
        if parent in family and pid != me:
            family.add(pid)
            name = "service" if " serve " in cmdline else "env server"
            out[name] = out.get(name, 0.0) + cpu_s
    return out


def stats(url: str) -> dict[str, Any]:
    """The service's scheduler and swap counters (zeros from a service without the stats route: a --baseline)."""
    resp = httpx.get(f"{url}/api/v1/service_stats", headers={"X-API-Key": "tml-bench"}, timeout=30)
    if resp.status_code == 404:
        return {"queue": {"busy_s": 0.0, "batches": {}, "largest_batch": {}, "batched_jobs": {}},
                "sampler_slots": {"swaps": 0}}
    return dict(resp.json())


def report(results: list[dict[str, Any]]) -> None:
    one = results[0]
    print("tenants  wall s  sampled tok/s  trained tok/s  x of 1 tenant  sample batches (requests each)  fwd_bwd batched"
          "  swaps")
    for r in results:
        speedup = (r["sampled_tok_s"] + r["trained_tok_s"]) / (one["sampled_tok_s"] + one["trained_tok_s"])
        print(f"{r['n']:7d}  {r['wall_s']:6.1f}  {r['sampled_tok_s']:13.1f}  {r['trained_tok_s']:13.1f}  "
              f"{speedup:13.2f}  {r['sample_batches']:14d} ({r['sample_batched'] / max(r['sample_batches'], 1):5.1f})"
              f"          {r['fwdbwd_batched']:15d}"
              f"  {r['swaps']:5d}")
    for r in results:
        runs = r["runs"]
        parts = {k: statistics.fmean(getattr(x, k) / len(x.step_s) for x in runs) for k in ("sample_s", "reward_s", "train_s")}
        print(f"  {r['n']} tenants: service worker busy {100 * r['busy']:.0f}% of the wall time; a step's mean "
              f"sampling {parts['sample_s']:.2f} s, rewards {parts['reward_s']:.2f} s, training {parts['train_s']:.2f} s")
        steps = sum(len(x.step_s) for x in runs)
        work = ", ".join(f"{kind} {1000 * s / steps:.0f}" for kind, s in sorted(r["busy_by_type"].items()) if s > 0)
        print(f"    service worker ms per tenant-step: {work}")
        if r["cpu_by_type"]:
            cpu_work = ", ".join(f"{kind} {1000 * s / steps:.0f}" for kind, s in sorted(r["cpu_by_type"].items()) if s > 0)
            print(f"    service worker CPU ms per tenant-step: {cpu_work}")
        cpu = ", ".join(f"{k} {1000 * v / steps:.0f}" for k, v in sorted(r["cpu_s"].items()))
        cpu += f" (its model worker {1000 * r['worker_cpu_s'] / steps:.0f})" if r["worker_cpu_s"] else ""
        print(f"    CPU ms per tenant-step: {cpu} (all: {1000 * sum(r['cpu_s'].values()) / steps:.0f}; "
              f"{sum(r['cpu_s'].values()) / r['wall_s']:.2f} cores busy; load average {r['load']:.1f})")
    for r in results:
        per = ", ".join(f"{run.key[4:]}: {statistics.median(run.step_s):.2f} s/step" for run in r["runs"])
        print(f"  {r['n']} tenants: {per}")
    for r in results:
        print(f"  {r['n']} tenants, learning:")
        for run in r["runs"]:
            train = run.rewards + run.learn_rewards
            quarter = max(len(train) // 4, 1)
            print(f"    {run.key[4:]}: train reward {statistics.fmean(train[:quarter]):.3f} (first quarter of its steps) -> "
                  f"{statistics.fmean(train[-quarter:]):.3f} (last), validation {run.val_before} -> {run.val_after}")
        print(f"    {verdict([(run.val_before, run.val_after) for run in r['runs'] if run.val_before and run.val_after])}")
    if len(results) > 1:
        print("(x of 1 tenant: aggregate sampled + trained tokens/s over the 1-tenant phase's; target 4 tenants >= 3)")
    factors = [_factors(r, one) for r in results[1:]]
    for r, f in zip(results[1:], factors):
        if f is not None:
            print(f"  {r['n']} tenants: x of 1 tenant {f[0] * f[1] * f[2]:.2f} = {f[0]:.2f} (cores busy, over 1 tenant's) "
                  f"x {f[1]:.2f} (1 tenant's CPU per tenant-step, over theirs) x {f[2]:.2f} (tokens per tenant-step)")


def _factors(r: dict[str, Any], one: dict[str, Any]) -> tuple[float, float, float] | None:
    """The throughput ratio of phase ``r`` to ``one`` as the product of: how many more cores its processes kept
    busy, how much less CPU a tenant-step took, and how many more tokens a tenant-step had (None without /proc)."""
    def per_phase(x: dict[str, Any]) -> tuple[float, float, float]:
        cpu_s, steps = sum(x["cpu_s"].values()), sum(len(run.step_s) for run in x["runs"])
        tokens = sum(run.sampled_tokens + run.trained_tokens for run in x["runs"])
        return cpu_s / x["wall_s"], cpu_s / steps, tokens / steps
    if not r["cpu_s"] or not one["cpu_s"]:
        return None
    (cores, cpu, tokens), (cores1, cpu1, tokens1) = per_phase(r), per_phase(one)
    return cores / cores1, cpu1 / cpu, tokens / tokens1


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", default="1,2,4,8", help="comma-separated tenant counts, one phase each")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps per tenant per phase")
    p.add_argument("--batch", type=int, default=8, help="problems per GRPO step")
    p.add_argument("--group", type=int, default=8, help="samples per problem")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--problems", type=int, default=64, help="train problems the tenants draw from")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate of the GRPO steps")
    p.add_argument("--batch-window-ms", type=float, default=5.0, help="the service's --batch-window-ms")
    p.add_argument("--baseline", metavar="DIR",
                   help="also run every phase against a service from the source tree in DIR (say `git archive` of "
                        "an earlier commit): before/after in one run")
    p.add_argument("--warmup-target", type=float, default=0.3,
                   help="SFT the shared base until greedy train accuracy reaches this first (0: the random tiny model)")
    p.add_argument("--warmup-steps", type=int, default=400, help="the most SFT warm-up steps")
    p.add_argument("--warmup-dir", metavar="DIR",
                   help="keep the warmed-up base here and reuse it when DIR already holds one (default: a temporary one)")
    p.add_argument("--learn-steps", type=int, default=56,
                   help="further GRPO steps per tenant after the timed ones, untimed, before validation: enough for "
                        "validation to move clearly (the timed steps measure throughput, which needs few)")
    p.add_argument("--val-samples", type=int, default=64, help="samples per held-out problem for the validation reward")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: checks that the script still runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.tenants, args.steps, args.batch, args.group, args.max_tokens = "1,2", 1, 2, 2, 4
        args.learn_steps, args.val_samples = 1, 2
        args.warmup_target = 0.0
    counts = [int(n) for n in args.tenants.split(",")]
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from trainer.tokenizer import build_tiny_tokenizer

    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        out = Path(tmp)
        env_url = stack.enter_context(math_server(0, out / "math_server.log"))
        episodes = stack.enter_context(closing(MathEpisodes(env_url, build_tiny_tokenizer())))
        args.problems = min(args.problems, episodes.size("train"))
        base = []
        if args.warmup_target > 0:
            path = Path(args.warmup_dir or out / "base")
            if not (path / "config.json").exists():
                torch.set_num_threads(1)
                _, steps, acc = warmed_base(episodes, path, target=args.warmup_target, max_steps=args.warmup_steps)
                print(f"warm-up: {steps} SFT steps, greedy train accuracy {acc:.2f}", flush=True)
            base = ["--model", str(path), "--served-name", "tiny"]
        runs = {"this service": None, **({f"baseline {args.baseline}": args.baseline} if args.baseline else {})}
        results = {}
        for name, source in runs.items():
            serve_args = [*base, "--threads", "1", "--state-dir", str(out / name.replace("/", "_") / "state"),
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
