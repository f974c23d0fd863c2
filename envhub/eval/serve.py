"""An env served for the length of an eval: ``envhub serve TARGET`` as a child process on a free loopback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from envhub.fleet import _healthy


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the child binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class LocalEnvServer:
    """``envhub serve TARGET`` in a child process; the context manager waits for ``/health`` and stops it after.

    ``TARGET`` is a registered name or ``module:Class`` (resolved in the child, from this directory).
    A child that exits during start-up raises ``RuntimeError`` with the end of its log.
    """

    def __init__(self, target: str, *, env_config: dict[str, Any] | None = None, max_sessions: int = 64,
                 start_timeout_s: float = 60.0):
        self.target = target
        self.env_config = dict(env_config or {})
        self.max_sessions = max_sessions
        self.start_timeout_s = start_timeout_s
        self.host, self.port = "127.0.0.1", 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="envhub-eval-serve-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    def start(self) -> LocalEnvServer:
        self.port = free_port(self.host)
        argv = [sys.executable, "-m", "envhub", "serve", self.target, "--host", self.host, "--port", str(self.port),
                "--max-sessions", str(self.max_sessions), "--log-level", "warning"]
        for key, value in self.env_config.items():
            argv += ["--set", f"{key}={json.dumps(value)}"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while not _healthy(self.host, self.port, timeout_s=1.0):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self._tail()
                    raise RuntimeError(f"`envhub serve {self.target}` did not come up; its log:\n{log}")
                time.sleep(0.1)
        except BaseException:  # also Ctrl-C while waiting: the child is in its own session, so nothing else stops it
            self.__exit__()
            raise
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._log.close()

    def _tail(self, lines: int = 20) -> str:
        self._log.flush()
        return "".join(Path(self._log.name).read_text(errors="replace").splitlines(True)[-lines:])

    def __enter__(self) -> LocalEnvServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        Path(self._log.name).unlink(missing_ok=True)
