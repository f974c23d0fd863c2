"""Sampling from a policy with Hugging Face ``generate``: n samples, stop strings and stop ids, log-probs.

The log-prob of each sampled id is recomputed with the trainer's own forward pass
(:func:`~trainer.core.forward.target_logprobs` over prompt + completion at the sampling temperature),
so a ratio against the trainer's log-probs starts at 1 up to float rounding, whatever ``generate``'s
cache does. ``generate`` only picks the ids.

>>> client = SamplingClient(model, tokenizer)                               # doctest: +SKIP
>>> out = client.sample([1, 2, 3], 4, SamplingParams(max_tokens=8, stop=["\\n"], seed=0))  # doctest: +SKIP
>>> out.sequences[0].tokens, out.sequences[0].logprobs                      # doctest: +SKIP
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import Tensor

from trainer.core.forward import BASE_ADAPTER, model_device, run_model, target_logprobs
from trainer.core.types import SampledSequence, SampleResponse, SamplingParams


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
        completions = self._generate(prompt, num_samples, params)
        temperature = params.temperature or 1.0  # greedy ids are scored at temperature 1
        rows = [prompt + ids for ids, _ in completions]
        logprobs_BT = self._logprobs(rows, temperature)
        sequences = [SampledSequence(ids, logprobs_BT[i, len(prompt) - 1:len(rows[i]) - 1].tolist(), reason)
                     for i, (ids, reason) in enumerate(completions)]
        prompt_lps = None
        if include_prompt_logprobs:
            prompt_lps = [None] + self._logprobs([prompt], 1.0)[0, :len(prompt) - 1].tolist()
        return SampleResponse(sequences, prompt_lps)

    def compute_logprobs(self, tokens: Sequence[int]) -> list[float | None]:
        """log p(tokens[i] | tokens[:i]) for every position (None at 0): Tinker's ``compute_logprobs``."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("Expected a non-empty sequence, got no tokens.")
        return [None] + self._logprobs([tokens], 1.0)[0, :len(tokens) - 1].tolist()

    # -- internals -------------------------------------------------------------------------------
    def _adapters(self, n: int) -> list[str] | None:
        return [self.adapter] * n if self.adapter is not None else None

    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]], temperature: float) -> Tensor:
        """[B, T-1] log-probs of each row's next tokens (right-padded rows), on the CPU."""
        model = self.model
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(tokens)
        for i, r in enumerate(rows):
            tokens[i, :len(r)], attn[i, :len(r)] = torch.tensor(r), 1
        device = model_device(model)
        with _eval_mode(model):
            logits, _ = run_model(model, tokens.to(device), attn.to(device), adapters=self._adapters(len(rows)))
        return target_logprobs(logits[:, :-1], tokens[:, 1:].to(device), temperature).float().cpu()

    @torch.no_grad()
    def _generate(self, prompt: list[int], n: int, params: SamplingParams) -> list[tuple[list[int], str]]:
        model = _generation_model(self.model)
        device = model_device(model)
        stop_ids = set(params.stop_token_ids) if params.stop is not None else {self.eos_id}
        config = copy.deepcopy(model.generation_config)
        config.eos_token_id = None  # every stop is ours: EOS only when ``stop`` is None
        config.pad_token_id = self.pad_id
        config.max_new_tokens, config.max_length = params.max_tokens, None
        greedy = params.temperature == 0
        config.do_sample = not greedy
        config.temperature, config.top_p, config.top_k = (
            (None, None, None) if greedy else (params.temperature, params.top_p, max(params.top_k, 0)))
        ids_BT = torch.tensor([prompt] * n, device=device)
        criteria = _StopCriteria(len(prompt), stop_ids, params.stop_strings, self.tokenizer)
        kwargs: dict[str, Any] = dict(generation_config=config, stopping_criteria=[criteria],
                                      attention_mask=torch.ones_like(ids_BT))
        if self.adapter is not None:
            kwargs["adapter_names"] = self._adapters(n)
        with _eval_mode(self.model), _seeded(params.seed, device):
            out_BT = model.generate(input_ids=ids_BT, **kwargs)
        return [criteria.cut(row[len(prompt):].tolist(), params.max_tokens) for row in out_BT.cpu()]


class _StopCriteria:
    """Per-row stop check for ``generate`` (token ids or strings); :meth:`cut` trims a finished row.

    Each call looks at the newest token of each row only, so a long generation costs linear time.
    """

    def __init__(self, prompt_len: int, stop_ids: set[int], stop_strings: list[str], tokenizer: Any):
        self.prompt_len, self.stop_ids, self.stop_strings = prompt_len, stop_ids, stop_strings
        self.tokenizer = tokenizer
        # a stop string ends within this many trailing tokens (every token decodes to at least one byte)
        self.tail = max((len(s.encode()) for s in stop_strings), default=0) + 1
        self.ends: dict[int, int] = {}  # row -> ids to keep

    def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
        new = input_ids[:, self.prompt_len:].cpu()
        for i, row in enumerate(new.tolist()):
            if i not in self.ends and self._stops(row):
                self.ends[i] = len(row)
        return torch.tensor([i in self.ends for i in range(len(new))], dtype=torch.bool, device=input_ids.device)

    def _stops(self, ids: list[int]) -> bool:
        """Whether the newest id of ``ids`` ends the row."""
        if ids[-1] in self.stop_ids:
            return True
        if self.stop_strings:
            text = self.tokenizer.decode(ids[-self.tail:])
            return any(s in text for s in self.stop_strings)
        return False

    def cut(self, ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        for k in range(1, min(len(ids), max_tokens) + 1):
            if self._stops(ids[:k]):
                return ids[:k], "stop"
        return ids[:max_tokens], "length"


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
        self.seed, self.device, self.fork = seed, device, None

    def __enter__(self) -> None:
        if self.seed is not None:
            devices = [self.device] if self.device.type == "cuda" else []
            self.fork = torch.random.fork_rng(devices=devices)
            self.fork.__enter__()
            torch.manual_seed(self.seed)

    def __exit__(self, *exc: Any) -> None:
        if self.fork is not None:
            self.fork.__exit__(*exc)


def _generation_model(model: Any) -> Any:
    # DDP wrappers do not expose generate(); peft models do
    while not hasattr(model, "generate") and hasattr(model, "module"):
        model = model.module
    return model


def _vocab_size(model: Any) -> int:
    return int(_generation_model(model).get_output_embeddings().weight.shape[0])


__all__ = ["SamplingClient", "BASE_ADAPTER"]
