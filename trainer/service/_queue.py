"""The work queue: futures run one at a time, in arrival order, on one worker thread.

Every model computation goes through this thread, so a training run's requests apply in the
order the SDK sent them (it submits them in ``seq_id`` order) and no two touch the weights at
once. HTTP handlers only enqueue and wait. A finished future's body is written to the store
before anyone waiting on it is woken, so a result a client saw is one a restart keeps.

Errors are categorised here, in one place: :class:`~trainer.service._errors.UserError` and
``ValueError`` (bad input, unknown ids, limits) become ``category: "user"``; anything else is a server
fault, logged with its traceback, and the worker carries on with the next request.

The queue is bounded: each client (API key) may have ``max_pending`` futures pending, and queued work may
hold ``max_queued_bytes`` of request data in all; past either, :meth:`WorkQueue.submit` refuses with a 429
(the SDK backs off and re-sends), so no client can grow the server's memory by queueing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.service._errors import TooManyRequests
from trainer.service._store import Future, Store

log = logging.getLogger("envhub.service")

JSON = "application/json"
PROTOBUF = "application/x-protobuf"

#: what a queued job costs besides its request's bytes (the closure, the future's row): many tiny jobs add up
_JOB_BYTES = 1024

#: work returns the future's body and content type
Work = Callable[[], tuple[bytes, str]]


def json_body(obj: object) -> tuple[bytes, str]:
    return json.dumps(obj).encode(), JSON


def error_body(message: str, category: str) -> bytes:
    return json.dumps({"error": message, "category": category}).encode()


#: runs several jobs' ``batch`` payloads in one go: one ``(body, content_type)`` or exception per job
BatchRunner = Callable[[list[Any]], list["tuple[bytes, str] | BaseException"]]


@dataclass
class _Job:
    request_id: int
    request_type: str
    model_id: str | None
    work: Work
    owner: str = ""
    cost_bytes: int = 0
    batch: Any = None  # set for work that may run together with its neighbours' (see BatchRunner)


class WorkQueue:
    """Runs submitted work on a worker thread and wakes ``retrieve_future`` long-polls."""

    def __init__(self, store: Store, *, on_start: Callable[[], None] | None = None,
                 batch_runner: BatchRunner | None = None, max_batch_jobs: int = 8, max_pending: int = 1024,
                 max_queued_bytes: int = 512 * 2**20):
        self.store = store
        self.max_pending, self.max_queued_bytes = max_pending, max_queued_bytes
        self._pending: dict[str, int] = {}  # owner -> futures queued or running
        self._owner_of: dict[int, str] = {}  # request id -> owner, while queued or running
        self._queued_bytes = 0
        self._on_start = on_start
        self._batch_runner, self.max_batch_jobs = batch_runner, max_batch_jobs
        self.batched_jobs = 0  # jobs that ran in a batch with others (a statistic)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._waiters: dict[int, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="envhub-service-work", daemon=True)
        self._thread.start()

    # -- producer side (HTTP handlers) ---------------------------------------------------------

    def submit(self, request_type: str, work: Work, *, owner: str = "", cost_bytes: int = 0,
               dedupe_key: str | None = None, model_id: str | None = None, batch: Any = None,
               bounded: bool = True) -> int:
        """Record a pending future and queue its work; a re-sent request returns the first one's id.

        ``cost_bytes`` is what the queued work holds in memory (its request). Past ``owner``'s
        ``max_pending`` futures, or ``max_queued_bytes`` in all, :class:`TooManyRequests` (429), unless
        the work is the service's own (``bounded=False``). Queued jobs of one ``request_type`` that carry
        a ``batch`` payload and belong to different models may run as one batch when they are next to
        each other in the queue.
        """
        cost_bytes += _JOB_BYTES
        with self._lock:
            if bounded and self._pending.get(owner, 0) >= self.max_pending:
                raise TooManyRequests(f"This client has {self.max_pending} requests pending (--max-pending); "
                                      "wait for some to finish before sending more.")
            if bounded and self._queued_bytes and self._queued_bytes + cost_bytes > self.max_queued_bytes:
                raise TooManyRequests(f"The service's queue holds {self._queued_bytes} bytes of pending requests, "
                                      f"its limit ({self.max_queued_bytes}); send again shortly.")
            request_id, new = self.store.add_future(dedupe_key, request_type, model_id, owner)
            if new:
                self._pending[owner] = self._pending.get(owner, 0) + 1
                self._owner_of[request_id] = owner
                self._queued_bytes += cost_bytes
                self._queue.put(_Job(request_id, request_type, model_id, work, owner, cost_bytes, batch))
        return request_id

    async def retrieve(self, request_id: int, owner: str, timeout_s: float) -> Future | None:
        """``owner``'s future, once it finished or ``timeout_s`` passed (still pending then); None if it is not
        ``owner``'s or does not exist. A finished future answers at once."""
        with self._lock:
            pending_owner = self._owner_of.get(request_id)
        if pending_owner is not None:  # still running: wait first, read the store once
            if pending_owner != owner:
                return None
            await self.wait(request_id, timeout_s)
        future = self.store.future(request_id)
        return future if future is not None and future.owner == owner else None

    def pending(self) -> int:
        return self._queue.qsize()

    async def wait(self, request_id: int, timeout_s: float) -> bool:
        """Wait until the future is no longer pending or ``timeout_s`` passes; True if it finished."""
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self._lock:
            self._waiters.setdefault(request_id, []).append(entry)
        try:
            future = self.store.future(request_id)
            if future is None or future.status != "pending":
                return True
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                return False
            return True
        finally:
            with self._lock:
                waiters = self._waiters.get(request_id, [])
                if entry in waiters:
                    waiters.remove(entry)
                if not waiters:
                    self._waiters.pop(request_id, None)

    # -- consumer side (worker thread) ---------------------------------------------------------

    def _loop(self) -> None:
        if self._on_start is not None:
            self._on_start()  # e.g. torch's thread count, which is set per thread
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job] + self._batch_mates(job)
            start = time.perf_counter()
            if len(jobs) == 1:
                outcomes = [self._outcome(job, self._call(job.work))]
            else:
                self.batched_jobs += len(jobs)
                assert self._batch_runner is not None  # _batch_mates found mates: there is a runner
                results = self._call(functools.partial(self._batch_runner, [j.batch for j in jobs]))
                if isinstance(results, BaseException):
                    results = [results] * len(jobs)
                outcomes = [self._outcome(j, r) for j, r in zip(jobs, results)]
            log.debug("requests %s (%s) in %.3f s", [j.request_id for j in jobs], job.request_type,
                      time.perf_counter() - start)
            for j, (status, body, content_type) in zip(jobs, outcomes):
                self.store.finish_future(j.request_id, status, body, content_type)
                self._release(j)
                self._wake(j.request_id)

    def _release(self, job: _Job) -> None:
        with self._lock:
            left = self._pending.get(job.owner, 0) - 1
            if left > 0:
                self._pending[job.owner] = left
            else:
                self._pending.pop(job.owner, None)
            self._queued_bytes -= job.cost_bytes
            self._owner_of.pop(job.request_id, None)

    def _batch_mates(self, first: _Job) -> list[_Job]:
        """Queued jobs right behind ``first`` that can join its batch (taken off the queue)."""
        if first.batch is None or self._batch_runner is None:
            return []
        mates: list[_Job] = []
        models = {first.model_id}
        with self._queue.mutex:  # peek at the head of the queue without blocking producers for long
            pending = self._queue.queue
            while pending and len(mates) + 1 < self.max_batch_jobs:
                nxt = pending[0]
                if nxt is None or nxt.batch is None or nxt.request_type != first.request_type or nxt.model_id in models:
                    break
                mates.append(pending.popleft())
                models.add(nxt.model_id)
        return mates

    @staticmethod
    def _call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # categorised in _outcome; the worker carries on
            exc.__traceback_text__ = traceback.format_exc()  # type: ignore[attr-defined]
            return exc

    @staticmethod
    def _outcome(job: _Job, result: Any) -> tuple[str, bytes, str]:
        if not isinstance(result, BaseException):
            body, content_type = result
            return "completed", body, content_type
        if isinstance(result, ValueError):  # UserError and the core's own input checks
            return "failed", error_body(str(result), "user"), JSON
        log.error("request %s (%s) failed:\n%s", job.request_id, job.request_type,
                  getattr(result, "__traceback_text__", repr(result)))
        return "failed", error_body(f"{type(result).__name__}: {result}", "server"), JSON

    def _wake(self, request_id: int) -> None:
        with self._lock:
            waiters = list(self._waiters.get(request_id, []))
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that handler's loop has closed
                pass

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
