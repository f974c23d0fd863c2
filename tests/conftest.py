"""Shared fixtures: a factory that serves an env class on a loopback port for the duration of a test."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

# tests/ has no __init__.py, so pytest puts tests/ on sys.path to import this file, and tests/envhub
# would then shadow the envhub package (as a namespace package). The repository root first keeps
# `import envhub` pointing at the real package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture
def serve_env() -> Iterator[Callable[..., Any]]:
    """``serve_env(EnvCls, settings_field=value, ..., env_kwarg=...)`` -> a started ``ServerThread`` (port 0).

    Keyword arguments naming a ``Settings`` field configure the server; the rest go to the env
    constructor. Every server started here is stopped when the test ends.
    """
    from dataclasses import fields

    from envhub.server import ServerThread, create_app
    from envhub.settings import Settings

    names = {f.name for f in fields(Settings)}
    started: list[ServerThread] = []

    def start(env_cls: type, **kwargs: Any) -> ServerThread:
        settings = Settings(**{"log_level": "warning", **{k: v for k, v in kwargs.items() if k in names}})
        env_config = {k: v for k, v in kwargs.items() if k not in names}
        server = ServerThread(create_app(env_cls, settings=settings, **env_config)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _docker_engine_available() -> bool:
    import shutil
    import subprocess

    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests skip without CUDA and ``docker`` tests without an engine, whatever the test itself checks."""
    checks = {"gpu": (_cuda_available, "needs a CUDA GPU"), "docker": (_docker_engine_available, "needs a Docker engine")}
    for marker, (probe, reason) in checks.items():
        marked = [item for item in items if item.get_closest_marker(marker)]
        if marked and not probe():
            for item in marked:
                item.add_marker(pytest.mark.skip(reason=reason))
