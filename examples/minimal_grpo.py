"""GRPO in one screen: the training core's calls and the rollout engine, nothing else.

    python examples/minimal_grpo.py --steps 30        # CPU, a few minutes

A tiny model learns single-digit sums from the math env server (started here, stopped at the end): a
short SFT warm-up teaches it the ``\\boxed{N}`` format, then every step samples ``--group`` answers to
each of ``--batch`` train problems, scores them on the server, and takes one clipped policy-gradient step
on each answer's group-relative advantage. Accuracy on the held-out validation split (greedy, and the
mean of ``--val-samples`` sampled answers per problem) is printed before and after. The full recipe (PPO,
KL, torchrun, asynchronous rollouts, checkpoints) is ``trainer/recipes/rl.py``; this is its core loop.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import torch

from trainer import algos
from trainer.core import AdamParams, Datum, TrainingClient
from trainer.local_server import free_port
from trainer.model import ModelConfig, load_policy
from trainer.quickstart import collect_demos, listed_size, math_server
from trainer.recipes.sft import run_sft
from trainer.rollout import EnvPool, RolloutConfig, RolloutEngine, Trajectory, build_groups, make_tasks
from trainer.sampling import SamplingConfig, make_sampler

TASK = {"kind": "add", "difficulty": 1}


def accuracy(engine: RolloutEngine, url: str, split: str, n: int, samples: int = 0) -> float:
    """Accuracy on problems ``0..n-1`` of ``split``: greedy, or with ``samples`` > 0 the mean over that many
    answers to each problem sampled at the sampler's temperature (less noisy on a small split: every
    problem's chance counts, not only whether its greedy answer crossed over)."""
    tasks = make_tasks([{**TASK, "split": split, "index": i} for i in range(n)], max(samples, 1), [url])
    trajs = engine.run_sync(tasks, greedy=samples == 0)
    return sum(t.reward for t in trajs) / len(trajs)


def grpo_datums(groups: list[list[Trajectory]], negative_weight: float) -> list[Datum]:
    """One datum per answer: its sampled tokens weighted 1/(all sampled tokens) and advantaged by
    ``(reward - group mean) / group std`` (negatives scaled by ``negative_weight``)."""
    rewards_BG = torch.tensor([[t.reward for t in g] for g in groups])
    adv_BG = algos.weight_negatives(algos.grpo_advantages(rewards_BG), negative_weight)
    flat = [t for g in groups for t in g]
    tokens = sum(sum(t.mask[1:]) for t in flat)
    return [Datum.from_sequence(t.tokens, weights=[m / tokens for m in t.mask], advantages=[a * m for m in t.mask])
            for t, a in zip(flat, adv_BG.flatten().tolist())]


def train(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """SFT warm-up, then ``args.steps`` GRPO steps; returns the validation accuracy before and after GRPO and
    each step's mean train reward."""
    torch.manual_seed(args.seed)
    model, tok = load_policy(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                         intermediate_size=256, init_seed=args.seed))
    rollout = RolloutConfig(max_tokens_per_turn=12, max_total_tokens=12, max_in_flight=256)
    engine = RolloutEngine(EnvPool([url]), make_sampler(model, tok, SamplingConfig(temperature=1.0)), tok, rollout)
    train_size = asyncio.run(listed_size(url, "train", TASK)) or 125
    val_size = asyncio.run(listed_size(url, "validation", TASK)) or 19
    demos = asyncio.run(collect_demos(url, train_size, args.seed, TASK, by_index=True))
    run_sft(model, tok, demos, steps=600, batch_size=32, lr=3e-3, seed=args.seed, weight_decay=0.1,
            stop_when=lambda step: accuracy(engine, url, "train", train_size) >= args.sft_target, check_every=10)
    policy = TrainingClient(model, tok, micro_batch_size=256)
    before = accuracy(engine, url, "validation", val_size)
    before_sampled = accuracy(engine, url, "validation", val_size, samples=args.val_samples)
    print(f"validation accuracy after the SFT warm-up: {before:.3f} greedy, {before_sampled:.3f} sampled",
          flush=True)
    rewards = []
    for step in range(args.steps):
        # 1. sample --group answers to each of --batch fresh train problems
        seeds = [{**TASK, "split": "train", "seed": args.seed * 1_000_003 + step * args.batch + i}
                 for i in range(args.batch)]
        trajs = engine.run_sync(make_tasks(seeds, args.group, [url]))
        # 2. groups whose answers differ in reward (the others carry no GRPO signal)
        groups = build_groups(trajs, args.group, filter_zero_variance=True).groups
        if groups:
            # 3. advantages -> 4. forward_backward (clipped ratio, exactly 1 on one pass) -> 5. optim_step
            policy.forward_backward(grpo_datums(groups, args.negative_weight), "ppo",
                                    {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
            lr = args.lr * (1 - step / args.steps)  # linear decay to 0
            policy.optim_step(AdamParams(learning_rate=lr, weight_decay=0.1, grad_clip_norm=1.0))
            # 6. the sampler gets the new weights
            policy.save_weights_for_sampler(engine.sampler, version=step + 1)
        rewards.append(sum(t.reward for t in trajs) / len(trajs))
        print(f"step {step + 1}: train reward {rewards[-1]:.3f}, {len(groups)} groups trained on", flush=True)
    after = accuracy(engine, url, "validation", val_size)
    after_sampled = accuracy(engine, url, "validation", val_size, samples=args.val_samples)
    print(f"validation accuracy after {args.steps} GRPO steps: {after:.3f} greedy, {after_sampled:.3f} sampled "
          f"(before: {before:.3f}, {before_sampled:.3f})", flush=True)
    engine.close()
    return {"val_before": before, "val_after": after, "val_sampled_before": before_sampled,
            "val_sampled_after": after_sampled, "train_rewards": rewards}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32, help="train problems per step")
    p.add_argument("--group", type=int, default=8, help="answers per problem")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--negative-weight", type=float, default=0.0,
                   help="scale of negative advantages (0: learn from better-than-average answers; 1: unbiased)")
    p.add_argument("--val-samples", type=int, default=16,
                   help="answers sampled per validation problem for the sampled accuracy")
    p.add_argument("--sft-target", type=float, default=0.5, help="stop the warm-up at this greedy train accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/minimal_grpo", help="where the math server's log goes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    with math_server(free_port(), Path(args.out) / "math_server.log") as url:
        return train(url, args)


if __name__ == "__main__":
    main()
