"""Packing trajectories into training tensors (the update turns rows into the core's datums)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from trainer.rollout import Trajectory


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

    def cat(self, other: PackedBatch) -> PackedBatch:
        """Rows of ``self`` then rows of ``other`` (same width)."""
        cat = {f.name: torch.cat([getattr(self, f.name), getattr(other, f.name)])
               for f in fields(self) if f.name != "images_B"}
        return PackedBatch(**cat, images_B=self.images_B + other.images_B)


def padding_rows(rows: int, width: int, pad_id: int) -> PackedBatch:
    """``rows`` rows that train nothing: two attended pad tokens each (a forward pass needs one input and
    one target), mask 0 everywhere, so no loss and no gradient; ``width`` matches the batch they extend."""
    if rows < 0 or width < 2:
        raise ValueError(f"Expected rows >= 0 and width >= 2, got {rows}, {width}.")
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    attn = torch.zeros((rows, width), dtype=torch.long)
    attn[:, :2] = 1
    mask, adv, rew, lps = (torch.zeros((rows, width - 1)) for _ in range(4))
    return PackedBatch(tokens, attn, mask, adv, rew, lps)


def pad_to_rows(batch: PackedBatch | None, rows: int, pad_id: int) -> PackedBatch:
    """``batch`` (or nothing: a rank that kept no group) extended with :func:`padding_rows` up to ``rows``."""
    if batch is None:
        return padding_rows(rows, 2, pad_id)
    if rows < len(batch):
        raise ValueError(f"Expected at least the batch's {len(batch)} rows, got {rows}.")
    return batch.cat(padding_rows(rows - len(batch), int(batch.tokens_BT.shape[1]), pad_id))


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
    """Pad ``trajectories`` (with per-token ``advantages``) into a :class:`PackedBatch`; turn rewards sit on turn ends."""
    if not trajectories:
        raise ValueError("Expected at least one trajectory to pack, got none.")
    B, T = len(trajectories), max(len(t.tokens) for t in trajectories)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask, adv, rew, lps = (torch.zeros((B, T)) for _ in range(4))
    for i, (t, a) in enumerate(zip(trajectories, advantages)):
        n = len(t.tokens)
        tokens[i, :n] = torch.tensor(t.tokens)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(t.mask, dtype=torch.float)
        adv[i, :n] = torch.tensor(a, dtype=torch.float)
        lps[i, :n] = torch.tensor(t.logprobs, dtype=torch.float)
        for end, r in zip(t.turn_ends, t.turn_rewards):
            rew[i, end] = r
    return PackedBatch(tokens, attn, mask[:, 1:], adv[:, 1:], rew[:, 1:], lps[:, 1:],
                       [list(t.images) for t in trajectories])


__all__ = ["PackedBatch", "pack", "pad_to_rows", "padding_rows", "token_advantages"]
