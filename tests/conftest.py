"""Shared fixtures: factories that serve an env on a loopback port for the duration of a test, in-process
(``serve_env``) or as a subprocess (``serve_process``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass
class ServerProcess:
    """A server that ``serve_process`` started: the process, its port, and the file its output goes to."""

    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@pytest.fixture
def serve_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """``serve_process(argv, cwd=None, env=None, timeout_s=60)`` -> a ``ServerProcess`` that answers ``/health``.

    Runs ``argv --port <free port>`` (``python -m env_servers.X ...``, ``envhub serve ...``) with stdout and
    stderr in a log file, and fails with the log's tail if the process exits or ``/health`` is not 200 within
    ``timeout_s``. Every process started here is terminated (killed if it lingers) when the test ends.
    """
    import httpx

    started: list[ServerProcess] = []

    def start(argv: Sequence[str], *, cwd: Any = None, env: dict[str, str] | None = None,
              timeout_s: float = 60.0) -> ServerProcess:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = tmp_path_factory.mktemp("server") / "output.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([*argv, "--port", str(port)], cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
        server = ServerProcess(proc, port, log)
        started.append(server)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            try:
                if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{' '.join(argv)} did not answer /health within {timeout_s} s; its output:\n"
                            f"{server.log_tail()}")
            time.sleep(0.2)
        pytest.fail(f"{' '.join(argv)} exited with code {proc.returncode}; its output:\n{server.log_tail()}")

    yield start
    for server in started:
        server.proc.terminate()
        try:
            server.proc.wait(15)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _docker_engine_available() -> bool:
    import shutil

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
