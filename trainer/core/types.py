"""The training core's data types, mirroring the Tinker API's so a wire format maps onto them one to one.

The sampling types (:class:`SamplingParams`, :class:`SampleResponse`, :class:`SampledSequence`) live in
:mod:`trainer.sampling.types`, under the core; they are re-exported here with the rest of the API.

A :class:`Datum` is one sequence: ``model_input`` (N token ids) and ``loss_fn_inputs``, each a
length-N tensor in the same frame: position ``i`` of ``model_input`` predicts ``target_tokens[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from trainer.sampling.types import SampledSequence, SampleResponse, SamplingParams

#: loss_fn_inputs read as integer ids; every other input is float32
INT_INPUTS = ("target_tokens",)


def _as_tensor(key: str, value: Any) -> Tensor:
    dtype = torch.long if key in INT_INPUTS else torch.float32
    tensor = value.detach().to("cpu", dtype) if isinstance(value, Tensor) else torch.as_tensor(value, dtype=dtype)
    if tensor.dim() != 1:
        raise ValueError(f"Expected loss_fn_inputs[{key!r}] to be one value per position (1-D), "
                         f"got shape {tuple(tensor.shape)}.")
    return tensor


@dataclass
class Datum:
    """One training sequence: ``model_input`` token ids and per-position ``loss_fn_inputs``.

    Inputs by loss: ``target_tokens`` always; ``weights`` (cross_entropy; optional elsewhere, default 1);
    ``logprobs`` (the sampler's, for the ratio) and ``advantages`` for the policy losses. Extensions:
    ``ref_logprobs`` (KL penalty with ``kl_coef``), ``returns`` and ``old_values`` (value loss, on a client
    with a value head). Lists, numpy arrays and tensors are accepted; every input must have N entries.
    ``images``: a vision-language policy's :class:`~trainer.vision.ImageFeatures` behind the image
    placeholder ids of ``model_input``, in order (an extension; Tinker sends image chunks instead).

    >>> d = Datum([1, 2, 3], {"target_tokens": [2, 3, 4], "weights": [0, 1, 1]})
    >>> len(d), d.loss_fn_inputs["weights"].tolist()
    (3, [0.0, 1.0, 1.0])
    """

    model_input: Sequence[int] | Tensor
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        ids = self.model_input
        ids = ids.detach().to("cpu", torch.long) if isinstance(ids, Tensor) else torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"Expected model_input to be a non-empty list of token ids, got shape {tuple(ids.shape)}.")
        self.model_input = ids
        self.loss_fn_inputs = {k: _as_tensor(k, v) for k, v in self.loss_fn_inputs.items()}
        for key, tensor in self.loss_fn_inputs.items():
            if tensor.numel() != ids.numel():
                raise ValueError(f"Expected loss_fn_inputs[{key!r}] to have {ids.numel()} entries (one per "
                                 f"model_input token), got {tensor.numel()}.")

    def __len__(self) -> int:
        return len(self.model_input)  # a 1-D tensor after __post_init__

    @classmethod
    def from_sequence(cls, tokens: Sequence[int], **per_token: Sequence[float]) -> Datum:
        """A datum from a whole sequence: inputs ``tokens[:-1]``, targets ``tokens[1:]``, and each
        per-token list (aligned with ``tokens``, e.g. a loss mask) shifted the same way.

        >>> Datum.from_sequence([5, 6, 7], weights=[0, 1, 1]).loss_fn_inputs["weights"].tolist()
        [1.0, 1.0]
        """
        if len(tokens) < 2:
            raise ValueError(f"Expected a sequence of at least 2 tokens, got {len(tokens)}.")
        for key, values in per_token.items():
            if len(values) != len(tokens):
                raise ValueError(f"Expected {key} aligned with the {len(tokens)} tokens, got {len(values)} entries.")
        inputs = {"target_tokens": list(tokens[1:]), **{k: list(v[1:]) for k, v in per_token.items()}}
        return cls(list(tokens[:-1]), inputs)


@dataclass
class AdamParams:
    """AdamW with decoupled weight decay; ``grad_clip_norm`` 0 means no clipping (Tinker's defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        if not self.learning_rate >= 0 or not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ValueError(f"Expected learning_rate >= 0 and betas in [0, 1), got {self.learning_rate}, "
                             f"({self.beta1}, {self.beta2}).")
        if self.eps <= 0 or self.weight_decay < 0 or self.grad_clip_norm < 0:
            raise ValueError(f"Expected eps > 0, weight_decay >= 0, grad_clip_norm >= 0 (0: no clipping), got "
                             f"{self.eps}, {self.weight_decay}, {self.grad_clip_norm}.")


@dataclass
class ForwardBackwardOutput:
    """What forward_backward and forward return.

    ``loss_fn_outputs[i]`` holds datum i's per-position tensors: ``logprobs`` (of its target tokens, the
    ones the loss used) and ``elementwise_loss`` (the weighted per-token loss; summing it gives the
    datum's share of ``loss:sum``), plus ``values`` on a client with a value head. ``metrics`` keys are
    ``name:reduction`` (Tinker's convention): ``loss:sum``, ``tokens:sum`` (positions with a non-zero
    weight), and token means over those positions such as ``clip_frac:mean``.
    """

    loss_fn_outputs: list[dict[str, Tensor]]
    metrics: dict[str, float]
    loss_fn_output_type: str = "TensorData"


__all__ = ["Datum", "AdamParams", "SamplingParams", "ForwardBackwardOutput", "SampledSequence", "SampleResponse"]
