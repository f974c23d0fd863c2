"""The sandbox vocabulary: resource limits in, execution results out, and the backend protocol."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}(/[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}){0,3}")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the user's code): a backend cannot start or a worker died."""


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits. Every backend enforces them (the rlimit fallback only the rlimit part).

    ``max_output_bytes`` is what is kept of each stream; a run that writes more than
    ``kill_output_bytes`` in total is killed and reported ``output_truncated``.
    """

    timeout_s: float = 5.0
    mem_mb: int = 512
    nproc: int = 64
    fsize_mb: int = 32
    nofile: int = 256
    tmpfs_mb: int = 64
    max_output_bytes: int = 64 * 1024
    kill_output_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= 600:
            raise ValueError(f"Expected 0 < timeout_s <= 600, got {self.timeout_s}.")
        for name in ("mem_mb", "nproc", "fsize_mb", "nofile", "tmpfs_mb", "max_output_bytes", "kill_output_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Expected {name} to be a positive integer, got {value!r}.")
        if self.nofile < 16:
            raise ValueError(f"Expected nofile >= 16 (Python itself needs a few descriptors), got {self.nofile}.")
        if self.kill_output_bytes < self.max_output_bytes:
            raise ValueError(f"Expected kill_output_bytes >= max_output_bytes, got {self.kill_output_bytes} "
                             f"< {self.max_output_bytes}.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ExecResult:
    """What one run produced. ``stdout``/``stderr`` are capped and decoded as UTF-8 with replacement.

    ``exit_code`` is the process's exit status (None when it died from a signal, then ``signal``
    is set). ``timed_out``: the wall clock or CPU limit ended it. ``oom_killed``: the memory cgroup
    killed something. ``output_truncated``: output beyond the caps was dropped.
    """

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    oom_killed: bool = False
    output_truncated: bool = False
    duration_s: float = 0.0
    backend: str = ""

    @property
    def ok(self) -> bool:
        """True when the program exited 0 on its own, within its limits."""
        return self.exit_code == 0 and not (self.timed_out or self.oom_killed)

    @property
    def killed(self) -> bool:
        """True when the sandbox (not the program) ended the run."""
        return self.timed_out or self.oom_killed or self.signal is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """A short status line for humans and models: ``exit 0 in 0.01s`` / ``timed out after 2.00s``."""
        if self.timed_out:
            status = f"timed out after {self.duration_s:.2f}s"
        elif self.oom_killed:
            status = "killed: out of memory"
        elif self.signal == 9 and self.output_truncated:
            status = "killed: output limit exceeded"
        elif self.signal is not None:
            status = f"killed by signal {self.signal}"
        else:
            status = f"exit {self.exit_code}"
        trunc = " (output truncated)" if self.output_truncated else ""
        took = "" if self.timed_out else f" in {self.duration_s:.2f}s"  # a timeout already says how long
        return f"{status}{took}{trunc}"


@runtime_checkable
class SandboxBackend(Protocol):
    """Runs untrusted Python source. ``run`` is safe to call from any event loop and from many tasks at once."""

    name: str

    async def run(self, code: str, *, stdin: bytes = b"", files: dict[str, bytes] | None = None,
                  limits: Limits = Limits()) -> ExecResult: ...

    def run_sync(self, code: str, *, stdin: bytes = b"", files: dict[str, bytes] | None = None,
                 limits: Limits = Limits()) -> ExecResult: ...

    def info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def check_files(files: object) -> dict[str, bytes]:
    """Validate extra input files: relative names (up to 4 levels), bytes contents, not ``main.py``."""
    if not files:
        return {}
    if not isinstance(files, dict):
        raise ValueError(f"Expected files to be a dict of name -> bytes, got {type(files).__name__}.")
    out: dict[str, bytes] = {}
    for name, data in files.items():
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name.split("/"):
            raise ValueError(f"Expected a relative file name like 'data/input.txt', got {name!r}.")
        if name == "main.py":
            raise ValueError("'main.py' is reserved for the code being run; pick another file name.")
        out[name] = data.encode() if isinstance(data, str) else bytes(data)
    if len(out) > 32:
        raise ValueError(f"Expected at most 32 files, got {len(out)}.")
    return out


def decode_output(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
