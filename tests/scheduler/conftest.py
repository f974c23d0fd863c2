"""Fixtures for the scheduler tests: a scheduler with declared GPUs (no GPU needed), in-process
over ASGI, or live with uvicorn on a loopback port in a background thread; and for the Ray backend a
real multi-node Ray cluster started with ``ray start``, shared by the session's Ray tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ray_cluster import RayStartCluster
from sched_helpers import LiveScheduler, make_config

from trainer.scheduler._core import Scheduler
from trainer.scheduler.server import create_app


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayStartCluster]:
    """A head and one worker node (``ray start``, two fake GPUs and one CPU each); every process of it
    is killed at the end, also when a test failed. Skips where ray is not installed."""
    ray = pytest.importorskip("ray")
    cluster = RayStartCluster(workers=1, gpus=2, cpus=1)
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@pytest.fixture
async def sched(tmp_path: Path):
    """A started scheduler with four declared GPUs."""
    scheduler = Scheduler(make_config(tmp_path))
    await scheduler.start()
    yield scheduler
    if scheduler.started:
        await scheduler.stop()


@pytest.fixture
async def api(sched: Scheduler):
    """An httpx client talking to the scheduler's app in-process (no socket)."""
    transport = httpx.ASGITransport(app=create_app(sched))
    async with httpx.AsyncClient(transport=transport, base_url="http://sched") as client:
        yield client


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveScheduler]:
    """A live scheduler (four declared GPUs, auth off) on 127.0.0.1."""
    with LiveScheduler(make_config(tmp_path)) as server:
        yield server
