"""The sampler a run's ``sampling.backend`` names, built for the trainer's policy model."""

from __future__ import annotations

from typing import Any

from trainer.sampling.batching import BatchingSampler
from trainer.sampling.hf import HFSampler
from trainer.sampling.remote import RemoteSampler
from trainer.sampling.types import SamplingConfig


def make_sampler(model: Any, tokenizer: Any, config: SamplingConfig, *, lora: bool = False, seed: int = 0,
                 own_copy: bool = False, adapter_name: str = "policy") -> BatchingSampler | RemoteSampler:
    """The sampler ``config`` names: a :class:`RemoteSampler` over ``config.servers`` when there are any
    (``model``'s weights pushed to them first; a LoRA run's adapter as ``adapter_name``), else ``HFSampler``
    (``own_copy`` for asynchronous rollouts) or ``VLLMSampler`` (vLLM imported only then; its engine always
    holds its own weights)."""
    if config.servers:
        return RemoteSampler(config.servers, model, config, token=config.server_token, lora=lora,
                             adapter_name=adapter_name)
    if config.backend == "vllm":
        from trainer.sampling.vllm_engine import VLLMSampler

        return VLLMSampler(model, tokenizer, config, lora=lora, seed=seed)
    return HFSampler(model, tokenizer, config, own_copy=own_copy)


__all__ = ["make_sampler"]
