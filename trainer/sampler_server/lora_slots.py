"""LoRA adapters held as plain tensors, one slot per name, put into the model only for the passes that use them.

The HF backend keeps no peft layers around its model: an adapter is its ``A [r, in]`` and ``B [out, r]``
matrices per target module and its scale (:class:`Adapter`). For a pass whose rows use adapters,
:meth:`AdapterTable.installed` swaps each target ``nn.Linear`` for a :class:`LoraLinear` holding the
adapters in use, in the attribute shape :class:`~trainer.sampling.row_adapters.RowAdapters` drives
(peft's ``base_layer``, ``lora_A``, ``lora_B``, ``scaling``, ``lora_dropout``), so one pass serves rows
of several adapters and the base; the plain linears come back afterwards (a batch without adapters
keeps the decode kernel's fused projections). The arithmetic is peft's (``B(A(x)) * scale``, scale
``alpha / r`` or ``alpha / sqrt(r)`` with rsLoRA), so samples match the trainer's peft model.

Adapter tensors arrive under peft's state-dict names (``base_model.model.<module>.lora_A.weight``);
:meth:`AdapterTable.plan` checks them against the modules the LoRA settings target ("all-linear": every
linear but the output head, as peft reads it; or a list of module-name suffixes) before a byte is read.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.sampler_server.protocol import BadRequestError, NotFoundError
from trainer.sampling.wire import StreamHeader, WeightFormatError

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: per target module ``(A [r, in], B [out, r])``, its scale and version."""

    weights: dict[str, tuple[Tensor, Tensor]]
    scale: float
    version: int


class _Matrix(nn.Module):
    """``x @ weight.T`` as a module (what ``lora_A[name]`` and ``lora_B[name]`` are), the tensor not a parameter."""

    def __init__(self, weight: Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class LoraLinear(nn.Module):
    """A linear layer with named LoRA terms. Inside a ``RowAdapters`` block each row gets its own adapter; outside
    one, ``active`` (one adapter name, or None) applies to every row (a pass with one adapter for all)."""

    def __init__(self, base_layer: nn.Linear):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A, self.lora_B, self.lora_dropout = nn.ModuleDict(), nn.ModuleDict(), nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.active: str | None = None

    def add(self, name: str, a: Tensor, b: Tensor, scale: float) -> None:
        """Carry adapter ``name`` (``a`` [r, in], ``b`` [out, r])."""
        self.lora_A[name], self.lora_B[name] = _Matrix(a), _Matrix(b)
        self.lora_dropout[name], self.scaling[name] = nn.Identity(), scale

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.base_layer(x)
        if self.active is None or self.active not in self.lora_A:
            return out
        a, b = self.lora_A[self.active], self.lora_B[self.active]
        assert isinstance(a, _Matrix) and isinstance(b, _Matrix)
        delta: Tensor = b(a(x.to(a.weight.dtype))) * self.scaling[self.active]
        return out + delta.to(out.dtype)


class AdapterTable:
    """The adapters of one model by name: planned (tensors to stream into), applied, unloaded, put into passes.

    The caller holds its weights lock around :meth:`apply`, :meth:`unload` and a pass in :meth:`installed`;
    :meth:`plan` only reserves a name (``filling``) and allocates."""

    def __init__(self, model: Any, *, max_rank: int, max_adapters: int):
        self.model, self.max_rank, self.max_adapters = model, max_rank, max_adapters
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        head = model.get_output_embeddings()
        # peft's "all-linear": every linear but the output head (a list of names may name the head)
        self._all_linear = [name for name, m in self.linears.items() if m is not head]
        self.loaded: dict[str, Adapter] = {}
        self.filling: dict[str, tuple[float, dict[str, str]]] = {}  # name -> (scale, key -> module) being received

    def targets(self, config: dict[str, Any]) -> list[str]:
        """The module names ``config`` (checked LoRA settings) puts an adapter on."""
        wanted = config["target_modules"]
        if wanted == "all-linear":
            return list(self._all_linear)
        found = [n for n in self.linears if any(n == t or n.endswith(f".{t}") for t in wanted)]
        if not found:
            raise BadRequestError(f"Expected lora_config.target_modules to name linear modules of the model, got "
                                  f"{wanted[:5]}; e.g. {sorted({n.rsplit('.', 1)[-1] for n in self.linears})[:8]}.")
        return found

    def plan(self, name: str, config: dict[str, Any], header: StreamHeader) -> dict[str, Tensor]:
        """Fresh tensors for adapter ``name`` (``config``: checked LoRA settings) after checking every name and shape."""
        if name not in self.loaded and len(self.loaded) + len(self.filling) >= self.max_adapters:
            raise BadRequestError(f"Expected at most {self.max_adapters} adapters; unload one first "
                                  f"(loaded: {sorted(self.loaded)}).")
        if name in self.filling:
            raise BadRequestError(f"Adapter {name!r} is being updated by another request.")
        r = int(config["r"])
        shapes, modules = {}, {}
        for module in self.targets(config):
            linear = self.linears[module]
            for part, shape in (("lora_A", (r, linear.in_features)), ("lora_B", (linear.out_features, r))):
                key = f"{PEFT_PREFIX}{module}.{part}.weight"
                shapes[key], modules[key] = shape, module
        got, expected = set(header.specs), set(shapes)
        if got != expected:
            missing, unknown = sorted(expected - got), sorted(got - expected)
            raise WeightFormatError(f"Expected exactly the adapter's tensors for {config} ({len(expected)} tensors); "
                                    f"missing {missing[:3]}, unknown {unknown[:3]}.")
        for key, spec in header.specs.items():
            if spec.shape != shapes[key] or not spec.dtype.is_floating_point:
                raise WeightFormatError(f"Expected {key} as floats of shape {shapes[key]}, got {spec.dtype} "
                                        f"{spec.shape}.")
        alpha = float(config["lora_alpha"])
        scale = alpha / math.sqrt(r) if config["use_rslora"] else alpha / r
        self.filling[name] = (scale, modules)
        # fresh tensors: the adapter serving under ``name`` keeps serving until apply
        return {key: torch.empty(spec.shape, dtype=spec.dtype) for key, spec in header.specs.items()}

    def apply(self, name: str, tensors: dict[str, Tensor], version: int) -> None:
        """Make the received tensors adapter ``name`` (replacing the one loaded under it)."""
        scale, modules = self.filling.pop(name)
        device = next(self.model.parameters()).device
        pairs: dict[str, dict[str, Tensor]] = {}
        for key, tensor in tensors.items():
            part = "a" if ".lora_A." in key else "b"
            pairs.setdefault(modules[key], {})[part] = tensor.to(device)
        self.loaded[name] = Adapter({m: (p["a"], p["b"]) for m, p in pairs.items()}, scale, version)

    def discard(self, name: str) -> None:
        """Forget an unfinished update of ``name``."""
        self.filling.pop(name, None)

    def unload(self, name: str) -> None:
        """Unload ``name``; ``NotFoundError`` when none is loaded under that name."""
        if self.loaded.pop(name, None) is None:
            raise NotFoundError(f"No adapter named {name!r} is loaded; loaded: {sorted(self.loaded)}.")

    def check(self, name: str) -> None:
        """``NotFoundError`` unless adapter ``name`` is loaded."""
        if name not in self.loaded:
            raise NotFoundError(f"No adapter named {name!r} is loaded; loaded: {sorted(self.loaded)}.")

    @contextlib.contextmanager
    def installed(self, names: set[str], active: str | None = None) -> Iterator[dict[str, str]]:
        """The model with :class:`LoraLinear` layers carrying adapters ``names`` (``active``: applied to every row
        outside a ``RowAdapters`` block) while the block runs; it yields each name's key in the layers (what
        ``RowAdapters`` is given per row). Nothing changes for no names."""
        keys = {name: f"slot{i}" for i, name in enumerate(sorted(names))}  # a ModuleDict key takes no dots
        if not names:
            yield keys
            return
        layers: dict[str, LoraLinear] = {}
        for name, key in keys.items():
            adapter = self.loaded[name]
            for module, (a, b) in adapter.weights.items():
                layer = layers.get(module)
                if layer is None:
                    layer = layers[module] = LoraLinear(self.linears[module])
                    layer.active = None if active is None else keys[active]
                layer.add(key, a, b, adapter.scale)
        try:
            for module, layer in layers.items():
                _set(self.model, module, layer)
            yield keys
        finally:
            for module in layers:
                _set(self.model, module, self.linears[module])


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


__all__ = ["Adapter", "AdapterTable", "LoraLinear", "PEFT_PREFIX"]
