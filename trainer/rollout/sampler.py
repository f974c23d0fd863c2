"""Policy samplers behind one interface: ``await sampler.generate(GenRequest) -> GenResult``.

``HFSampler`` runs Hugging Face ``generate`` (CPU or GPU). Many episodes are in flight at once,
each awaiting its own turn; the sampler gathers every request that is waiting and answers them
with ONE batched ``generate`` call (left-padded), in a worker thread so env traffic keeps flowing
meanwhile. Requests with images (a vision-language policy) carry their pixel patches and grids
into the same call. The vLLM sampler lives in :mod:`trainer.rollout.vllm_sampler` (GPU, imported lazily).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

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

    backend: str = "hf"  # "hf" (transformers generate) or "vllm" (GPU)
    temperature: float = 1.0
    top_p: float = 1.0
    max_batch_size: int = 256
    batch_wait_s: float = 0.05  # the longest a request waits for the other live episodes to join its batch

    def __post_init__(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"Expected sampling.backend 'hf' or 'vllm', got {self.backend!r}.")
        if self.temperature <= 0:
            raise ValueError(f"Expected temperature > 0 (use GenRequest(greedy=True) for greedy), "
                             f"got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Expected 0 < top_p <= 1, got {self.top_p}.")


class HFSampler:
    """Batched Hugging Face ``generate``; shares the trainer's model object, so no weight copy is needed.

    Sampling draws from the global torch RNG: seed it (``train`` gives every torchrun rank its own seed,
    :func:`trainer.distributed.rank_seed`) for reproducible completions that differ across ranks.

    >>> sampler = HFSampler(model, tokenizer)                           # doctest: +SKIP
    >>> await sampler.generate(GenRequest(prompt_ids, max_new_tokens=16)) # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: Any, config: SamplingConfig | None = None):
        self.model = model
        self.config = config or SamplingConfig()
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        self.version = 0
        self.calls = 0          # batched generate calls (metrics: how well batching works)
        self.sequences = 0
        self._pending: list[tuple[GenRequest, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self._demand: Callable[[], int] = lambda: 1

    def set_demand(self, live_episodes: Callable[[], int]) -> None:
        """Tell the sampler how many episodes are live: a batch waits (up to ``batch_wait_s``) until they all ask."""
        self._demand = live_episodes

    def update_weights(self, model: Any, version: int) -> None:
        """The sampler holds the trainer's own model: only the version changes."""
        self.model = model
        self.version = version

    async def generate(self, request: GenRequest) -> GenResult:
        if request.max_new_tokens < 1:
            raise ValueError(f"Expected max_new_tokens >= 1, got {request.max_new_tokens}.")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((request, fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

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
                    results = await asyncio.to_thread(self.generate_batch, [r for r, _ in part])
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

    @torch.no_grad()
    def generate_batch(self, requests: list[GenRequest]) -> list[GenResult]:
        """One left-padded ``generate`` for all ``requests`` (same greedy flag); per-request caps applied after."""
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
        max_new = max(r.max_new_tokens for r in requests)
        images = _image_inputs(model, requests, ids_BT.to(device))
        was_training = model.training
        model.eval()
        try:
            out = model.generate(input_ids=ids_BT.to(device), attention_mask=attn_BT.to(device),
                                 max_new_tokens=max_new, do_sample=not greedy,
                                 temperature=temperature if not greedy else None,
                                 top_p=self.config.top_p if not greedy else None, top_k=0 if not greedy else None,
                                 eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                                 return_dict_in_generate=True, output_logits=True, **images)
        finally:
            model.train(was_training)
        self.calls += 1
        self.sequences += len(requests)
        new_BN = out.sequences[:, width:].cpu()
        logits_BNV = torch.stack(out.logits, dim=1).float().cpu() / temperature
        logprobs_BN = torch.log_softmax(logits_BNV, dim=-1).gather(-1, new_BN.unsqueeze(-1)).squeeze(-1)
        return [self._cut(new_BN[i].tolist(), logprobs_BN[i].tolist(), r.max_new_tokens)
                for i, r in enumerate(requests)]

    def _cut(self, ids: list[int], logprobs: list[float], cap: int) -> GenResult:
        ids, logprobs = ids[:cap], logprobs[:cap]
        if self.eos_id in ids:
            end = ids.index(self.eos_id) + 1
            return GenResult(ids[:end], logprobs[:end], "stop")
        return GenResult(ids, logprobs, "length")


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


__all__ = ["Sampler", "SamplingConfig", "HFSampler"]
