"""Every size a client controls, bounded before anything is allocated, and the checks that turn a parsed request
into the training core's inputs (token ids in the vocabulary, lengths that match, finite values).

:class:`Limits` holds the numbers (from :class:`~trainer.service._settings.ServiceSettings` and the served
model); its methods run on the HTTP side when a request arrives, so a request past a limit is answered
with a 400 at once and never reaches the work queue. ``docs/service.md`` tabulates the limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.core import AdamParams, Datum, SamplingParams
from trainer.core.losses import LOSSES, check_loss
from trainer.service import _proto, _requests
from trainer.service._errors import UserError
from trainer.service._settings import ServiceSettings

_UNSUPPORTED_SAMPLE_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")


@dataclass(frozen=True)
class Limits:
    """The bounds the service checks, resolved for one served model."""

    vocab_size: int
    context: int  # tokens in one sequence: a datum, or a prompt plus its completion
    max_batch_tokens: int
    max_batch_datums: int
    max_samples: int
    max_sample_tokens: int
    max_lora_rank: int

    @classmethod
    def of(cls, settings: ServiceSettings, *, vocab_size: int, context: int) -> Limits:
        return cls(vocab_size=vocab_size, context=context, max_batch_tokens=settings.max_batch_tokens,
                   max_batch_datums=settings.max_batch_datums, max_samples=settings.max_samples,
                   max_sample_tokens=settings.max_sample_tokens, max_lora_rank=settings.max_lora_rank)

    def proto_bounds(self) -> _proto.Bounds:
        """What the protobuf decoder may allocate: datums and token-sized arrays of one batch."""
        return _proto.Bounds(max_datums=self.max_batch_datums, max_values=self.max_batch_tokens)

    # -- training ------------------------------------------------------------------------------

    def datums(self, req: _proto.ForwardBackwardRequest) -> list[Datum]:
        """The batch as core datums: sizes, token ids, lengths, finite values and the loss's inputs checked."""
        if not req.data:
            raise UserError("Expected at least one Datum in forward_backward, got none.")
        if req.loss_fn not in LOSSES:
            raise UserError(f"Expected loss_fn in {LOSSES}, got {req.loss_fn!r} (this service implements no other).")
        total = sum(len(d.tokens) for d in req.data)
        if total > self.max_batch_tokens:
            raise UserError(f"Expected at most {self.max_batch_tokens} tokens in one forward_backward "
                            f"(--max-batch-tokens), got {total} in {len(req.data)} datums; send the batch in "
                            "smaller calls and optim_step once.")
        config = self.loss_config(req.loss_fn_config)
        return [self._datum(i, d, req.loss_fn, config) for i, d in enumerate(req.data)]

    def _datum(self, i: int, wire: _proto.WireDatum, loss_fn: str, config: dict[str, float]) -> Datum:
        n = len(wire.tokens)
        if not 1 <= n <= self.context:
            raise UserError(f"Expected datum {i} to hold 1 to {self.context} tokens (the model's context), got {n}.")
        self.check_ids(wire.tokens, f"datum {i} model_input")
        inputs: dict[str, torch.Tensor] = {}
        for key, array in wire.loss_fn_inputs.items():
            flat = array.reshape(-1)
            if flat.size != n:
                raise UserError(f"Expected datum {i} loss_fn_inputs[{key!r}] to have {n} entries (one per "
                                f"model_input token), got {flat.size}.")
            if key == "target_tokens":
                if flat.dtype.kind not in "iu":
                    raise UserError(f"Expected datum {i} target_tokens as integers, got {flat.dtype}.")
                self.check_ids(flat, f"datum {i} target_tokens")
                inputs[key] = torch.from_numpy(flat.astype(np.int64))
            else:
                if not np.isfinite(flat).all():
                    raise UserError(f"Expected finite datum {i} loss_fn_inputs[{key!r}], got NaN or infinity.")
                inputs[key] = torch.from_numpy(flat.astype(np.float32))
        try:
            check_loss(loss_fn, inputs, config)
        except ValueError as exc:
            raise UserError(f"datum {i}: {exc}") from None
        return Datum(torch.from_numpy(wire.tokens.astype(np.int64)), inputs)

    @staticmethod
    def loss_config(config: dict[str, float | str]) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in config.items():
            if isinstance(value, str) or not math.isfinite(value):
                raise UserError(f"Expected loss_fn_config[{key!r}] to be a finite number, got {value!r}.")
            out[key] = float(value)
        if out.get("temperature", 1.0) <= 0:
            raise UserError(f"Expected loss_fn_config temperature > 0, got {out['temperature']}.")
        return out

    def check_ids(self, ids: Any, what: str) -> None:
        """Token ids in ``[0, vocab_size)``; ``ids`` is a numpy array or a list."""
        array = np.asarray(ids)
        if array.size and (int(array.min()) < 0 or int(array.max()) >= self.vocab_size):
            bad = array[(array < 0) | (array >= self.vocab_size)][:5].tolist()
            raise UserError(f"Expected {what} token ids in [0, {self.vocab_size}) (the model's vocabulary), got {bad}.")

    def lora_rank(self, rank: int) -> int:
        if not 1 <= rank <= self.max_lora_rank:
            raise UserError(f"Expected a LoRA rank in [1, {self.max_lora_rank}] (--max-lora-rank), got {rank}.")
        return rank

    @staticmethod
    def adam(req: _requests.OptimStep) -> AdamParams:
        if req.adam_params is None:
            kind = (req.optimizer_params or {}).get("type", "none")
            raise UserError(f"Expected adam_params in optim_step (this service trains with AdamW only), got {kind!r}.")
        return AdamParams(**req.adam_params.model_dump())

    # -- sampling ------------------------------------------------------------------------------

    def sample(self, req: _requests.Sample) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the core's sampling parameters, every size checked."""
        for field in _UNSUPPORTED_SAMPLE_FIELDS:
            if getattr(req, field):
                raise UserError(f"{field} is not supported by this service; leave it at 0.")
        if req.target_prompt_logprobs is not None or req.prompt_logprobs_last_n is not None:
            raise UserError("target_prompt_logprobs and prompt_logprobs_last_n are not supported here.")
        if req.num_samples > self.max_samples:
            raise UserError(f"Expected num_samples in [1, {self.max_samples}] (--max-samples), got {req.num_samples}.")
        prompt = self.prompt(req.prompt)
        params = req.sampling_params
        if params.max_tokens is None:
            raise UserError("Expected sampling_params.max_tokens (a positive integer), got none.")
        if len(prompt) + params.max_tokens > self.context:
            raise UserError(f"Expected prompt + max_tokens <= {self.context} (the model's context), got "
                            f"{len(prompt)} + {params.max_tokens}.")
        total = req.num_samples * (len(prompt) + params.max_tokens)
        if total > self.max_sample_tokens:
            raise UserError(f"Expected num_samples * (prompt + max_tokens) <= {self.max_sample_tokens} "
                            f"(--max-sample-tokens), got {req.num_samples} * ({len(prompt)} + {params.max_tokens}) "
                            f"= {total}; ask for fewer samples per request.")
        stop = params.stop
        if isinstance(stop, list) and stop and isinstance(stop[0], int):
            self.check_ids(stop, "stop")
        top_k = params.top_k if params.top_k == -1 else min(params.top_k, self.vocab_size)  # k >= vocab: all ids
        if top_k == 0:
            raise UserError("Expected top_k -1 (off) or >= 1, got 0.")
        return prompt, SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                      top_p=params.top_p, top_k=top_k, stop=stop, seed=params.seed)

    def prompt(self, prompt: _requests.Prompt) -> list[int]:
        tokens: list[int] = []
        for chunk in prompt.chunks:
            if chunk.type != "encoded_text":
                raise UserError(f"Expected encoded_text prompt chunks (this service is text-only), got {chunk.type!r}.")
            tokens += chunk.tokens
            if len(tokens) >= self.context:
                raise UserError(f"Expected a prompt shorter than {self.context} tokens (the model's context), got "
                                f"at least {len(tokens)}.")
        if not tokens:
            raise UserError("Expected a prompt with at least one token, got none.")
        self.check_ids(tokens, "prompt")
        return tokens


__all__ = ["Limits"]
