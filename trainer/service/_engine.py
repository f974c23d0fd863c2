"""The work queue: futures run one at a time, in arrival order, on one worker thread.

Every model computation goes through this thread, so a training run's requests apply in the
order the SDK sent them (it submits them in ``seq_id`` order) and no two touch the weights at
once. HTTP handlers only enqueue and wait. A finished future's body is written to the store
before anyone waiting on it is woken, so a result a client saw is one a restart keeps.

Errors are categorised here, in one place: :class:`UserError` and ``ValueError`` (bad input,
unknown ids, limits) become ``category: "user"``; anything else is a server fault, logged with its
traceback, and the worker carries on with the next request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from trainer.service._store import Store

log = logging.getLogger("envhub.service")

JSON = "application/json"
PROTOBUF = "application/x-protobuf"

#: work returns the future's body and content type
Work = Callable[[], tuple[bytes, str]]


class UserError(ValueError):
    """A request the client got wrong; answered as ``{"error": ..., "category": "user"}``."""


def json_body(obj: object) -> tuple[bytes, str]:
    return json.dumps(obj).encode(), JSON


def error_body(message: str, category: str) -> bytes:
    return json.dumps({"error": message, "category": category}).encode()


@dataclass
class _Job:
    request_id: int
    request_type: str
    model_id: str | None
    work: Work


class Engine:
    """Runs submitted work on a worker thread and wakes ``retrieve_future`` long-polls."""

    def __init__(self, store: Store, *, on_start: Callable[[], None] | None = None):
        self.store = store
        self._on_start = on_start
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._waiters: dict[int, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="envhub-service-engine", daemon=True)
        self._thread.start()

    # -- producer side (HTTP handlers) ---------------------------------------------------------

    def submit(self, request_type: str, work: Work, *, dedupe_key: str | None = None,
               model_id: str | None = None) -> int:
        """Record a pending future and queue its work; a re-sent request returns the first one's id."""
        request_id, new = self.store.add_future(dedupe_key, request_type, model_id)
        if new:
            self._queue.put(_Job(request_id, request_type, model_id, work))
        return request_id

    def fail_now(self, request_type: str, message: str, *, model_id: str | None = None) -> int:
        """A future that is failed from the start (input rejected before any work could be queued)."""
        request_id, _ = self.store.add_future(None, request_type, model_id)
        self.store.finish_future(request_id, "failed", error_body(message, "user"), JSON)
        return request_id

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
            start = time.perf_counter()
            status, body, content_type = self._run(job)
            log.debug("request %s (%s) %s in %.3f s", job.request_id, job.request_type, status,
                      time.perf_counter() - start)
            self.store.finish_future(job.request_id, status, body, content_type)
            self._wake(job.request_id)

    def _run(self, job: _Job) -> tuple[str, bytes, str]:
        try:
            body, content_type = job.work()
            return "completed", body, content_type
        except ValueError as exc:  # UserError and the core's own input checks
            return "failed", error_body(str(exc), "user"), JSON
        except Exception as exc:  # noqa: BLE001 - one request's fault must not stop the worker
            log.error("request %s (%s) failed:\n%s", job.request_id, job.request_type, traceback.format_exc())
            return "failed", error_body(f"{type(exc).__name__}: {exc}", "server"), JSON

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
