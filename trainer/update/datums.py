"""A packed batch's rows as the training core's datums, and forward-only per-token outputs over them."""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.core import Datum, TrainingClient
from trainer.update.batch import PackedBatch


def datums(batch: PackedBatch, rows: list[int], weights_BS: Tensor, **extra_BS: Tensor | None) -> list[Datum]:
    """The core's datums for ``rows`` of ``batch``: inputs ``tokens[:n-1]``, targets ``tokens[1:n]``, the given
    per-token weights and advantages, plus each ``extra_BS`` tensor (sampler ``logprobs``, ``ref_logprobs``,
    ``returns``, ``old_values``) that is not None."""
    out = []
    for i in rows:
        n = int(batch.attn_BT[i].sum())
        inputs = {"target_tokens": batch.tokens_BT[i, 1:n], "weights": weights_BS[i, :n - 1],
                  "advantages": batch.advantages_BS[i, :n - 1],
                  **{k: v[i, :n - 1] for k, v in extra_BS.items() if v is not None}}
        out.append(Datum(batch.tokens_BT[i, :n - 1], inputs, images=batch.images_B[i]))
    return out


def forward_values(client: TrainingClient, batch: PackedBatch, key: str, temperature: float = 1.0) -> Tensor:
    """[B, S] of a forward-only pass's per-token output ``key`` (``logprobs`` or ``values``); 0 on padding."""
    out_BS = torch.zeros_like(batch.mask_BS)
    result = client.forward(datums(batch, list(range(len(batch))), batch.mask_BS), "importance_sampling",
                            {"temperature": temperature})
    for i, row in enumerate(result.loss_fn_outputs):
        out_BS[i, :len(row[key])] = row[key]
    return out_BS


__all__ = ["datums", "forward_values"]
