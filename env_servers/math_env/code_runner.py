"""Where the math tool env runs the model's Python: the code sandbox, or a plain local subprocess.

``PythonRunner`` is the small interface the env needs (``await runner.run(code, timeout_s)``).
``SandboxPythonRunner`` adapts the code sandbox package (``env_servers.sandbox``: its
process-wide backend, bubblewrap namespaces + seccomp + cgroups, or docker; the sandbox
interpreter has numpy but not necessarily sympy). ``LocalSubprocessRunner`` only adds a
wall-clock timeout and output caps around ``python -I``: it is **not isolation** and is meant for
development and tests on machines without the sandbox. ``make_runner("auto")`` picks the sandbox
when it is importable and works, else the local runner with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("envhub.env_servers.math")

RUNNER_KINDS = ("auto", "sandbox", "local-subprocess")


@dataclass
class RunOutput:
    """What one run printed and how it ended."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False

    def as_observation(self, max_chars: int) -> str:
        """The text the model sees: output, errors, or a note that there was none."""
        if self.timed_out:
            text = (self.stdout + self.stderr).strip()
            return (text + "\n" if text else "") + "[Error: code execution timed out]"
        text = (self.stdout + ("\n" if self.stdout and self.stderr else "") + self.stderr).strip()
        if not text:
            return "(Code executed successfully, no output)"
        return text if len(text) <= max_chars else text[:max_chars] + f"\n[... output cut at {max_chars} characters]"


class PythonRunner(Protocol):
    """Runs Python source and returns its output; must be safe to call from many tasks at once."""

    name: str

    async def run(self, code: str, timeout_s: float) -> RunOutput: ...


class LocalSubprocessRunner:
    """``python -I -c code`` in a child process with a timeout and output cap. NOT a security boundary."""

    name = "local-subprocess"

    def __init__(self, max_output_bytes: int = 64 * 1024, max_concurrent: int = 4):
        self.max_output_bytes = max_output_bytes
        self.max_concurrent = max_concurrent
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())  # one bound per event loop

    async def run(self, code: str, timeout_s: float) -> RunOutput:
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots[loop] = asyncio.Semaphore(self.max_concurrent)
        async with slots:
            return await self._run(code, timeout_s)

    async def _run(self, code: str, timeout_s: float) -> RunOutput:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONIOENCODING": "utf-8",
               "OPENBLAS_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", code, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            return RunOutput("", "", None, timed_out=True)
        cap = self.max_output_bytes
        return RunOutput(out[:cap].decode("utf-8", "replace"), err[:cap].decode("utf-8", "replace"), proc.returncode)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


class SandboxPythonRunner:
    """Runs code through the code sandbox's process-wide backend (shared by every session)."""

    def __init__(self) -> None:
        from env_servers import sandbox

        self._sandbox = sandbox
        self.backend = sandbox.get_default_backend()  # probes now, so "auto" can fall back at start-up
        self.name = f"sandbox:{self.backend.info().get('backend', type(self.backend).__name__)}"

    async def run(self, code: str, timeout_s: float) -> RunOutput:
        result = await self.backend.run(code, limits=self._sandbox.Limits(timeout_s=timeout_s))
        note = "\n[killed: out of memory]" if result.oom_killed else ""
        return RunOutput(result.stdout, result.stderr + note, result.exit_code, timed_out=result.timed_out)


_shared: dict[str, PythonRunner] = {}
_shared_lock = threading.Lock()


def make_runner(kind: str = "auto") -> PythonRunner:
    """The process-wide runner of ``kind`` (``auto``, ``sandbox`` or ``local-subprocess``)."""
    if kind not in RUNNER_KINDS:
        raise ValueError(f"Expected the Python runner to be one of {RUNNER_KINDS}, got {kind!r}.")
    with _shared_lock:
        if kind in _shared:
            return _shared[kind]
        runner: PythonRunner
        if kind == "local-subprocess":
            runner = LocalSubprocessRunner()
        else:
            try:
                runner = SandboxPythonRunner()
            except Exception as exc:
                if kind == "sandbox":
                    raise RuntimeError(f"The code sandbox is not available here: {exc}") from exc
                log.warning("code sandbox unavailable (%s); running model code in a plain local subprocess "
                            "(INSECURE: no isolation, only a timeout)", exc)
                runner = LocalSubprocessRunner()
        _shared[kind] = runner
        return runner


__all__ = ["RunOutput", "PythonRunner", "LocalSubprocessRunner", "SandboxPythonRunner", "make_runner",
           "RUNNER_KINDS"]
