"""A scalar value head on a language model's hidden states, for PPO."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ValueHead(nn.Module):
    """Linear map hidden_size -> 1 per token: ``ValueHead(hidden_size)(hidden_BTH) -> values_BT``.

    Starts from zero weights so the first value estimates are 0 and do not inject noise into GAE.
    Computes in float32 whatever the hidden-state dtype, because value regression is sensitive to
    bf16 rounding.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"Expected a positive hidden_size, got {hidden_size}; pass model.config.hidden_size.")
        self.proj = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden_BTH: Tensor) -> Tensor:
        """hidden_BTH: [B, T, H] -> values_BT: [B, T] (float32)."""
        values_BT1: Tensor = self.proj(hidden_BTH.float())
        return values_BT1.squeeze(-1)
