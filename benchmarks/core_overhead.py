"""What the training core costs, on the CPU: its SFT step against the same step in plain torch, and one batched
pass for several LoRA tenants against one pass per tenant.

1. ``sft``: a batch of token sequences, token-mean cross-entropy, backward, gradient clipping, AdamW. Plain torch pads, runs the
   model, takes the loss and steps; the core does ``forward_backward([Datum...], "cross_entropy")`` (weights
   ``1 / tokens``) and ``optim_step``. Both start from the same weights and must end on the same loss.
2. ``tenants``: N LoRA tenants on one base (``ModelHost``), each with its own batch: N ``forward_backward`` calls
   against one ``forward_backward_batch`` (peft's per-row adapters), forward and backward only.

    .venv/bin/python benchmarks/core_overhead.py
    .venv/bin/python benchmarks/core_overhead.py --hidden-size 256 --layers 4 --tenants 8

Figures are medians of interleaved repeats (the sides alternate, so load on the machine hits both alike).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from trainer.core import AdamParams, Datum, ModelHost, TrainingClient, token_logprobs
from trainer.model import ModelConfig, load_policy


def batch(args: argparse.Namespace, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (args.batch, args.seq_len), generator=gen).tolist()


def plain_sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: list[list[int]]) -> float:
    tokens_BT = torch.tensor(rows)
    logits_BTV = model(input_ids=tokens_BT, use_cache=False).logits
    loss = -token_logprobs(logits_BTV[:, :-1], tokens_BT[:, 1:]).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def core_sft_step(client: TrainingClient, rows: list[list[int]]) -> float:
    n = sum(len(r) - 1 for r in rows)
    out = client.forward_backward([Datum.from_sequence(r, weights=[1.0 / n] * len(r)) for r in rows])
    client.optim_step(AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0))
    return out.metrics["loss:sum"]


def timed(fn, *args) -> tuple[float, float]:
    t = time.perf_counter()
    value = fn(*args)
    return (time.perf_counter() - t) * 1e3, value


def bench_sft(args: argparse.Namespace, cfg: ModelConfig) -> None:
    model, tok = load_policy(cfg)
    plain = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    client = TrainingClient(copy.deepcopy(model).train(), tok)
    plain_ms, core_ms = [], []
    for step in range(args.warmup + args.steps):
        rows = batch(args, step)
        ms_p, loss_p = timed(plain_sft_step, plain, optimizer, rows)
        ms_c, loss_c = timed(core_sft_step, client, rows)
        if abs(loss_p - loss_c) > 1e-4 * max(1.0, abs(loss_p)):
            raise AssertionError(f"step {step}: plain loss {loss_p} != core loss {loss_c}")
        if step >= args.warmup:
            plain_ms.append(ms_p)
            core_ms.append(ms_c)
    p, c = statistics.median(plain_ms), statistics.median(core_ms)
    print(f"SFT step, {args.batch} x {args.seq_len} tokens (same losses on both sides, {args.steps} steps)")
    print(f"  plain torch          {p:8.1f} ms")
    print(f"  trainer.core         {c:8.1f} ms   ratio core / plain: {c / p:.2f}x")


def bench_tenants(args: argparse.Namespace, cfg: ModelConfig) -> None:
    host = ModelHost(cfg, max_tenants=args.tenants)
    clients = [host.create_lora_client(f"t{i}", rank=8, seed=i) for i in range(args.tenants)]
    data = [[Datum.from_sequence(r, weights=[1.0] * len(r)) for r in batch(args, 100 + i)] for i in range(args.tenants)]
    one_each, batched = [], []
    for step in range(args.warmup + args.steps):
        ms_s, _ = timed(lambda: [c.forward_backward(d) for c, d in zip(clients, data)])
        for c in clients:
            c.zero_grad()
        ms_b, _ = timed(host.forward_backward_batch, [(c, d, "cross_entropy", {}) for c, d in zip(clients, data)])
        for c in clients:
            c.zero_grad()
        if step >= args.warmup:
            one_each.append(ms_s)
            batched.append(ms_b)
    s, b = statistics.median(one_each), statistics.median(batched)
    print(f"{args.tenants} LoRA tenants x {args.batch} sequences of {args.seq_len}, forward + backward")
    print(f"  one pass per tenant  {s:8.1f} ms")
    print(f"  one batched pass     {b:8.1f} ms   ratio batched / per tenant: {b / s:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (per tenant)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(name="tiny", hidden_size=args.hidden_size, num_layers=args.layers)
    print(f"model: tiny Qwen2 hidden={args.hidden_size} layers={args.layers} | torch threads={args.threads}")
    bench_sft(args, cfg)
    bench_tenants(args, cfg)


if __name__ == "__main__":
    main()
