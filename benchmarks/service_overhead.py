"""Overhead of the training service: the same SFT and GRPO steps through ``envhub-train serve`` and in process.

    python benchmarks/service_overhead.py [--steps 10] [--repeats 3] [--lora]

In process, the steps call the training core directly (``ModelHost`` and its ``TrainingClient``);
through the service, the official ``tinker`` SDK drives ``envhub-train serve`` in a subprocess over
loopback HTTP (protobuf batches, long-polled futures, SQLite). Both use the tiny model of the quick
start, one torch thread, the same data and the same seeds. An SFT step is ``forward_backward``
(cross-entropy, 32 sequences of 48 tokens) + ``optim_step``; a GRPO step is a sampler over the current
weights, 16 prompts x 8 samples of 12 tokens, then ``forward_backward`` (importance sampling over the
128 sequences) + ``optim_step``. Runs alternate; the script prints the median seconds per step and
the ratio service / in process (target: <= 1.2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer import core
from trainer.service.serve import local_service, model_config

SFT_BATCH, SFT_LEN = 32, 48
PROMPTS, GROUP, MAX_TOKENS, PROMPT_LEN = 16, 8, 12, 24


def sft_rows(step: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(model input, targets, weights) for one SFT batch: byte-like token ids, a mean over its tokens."""
    rows = []
    for i in range(SFT_BATCH):
        ids = [(7 * step + 13 * i + 3 * t) % 250 + 1 for t in range(SFT_LEN + 1)]
        rows.append((ids[:-1], ids[1:], [1.0 / (SFT_BATCH * SFT_LEN)] * SFT_LEN))
    return rows


def prompts(step: int) -> list[list[int]]:
    return [[(11 * step + 5 * i + t) % 250 + 1 for t in range(PROMPT_LEN)] for i in range(PROMPTS)]


def grpo_rows(groups: list[tuple[list[int], list[list[int]], list[list[float]]]]):
    """Importance-sampling rows: each sample's tokens, sampler log-probs and a fixed +-1 advantage per group."""
    n_tokens = sum(len(s) for _, samples, _ in groups for s in samples)
    rows = []
    for prompt, samples, logprobs in groups:
        for j, (seq, lps) in enumerate(zip(samples, logprobs)):
            tokens = prompt + seq
            pad = [0.0] * (len(prompt) - 1)
            adv = (1.0 if j % 2 else -1.0) / n_tokens
            rows.append((tokens[:-1], tokens[1:], pad + lps, pad + [adv] * len(seq)))
    return rows


class InProcess:
    name = "in process (training core)"

    def __init__(self, lora: bool):
        torch.set_num_threads(1)
        self.host = core.ModelHost(model_config("tiny", []), max_tenants=4)
        self.client = (self.host.create_lora_client("bench", rank=8, seed=0) if lora
                       else self.host.create_full_client("bench"))

    def sft_step(self, step: int) -> None:
        data = [core.Datum(x, {"target_tokens": y, "weights": w}) for x, y, w in sft_rows(step)]
        self.client.forward_backward(data, "cross_entropy")
        self.client.optim_step(core.AdamParams(learning_rate=1e-4))

    def grpo_step(self, step: int) -> None:
        sampler = self.client.sampling_client()
        params = core.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop=[], seed=step)
        groups = []
        for p in prompts(step):
            out = sampler.sample(p, GROUP, params)
            groups.append((p, [s.tokens for s in out.sequences], [s.logprobs for s in out.sequences]))
        data = [core.Datum(x, {"target_tokens": y, "logprobs": lp, "advantages": a})
                for x, y, lp, a in grpo_rows(groups)]
        self.client.forward_backward(data, "importance_sampling")
        self.client.optim_step(core.AdamParams(learning_rate=1e-4))

    def close(self) -> None:
        pass


class ThroughService:
    name = "service (tinker SDK, HTTP)"

    def __init__(self, lora: bool, workdir: Path, source: str | None = None):
        import tinker

        self.types = tinker.types
        if source:
            self.name = f"service from {Path(source).name}"
        args = ["--threads", "1", "--state-dir", str(workdir / "state")] + ([] if lora else ["--full-parameter"])
        self._service = local_service(args, workdir / "service.log", cwd=source)
        url = self._service.__enter__()
        self.sc = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.tc = self.sc.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()

    def _datum(self, x: list[int], inputs: dict[str, list]) -> Any:
        return self.types.Datum(model_input=self.types.ModelInput.from_ints(x), loss_fn_inputs=inputs)

    def sft_step(self, step: int) -> None:
        data = [self._datum(x, {"target_tokens": y, "weights": w}) for x, y, w in sft_rows(step)]
        fb = self.tc.forward_backward(data, "cross_entropy")
        self.tc.optim_step(self.types.AdamParams(learning_rate=1e-4)).result()
        fb.result()

    def grpo_step(self, step: int) -> None:
        t = self.types
        sampler = self.tc.save_weights_and_get_sampling_client().result()
        params = t.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop=[], seed=step)
        futures = [(p, sampler.sample(t.ModelInput.from_ints(p), GROUP, params)) for p in prompts(step)]
        groups = []
        for p, f in futures:
            seqs = f.result().sequences
            groups.append((p, [list(s.tokens) for s in seqs], [list(s.logprobs) for s in seqs]))
        data = [self._datum(x, {"target_tokens": y, "logprobs": lp, "advantages": a})
                for x, y, lp, a in grpo_rows(groups)]
        fb = self.tc.forward_backward(data, "importance_sampling")
        self.tc.optim_step(t.AdamParams(learning_rate=1e-4)).result()
        fb.result()

    def close(self) -> None:
        self.sc.close("success").result(timeout=30)
        self._service.__exit__(None, None, None)


def time_steps(step_fn: Callable[[int], None], steps: int, offset: int) -> float:
    """Median seconds per step over ``steps`` steps (after one warm-up step)."""
    step_fn(offset)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step_fn(offset + 1 + i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each")
    p.add_argument("--lora", action="store_true", help="a rank-8 LoRA tenant instead of full-parameter training")
    p.add_argument("--baseline", metavar="DIR",
                   help="also time a service run from the source tree in DIR (say `git archive` of an earlier "
                        "commit), alternating with this one: before/after side by side")
    p.add_argument("--kinds", default="sft,grpo", help="which steps to time: sft, grpo or both (default)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: checks that the script still runs (CI does this)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats = 1, 1
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - {"sft", "grpo"}:
        p.error(f"Expected --kinds from sft, grpo, got {args.kinds!r}.")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with tempfile.TemporaryDirectory() as tmp:
        local, remote = InProcess(args.lora), ThroughService(args.lora, Path(tmp) / "this")
        services = [remote] + ([ThroughService(args.lora, Path(tmp) / "baseline", args.baseline)]
                               if args.baseline else [])
        results: dict[tuple[str, str], list[float]] = {}
        try:
            for r in range(args.repeats):
                for runner in (local, *services):
                    for kind in kinds:
                        fn = runner.sft_step if kind == "sft" else runner.grpo_step
                        results.setdefault((runner.name, kind), []).append(
                            time_steps(fn, args.steps, 1000 * r))
        finally:
            for service in services:
                service.close()
    mode = "LoRA rank 8" if args.lora else "full-parameter"
    print(f"tiny model, {mode}, 1 torch thread; median s/step of {args.repeats} alternating runs x {args.steps} steps")
    ratios = {}
    for kind in kinds:
        med = {name: statistics.median(results[name, kind]) for name in (local.name, *(s.name for s in services))}
        for name, m in med.items():
            runs = ", ".join(f"{x:.4f}" for x in results[name, kind])
            print(f"  {kind:4s} {name:28s} {m:8.4f} s/step   runs: {runs}")
        ratios[kind] = med[remote.name] / med[local.name]
        print(f"  {kind:4s} ratio service / in process: {ratios[kind]:.3f}  (target <= 1.2)")
        for service in services[1:]:
            print(f"  {kind:4s} ratio {service.name} / in process: {med[service.name] / med[local.name]:.3f}")
    return ratios


if __name__ == "__main__":
    main()
