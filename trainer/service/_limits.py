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
from trainer.core.types import INT_INPUTS
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
        """The batch as core datums: sizes, token ids, lengths, finite values and the loss's inputs checked.

        Each check runs once over the whole batch (its arrays concatenated), not once per datum: this is
        on the critical path of every training step."""
        if not req.data:
            raise UserError("Expected at least one Datum in forward_backward, got none.")
        if req.loss_fn not in LOSSES:
            raise UserError(f"Expected loss_fn in {LOSSES}, got {req.loss_fn!r} (this service implements no other).")
        lengths = [len(d.tokens) for d in req.data]
        if sum(lengths) > self.max_batch_tokens:
            raise UserError(f"Expected at most {self.max_batch_tokens} tokens in one forward_backward "
                            f"(--max-batch-tokens), got {sum(lengths)} in {len(req.data)} datums; send the batch in "
                            "smaller calls and optim_step once.")
        if min(lengths) < 1 or max(lengths) > self.context:
            i, n = next((i, n) for i, n in enumerate(lengths) if not 1 <= n <= self.context)
            raise UserError(f"Expected datum {i} to hold 1 to {self.context} tokens (the model's context), got {n}.")
        tokens = np.concatenate([d.tokens for d in req.data]) if len(req.data) > 1 else req.data[0].tokens
        self.check_ids(tokens, "model_input")
        inputs = {key: self._input(key, [d.loss_fn_inputs.get(key) for d in req.data], lengths)
                  for key in req.data[0].loss_fn_inputs}
        for i, d in enumerate(req.data):
            if d.loss_fn_inputs.keys() != inputs.keys():
                raise UserError(f"Expected every datum to carry the same loss_fn_inputs, got {sorted(inputs)} in datum "
                                f"0 and {sorted(d.loss_fn_inputs)} in datum {i}.")
        try:
            check_loss(req.loss_fn, {k: v[0] for k, v in inputs.items()}, self.loss_config(req.loss_fn_config))
        except ValueError as exc:
            raise UserError(str(exc)) from None
        ids = torch.split(torch.from_numpy(tokens.astype(np.int64)), lengths)
        return [Datum(ids[i], {k: v[i] for k, v in inputs.items()}) for i in range(len(lengths))]

    def _input(self, key: str, arrays: list[np.ndarray | None], lengths: list[int]) -> tuple[torch.Tensor, ...]:
        """One loss input of every datum, checked (as long as its datum, ids in the vocabulary or finite floats)
        and split back into one tensor per datum."""
        flat = []
        for i, (array, n) in enumerate(zip(arrays, lengths)):
            if array is None or array.size != n:
                got = "none" if array is None else array.size
                raise UserError(f"Expected datum {i} loss_fn_inputs[{key!r}] to have {n} entries (one per "
                                f"model_input token), got {got}.")
            flat.append(array.reshape(-1))
        values = np.concatenate(flat) if len(flat) > 1 else flat[0]
        if key in INT_INPUTS:
            if values.dtype.kind not in "iu":
                raise UserError(f"Expected {key} as integers, got {values.dtype}.")
            self.check_ids(values, key)
            return torch.split(torch.from_numpy(values.astype(np.int64)), lengths)
        if values.dtype.kind not in "iuf" or not np.isfinite(values).all():
            raise UserError(f"Expected finite numbers in loss_fn_inputs[{key!r}], got NaN, infinity or another type.")
        return torch.split(torch.from_numpy(values.astype(np.float32)), lengths)

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
