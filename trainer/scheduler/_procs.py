"""Process trees of jobs: start one in its own session, find all of it, end all of it.

A job's main process is started with ``start_new_session=True``, so it leads its own session and
process group, and with a marker in its environment (``ENVHUB_SCHED_JOB=<id>``) that every
descendant inherits. Ending a job sends SIGTERM, then SIGKILL after a grace, to the union of

- the job's process group (one ``killpg``),
- every descendant of the main process, found by walking parent links in ``/proc``, and
- every process whose environment carries the job's marker, which finds a grandchild that called
  ``setsid()`` and was orphaned when its parent exited.

A process that both clears its environment and escapes its parent before the scan is the one case
this cannot see; a cgroup per job would close it. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

#: name of the environment variable that marks every process of a job
JOB_MARKER_ENV = "ENVHUB_SCHED_JOB"

_PROC = Path("/proc")


@dataclass(frozen=True)
class ProcInfo:
    """What ``/proc/<pid>/stat`` says about one process."""

    pid: int
    ppid: int
    pgid: int
    state: str
    start_ticks: int  # clock ticks after boot: with the pid, names a process uniquely


def read_proc(pid: int) -> ProcInfo | None:
    """The process ``pid``, or None when it is gone (or a zombie, which holds no resources)."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    rest = raw[raw.rindex(")") + 2:].split()
    info = ProcInfo(pid=pid, state=rest[0], ppid=int(rest[1]), pgid=int(rest[2]), start_ticks=int(rest[19]))
    return None if info.state in ("Z", "X") else info


def start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks after boot, or None when it is gone."""
    info = read_proc(pid)
    return info.start_ticks if info else None


def is_same_process(pid: int, ticks: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``ticks`` (pids are reused)."""
    return ticks is not None and start_ticks(pid) == ticks


def _all_procs() -> list[ProcInfo]:
    procs = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            info = read_proc(int(entry.name))
            if info is not None:
                procs.append(info)
    return procs


def _has_marker(pid: int, marker: bytes) -> bool:
    try:
        environ = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return False
    return marker in environ.split(b"\0")


def job_processes(job_id: str, root_pid: int | None = None, pgid: int | None = None) -> set[int]:
    """Pids of every live process of job ``job_id`` (see the module docstring for how)."""
    procs = _all_procs()
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    marker = f"{JOB_MARKER_ENV}={job_id}".encode()
    found = {p.pid for p in procs if (pgid is not None and p.pgid == pgid) or _has_marker(p.pid, marker)}
    stack = list(found) + ([root_pid] if root_pid and read_proc(root_pid) else [])
    while stack:  # close over descendants of everything found so far
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
        stack.extend(c for c in children.get(pid, ()) if c not in found)
    found.discard(os.getpid())  # never the scheduler itself
    return found


def _signal_all(pids: set[int], pgid: int | None, sig: int) -> None:
    if pgid is not None and pgid > 1:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_job_tree(job_id: str, root_pid: int | None, pgid: int | None, grace_s: float) -> set[int]:
    """SIGTERM the whole tree of a job, SIGKILL what is left after ``grace_s``; blocking.

    Returns the pids that were signalled. On return no process of the job is alive, except one
    that a SIGKILL cannot end at once (uninterruptible sleep), which this waits a little for.
    """
    pids = job_processes(job_id, root_pid, pgid)
    if not pids:
        return pids
    _signal_all(pids, pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = job_processes(job_id, root_pid, pgid)
    signalled = set(pids)
    for _ in range(40):  # a re-scan catches processes forked while we were signalling
        if not alive:
            break
        signalled |= alive
        _signal_all(alive, pgid, signal.SIGKILL)
        time.sleep(0.05)
        alive = job_processes(job_id, root_pid, pgid)
    return signalled
