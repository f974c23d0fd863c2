"""Packing trajectories into training tensors (the update turns rows into the core's datums)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainer.rollout import Task, Trajectory


@dataclass
class PackedBatch:
    """Right-padded sequences in the shifted frame: position j scores ``tokens_BT[:, j + 1]``.

    tokens_BT/attn_BT: [B, T] inputs; mask_BS/advantages_BS/rewards_BS/sampler_logprobs_BS: [B, T-1].
    images_B: row b's :class:`~trainer.vision.ImageFeatures` (empty lists for a text-only policy).
    """

    tokens_BT: Tensor
    attn_BT: Tensor
    mask_BS: Tensor
    advantages_BS: Tensor
    rewards_BS: Tensor
    sampler_logprobs_BS: Tensor
    images_B: list[list[Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.images_B:
            self.images_B = [[] for _ in range(self.tokens_BT.shape[0])]

    def __len__(self) -> int:
        return int(self.tokens_BT.shape[0])


def padding_row(pad_id: int) -> tuple[Trajectory, list[float]]:
    """A row that trains nothing, with its advantages: two pad tokens (a forward pass needs one input and one
    target), mask 0, so no loss and no gradient; what a torchrun rank that kept fewer rows trains on
    (:func:`trainer.distributed.pad_to_ranks`)."""
    return Trajectory(task=Task(reset_kwargs={}), tokens=[pad_id, pad_id], mask=[0, 0], logprobs=[0.0, 0.0]), [0.0, 0.0]


def token_advantages(traj: Trajectory, per_turn: list[float]) -> list[float]:
    """One advantage per token: policy tokens of turn t get ``per_turn[t]``; others 0."""
    out = [0.0] * len(traj.tokens)
    turn, start = 0, 0
    for turn, end in enumerate(traj.turn_ends):
        for i in range(start, end + 1):
            if traj.mask[i]:
                out[i] = per_turn[turn] if turn < len(per_turn) else per_turn[-1]
        start = end + 1
    return out


def pack(trajectories: list[Trajectory], advantages: list[list[float]], pad_id: int) -> PackedBatch:
    """Pad ``trajectories`` (with per-token ``advantages``) into a :class:`PackedBatch`; turn rewards sit on turn ends.

    Each sequence of a trajectory is a row (:meth:`~trainer.rollout.Trajectory.segments`: one per trajectory,
    one per turn under a history window), with that sequence's tokens, advantages and images.
    """
    if not trajectories or len(advantages) != len(trajectories):
        raise ValueError(f"Expected at least one trajectory and one advantage list for each, got "
                         f"{len(trajectories)} and {len(advantages)}.")
    rows = [(t, a, tokens, images) for t, a in zip(trajectories, advantages) for tokens, images in t.segments()]
    B, T = len(rows), max(len(t.tokens[tokens]) for t, _, tokens, _ in rows)
    tokens_BT = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask, adv, rew, lps = (torch.zeros((B, T)) for _ in range(4))
    for i, (t, a, span, _) in enumerate(rows):
        n = span.stop - span.start
        tokens_BT[i, :n] = torch.tensor(t.tokens[span])
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(t.mask[span], dtype=torch.float)
        adv[i, :n] = torch.tensor(a[span], dtype=torch.float)
        lps[i, :n] = torch.tensor(t.logprobs[span], dtype=torch.float)
        for end, r in zip(t.turn_ends, t.turn_rewards):
            if span.start <= end < span.stop:
                rew[i, end - span.start] = r
    return PackedBatch(tokens_BT, attn, mask[:, 1:], adv[:, 1:], rew[:, 1:], lps[:, 1:],
                       [list(t.images[images]) for t, _, _, images in rows])


__all__ = ["PackedBatch", "pack", "padding_row", "token_advantages"]
