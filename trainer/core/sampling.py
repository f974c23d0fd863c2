"""Sampling from a policy with :func:`trainer.sampling.decode`: n samples, stop strings and stop ids, log-probs.

The log-prob of each sampled id is the trainer's: in float32 the decode loop's own (the same softmax
of the same logits as :func:`~trainer.core.forward.target_logprobs`, the cached pass differing from the
trainer's forward by float rounding, about 1e-6); in lower precision (bf16 on a GPU), where a cached
decode and the trainer's forward round differently enough to matter, they are recomputed with the
trainer's own forward over prompt + completion at the sampling temperature. Either way a ratio against
the trainer's log-probs starts at 1 up to float rounding.

>>> client = SamplingClient(model, tokenizer)                               # doctest: +SKIP
>>> out = client.sample([1, 2, 3], 4, SamplingParams(max_tokens=8, stop=["\\n"], seed=0))  # doctest: +SKIP
>>> out.sequences[0].tokens, out.sequences[0].logprobs                      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.core.forward import BASE_ADAPTER, model_device, run_model, target_logprobs
from trainer.sampling import (
    SampledSequence,
    SampleResponse,
    SamplingParams,
    decode,
    generation_model,
    stop_string_check,
)
from trainer.sampling.row_adapters import RowAdapters


class SamplingClient:
    """Samples from ``model`` (with peft adapter ``adapter`` when several share it; ``BASE_ADAPTER`` for none).

    The model object is shared, not copied: the samples reflect its weights at the time of the call.
    """

    def __init__(self, model: Any, tokenizer: Any, *, adapter: str | None = None, max_context: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        self.max_context = max_context

    def sample(self, prompt_tokens: Sequence[int], num_samples: int = 1, sampling_params: SamplingParams | None = None,
               *, include_prompt_logprobs: bool = False) -> SampleResponse:
        """``num_samples`` completions of ``prompt_tokens``; ``prompt_logprobs`` (None first) when asked."""
        params = sampling_params or SamplingParams()
        prompt = [int(t) for t in prompt_tokens]
        self.check_request(prompt, num_samples, params)
        completions = self._generate(prompt, num_samples, params)
        if not decode_logprobs_exact(self.model):
            temperature = params.temperature or 1.0  # greedy ids are scored at temperature 1
            rows = [prompt + ids for ids, _, _ in completions]
            logprobs_BT = self._logprobs(rows, temperature)
            completions = [(ids, reason, logprobs_BT[i, len(prompt) - 1:len(rows[i]) - 1].tolist())
                           for i, (ids, reason, _) in enumerate(completions)]
        sequences = [SampledSequence(ids, lps, reason) for ids, reason, lps in completions]
        prompt_lps = None
        if include_prompt_logprobs:
            prompt_lps = [None] + self._logprobs([prompt], 1.0)[0, :len(prompt) - 1].tolist()
        return SampleResponse(sequences, prompt_lps)

    def check_request(self, prompt: list[int], num_samples: int, params: SamplingParams) -> None:
        """Raise ``ValueError`` for a request this sampler cannot honour (empty prompt, ids outside the vocabulary,
        past the context)."""
        if not prompt:
            raise ValueError("Expected a non-empty prompt, got no tokens.")
        if num_samples < 1:
            raise ValueError(f"Expected num_samples >= 1, got {num_samples}.")
        vocab = _vocab_size(self.model)
        if max(prompt) >= vocab or min(prompt) < 0:
            raise ValueError(f"Expected prompt token ids in [0, {vocab}), got one out of range.")
        if self.max_context and len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(f"Expected prompt + max_tokens <= {self.max_context} (the model's context), got "
                             f"{len(prompt)} + {params.max_tokens}.")

    def compute_logprobs(self, tokens: Sequence[int]) -> list[float | None]:
        """log p(tokens[i] | tokens[:i]) for every position (None at 0): Tinker's ``compute_logprobs``."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("Expected a non-empty sequence, got no tokens.")
        return [None] + self._logprobs([tokens], 1.0)[0, :len(tokens) - 1].tolist()

    # -- internals -------------------------------------------------------------------------------
    def _adapters(self, n: int) -> list[str] | None:
        return [self.adapter] * n if self.adapter is not None else None

    def _logprobs(self, rows: list[list[int]], temperature: float) -> Tensor:
        return self.row_logprobs(rows, temperature, self._adapters(len(rows)))

    @torch.no_grad()
    def row_logprobs(self, rows: list[list[int]], temperature: float, adapters: list[str] | None) -> Tensor:
        """[B, T-1] log-probs of each row's next tokens (right-padded rows), row ``b`` under peft adapter
        ``adapters[b]`` (None: the model as it is), on the CPU."""
        model = self.model
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(tokens)
        for i, r in enumerate(rows):
            tokens[i, :len(r)], attn[i, :len(r)] = torch.tensor(r), 1
        device = model_device(model)
        with _eval_mode(model):
            logits, _ = run_model(model, tokens.to(device), attn.to(device), adapters=adapters)
        return target_logprobs(logits[:, :-1], tokens[:, 1:].to(device), temperature).float().cpu()

    @torch.no_grad()
    def _generate(self, prompt: list[int], n: int, params: SamplingParams) -> list[tuple[list[int], str, list[float]]]:
        model = generation_model(self.model)
        device = model_device(model)
        stop_ids = set(params.stop_token_ids) if params.stop is not None else {self.eos_id}
        greedy = params.temperature == 0
        ids_BT = torch.tensor([prompt] * n, device=device)
        adapters = self._adapters(n)
        rows = RowAdapters(self.model, adapters) if adapters is not None else None
        with _eval_mode(self.model), _seeded(params.seed, device):
            out = decode(model, ids_BT, torch.ones_like(ids_BT), max_new_tokens=params.max_tokens, eos_ids=stop_ids,
                         temperature=1.0 if greedy else params.temperature, greedy=greedy,
                         top_k=max(params.top_k, 0), top_p=params.top_p,
                         stop_check=stop_string_check(params.stop_strings, self.tokenizer), row_adapters=rows)
        return list(zip(out.token_ids, out.finish_reasons, out.logprobs))


def decode_logprobs_exact(model: Any) -> bool:
    """Whether :func:`~trainer.sampling.decode`'s log-probs are the trainer's up to float rounding: a float32 model.
    In lower precision the cached decode and the trainer's forward round apart, so samplers recompute them."""
    return all(p.dtype == torch.float32 for p in generation_model(model).parameters() if p.is_floating_point())


class _eval_mode:
    """Eval mode (no dropout) for the duration, the previous mode restored after."""

    def __init__(self, model: Any):
        self.model, self.was_training = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        self.model.train(self.was_training)


class _seeded:
    """Fork the torch RNG (CPU and this CUDA device) and seed it, when a seed is given."""

    def __init__(self, seed: int | None, device: torch.device):
        self.seed, self.device = seed, device
        self.fork: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> None:
        if self.seed is not None:
            devices = [self.device] if self.device.type == "cuda" else []
            self.fork = torch.random.fork_rng(devices=devices)
            self.fork.__enter__()
            torch.manual_seed(self.seed)

    def __exit__(self, *exc: Any) -> None:
        if self.fork is not None:
            self.fork.__exit__(*exc)


def _vocab_size(model: Any) -> int:
    return int(generation_model(model).get_output_embeddings().weight.shape[0])


__all__ = ["SamplingClient", "BASE_ADAPTER", "decode_logprobs_exact"]
