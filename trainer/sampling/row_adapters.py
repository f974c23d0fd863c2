"""Rows of one pass under different LoRA adapters, at about the cost of one: several tenants in one forward.

peft's mixed batches (``adapter_names``) serve rows with different adapters, but in every LoRA layer, on
every forward, they rebuild each adapter's row list in Python, gather those rows, and scatter the
adapter's output back into the base output in place; on a small model that costs more than the
arithmetic, and its backward more again, so merging tenants into one pass saved little. Here a pass's
rows come in **runs** (consecutive rows with one adapter: the callers put each tenant's rows together),
found once per pass, and each LoRA layer computes ``base(x)`` once and adds ``B(A(x[run])) * scale`` per
run on contiguous pieces (a ``split``: views, no gather) joined by one ``cat``: with one run it is the plain LoRA
forward. When the runs are of equal length and their adapters of one rank (every tenant's GRPO batch the same
size), the runs' terms are two batched matmuls over the adapters' stacked weights instead, so a pass costs
the same number of ops whether it serves one tenant or eight. Rows without an adapter (None or ``"__base__"``)
get the base output alone.

>>> with RowAdapters(model, ["tenant0"] * 8 + ["tenant1"] * 8):   # doctest: +SKIP
...     logits = model(input_ids=ids_BT).logits                    # rows 0-7 under tenant0, 8-15 under tenant1

A LoRA layer is any module with peft's ``base_layer``, ``lora_A``, ``lora_B``, ``scaling`` and
``lora_dropout`` (a vanilla LoRA ``Linear``; DoRA and other variants are refused). Inputs may be
``[B, ...]`` (the Hugging Face model) or ``[B * T, features]`` (the decode kernel's rows, row-major). The
layers' ``forward`` is replaced while a block is open, and only the thread that opened it sees its
layout: passes of other threads on the same model run the layers' own forward.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

#: peft's name for "no adapter" in a mixed batch
BASE_ADAPTER = "__base__"

#: (first row, end row, adapter or None)
Run = tuple[int, int, "str | None"]


def runs_of(adapters_B: Sequence[str | None]) -> list[Run]:
    """Consecutive rows that share an adapter, in order."""
    runs: list[Run] = []
    start = 0
    for i in range(1, len(adapters_B) + 1):
        if i == len(adapters_B) or adapters_B[i] != adapters_B[start]:
            name = adapters_B[start]
            runs.append((start, i, None if name == BASE_ADAPTER else name))
            start = i
    return runs


def lora_layers(model: Any) -> list[Any]:
    """The model's LoRA layers (see the module docstring)."""
    return [m for m in model.modules()
            if hasattr(m, "base_layer") and isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)]


class RowAdapters:
    """While entered, every LoRA layer of ``model`` applies ``adapters_B[b]`` to row ``b``; :meth:`select` switches
    to another row layout (a subset or reordering of the rows) for the following passes."""

    def __init__(self, model: Any, adapters_B: Sequence[str | None]):
        if not adapters_B:
            raise ValueError("Expected one adapter name (or None) per row, got no rows.")
        self.model, self.adapters_B = model, list(adapters_B)
        self.runs = runs_of(self.adapters_B)
        self.rows = len(self.adapters_B)
        self._layers: list[Any] = []
        # without autograd (a decode loop's many steps), each layer's stacked adapter weights, built once per block
        self.stacked: dict[tuple[int, tuple[str, ...]], tuple[Tensor, Tensor]] = {}

    def select(self, index_R: Tensor | Sequence[int]) -> None:
        """The next passes' row ``r`` is row ``index_R[r]`` of the layout given at construction."""
        index = index_R.tolist() if isinstance(index_R, Tensor) else list(index_R)
        chosen = [self.adapters_B[i] for i in index]
        self.runs, self.rows = runs_of(chosen), len(chosen)

    def __enter__(self) -> RowAdapters:
        layers = lora_layers(self.model)
        for layer in layers:
            if any(getattr(layer, "use_dora", {}).values()) or getattr(layer, "lora_variant", None):
                raise ValueError("Expected vanilla LoRA layers for per-row adapters, got a LoRA variant (DoRA).")
        me = threading.get_ident()
        with _PATCHING:
            if any(me in getattr(vars(layer).get("forward"), "layouts", {}) for layer in layers):
                raise RuntimeError("Expected one per-row adapter block at a time per thread, got a nested one.")
            for layer in layers:
                forward = vars(layer).get("forward")
                if not isinstance(forward, _RowForward):
                    forward = layer.forward = _RowForward(layer)
                forward.layouts[me] = self
        self._layers = layers
        return self

    def __exit__(self, *exc: Any) -> None:
        me = threading.get_ident()
        with _PATCHING:
            for layer in self._layers:
                forward = vars(layer).get("forward")
                if isinstance(forward, _RowForward):
                    forward.layouts.pop(me, None)
                    if not forward.layouts:
                        del layer.forward
        self._layers = []
        self.stacked.clear()


#: guards installing and removing the per-row forwards (blocks may open on several threads)
_PATCHING = threading.Lock()


class _RowForward:
    """A LoRA layer's forward under the :class:`RowAdapters` layout of the calling thread; a thread without one
    gets the layer's own forward, so another thread's passes on the same model are untouched."""

    def __init__(self, layer: Any):
        self.layer = layer
        self.layouts: dict[int, RowAdapters] = {}  # thread id -> its open block

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        layer, rows = self.layer, self.layouts.get(threading.get_ident())
        if rows is None:
            own: Tensor = type(layer).forward(layer, x, *args, **kwargs)
            return own
        result: Tensor = layer.base_layer(x, *args, **kwargs)
        if len(x) % rows.rows:
            raise ValueError(f"Expected an input of {rows.rows} rows (or rows x positions), got {tuple(x.shape)}.")
        per_row = len(x) // rows.rows  # 1 for [B, ...] inputs, T for the decode kernel's [B * T, features]
        names = [name if name is not None and name in layer.lora_A else None for _, _, name in rows.runs]
        if all(name is None for name in names):
            return result
        if len(names) == 1:
            return result + self._delta(x, str(names[0])).to(result.dtype)
        sizes = [(end - start) * per_row for start, end, _ in rows.runs]
        if len(set(sizes)) == 1 and self._stackable(names):  # a GRPO batch: every tenant the same rows
            return result + self._stacked_delta(x, [str(n) for n in names], rows).view_as(result).to(result.dtype)
        # split, not slices: a split's backward is one cat, where each slice's is a zero-filled full-size gradient
        parts = [part if name is None else part + self._delta(xs, name).to(result.dtype)
                 for part, xs, name in zip(result.split(sizes), x.split(sizes), names)]
        return torch.cat(parts)

    def _delta(self, x: Tensor, name: str) -> Tensor:
        layer = self.layer
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        out: Tensor = lora_B(lora_A(layer.lora_dropout[name](x.to(lora_A.weight.dtype)))) * layer.scaling[name]
        return out

    def _stackable(self, names: list[str | None]) -> bool:
        """Whether these runs' adapters batch into :meth:`_stacked_delta`: all present, one rank, no dropout or
        bias."""
        layer = self.layer
        if None in names:
            return False
        shapes = {(layer.lora_A[n].weight.shape, layer.lora_B[n].weight.shape) for n in names}
        return len(shapes) == 1 and all(type(layer.lora_dropout[n]) is torch.nn.Identity
                                        and getattr(layer.lora_B[n], "bias", None) is None for n in names)

    def _stacked_delta(self, x: Tensor, names: list[str], rows: RowAdapters) -> Tensor:
        """The LoRA terms of equal runs, one adapter each, as two batched matmuls over the runs: the same
        arithmetic as one ``_delta`` per run, in a fixed number of ops however many tenants share the pass."""
        A_KIR, B_KRO = self._stacked_weights(names, rows)
        x_KNI = x.to(A_KIR.dtype).reshape(len(names), -1, x.shape[-1])  # run k's rows (x positions)
        return torch.bmm(torch.bmm(x_KNI, A_KIR), B_KRO)

    def _stacked_weights(self, names: list[str], rows: RowAdapters) -> tuple[Tensor, Tensor]:
        """The runs' adapter weights stacked: A [runs, in, rank] and B (scaled) [runs, rank, out]; without autograd
        kept for the rest of ``rows``' block, so a decode loop stacks them once, not on every step."""
        key = (id(self), tuple(names))
        cached = None if torch.is_grad_enabled() else rows.stacked.get(key)
        if cached is not None:
            return cached
        layer = self.layer
        A_KIR = torch.stack([layer.lora_A[n].weight for n in names]).transpose(1, 2)
        B_KRO = torch.stack([layer.lora_B[n].weight * layer.scaling[n] for n in names]).transpose(1, 2)
        if not torch.is_grad_enabled():
            A_KIR, B_KRO = A_KIR.contiguous(), B_KRO.contiguous()
            rows.stacked[key] = (A_KIR, B_KRO)
        return A_KIR, B_KRO


__all__ = ["RowAdapters", "runs_of", "lora_layers", "BASE_ADAPTER"]
