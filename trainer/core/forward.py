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
from trainer.core.types import Datum, ForwardBackwardOutput
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


def plan_passes(lengths_R: Sequence[Sequence[int]], max_tokens: int | None) -> list[list[tuple[int, int, int]]]:
    """Passes of ``(request, first row, end row)`` pieces: every request's rows in order, cut so that a pass's
    padded tokens (its rows x its longest row) stay within ``max_tokens`` (None: one pass); a row longer than
    the bound gets a pass of its own.

    >>> plan_passes([[4, 4], [4, 4, 4]], 12)
    [[(0, 0, 2), (1, 0, 1)], [(1, 1, 3)]]
    """
    passes: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    rows = width = 0
    for r, lengths in enumerate(lengths_R):
        start = 0
        for i, n in enumerate(lengths):
            if max_tokens is not None and rows and (rows + 1) * max(width, n) > max_tokens:
                if i > start:
                    current.append((r, start, i))
                passes.append(current)
                current, rows, width, start = [], 0, 0, i
            rows, width = rows + 1, max(width, n)
        current.append((r, start, len(lengths)))
    if current:
        passes.append(current)
    return passes


def joined(outs: Sequence[ForwardBackwardOutput]) -> ForwardBackwardOutput:
    """One request's output from its passes: datums in order, ``:sum`` metrics summed, the others (token means)
    weighted by each pass's ``tokens:sum``, as :class:`TrainingClient` joins its micro-batches."""
    if len(outs) == 1:
        return outs[0]
    totals: dict[str, float] = {}
    for out in outs:
        active = out.metrics.get("tokens:sum", 0.0)
        for key, value in out.metrics.items():
            totals[key] = totals.get(key, 0.0) + (value if key.endswith(":sum") else value * active)
    tokens = max(totals.get("tokens:sum", 0.0), 1.0)
    return ForwardBackwardOutput([row for out in outs for row in out.loss_fn_outputs],
                                 {k: v if k.endswith(":sum") else v / tokens for k, v in totals.items()})


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


#: rows of a low-precision logits table upcast to float32 at once (bounds the copy's memory)
_UPCAST_ROWS = 1024


class PassLogits:
    """A pass's logits, read per row: dense ``[B, T, V]``, or (``index_BT`` given) row ``b`` at position ``t`` is
    row ``index_BT[b, t]`` of a table ``[N, V]``, as a shared-prefix pass leaves them (:mod:`trainer.core.prefix`:
    each group's prefix logits once). On a table, :meth:`logprobs` normalises each table row once (per
    temperature, for every view :meth:`split` made), so a prompt shared by k rows costs one log-sum-exp, not k,
    and the expanded ``[B, T, V]`` tensor is never built; its values are those of the expanded logits."""

    def __init__(self, logits: Tensor, index_BT: Tensor | None = None,
                 normalised: dict[float, tuple[Tensor, Tensor]] | None = None):
        if index_BT is None and logits.dim() != 3:
            raise ValueError(f"Expected dense logits [B, T, V], got {tuple(logits.shape)}.")
        self.logits, self.index_BT = logits, index_BT
        self._normalised = {} if normalised is None else normalised  # temperature -> (scaled table, logsumexp)

    @property
    def shape_BT(self) -> tuple[int, int]:
        B, T = (self.logits if self.index_BT is None else self.index_BT).shape[:2]
        return int(B), int(T)

    def split(self, rows: Sequence[int], widths: Sequence[int]) -> list[PassLogits]:
        """Consecutive pieces of ``rows[i]`` rows, trimmed to ``widths[i]`` positions (a dense piece is a ``split``:
        its backward is one cat, where a slice's is a zero-filled full-size gradient)."""
        if self.index_BT is None:
            return [PassLogits(piece[:, :w]) for piece, w in zip(self.logits.split(list(rows)), widths)]
        return [PassLogits(self.logits, piece[:, :w], self._normalised)
                for piece, w in zip(self.index_BT.split(list(rows)), widths)]

    def logprobs(self, targets_BT: Tensor, temperature: float = 1.0) -> Tensor:
        """Log-probs [B, T] (float32) of ``targets_BT`` under ``logits / temperature``, as :func:`target_logprobs`."""
        if self.index_BT is None:
            return target_logprobs(self.logits, targets_BT, temperature)
        if self.index_BT.shape != targets_BT.shape:
            raise ValueError(f"Expected targets {tuple(self.index_BT.shape)}, got {tuple(targets_BT.shape)}.")
        if temperature not in self._normalised:
            table_NV = self.logits if temperature == 1.0 else self.logits / temperature
            # float32 as token_logprobs computes it; a lower-precision table is upcast a slice at a time
            parts = [table_NV] if table_NV.dtype == torch.float32 else table_NV.split(_UPCAST_ROWS)
            lse_N = torch.cat([torch.logsumexp(part.float(), dim=-1) for part in parts])
            self._normalised[temperature] = (table_NV, lse_N)
        table_NV, lse_N = self._normalised[temperature]
        return table_NV[self.index_BT, targets_BT.long()].float() - lse_N[self.index_BT]

    def argmax(self) -> Tensor:
        """The most likely id at each position [B, T] (no gradient)."""
        with torch.no_grad():
            best = self.logits.argmax(dim=-1)
            return best if self.index_BT is None else best[self.index_BT]

    def dense(self) -> Tensor:
        """The logits as one [B, T, V] tensor."""
        return self.logits if self.index_BT is None else self.logits[self.index_BT]


def model_device(model: Any) -> torch.device:
    device: torch.device = next(model.parameters()).device
    return device


__all__ = ["Padded", "PassLogits", "pad", "rows_of", "plan_passes", "joined", "run_model", "target_logprobs",
           "model_device", "BASE_ADAPTER"]
