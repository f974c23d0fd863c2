"""A :class:`~trainer.core.host.ModelHost`'s samplers on one vLLM engine (``ModelHost(..., sampler="vllm")``).

The engine is built once, from the host's base weights, when the host is. Every sampler is a view of
it: the base model (no LoRA request), a LoRA adapter (its weights written once, in peft's format, to
a directory vLLM loads into one of its LoRA slots; vLLM swaps slots itself when more adapters are
registered than it holds), or a full-parameter tenant's live weights (streamed in memory into the
engine when the tenant has stepped since the last sync, and the base weights streamed back when the
tenant leaves). Views sample with :meth:`VLLMSampler.sample`: the core ``SamplingParams`` semantics
and log-probs after temperature, as the trainer computes them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from trainer.sampling import SampleResponse, SamplingConfig, SamplingParams
from trainer.sampling.vllm_engine import VLLMSampler, memory_dir, on_vllm_thread, sample_response

#: the largest LoRA rank the engine holds unless the host asks for more (slots are allocated at this rank)
DEFAULT_MAX_LORA_RANK = 64


class VLLMView:
    """One sampler on the shared engine: ``sample`` like :class:`~trainer.core.sampling.SamplingClient`."""

    def __init__(self, engine: VLLMSampler, lora_request: Any = None):
        self.engine, self.lora_request = engine, lora_request

    def sample(self, prompt_tokens: Sequence[int], num_samples: int = 1, sampling_params: SamplingParams | None = None,
               *, include_prompt_logprobs: bool = False) -> SampleResponse:
        from vllm.exceptions import VLLMValidationError

        try:
            return self.engine.sample(prompt_tokens, num_samples, sampling_params,
                                      include_prompt_logprobs=include_prompt_logprobs, lora_request=self.lora_request)
        except VLLMValidationError as exc:  # bad input (a prompt past the engine's context, say): the caller's error
            raise ValueError(str(exc)) from exc


def sample_views(requests: Sequence[tuple[VLLMView, list[int], int, SamplingParams, bool]]) -> list[SampleResponse]:
    """Several ``(view, prompt, num_samples, params, include_prompt_logprobs)`` requests on one engine in ONE
    ``generate`` call: vLLM schedules their rows together, each with its own sampling parameters (a seed stays
    per request) and its own LoRA adapter (its multi-LoRA batches). Each answer is what ``view.sample`` gives.
    Keep base-model views (no adapter) out of a call with LoRA views: vLLM's CPU build (0.11) applies the
    batch's adapters to them too (observed), so the service sends the two kinds in separate calls."""
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    if not requests:
        return []
    engine = requests[0][0].engine
    if any(view.engine is not engine for view, *_ in requests):
        raise ValueError("Expected views of one vLLM engine in one batch.")
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in prompt]) for _, prompt, *_ in requests]
    params = [_engine_params(engine, p, n, logprobs) for _, _, n, p, logprobs in requests]
    loras = [view.lora_request for view, *_ in requests]
    try:
        with engine.weights_lock:
            outputs = on_vllm_thread(engine.llm.generate, prompts, params, lora_request=loras, use_tqdm=False)
    except VLLMValidationError as exc:  # bad input (a prompt past the engine's context, say): the caller's error
        raise ValueError(str(exc)) from exc
    return [sample_response(out, prompt, logprobs) for out, (_, prompt, _, _, logprobs) in zip(outputs, requests)]


def _engine_params(engine: VLLMSampler, p: SamplingParams, n: int, prompt_logprobs: bool) -> Any:
    """vLLM's sampling parameters for the core's ``p``, as :meth:`VLLMSampler.sample` builds them."""
    from vllm import SamplingParams as VParams

    if n < 1:
        raise ValueError(f"Expected num_samples >= 1, got {n}.")
    return VParams(n=n, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                   top_k=p.top_k if p.top_k > 0 else 0, seed=p.seed, logprobs=0, detokenize=bool(p.stop_strings),
                   stop_token_ids=p.stop_token_ids if p.stop is not None else [engine.eos_id],
                   stop=p.stop_strings or None, include_stop_str_in_output=True, ignore_eos=p.stop is not None,
                   prompt_logprobs=0 if prompt_logprobs else None, skip_special_tokens=False)


class VLLMSamplers:
    """The engine and the adapters registered in it, keyed by sampler name."""

    def __init__(self, base: Any, tokenizer: Any, *, max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
                 max_loras: int = 2, max_model_len: int = 4096):
        self.max_lora_rank = max_lora_rank
        self.engine = VLLMSampler(base, tokenizer, SamplingConfig(backend="vllm"), lora=True, lora_slots=max_loras,
                                  max_lora_rank=max_lora_rank, max_model_len=max_model_len)
        self._dir = tempfile.mkdtemp(prefix="envhub-vllm-adapters-", dir=memory_dir())
        self._requests: dict[str, Any] = {}
        self._ids = 0
        self._synced: tuple[str, int] | None = None  # (full tenant, generation) whose weights the engine holds

    def base(self) -> VLLMView:
        return VLLMView(self.engine)

    def add_adapter(self, name: str, weights: dict[str, torch.Tensor], *, rank: int, alpha: int,
                    target_modules: Any) -> VLLMView:
        """Register LoRA ``weights`` (peft state-dict keys, as ``weights_state`` gives them) as sampler ``name``."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if rank > self.max_lora_rank:
            raise ValueError(f"Expected a LoRA rank <= {self.max_lora_rank} (the vLLM engine's LoRA slots), got {rank}.")
        self._ids += 1
        path = os.path.join(self._dir, f"adapter-{self._ids}")
        os.makedirs(path)
        targets = sorted(target_modules) if isinstance(target_modules, (set, list, tuple)) else target_modules
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": int(alpha),
                  "lora_dropout": 0.0, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
                  "base_model_name_or_path": None, "modules_to_save": None}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
                  os.path.join(path, "adapter_model.safetensors"))
        request = LoRARequest(f"sampler-{self._ids}", self._ids, path)
        try:
            with self.engine.weights_lock:
                on_vllm_thread(self.engine.llm.llm_engine.add_lora, request)
        except Exception as exc:
            shutil.rmtree(path, ignore_errors=True)
            raise ValueError(f"vLLM could not load LoRA adapter {name!r} ({type(exc).__name__}: {exc}).") from exc
        self._requests[name] = request
        return VLLMView(self.engine, request)

    def remove(self, name: str) -> None:
        request = self._requests.pop(name)
        with self.engine.weights_lock:
            on_vllm_thread(self.engine.llm.llm_engine.remove_lora, request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def live(self, name: str, model: Any, generation: int) -> VLLMView:
        """A full-parameter tenant's weights at ``generation``, synced into the engine in memory when they moved."""
        if generation < 0 or self._synced != (name, generation):
            self.engine.update_weights(model, generation)
            self._synced = (name, generation)
        return VLLMView(self.engine)

    def restore_base(self, base: Any) -> None:
        """Stream the base weights back after a full-parameter tenant changed the engine's."""
        if self._synced is not None:
            self.engine.update_weights(base, 0)
            self._synced = None

    def close(self) -> None:
        self.engine.close()
        shutil.rmtree(self._dir, ignore_errors=True)


__all__ = ["DEFAULT_MAX_LORA_RANK", "VLLMSamplers", "VLLMView", "sample_views"]
