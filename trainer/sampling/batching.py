"""The request queue every sampler shares: many awaiting callers, one batched call.

Many episodes are in flight at once, each awaiting its own turn: :meth:`BatchingSampler.generate`
queues a request, and one drain task gathers every request that is waiting and answers them with ONE
``generate_batch`` call in a worker thread, so env traffic keeps flowing meanwhile. A backend
subclasses it and implements ``generate_batch`` and ``update_weights``. The gathering itself,
:class:`TurnQueue`, is shared with :class:`~trainer.sampling.server_batches.ServerBatches` (the trainer's
:class:`~trainer.sampling.remote.RemoteSampler` and the training service's sampler-server requests), which
answers what it gathers with one request per sampler server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from trainer.sampling.types import GenRequest, SampledSequence, SamplingConfig

_T = TypeVar("_T")


class TurnQueue(Generic[_T]):
    """Turns waiting for a batched answer, released once every live episode asked for its turn.

    One generate call for every live episode beats many small ones (CPU and GPU alike), so
    :meth:`gather` waits until the waiting turns and the ones being answered meanwhile (``busy``)
    cover every live episode (``demand``, :meth:`set_demand`; at most ``max_batch_size``), or
    ``batch_wait_s`` passed.
    """

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.items: list[_T] = []
        self.demand: Callable[[], int] = lambda: 1

    async def gather(self, busy: Callable[[], int] = lambda: 0) -> None:
        """Wait until every live episode not being answered is waiting here (at most ``batch_wait_s``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.batch_wait_s
        await asyncio.sleep(0)
        while (len(self.items) + busy() < min(self.demand(), self.config.max_batch_size)
               and loop.time() < deadline):
            await asyncio.sleep(0.001)

    def take(self, size: int) -> list[_T]:
        """The first ``size`` waiting turns, out of the queue."""
        batch, self.items = self.items[:size], self.items[size:]
        return batch


class BatchingSampler:
    """The request-batching queue of every in-process sampler; a backend implements ``generate_batch`` and
    ``update_weights`` (the :class:`~trainer.sampling.protocol.Sampler` interface).

    ``generate`` queues a request and one drain task gathers every request that is waiting (up to
    ``batch_wait_s`` for all live episodes, :meth:`set_demand`) and answers them with ONE
    ``generate_batch`` call in a worker thread. Greedy and sampled requests go in separate calls.

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
        self._queue: TurnQueue[tuple[GenRequest, asyncio.Future[SampledSequence]]] = TurnQueue(self.config)
        self._worker: asyncio.Task[None] | None = None

    def set_demand(self, live_episodes: Callable[[], int]) -> None:
        """Tell the sampler how many episodes are live: a batch waits (up to ``batch_wait_s``) until they all ask."""
        self._queue.demand = live_episodes

    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]:
        """Answer ``requests`` (all with the same greedy flag) in one call; runs in a worker thread."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate_batch")

    def update_weights(self, model: Any, version: int) -> None:
        """Sample from ``model``'s current weights from now on; later results carry ``version``."""
        raise NotImplementedError(f"{type(self).__name__} must implement update_weights")

    def close(self) -> None:
        """Free what the sampler holds; a sampler on the trainer's own model holds nothing."""

    async def generate(self, request: GenRequest) -> SampledSequence:
        """The completion of ``request``, answered in one batch with every other request waiting meanwhile."""
        if request.max_new_tokens < 1:
            raise ValueError(f"Expected max_new_tokens >= 1, got {request.max_new_tokens}.")
        fut: asyncio.Future[SampledSequence] = asyncio.get_running_loop().create_future()
        self._queue.items.append((request, fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

    def _generate_locked(self, requests: list[GenRequest]) -> list[SampledSequence]:
        with self.weights_lock:
            version = self.version
            results = self.generate_batch(requests)
        self.calls += 1
        self.sequences += len(requests)
        for res in results:  # fresh results of this call: stamping them changes no caller's data
            res.version = version
        return results

    async def _drain(self) -> None:
        while self._queue.items:
            await self._queue.gather()
            batch = self._queue.take(self.config.max_batch_size)
            for greedy in (False, True):
                part = [(r, f) for r, f in batch if r.greedy == greedy]
                if part:
                    await self._answer(part)

    async def _answer(self, part: list[tuple[GenRequest, asyncio.Future[SampledSequence]]]) -> None:
        try:
            results = await asyncio.to_thread(self._generate_locked, [r for r, _ in part])
        except BaseException as exc:  # the episodes waiting on this batch see the error
            for _, f in part:
                if not f.done():
                    f.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, f), res in zip(part, results):
            if not f.done():
                f.set_result(res)


__all__ = ["BatchingSampler", "TurnQueue"]
