"""A server as a child process on a loopback port: start it, wait until ``/health`` answers, stop it.

The quick start's env server, the sampler servers of the benchmarks and of the tests start this way. A
child that exits during start-up, or is not healthy in time, raises ``RuntimeError`` with the end of its
log (a child that timed out is killed first), so a failed start says why instead of hanging. Start the
child through :mod:`trainer.while_parent` (``while_parent.argv``) to have it end with this process however
this process ends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the child binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def log_tail(log_path: Path, chars: int = 2000) -> str:
    """The last ``chars`` characters of a child's log ('' when there is none yet)."""
    try:
        return log_path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def spawn(argv: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
          cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes]:
    """Run ``argv`` with its output to ``log_path``, without waiting (start several, then
    :func:`wait_healthy` on each: they come up side by side)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(env) if env is not None else None)


def start(argv: Sequence[str], url: str, log_path: Path, *, timeout_s: float = 60.0, what: str = "the server",
          env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes]:
    """Run ``argv`` (its output to ``log_path``) and return it once ``GET {url}/health`` answers 200.

    ``what`` names the child in errors. Raises ``RuntimeError`` (with the log's tail) if it exits first, or
    if it is not healthy within ``timeout_s``; the child is stopped then (and on Ctrl-C while waiting).
    """
    proc = spawn(argv, log_path, env=env, cwd=cwd)
    try:
        wait_healthy(url, proc, log_path, timeout_s=timeout_s, what=what)
    except BaseException:  # a failed start, or Ctrl-C while waiting: no child is left behind
        stop(proc)
        raise
    return proc


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, *, timeout_s: float = 60.0,
                 what: str = "the server") -> None:
    """Return once ``GET {url}/health`` answers 200; ``RuntimeError`` if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting; the end of its log "
                               f"({log_path}):\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become healthy within {timeout_s:.0f} s; the end of its log "
                               f"({log_path}):\n{log_tail(log_path)}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; returns once the child is gone (at once if it already is)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


__all__ = ["free_port", "log_tail", "spawn", "start", "stop", "wait_healthy"]
