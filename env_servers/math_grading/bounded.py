"""Run a pure function in a worker process under a wall-clock deadline; a worker that overruns is killed.

Size caps keep most sympy work small, but sympy's automatic evaluation of transcendental or
complex expressions (``asin(99)^(i*sqrt(2))``, ``floor(2^60)/log(i)``) can still take seconds or
exhaust memory. Those calls go through :func:`call`: a small pool of spawned worker processes
(each with an address-space limit), one JSON request at a time per worker; on timeout the worker is
killed and replaced, and the caller gets :class:`BoundedCallError`. Targets are ``"module:function"`` names of
envhub's own pure functions, never anything taken from model output.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("envhub.env_servers.math")

WORKER_MEMORY_BYTES = 1 << 30
_START_TIMEOUT_S = 60.0
_ROOT = str(Path(__file__).resolve().parents[2])  # where ``env_servers`` is importable from


class BoundedCallError(RuntimeError):
    """The call did not finish in time (``timed_out``) or raised inside the worker (the message says what)."""

    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def _serve() -> None:
    """Worker loop: one JSON request per stdin line, one JSON reply per stdout line."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    import sympy  # noqa: F401  (warm: the first real request should not pay for the import)

    out = sys.stdout
    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        target, args = json.loads(line)
        module_name, _, name = target.partition(":")
        try:
            reply = ["ok", getattr(importlib.import_module(module_name), name)(*args)]
        except BaseException as exc:  # report, keep serving
            reply = ["error", f"{type(exc).__name__}: {exc}"]
        out.write(json.dumps(reply) + "\n")
        out.flush()


class _Worker:
    """One worker process (started with ``python -m``, so no ``__main__`` re-import, no fork of a threaded server)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen([sys.executable, "-m", "env_servers.math_grading.bounded"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None  # both are pipes
        self._stdin, self._stdout = stdin, stdout
        self._buffer = b""
        if self.read_line(_START_TIMEOUT_S) != "ready":
            self.kill()
            raise BoundedCallError("the evaluation worker did not start")

    def send(self, message: Any) -> None:
        self._stdin.write(json.dumps(message).encode() + b"\n")
        self._stdin.flush()

    def read_line(self, timeout_s: float) -> Any:
        """The next reply, or a ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        fd = self._stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        for stream in (self._stdin, self._stdout):
            stream.close()


class BoundedPool:
    """Worker processes handing out one deadline-bounded call at a time each."""

    def __init__(self, size: int | None = None):
        self.size = size or max(1, min(4, os.cpu_count() or 1))
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._started = 0
        self._lock = threading.Lock()

    def _take(self, wait_s: float) -> _Worker | None:
        """An idle worker, a new one while the pool is below size, or None after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                start = self._started < self.size
                self._started += start
            if start:
                try:
                    return _Worker()
                except Exception as exc:
                    with self._lock:
                        self._started -= 1
                    raise BoundedCallError(f"cannot start an evaluation worker: {exc}") from exc
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:  # short waits: a worker killed meanwhile frees a slot to start a new one
                return self._idle.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue

    def _replace(self) -> None:
        try:
            self._idle.put(_Worker())
        except Exception:
            with self._lock:
                self._started -= 1

    def call(self, target: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        """``target(*args)`` in a worker; :class:`BoundedCallError` on timeout, error, or a pool that stays busy."""
        worker = self._take(wait_s=4 * timeout_s)
        if worker is None:
            raise BoundedCallError(f"every evaluation worker stayed busy for {4 * timeout_s:g}s", timed_out=True)
        try:
            worker.send([target, list(args)])
            status, value = worker.read_line(timeout_s)
        except (OSError, EOFError, TimeoutError, ValueError):
            pass
        else:
            self._idle.put(worker)
            if status == "ok":
                return value
            raise BoundedCallError(value)
        worker.kill()  # overran or died: start its replacement now, off the caller's path
        threading.Thread(target=self._replace, daemon=True, name="envhub-sympy-respawn").start()
        raise BoundedCallError(f"evaluation took longer than {timeout_s:g}s", timed_out=True)


_pool: BoundedPool | None = None
_pool_lock = threading.Lock()


def call(target: str, *args: Any, timeout_s: float = 2.0) -> Any:
    """Run ``module:function(*args)`` in the shared pool under ``timeout_s`` (raises :class:`BoundedCallError`)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = BoundedPool()
    return _pool.call(target, args, timeout_s)


__all__ = ["call", "BoundedPool", "BoundedCallError"]

if __name__ == "__main__":
    _serve()
