"""One forward pass of the policy over padded datums: log-probs of the targets (and values), in any wrapper.

The model may be a plain Hugging Face causal LM, a peft model (one adapter, or several named adapters
selected per row: :class:`~trainer.sampling.row_adapters.RowAdapters`) or a DDP wrapper around either; the pass goes through the
outermost wrapper so DDP's gradient hooks fire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.core.losses import token_logprobs
from trainer.core.types import Datum
from trainer.sampling.row_adapters import BASE_ADAPTER, RowAdapters
from trainer.vision import vision_inputs


@dataclass
class Padded:
    """Datums right-padded to one width: ``tokens_BT``/``attn_BT`` and every loss input as [B, T] (0 on padding),
    and each row's images (a vision-language policy's)."""

    tokens_BT: Tensor
    attn_BT: Tensor
    inputs: dict[str, Tensor]
    lengths: list[int]
    images_B: list[list[Any]] | None = None


def pad(data: Sequence[Datum], device: torch.device | str) -> Padded:
    """Stack ``data`` into [B, T] tensors on ``device``; a loss input only some datums carry is refused."""
    if not data:
        raise ValueError("Expected at least one Datum, got none.")
    keys = set(data[0].loss_fn_inputs)
    for i, d in enumerate(data):
        if set(d.loss_fn_inputs) != keys:
            raise ValueError(f"Expected every datum to carry the same loss_fn_inputs, got {sorted(keys)} on datum 0 "
                             f"and {sorted(d.loss_fn_inputs)} on datum {i}.")
    lengths = [len(d) for d in data]
    B, T = len(data), max(lengths)
    tokens = torch.zeros((B, T), dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    inputs = {k: torch.zeros((B, T), dtype=data[0].loss_fn_inputs[k].dtype) for k in keys}
    for i, (d, n) in enumerate(zip(data, lengths)):
        tokens[i, :n], attn[i, :n] = torch.as_tensor(d.model_input), 1  # a tensor already (Datum's check)
        for k in keys:
            inputs[k][i, :n] = d.loss_fn_inputs[k]
    if "weights" not in inputs:  # padding must never count, whatever a loss's default weight is
        inputs["weights"] = attn.float()
    else:
        inputs["weights"] = inputs["weights"] * attn
    return Padded(tokens.to(device), attn.to(device), {k: v.to(device) for k, v in inputs.items()}, lengths,
                  [list(d.images) for d in data])


def rows_of(padded: Padded, start: int, end: int) -> Padded:
    """Rows ``start..end`` of ``padded`` (views), trimmed to the longest of them."""
    lengths = padded.lengths[start:end]
    if not lengths:
        raise ValueError(f"Expected a non-empty row range of {len(padded.lengths)} rows, got {start}..{end}.")
    T = max(lengths)
    return Padded(padded.tokens_BT[start:end, :T], padded.attn_BT[start:end, :T],
                  {k: v[start:end, :T] for k, v in padded.inputs.items()}, lengths,
                  None if padded.images_B is None else padded.images_B[start:end])


def run_model(model: Any, tokens_BT: Tensor, attn_BT: Tensor, *, adapters: list[str] | None = None,
              hidden: bool = False, images_B: list[list[Any]] | None = None) -> tuple[Tensor, Tensor | None]:
    """``(logits [B, T, V], last hidden states [B, T, H] or None)`` of one pass through ``model``; ``images_B``
    (row b's image features, behind its placeholder ids) go in as pixel values, grids and token types."""
    kwargs: dict[str, Any] = {}
    if images_B and any(images_B):
        from trainer.model import unwrap

        config: Any = unwrap(model).config  # a Hugging Face vision-language config
        kwargs.update(vision_inputs(images_B, tokens_BT, int(config.image_token_id)))
    # no padding: no mask, so attention keeps its fastest (purely causal) path
    mask = None if bool(attn_BT.all()) else attn_BT
    if adapters is None:
        out = model(input_ids=tokens_BT, attention_mask=mask, output_hidden_states=hidden, use_cache=False, **kwargs)
    else:
        with RowAdapters(model, adapters):  # row b under adapters[b]
            out = model(input_ids=tokens_BT, attention_mask=mask, output_hidden_states=hidden, use_cache=False,
                        **kwargs)
    return out.logits, (out.hidden_states[-1] if hidden else None)


def target_logprobs(logits_BTV: Tensor, targets_BT: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probs [B, T] of ``targets_BT`` under ``logits / temperature``: the trainer's and the sampler's one rule."""
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    return token_logprobs(logits_BTV, targets_BT)


def model_device(model: Any) -> torch.device:
    device: torch.device = next(model.parameters()).device
    return device


__all__ = ["Padded", "pad", "rows_of", "run_model", "target_logprobs", "model_device", "BASE_ADAPTER"]
