"""The work queue and its scheduler: all model work runs on one worker thread, in batches, fairly across clients.

Every model computation goes through this thread, so no two touch the weights at once; HTTP handlers
only enqueue and wait. Queued work waits in one lane per client (API key), in arrival order, so a
training run's requests apply in the order the SDK sent them (it submits them in ``seq_id`` order).

Scheduling: the worker serves the lanes round-robin: it takes the head of the next lane, then, when that
job is batchable, fills the batch with the heads of the lanes after it, one job per lane per pass and
again round the lanes until the batch's budget is reached (a sample batch's tokens, a forward_backward
batch's tokens; at most ``max_batch_jobs`` jobs). So one pass holds several clients' work, no client
waits behind another's long queue for more than one batch, and an ``optim_step`` (never batched) runs
at its lane's next turn. Batchable jobs of a ``windowed`` type (sampling) wait up to ``batch_window_s``
after they arrive so that concurrent requests meet in one batch; other lanes' ready work runs meanwhile.

Work may also answer with a ``concurrent.futures.Future`` (sampling on sampler servers: the servers do the
model work): the worker moves on to the next job, and the request's future is finished when that one is.

A finished future's body is written to the store before anyone waiting on it is woken, so a result a
client saw is one a restart keeps. Errors are categorised here, in one place:
:class:`~trainer.service._errors.UserError` and ``ValueError`` (bad input, unknown ids, limits) become
``category: "user"``; anything else is a server fault, logged with its traceback, and the worker carries on.

Admission control: each client may have ``max_pending`` futures pending, all clients together
``max_queued``, and queued work may hold ``max_queued_bytes`` of request data; past any,
:meth:`WorkQueue.submit` refuses with a 429 ("overloaded, retry"): the SDK backs off and re-sends, so no
client can grow the server's memory by queueing.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future as Later
from dataclasses import dataclass, field
from typing import Any

from trainer.service._errors import TooManyRequests
from trainer.service._store import Future, Store

log = logging.getLogger("envhub.service")

JSON = "application/json"
PROTOBUF = "application/x-protobuf"

#: what a queued job costs besides its request's bytes (the closure, the future's row): many tiny jobs add up
_JOB_BYTES = 1024

#: a result that arrives later, from another thread: the future's body and content type
Deferred = Later[tuple[bytes, str]]
#: work returns the future's body and content type, or a Deferred one
Work = Callable[[], "tuple[bytes, str] | Deferred"]


def json_body(obj: object) -> tuple[bytes, str]:
    return json.dumps(obj).encode(), JSON


def error_body(message: str, category: str) -> bytes:
    return json.dumps({"error": message, "category": category}).encode()


#: runs several jobs' ``Batchable.payload`` in one go: one ``(body, content_type)`` or exception per job
BatchRunner = Callable[[list[Any]], Sequence["tuple[bytes, str] | Deferred | BaseException"]]


@dataclass
class Batchable:
    """What lets a queued job run in one batch with others of its request type.

    Jobs whose ``key`` is equal may share a batch; ``cost`` is what the job adds to the batch (tokens) and
    the batch's first job's ``budget`` bounds the sum. ``one_per_model``: at most one job per training run
    in a batch (``forward_backward``: each run's gradient from its own requests, applied in order)."""

    payload: Any
    key: Hashable
    cost: int
    budget: int
    one_per_model: bool = False


@dataclass
class _Job:
    request_id: int
    request_type: str
    model_id: str | None
    work: Work
    owner: str = ""
    cost_bytes: int = 0
    batch: Batchable | None = None
    arrived_s: float = field(default_factory=time.monotonic)


@dataclass
class QueueStats:
    """What the scheduler did (``GET /api/v1/service_stats``): batches run, jobs and sizes, refusals."""

    batches: dict[str, int] = field(default_factory=dict)  # request type -> batches of more than one job
    batched_jobs: dict[str, int] = field(default_factory=dict)  # request type -> jobs that ran in such batches
    largest_batch: dict[str, int] = field(default_factory=dict)  # request type -> most jobs in one batch
    jobs: int = 0  # jobs run in all
    refused: int = 0  # submissions answered 429
    busy_s: float = 0.0  # time the worker spent running work
    busy_cpu_s: float = 0.0  # the worker thread's CPU time in it (less than busy_s where other processes took the core)
    busy_by_type: dict[str, float] = field(default_factory=dict)  # request type -> its share of busy_s
    busy_cpu_by_type: dict[str, float] = field(default_factory=dict)  # request type -> its share of busy_cpu_s


class WorkQueue:
    """Runs submitted work on a worker thread, batching and interleaving clients; wakes ``retrieve_future`` polls.

    ``batch_runners`` maps a request type to the function that runs several of its jobs at once;
    ``windowed`` request types wait up to ``batch_window_s`` for batch mates."""

    def __init__(self, store: Store, *, on_start: Callable[[], None] | None = None,
                 batch_runners: dict[str, BatchRunner] | None = None, max_batch_jobs: int = 256,
                 batch_window_s: float = 0.0, windowed: frozenset[str] = frozenset(), max_pending: int = 1024,
                 max_queued: int = 4096, max_queued_bytes: int = 512 * 2**20):
        self.store = store
        self.max_pending, self.max_queued, self.max_queued_bytes = max_pending, max_queued, max_queued_bytes
        self.max_batch_jobs, self.batch_window_s, self.windowed = max_batch_jobs, batch_window_s, windowed
        self.stats = QueueStats()
        self._runners = dict(batch_runners or {})
        self._pending: dict[str, int] = {}  # owner -> futures queued or running
        self._owner_of: dict[int, str] = {}  # request id -> owner, while queued or running
        self._queued_bytes = 0
        self._queued = 0
        self._on_start = on_start
        self._lanes: OrderedDict[str, deque[_Job]] = OrderedDict()  # owner -> queued jobs; served in this order
        self._closed = False
        self._waiters: dict[int, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._loop, name="envhub-service-work", daemon=True)
        self._thread.start()

    @property
    def batched_jobs(self) -> int:
        """Jobs that ran in a batch with others, all request types."""
        return sum(self.stats.batched_jobs.values())

    # -- producer side (HTTP handlers) ---------------------------------------------------------

    def submit(self, request_type: str, work: Work, *, owner: str = "", cost_bytes: int = 0,
               dedupe_key: str | None = None, model_id: str | None = None, batch: Batchable | None = None,
               bounded: bool = True) -> int:
        """Record a pending future and queue its work in ``owner``'s lane; a re-sent request returns the first one's id.

        ``cost_bytes`` is what the queued work holds in memory (its request). Past ``owner``'s
        ``max_pending`` futures, ``max_queued`` jobs or ``max_queued_bytes`` in all, :class:`TooManyRequests`
        (429), unless the work is the service's own (``bounded=False``). ``batch`` lets the job share a
        batch with others of its request type (:class:`Batchable`)."""
        cost_bytes += _JOB_BYTES
        with self._lock:
            if bounded:
                self._admit(owner, cost_bytes)
            request_id, new = self.store.add_future(dedupe_key, request_type, model_id, owner)
            if new:
                self._pending[owner] = self._pending.get(owner, 0) + 1
                self._owner_of[request_id] = owner
                self._queued_bytes += cost_bytes
                self._queued += 1
                self._lanes.setdefault(owner, deque()).append(
                    _Job(request_id, request_type, model_id, work, owner, cost_bytes, batch))
                self._ready.notify()
        return request_id

    def _admit(self, owner: str, cost_bytes: int) -> None:
        """Raise :class:`TooManyRequests` when queueing ``cost_bytes`` more for ``owner`` would pass a budget."""
        refusal = None
        if self._pending.get(owner, 0) >= self.max_pending:
            refusal = (f"This client has {self.max_pending} requests pending (--max-pending); "
                       "wait for some to finish before sending more.")
        elif self._queued >= self.max_queued:
            refusal = (f"The service is overloaded: {self._queued} requests are queued, its limit (--max-queued); "
                       "retry shortly.")
        elif self._queued_bytes and self._queued_bytes + cost_bytes > self.max_queued_bytes:
            refusal = (f"The service's queue holds {self._queued_bytes} bytes of pending requests, its limit "
                       f"({self.max_queued_bytes}); retry shortly.")
        if refusal is not None:
            self.stats.refused += 1
            raise TooManyRequests(refusal)

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
        """Jobs queued and not yet started."""
        with self._lock:
            return sum(len(lane) for lane in self._lanes.values())

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

    # -- scheduling (worker thread) -------------------------------------------------------------

    def _next_jobs(self) -> list[_Job] | None:
        """The next batch to run (one job or several), waiting for one; None once closed and drained."""
        with self._ready:
            while True:
                if not self._lanes:
                    if self._closed:
                        return None
                    self._ready.wait()
                    continue
                lane, wait_s = self._ready_lane(time.monotonic())
                if lane is not None:
                    return self._take(lane)
                self._ready.wait(wait_s)

    def _ready_lane(self, now: float) -> tuple[str | None, float]:
        """The first lane, in serving order, whose head may start now; else how long until one may."""
        wait_s = self.batch_window_s
        for owner, lane in self._lanes.items():
            head = lane[0]
            if head.batch is None or head.request_type not in self.windowed or self._closed:
                return owner, 0.0
            left_s = head.arrived_s + self.batch_window_s - now
            if left_s <= 0:
                return owner, 0.0
            wait_s = min(wait_s, left_s)
        return None, wait_s

    def _take(self, owner: str) -> list[_Job]:
        """Take ``owner``'s head and, when it is batchable, its mates from the heads of the lanes (round-robin);
        ``owner``'s lane goes to the back of the serving order."""
        first = self._lanes[owner].popleft()
        self._lanes.move_to_end(owner)
        jobs = [first]
        if first.batch is not None and first.request_type in self._runners:
            spec, cost, models = first.batch, first.batch.cost, {first.model_id}
            added = True
            while added and len(jobs) < self.max_batch_jobs:
                added = False
                for lane in self._lanes.values():  # one job per lane per pass
                    head = lane[0] if lane else None
                    if (head is None or head.batch is None or head.request_type != first.request_type
                            or head.batch.key != spec.key or cost + head.batch.cost > spec.budget
                            or (spec.one_per_model and head.model_id in models) or len(jobs) >= self.max_batch_jobs):
                        continue
                    jobs.append(lane.popleft())
                    cost, added = cost + head.batch.cost, True
                    models.add(head.model_id)
        for key in [k for k, lane in self._lanes.items() if not lane]:
            del self._lanes[key]
        return jobs

    # -- running (worker thread) ----------------------------------------------------------------

    def _loop(self) -> None:
        if self._on_start is not None:
            self._on_start()  # e.g. torch's thread count, which is set per thread
        while True:
            jobs = self._next_jobs()
            if jobs is None:
                return
            start, start_cpu = time.perf_counter(), time.thread_time()
            outcomes = self._run(jobs)
            elapsed_s = time.perf_counter() - start
            cpu_s = time.thread_time() - start_cpu
            self.stats.busy_s += elapsed_s
            self.stats.busy_cpu_s += cpu_s
            kind = jobs[0].request_type
            self.stats.busy_by_type[kind] = self.stats.busy_by_type.get(kind, 0.0) + elapsed_s
            self.stats.busy_cpu_by_type[kind] = self.stats.busy_cpu_by_type.get(kind, 0.0) + cpu_s
            self.stats.jobs += len(jobs)
            log.debug("requests %s (%s) in %.3f s", [j.request_id for j in jobs], jobs[0].request_type, elapsed_s)
            for j, outcome in zip(jobs, outcomes):
                if isinstance(outcome, Later):
                    outcome.add_done_callback(functools.partial(self._finish_later, j))
                else:
                    self._finish(j, *outcome)

    def _finish(self, job: _Job, status: str, body: bytes, content_type: str) -> None:
        self.store.finish_future(job.request_id, status, body, content_type)
        self._release(job)
        self._wake(job.request_id)

    def _finish_later(self, job: _Job, later: Deferred) -> None:
        """A deferred result arrived (on the thread that produced it)."""
        result: Any
        if later.cancelled():
            result = RuntimeError("the service stopped before this request was answered")
        else:
            result = later.exception() or later.result()
        outcome = self._outcome(job, result)
        assert not isinstance(outcome, Later)
        self._finish(job, *outcome)

    def _run(self, jobs: list[_Job]) -> list[tuple[str, bytes, str] | Deferred]:
        first = jobs[0]
        if len(jobs) == 1:
            return [self._outcome(first, self._call(first.work))]
        kind = first.request_type
        self.stats.batches[kind] = self.stats.batches.get(kind, 0) + 1
        self.stats.batched_jobs[kind] = self.stats.batched_jobs.get(kind, 0) + len(jobs)
        self.stats.largest_batch[kind] = max(self.stats.largest_batch.get(kind, 0), len(jobs))
        runner = self._runners[kind]
        results = self._call(functools.partial(runner, [j.batch.payload for j in jobs if j.batch is not None]))
        if isinstance(results, BaseException):
            results = [results] * len(jobs)
        return [self._outcome(j, r) for j, r in zip(jobs, results)]

    def _release(self, job: _Job) -> None:
        with self._lock:
            left = self._pending.get(job.owner, 0) - 1
            if left > 0:
                self._pending[job.owner] = left
            else:
                self._pending.pop(job.owner, None)
            self._queued_bytes -= job.cost_bytes
            self._queued -= 1
            self._owner_of.pop(job.request_id, None)

    @staticmethod
    def _call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # categorised in _outcome; the worker carries on
            exc.__traceback_text__ = traceback.format_exc()  # type: ignore[attr-defined]
            return exc

    @staticmethod
    def _outcome(job: _Job, result: Any) -> tuple[str, bytes, str] | Deferred:
        if isinstance(result, Later):
            return result
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
        """Run what is queued, then stop the worker."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout=30)
