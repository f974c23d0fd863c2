"""An optional imitation warm-up: each agent first copies a scripted player's well-formed moves.

A randomly initialised tiny policy never writes ``<move>row,col</move>``, so every game it plays
ends the same way (the first player forfeits) and carries no learning signal. A few supervised
steps on the moves of two :class:`RandomMoveSampler` players (random empty cells, played over the
same match env and rendered with the agent's own tokenizer) teach the answer format; which cells
win is left to the two-agent RL that follows.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from trainer.core import AdamParams, TrainingClient
from trainer.recipes.matches import SEATS, MatchRollout, MatchSpec
from trainer.recipes.opponents import RandomMoveSampler
from trainer.recipes.sft import sft_step
from trainer.rollout import EnvPool, RolloutConfig, Trajectory
from trainer.sampling import Sampler


async def scripted_games(pool: EnvPool, tokenizer: Any, config: RolloutConfig, *, matches: int, seed: int = 0,
                         reset_kwargs: dict[str, Any] | None = None, prefix: str = "warmup") -> list[Trajectory]:
    """Both seats' trajectories of ``matches`` games between two random players (``seed + i`` openings)."""
    players: dict[str, tuple[Sampler, Any]] = {
        f"scripted-{s}": (RandomMoveSampler(tokenizer, seed=seed + n), tokenizer) for n, s in enumerate(SEATS)}
    rollout = MatchRollout(pool, players, config)
    specs = [MatchSpec(f"{prefix}-{seed}-{i}", {s: f"scripted-{s}" for s in SEATS},
                       {**(reset_kwargs or {}), "seed": seed + i}) for i in range(matches)]
    return [t for r in await rollout.run(specs) for t in r.trajectories.values() if not t.infra_failed]


def demos_from(trajectories: list[Trajectory], max_turns: int = 1) -> list[tuple[list[int], list[int]]]:
    """``(ids, mask)`` pairs: each trajectory cut after its first ``max_turns`` moves (mask 1 on the moves);
    under a history window (one sequence per turn), each of those turns' sequences is a pair of its own."""
    demos = []
    for t in trajectories:
        if not t.turn_ends:
            continue
        end = t.turn_ends[min(max_turns, len(t.turn_ends)) - 1] + 1
        for span, _ in t.segments():
            if span.start < end:
                cut = slice(span.start, min(span.stop, end))
                demos.append((t.tokens[cut], t.mask[cut]))
    return demos


def imitation_warmup(model: Any, tokenizer: Any, demos: list[tuple[list[int], list[int]]], *, steps: int,
                     batch_size: int = 8, lr: float = 3e-3, seed: int = 0, all_parameters: bool = True,
                     device: torch.device | str = "cpu") -> dict[str, float]:
    """``steps`` AdamW steps of cross-entropy on the demos' mask-1 tokens, with a throw-away optimizer.

    ``all_parameters`` trains every weight, also under a LoRA adapter (a warmed-up base, then LoRA
    RL): an adapter alone learns the format far more slowly (it cannot touch the embeddings).
    """
    if not demos:
        raise ValueError("Expected scripted demonstrations to warm up on, got none (did every warm-up game fail?).")
    rng = random.Random(seed)
    frozen = [p for p in model.parameters() if not p.requires_grad] if all_parameters else []
    for p in frozen:
        p.requires_grad_(True)
    try:
        model.to(device).train()
        # a client of its own: the optimizer state is thrown away with it
        client = TrainingClient(model, tokenizer, params=[p for p in model.parameters() if p.requires_grad])
        adam = AdamParams(learning_rate=lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
        metrics: dict[str, float] = {}
        for _ in range(steps):
            batch = [demos[rng.randrange(len(demos))] for _ in range(batch_size)]
            metrics = sft_step(client, batch, adam)
    finally:
        for p in frozen:
            p.requires_grad_(False)
            p.grad = None
    return metrics


__all__ = ["scripted_games", "demos_from", "imitation_warmup"]
