"""The sampler interface every backend implements, in process (HF, vLLM) or, next, behind an HTTP server.

A sampler turns token-id prompts into :class:`~trainer.sampling.types.SampledSequence` results stamped
with the policy version that produced them, and takes new weights from the trainer. See the package
docstring of :mod:`trainer.sampling` for who calls what.
"""

from __future__ import annotations

from typing import Any, Protocol

from trainer.sampling.types import GenRequest, SampledSequence


class Sampler(Protocol):
    """A policy sampler: batched generation from token ids, versioned weight updates, and release.

    ``generate_batch`` answers requests that share one ``greedy`` flag in one call and may block (callers
    on an event loop use ``generate``, which queues and batches); ``update_weights`` makes the sampler
    sample from ``model``'s current weights and stamps later results with ``version``; ``close`` frees
    what the sampler holds (an engine, temporary files) and is safe to call twice.
    """

    #: the policy version of the weights now loaded; stamped on every result
    version: int

    async def generate(self, request: GenRequest) -> SampledSequence: ...

    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]: ...

    def update_weights(self, model: Any, version: int) -> None: ...

    def close(self) -> None: ...


__all__ = ["Sampler"]
