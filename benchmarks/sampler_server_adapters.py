"""A sampler server's HF backend answering one batch of several LoRA adapters: peft adapters, one decode per
adapter (the backend before per-row adapters) against plain LoRA tensors in ONE decode pass
(:class:`~trainer.sampler_server.backends.HFBackend`: per-row adapters, the lean decode kernel, shared
prefills), side by side in one process, alternating, on the same adapters and prompts.

The peft path is what the backend ran before: the adapters as peft adapters on the model, the batcher
grouping jobs by adapter, each group one :func:`~trainer.sampling.decode.decode` call with peft's
``adapter_names`` (the Hugging Face forward, every row's prefill). Both paths sample at temperature 1 from
the same seed; the figure is the wall time of answering the whole batch (median of ``--repeats``).

    .venv/bin/python benchmarks/sampler_server_adapters.py                     # 4 adapters x 16 rows, two shapes
    .venv/bin/python benchmarks/sampler_server_adapters.py --adapters 8 --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import torch

from trainer.model import ModelConfig, load_policy
from trainer.sampler_server.backends import HFBackend
from trainer.sampler_server.protocol import SampleJob
from trainer.sampling.decode import decode
from trainer.sampling.wire import StreamHeader, TensorSpec

SHAPES = {
    "tiny (quick start)": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256),
    "small": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1024),
}


def adapters_for(cfg: ModelConfig, count: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """``count`` random adapters (peft state dicts, non-zero B) for the model of ``cfg``."""
    from peft import get_peft_model_state_dict

    out = []
    for seed in range(count):
        torch.manual_seed(seed)
        policy, _ = load_policy(dataclasses.replace(cfg, lora_rank=rank))
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        out.append({k: v.detach().clone() for k, v in get_peft_model_state_dict(policy).items()})
    return out


class PeftPath:
    """The backend before per-row adapters: peft adapters on the model, one ``adapter_names`` decode per adapter."""

    def __init__(self, cfg: ModelConfig, adapters: list[dict[str, torch.Tensor]], rank: int):
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        base, tok = load_policy(cfg)
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0,
                          task_type="CAUSAL_LM")
        self.model: Any = get_peft_model(base, lora, adapter_name="slot0").eval()
        for i in range(1, len(adapters)):
            self.model.add_adapter(f"slot{i}", lora)
        for i, state in enumerate(adapters):
            set_peft_model_state_dict(self.model, state, adapter_name=f"slot{i}")
        self.eos, self.pad = int(tok.eos_token_id), int(tok.pad_token_id or tok.eos_token_id)

    def answer(self, groups: list[list[SampleJob]]) -> int:
        tokens = 0
        for i, jobs in enumerate(groups):
            rows = [job.prompt_ids for job in jobs for _ in range(job.n)]
            width = max(len(r) for r in rows)
            ids_BT = torch.full((len(rows), width), self.pad)
            attn_BT = torch.zeros_like(ids_BT)
            for b, ids in enumerate(rows):
                ids_BT[b, width - len(ids):], attn_BT[b, width - len(ids):] = torch.tensor(ids), 1
            out = decode(self.model, ids_BT, attn_BT, max_new_tokens=jobs[0].max_tokens, eos_ids={self.eos},
                         adapter_names=[f"slot{i}"] * len(rows))
            tokens += sum(len(t) for t in out.token_ids)
        return tokens


def row_adapters_path(cfg: ModelConfig, adapters: list[dict[str, torch.Tensor]], rank: int) -> HFBackend:
    """The server's backend with the adapters loaded as it loads a push (plan, fill, apply)."""
    backend = HFBackend(cfg, max_adapters=len(adapters))
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear"}
    for i, state in enumerate(adapters):
        specs = {k: TensorSpec(t.dtype, tuple(t.shape), 0, 0) for k, t in state.items()}
        plan = backend.plan_adapter(f"tenant{i}", config, StreamHeader(specs, {}))
        for key, tensor in plan.items():
            tensor.copy_(state[key])
        backend.apply_adapter(f"tenant{i}", plan, 1)
    return backend


def run_shape(name: str, shape: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    cfg = ModelConfig(**shape, dtype="fp32")
    adapters = adapters_for(cfg, args.adapters, args.rank)
    peft_path, backend = PeftPath(cfg, adapters, args.rank), row_adapters_path(cfg, adapters, args.rank)
    per_adapter = args.rows // args.n  # prompts per adapter, n samples each (a GRPO group)
    groups = [[SampleJob(tuple(range(3 + p + 7 * a, 3 + p + 7 * a + args.prompt_tokens)), args.n, args.max_tokens,
                         adapter=f"tenant{a}") for p in range(per_adapter)] for a in range(args.adapters)]
    times: dict[str, list[float]] = {"peft, one decode per adapter": [], "row adapters, one decode": []}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):  # alternating, so both see the same machine load
        torch.manual_seed(0)
        start = time.perf_counter()
        tokens["peft, one decode per adapter"] = peft_path.answer(groups)
        times["peft, one decode per adapter"].append(time.perf_counter() - start)
        torch.manual_seed(0)
        start = time.perf_counter()
        outcomes = backend.generate([job for jobs in groups for job in jobs])
        times["row adapters, one decode"].append(time.perf_counter() - start)
        tokens["row adapters, one decode"] = sum(len(s.token_ids) for o in outcomes if not isinstance(o, Exception)
                                                 for s in o[0])
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratio = medians["peft, one decode per adapter"] / medians["row adapters, one decode"]
    return {"shape": name, "adapters": args.adapters, "rows": args.adapters * args.rows,
            "median_s": {k: round(v, 4) for k, v in medians.items()}, "tokens": tokens,
            "speedup (peft time / row-adapters time)": round(ratio, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rows", type=int, default=16, help="rows per adapter (prompts x n)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="seconds: one shape, two repeats, few tokens")
    args = p.parse_args()
    if args.smoke:
        args.repeats, args.max_tokens = 2, 4
    torch.set_num_threads(args.threads)
    shapes = list(SHAPES.items())[:1] if args.smoke else list(SHAPES.items())
    for name, shape in shapes:
        print(json.dumps(run_shape(name, shape, args)), flush=True)


if __name__ == "__main__":
    main()
