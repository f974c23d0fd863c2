"""Helpers of the scheduler tests: declared-GPU configs, a live uvicorn scheduler, waiting."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import uvicorn

from trainer.scheduler._core import Scheduler, SchedulerConfig
from trainer.scheduler._procs import read_proc
from trainer.scheduler._resources import Gpu
from trainer.scheduler.server import bind_socket, create_app

PY = sys.executable


def make_config(tmp_path: Path, n_gpus: int = 4, grace_s: float = 1.0) -> SchedulerConfig:
    return SchedulerConfig(gpus=[Gpu(i) for i in range(n_gpus)], db_path=str(tmp_path / "sched.db"),
                           grace_s=grace_s, port_first=39500, port_last=39999)


class LiveScheduler:
    """uvicorn serving a scheduler on 127.0.0.1:<free port> in a thread, as ``envhub-sched serve`` does."""

    def __init__(self, config: SchedulerConfig, auth: bool = False):
        self.scheduler = Scheduler(config)
        self.auth = auth
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.scheduler, auth=auth), log_level="warning",
                                                    timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveScheduler:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("the live scheduler did not start in 10 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def alive(pid: int) -> bool:
    return read_proc(pid) is not None


async def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Await ``predicate()`` becoming true (checked every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


def wait_for_sync(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
