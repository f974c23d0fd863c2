"""Fixtures for the training service: ``serve_training`` runs ``envhub-train serve``'s app in process on a
loopback port (port 0) with a small tiny model, and ``sdk`` builds an official ``tinker.ServiceClient`` for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: a tiny model small enough for a test to train in seconds
TINY = ["hidden_size=32", "num_layers=1", "num_heads=2", "num_kv_heads=1", "intermediate_size=64"]
BASE = "tiny"


@pytest.fixture(scope="session", autouse=True)
def _tinker_env() -> None:
    import os

    os.environ["TINKER_TELEMETRY"] = "0"


@pytest.fixture
def serve_training(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``serve_training(state_dir=None, **settings)`` -> a started ``ServerThread`` (``.url``, ``.app``)."""
    from envhub.server import ServerThread
    from trainer.service import ServiceSettings, build_app

    started: list[ServerThread] = []

    def start(state_dir: Path | None = None, **settings: Any) -> ServerThread:
        settings = {"state_dir": state_dir or tmp_path / "state", "long_poll_s": 5.0, "threads": 1, **settings}
        cfg = ServiceSettings(**settings)
        app = build_app(cfg, TINY)
        server = ServerThread(app).start()
        server.app = app
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def sdk() -> Iterator[Callable[..., Any]]:
    """``sdk(url, api_key="tml-test")`` -> a ``tinker.ServiceClient``; all are closed when the test ends."""
    tinker = pytest.importorskip("tinker")
    clients: list[Any] = []

    def make(url: str, api_key: str = "tml-test") -> Any:
        client = tinker.ServiceClient(base_url=url, api_key=api_key)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close("success").result(timeout=30)
