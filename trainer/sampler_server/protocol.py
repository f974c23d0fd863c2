"""The sampler server's trainer API: what a request may ask (bounded), what a backend answers, and the limits.

A :class:`SampleJob` is one prompt with ``n`` samples (and, for a vision-language model, the image
features behind its placeholder ids); jobs whose :meth:`SampleJob.batch_key` match share one batched
decode. A backend (:class:`Backend`, implemented in :mod:`.backends`) answers a list of such jobs under
its weights lock: per job its samples and the policy version that drew them, or the error that job met.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from trainer.sampling.image_wire import features_of, grid_of
from trainer.sampling.wire import StreamHeader
from trainer.vision import ImageFeatures

#: hard caps of the wire schema; :class:`ServerLimits` narrows them per server
MAX_IDS = 1 << 20
MAX_STOPS = 64
MAX_NAME_CHARS = 128
MAX_BATCH_REQUESTS = 4096
MAX_IMAGES = 64


@dataclass(frozen=True)
class ServerLimits:
    """Every size a client controls, bounded before anything is allocated for it."""

    max_prompt_tokens: int = 32768
    max_new_tokens: int = 4096
    max_samples: int = 64              # n per request
    max_batch_rows: int = 256          # sequences per batched decode
    max_queued_requests: int = 4096    # beyond this a request gets 503 (retry later)
    max_request_bytes: int = 8 << 20   # JSON bodies
    max_batch_request_bytes: int = 64 << 20  # a multi-prompt /sample/batch body
    max_header_bytes: int = 16 << 20   # a weight push's safetensors header
    max_lora_rank: int = 256
    max_adapters: int = 8
    max_stop_chars: int = 256
    max_images: int = 16               # per request
    max_image_patches: int = 16384     # per request, all its images (a patch: 14x14 px x 2 frames in Qwen2-VL)


class BadRequestError(ValueError):
    """A request the server refuses (a 400 with this message)."""


class NotFoundError(KeyError):
    """A model or adapter the server does not hold (a 404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class SampleJob:
    """One prompt to continue ``n`` times; ``stop_ids`` None means the tokenizer's EOS, ``()`` no stop id."""

    prompt_ids: tuple[int, ...]
    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    adapter: str | None = None
    prompt_logprobs: bool = False  # also score the prompt: log p(prompt[i] | prompt[:i]), None first
    images: tuple[ImageFeatures, ...] = ()  # behind the prompt's image placeholders, in order

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def batch_key(self, mix_adapters: bool = False) -> tuple[Any, ...]:
        """Jobs with equal keys run in one decode call (jobs of different adapters too, when the backend
        ``mix_adapters``); a seeded job runs alone (its own RNG stream)."""
        solo = id(self) if self.seed is not None else None
        adapter = None if mix_adapters else self.adapter
        return (self.temperature, self.top_p, self.top_k, self.stop_ids, self.stop_strings, adapter, solo)


@dataclass
class Sample:
    """One sampled continuation: ids (ending with the stop id when ``finish_reason == "stop"``), their log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    prompt_logprobs: list[float | None] | None = None  # the job's prompt scored (when it asked), on each sample


#: one job's answer from a backend: its samples and the version that drew them, or the error it met
Outcome = tuple[list[Sample], int] | Exception


@dataclass(frozen=True)
class ImageSpec:
    """What a vision-language model takes: patch size (values per patch), merge size, the placeholder id."""

    patch_dim: int
    merge_size: int
    image_token_id: int


class Backend(Protocol):
    """What the server needs from a sampler: batched generation and versioned, atomic weight updates.

    ``mixes_adapters``: one ``generate`` call may hold jobs of different adapters (and the base).
    ``images``: what its model takes as images (None: text only).
    ``base_fingerprint``: :func:`~trainer.sampling.remote_push.base_fingerprint` of the weights it loaded (None:
    not known; the trainer then cannot check that its LoRA adapters fit the server's base)."""

    model_name: str
    base_fingerprint: str | None
    tokenizer: Any
    version: int
    mixes_adapters: bool
    images: ImageSpec | None

    def vocab_size(self) -> int: ...

    def max_context(self) -> int: ...

    def generate(self, jobs: list[SampleJob]) -> list[Outcome]: ...

    def plan_full(self, header: StreamHeader) -> dict[str, torch.Tensor]: ...

    def apply_full(self, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def plan_adapter(self, name: str, lora_config: dict[str, Any], header: StreamHeader) -> dict[str, torch.Tensor]: ...

    def apply_adapter(self, name: str, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def discard_adapter(self, name: str) -> None: ...

    def unload_adapter(self, name: str) -> None: ...

    def adapters(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class SampleBody(BaseModel):
    """``POST /sample``: token ids in; ``n`` continuations with their sampled log-probs out (and the prompt's
    log-probs, None first, with ``prompt_logprobs``: Tinker's ``compute_logprobs``)."""

    model_config = ConfigDict(extra="forbid")

    prompt_ids: list[int] = Field(min_length=1, max_length=MAX_IDS)
    n: int = Field(1, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop_ids: list[int] | None = Field(None, max_length=MAX_STOPS)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS)
    seed: int | None = None
    adapter: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt_logprobs: bool = False
    images: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_IMAGES)


class SampleBatchBody(BaseModel):
    """``POST /sample/batch``: several ``/sample`` bodies decoded together, each answered (or refused) on its own."""

    model_config = ConfigDict(extra="forbid")

    requests: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_BATCH_REQUESTS)


def check_job(job: SampleJob, limits: ServerLimits, vocab: int, context: int) -> None:
    """Refuse (``BadRequestError``, with the bound) a job past the server's limits or the model's vocabulary."""
    if len(job.prompt_ids) > limits.max_prompt_tokens:
        raise BadRequestError(f"Expected at most {limits.max_prompt_tokens} prompt tokens, got {len(job.prompt_ids)}.")
    if job.max_tokens > limits.max_new_tokens:
        raise BadRequestError(f"Expected max_tokens <= {limits.max_new_tokens}, got {job.max_tokens}.")
    if job.n > limits.max_samples:
        raise BadRequestError(f"Expected n <= {limits.max_samples}, got {job.n}.")
    if len(job.prompt_ids) + job.max_tokens > context:
        raise BadRequestError(f"Expected prompt + max_tokens <= {context} (the model's context), got "
                              f"{len(job.prompt_ids)} + {job.max_tokens}.")
    ids = [*job.prompt_ids, *(job.stop_ids or ())]
    if min(ids) < 0 or max(ids) >= vocab:
        raise BadRequestError(f"Expected token ids in [0, {vocab}), got one out of range.")
    if any(not s or len(s) > limits.max_stop_chars for s in job.stop_strings):
        raise BadRequestError(f"Expected stop strings of 1 to {limits.max_stop_chars} characters.")


def job_of(body: SampleBody, limits: ServerLimits | None = None, spec: ImageSpec | None = None,
           backend_kind: str = "hf") -> SampleJob:
    """The backend's job for a ``/sample`` body (its images checked against ``limits`` and ``spec``, the server
    model's image inputs: ``BadRequestError`` for a text-only model or a bad image, before anything is decoded)."""
    placeholders = spec is not None and spec.image_token_id in body.prompt_ids
    images = _images(body, limits or ServerLimits(), spec, backend_kind) if body.images or placeholders else ()
    return SampleJob(tuple(body.prompt_ids), body.n, body.max_tokens, body.temperature, body.top_p, body.top_k,
                     None if body.stop_ids is None else tuple(body.stop_ids), tuple(body.stop), body.seed,
                     body.adapter, body.prompt_logprobs, images)


def _images(body: SampleBody, limits: ServerLimits, spec: ImageSpec | None,
            backend_kind: str) -> tuple[ImageFeatures, ...]:
    if spec is None:
        why = ("the vLLM backend takes no images; run a vision-language policy's sampler server with --backend hf"
               if backend_kind == "vllm" else "its model is text-only (start it with a vision-language model)")
        raise BadRequestError(f"Expected a request without images: this server cannot take them ({why}).")
    if len(body.images) > limits.max_images:
        raise BadRequestError(f"Expected at most {limits.max_images} images in a request, got {len(body.images)}.")
    try:
        patches = sum(math.prod(grid_of(entry, spec.merge_size)) for entry in body.images)
    except ValueError as exc:
        raise BadRequestError(f"Bad image: {exc}") from None
    if patches > limits.max_image_patches:
        raise BadRequestError(f"Expected at most {limits.max_image_patches} image patches in a request, got "
                              f"{patches}.")
    out = []
    for i, entry in enumerate(body.images):
        try:
            out.append(features_of(entry, patch_dim=spec.patch_dim, merge_size=spec.merge_size, max_patches=patches))
        except ValueError as exc:
            raise BadRequestError(f"Bad image {i}: {exc}") from None
    placeholders, expected = body.prompt_ids.count(spec.image_token_id), sum(f.num_tokens for f in out)
    if placeholders != expected:
        raise BadRequestError(f"Expected {expected} image placeholder ids ({spec.image_token_id}) in prompt_ids for "
                              f"the images' grids, got {placeholders}.")
    return tuple(out)


__all__ = ["ServerLimits", "SampleJob", "Sample", "Backend", "ImageSpec", "Outcome", "SampleBody", "SampleBatchBody",
           "BadRequestError", "NotFoundError", "check_job", "job_of"]
