"""The server's request queue: concurrent requests gathered into batched decodes, one at a time, off the event loop.

Many episodes ask for their next turn at about the same moment; answering them in ONE decode call is
what makes a sampler fast (on a CPU and on a GPU alike). :meth:`RequestBatcher.submit` queues a job;
a drain task waits until arrivals pause (``quiet_s``, at most ``batch_wait_s``), groups the waiting
jobs by :meth:`~trainer.sampler_server.protocol.SampleJob.batch_key` (jobs of different adapters together
when the backend mixes them in one pass), and runs each group (at most
``max_batch_rows`` sequences) in a worker thread while new requests keep queueing. The jobs of one
multi-prompt request (:meth:`RequestBatcher.submit_many`, a client that gathered its turns itself)
arrive together, so their decode starts without waiting for arrivals to pause.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from trainer.sampler_server.protocol import Backend, Sample, SampleJob


class QueueFullError(RuntimeError):
    """More requests are waiting than the server accepts (a 503: retry later)."""


@dataclass
class BatcherStats:
    """Counters for ``/metrics``."""

    requests: int = 0
    sequences: int = 0
    tokens: int = 0
    batches: int = 0
    busy_s: float = 0.0  # time spent inside decode calls
    errors: dict[str, int] = field(default_factory=dict)


class RequestBatcher:
    """Queues :class:`SampleJob` s and answers them with batched ``backend.generate`` calls."""

    def __init__(self, backend: Backend, *, max_batch_rows: int = 256, max_queued: int = 4096,
                 batch_wait_s: float = 0.05, quiet_s: float = 0.005):
        self.backend = backend
        self.max_batch_rows, self.max_queued = max_batch_rows, max_queued
        self.batch_wait_s, self.quiet_s = batch_wait_s, quiet_s
        self.stats = BatcherStats()
        self._pending: list[tuple[SampleJob, asyncio.Future[tuple[list[Sample], int]]]] = []
        self._last_arrival = 0.0
        self._gathered = False  # a multi-prompt request arrived: decode without waiting for a pause
        self._worker: asyncio.Task[None] | None = None

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a decode (not counting the one running)."""
        return len(self._pending)

    async def submit(self, job: SampleJob) -> tuple[list[Sample], int]:
        """The job's samples and the policy version that drew them."""
        return await self._queue(job)

    async def submit_many(self, jobs: list[SampleJob]) -> list[tuple[list[Sample], int] | Exception]:
        """Each job's samples and version, or the error that job met (the others are answered anyway).

        The jobs are queued at once and decoded without waiting for other arrivals: the client gathered them."""
        slots: list[asyncio.Future[tuple[list[Sample], int]] | Exception] = []
        for job in jobs:
            try:
                slots.append(self._queue(job))
            except QueueFullError as exc:
                slots.append(exc)
        self._gathered = True
        futures = [s for s in slots if isinstance(s, asyncio.Future)]
        try:
            if futures:
                await asyncio.wait(futures)
        except asyncio.CancelledError:  # the client went away: its jobs leave the queue
            for f in futures:
                f.cancel()
            raise
        return [s if isinstance(s, Exception) else _outcome(s) for s in slots]

    def _queue(self, job: SampleJob) -> asyncio.Future[tuple[list[Sample], int]]:
        if len(self._pending) >= self.max_queued:
            raise QueueFullError(f"{len(self._pending)} requests are queued (the most this server takes); "
                                 "retry later.")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[list[Sample], int]] = loop.create_future()
        self._pending.append((job, fut))
        self._last_arrival = loop.time()
        self.stats.requests += 1
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return fut

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            deadline = loop.time() + self.batch_wait_s
            while (not self._gathered and loop.time() < deadline
                   and loop.time() - self._last_arrival < self.quiet_s):
                await asyncio.sleep(self.quiet_s / 2)
            batch, self._pending, self._gathered = self._pending, [], False
            groups: dict[tuple[object, ...], list[tuple[SampleJob, asyncio.Future[tuple[list[Sample], int]]]]] = {}
            for job, fut in batch:
                if not fut.done():  # a client that went away cancelled its future
                    groups.setdefault(job.batch_key(self.backend.mixes_adapters), []).append((job, fut))
            for group in groups.values():
                for part in _split_rows(group, self.max_batch_rows):
                    await self._run(part)

    async def _run(self, part: list[tuple[SampleJob, asyncio.Future[tuple[list[Sample], int]]]]) -> None:
        start = time.monotonic()
        try:
            outcomes = await asyncio.to_thread(self.backend.generate, [job for job, _ in part])
        except Exception as exc:  # each request of the batch sees the error (a bad adapter name, say)
            outcomes = [exc] * len(part)
        if any(not isinstance(o, Exception) for o in outcomes):
            self.stats.busy_s += time.monotonic() - start
            self.stats.batches += 1
        for (_, fut), outcome in zip(part, outcomes):
            if isinstance(outcome, Exception):
                self.stats.errors[type(outcome).__name__] = self.stats.errors.get(type(outcome).__name__, 0) + 1
                if not fut.done():
                    fut.set_exception(outcome)
                continue
            self.stats.sequences += len(outcome[0])
            self.stats.tokens += sum(len(s.token_ids) for s in outcome[0])
            if not fut.done():
                fut.set_result(outcome)


def _outcome(fut: asyncio.Future[tuple[list[Sample], int]]) -> tuple[list[Sample], int] | Exception:
    exc = fut.exception()
    if exc is None:
        return fut.result()
    if not isinstance(exc, Exception):
        raise exc
    return exc


def _split_rows(group: list[tuple[SampleJob, asyncio.Future[tuple[list[Sample], int]]]],
                max_rows: int) -> list[list[tuple[SampleJob, asyncio.Future[tuple[list[Sample], int]]]]]:
    """Consecutive parts of ``group`` of at most ``max_rows`` sequences each (a job is never split)."""
    parts: list[list[tuple[SampleJob, asyncio.Future[tuple[list[Sample], int]]]]] = [[]]
    rows = 0
    for item in group:
        if parts[-1] and rows + item[0].n > max_rows:
            parts.append([])
            rows = 0
        parts[-1].append(item)
        rows += item[0].n
    return parts


__all__ = ["RequestBatcher", "QueueFullError", "BatcherStats"]
