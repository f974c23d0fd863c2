"""Packing trajectories into training tensors, and the model forward both RL and SFT use."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from trainer.algos import token_logprobs
from trainer.rollout.types import Trajectory
from trainer.vision import ImageFeatures, vision_inputs


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
    images_B: list[list[ImageFeatures]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.images_B:
            self.images_B = [[] for _ in range(self.tokens_BT.shape[0])]

    def __len__(self) -> int:
        return self.tokens_BT.shape[0]

    def to(self, device: torch.device | str) -> "PackedBatch":
        """The tensors on ``device`` (images stay on the CPU until :meth:`model_inputs`)."""
        return PackedBatch(*(getattr(self, f.name).to(device) for f in _TENSOR_FIELDS), self.images_B)

    def cat(self, other: "PackedBatch") -> "PackedBatch":
        """Rows of ``self`` then rows of ``other`` (same width)."""
        return PackedBatch(*(torch.cat([getattr(self, f.name), getattr(other, f.name)]) for f in _TENSOR_FIELDS),
                           self.images_B + other.images_B)

    def model_inputs(self, image_token_id: int | None) -> dict[str, Any]:
        """Extra model inputs of these rows: pixel values, grids and token types when any row has an image."""
        if image_token_id is None or not any(self.images_B):
            return {}
        return vision_inputs(self.images_B, self.tokens_BT, image_token_id)

    def select(self, idx: list[int] | Tensor) -> "PackedBatch":
        """Rows ``idx``, trimmed to their longest sequence (micro-batches stay small)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        width = int(self.attn_BT[idx].sum(dim=1).max().item())
        return PackedBatch(self.tokens_BT[idx, :width], self.attn_BT[idx, :width], self.mask_BS[idx, :width - 1],
                           self.advantages_BS[idx, :width - 1], self.rewards_BS[idx, :width - 1],
                           self.sampler_logprobs_BS[idx, :width - 1], [self.images_B[i] for i in idx.tolist()])


_TENSOR_FIELDS = [f for f in fields(PackedBatch) if f.name != "images_B"]


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


def forward_logprobs(model: torch.nn.Module, tokens_BT: Tensor, attn_BT: Tensor, *, temperature: float = 1.0,
                     hidden: bool = False, **model_inputs: Any) -> tuple[Tensor, Tensor | None]:
    """Log-probs [B, T-1] of each next token (logits / temperature), and the last hidden states if asked.

    ``model_inputs`` go to the model as they are (a vision policy's ``PackedBatch.model_inputs``).
    """
    out = model(input_ids=tokens_BT, attention_mask=attn_BT, output_hidden_states=hidden, use_cache=False,
                **model_inputs)
    logits_BSV = out.logits[:, :-1]
    if temperature != 1.0:
        logits_BSV = logits_BSV / temperature
    lp_BS = token_logprobs(logits_BSV, tokens_BT[:, 1:])
    return lp_BS, (out.hidden_states[-1][:, :-1] if hidden else None)


def micro_batches(n: int, size: int, *, generator: torch.Generator | None = None, shuffle: bool = False) -> list[list[int]]:
    """Index lists of at most ``size`` rows covering ``range(n)``."""
    order = torch.randperm(n, generator=generator).tolist() if shuffle else list(range(n))
    return [order[i:i + size] for i in range(0, n, size)]


def image_token_id(model: Any) -> int | None:
    """The image placeholder id of a vision-language policy (under any wrapper), None for a text-only one."""
    from trainer.model import unwrap

    return getattr(unwrap(model).config, "image_token_id", None)


__all__ = ["PackedBatch", "pack", "token_advantages", "forward_logprobs", "micro_batches", "image_token_id"]
