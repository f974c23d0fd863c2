"""Merged multi-tenant passes in process: k LoRA tenants' work in one pass against k separate passes.

    python benchmarks/merged_passes.py [--tenants 1,4,8] [--repeats 5] [--baseline DIR]

The per-tenant workload of ``benchmarks/service_tenants.py``'s GRPO step, on the tiny model (one torch
thread) with rank-8 LoRA tenants on one :class:`~trainer.core.host.ModelHost`: a **sample batch** of 8 math
problems x 8 samples of at most 12 tokens at temperature 1 (``trainer.core.batch_sampling.sample_batch``, the
service's engine batch; the prompts are the math env's chat prompts) and a **forward_backward** of those 64
sequences with ``importance_sampling`` (``ModelHost.forward_backward_batch``). For each k it times the k tenants'
work merged into one call and the same work as k calls of one tenant each, alternating, and prints medians and
each figure over one tenant's (ideal merging: merged / 1 tenant < k; the 1-tenant figure is the k=1 call).
``--baseline DIR`` runs the same measurement on the source tree in DIR (say a ``git archive`` of an earlier
commit) too, a process per tree per repeat, alternating, and prints both side by side.
``--profile KIND`` prints a ``torch.profiler`` table of one merged call of the largest k instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the tree under test: this one, or a --baseline's (set for the child processes)
sys.path.insert(0, os.environ.get("MERGED_PASSES_TREE", str(Path(__file__).resolve().parents[1])))

import torch

from env_servers.math_env.env import MathEnv
from trainer.core import Datum, SamplingParams
from trainer.core.batch_sampling import SampleRequest, sample_batch
from trainer.core.host import ModelHost
from trainer.core.sampling import SamplingClient
from trainer.model import ModelConfig
from trainer.quickstart import SYSTEM_PROMPT


def math_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """The chat prompts of ``n`` train problems, as ``examples/tinker_rl.py`` builds them from the math env server
    ``benchmarks/service_tenants.py`` runs (the quick start's system prompt, no extra instruction)."""
    env = MathEnv(system_prompt=SYSTEM_PROMPT, instruction="")
    prompts = []
    for i in range(n):
        obs = env.reset(split="train", index=i, kind="add", difficulty=1)
        messages = [{"role": "system", "content": obs.metadata["system_prompt"]}, {"role": "user", "content": obs.text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


class Workload:
    """Tenants on one host and each tenant's sample requests and training data."""

    def __init__(self, tenants: int, problems: int, group: int, max_tokens: int):
        torch.manual_seed(0)
        self.host = ModelHost(ModelConfig(name="tiny"), max_tenants=tenants)
        tok = self.host.tokenizer
        self.clients = [self.host.create_lora_client(f"t{i}", rank=8, seed=i) for i in range(tenants)]
        self.samplers = [SamplingClient(self.host.model, tok, adapter=c.adapter) for c in self.clients]
        self.params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
        self.prompts = math_prompts(tok, problems * tenants)
        self.problems, self.group = problems, group
        self.data = [self._data(k) for k in range(tenants)]

    def requests(self, k: int) -> list[SampleRequest]:
        """Tenant ``k``'s sample requests: one per problem (its own problems, as in the service benchmark)."""
        prompts = self.prompts[k * self.problems:(k + 1) * self.problems]
        return [SampleRequest(self.samplers[k], p, self.group, self.params) for p in prompts]

    def _data(self, k: int) -> list[Datum]:
        outs = sample_batch(self.requests(k))
        data = []
        for prompt, out in zip(self.prompts[k * self.problems:], outs):
            for seq in out.sequences:
                ids = prompt + seq.tokens
                n, c = len(prompt) - 1, len(seq.tokens)
                data.append(Datum(ids[:-1], {"target_tokens": ids[1:], "logprobs": [0.0] * n + seq.logprobs,
                                             "advantages": [0.0] * n + [0.01] * c}))
        return data

    def sample(self, tenants: list[int]) -> None:
        sample_batch([r for k in tenants for r in self.requests(k)])

    def forward_backward(self, tenants: list[int]) -> None:
        outs = self.host.forward_backward_batch(
            [(self.clients[k], self.data[k], "importance_sampling", {}) for k in tenants])
        for out in outs:
            if isinstance(out, BaseException):
                raise out
        for k in tenants:  # the gradients are what a step would apply; clear them as optim_step would
            self.clients[k].model.zero_grad(set_to_none=True)


def timed(fn: Callable[[], None]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure(work: Workload, kind: str, counts: list[int], repeats: int) -> dict[str, float]:
    """Median seconds of: one tenant ("1"), k merged ("k merged"), k separate ("k separate")."""
    run = getattr(work, kind)
    times: dict[str, list[float]] = {"1": []}
    for k in counts:
        times[f"{k} merged"], times[f"{k} separate"] = [], []
    run([0])  # warm-up
    for _ in range(repeats):
        times["1"].append(timed(lambda: run([0])))
        for k in counts:
            if k == 1:
                continue
            times[f"{k} merged"].append(timed(lambda k=k: run(list(range(k)))))
            times[f"{k} separate"].append(timed(lambda k=k: [run([i]) for i in range(k)]))
    return {name: statistics.median(ts) for name, ts in times.items() if ts}


def profile(work: Workload, kind: str, k: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run = getattr(work, kind)
    run(list(range(k)))
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run(list(range(k)))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def side_by_side(args: argparse.Namespace, argv: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Medians of one child process per tree per repeat, the trees alternating."""
    trees = {"this tree": str(Path(__file__).resolve().parents[1]), "baseline": str(Path(args.baseline).resolve())}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    child = [a for a in argv if not a.startswith("--baseline") and a != args.baseline]
    for _ in range(args.repeats):
        for name, tree in trees.items():
            env = {**os.environ, "MERGED_PASSES_TREE": tree, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, __file__, *child, "--repeats", "1", "--json"], env=env, cwd=tree,
                                 check=True, capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    return {name: {kind: {m: statistics.median(r[kind][m] for r in rs) for m in rs[0][kind]} for kind in rs[0]}
            for name, rs in runs.items()}


def report(name: str, results: dict[str, dict[str, float]]) -> None:
    print(f"-- {name}")
    for kind, res in results.items():
        one = res["1"]
        cells = [f"1: {one:.3f} s"] + [f"{m}: {s:.3f} s ({s / one:.2f}x)" for m, s in res.items() if m != "1"]
        print(f"{kind:17s} " + ", ".join(cells))


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", default="1,4,8", help="comma-separated tenant counts")
    p.add_argument("--kinds", default="sample,forward_backward", help="which passes to time")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--problems", type=int, default=8, help="problems per tenant")
    p.add_argument("--group", type=int, default=8, help="samples per problem")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--pass-tokens", type=int, default=0,
                   help="the host's max_pass_tokens for forward_backward (0: its default; -1: no bound)")
    p.add_argument("--baseline", metavar="DIR", help="also measure the source tree in DIR, alternating")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a --baseline child's output
    p.add_argument("--profile", metavar="KIND", help="profile one merged pass of KIND at the largest tenant count")
    p.add_argument("--smoke", action="store_true", help="seconds: 1 and 2 tenants, one repeat, 2 problems x 2 samples")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.smoke:
        args.tenants, args.repeats, args.problems, args.group, args.max_tokens = "1,2", 1, 2, 2, 4
    torch.set_num_threads(1)
    counts = [int(n) for n in args.tenants.split(",")]
    print(f"tiny model, LoRA rank 8, 1 torch thread; per tenant {args.problems} problems x {args.group} samples of "
          f"<= {args.max_tokens} tokens, side by side (k merged / 1 tenant below k: merging pays; k separate / 1 "
          "tenant is about k)", flush=True)
    if args.baseline:
        both = side_by_side(args, argv)
        for name, res in both.items():
            report(name, res)
        return both["this tree"]
    work = Workload(max(counts), args.problems, args.group, args.max_tokens)
    if args.pass_tokens:
        work.host.max_pass_tokens = None if args.pass_tokens < 0 else args.pass_tokens
    if args.profile:
        profile(work, args.profile, max(counts))
        return {}
    results = {kind: measure(work, kind, counts, args.repeats) for kind in args.kinds.split(",")}
    if args.json:
        print(json.dumps(results))
    else:
        report(f"prompts {len(work.prompts[0])} tokens; forward_backward {sum(len(d) for d in work.data[0])} tokens "
               "per tenant", results)
    return results


if __name__ == "__main__":
    main()
