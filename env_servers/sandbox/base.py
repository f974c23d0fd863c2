"""Shared plumbing of the local backends: worker slots, a bounded thread pool, async and sync entry points.

A slot is one unit of concurrency with its own host uid and cgroup. ``run`` may be awaited from
any event loop (each test gets its own) and from many tasks at once: the blocking work runs in a
thread pool with one thread per slot, so at most ``slots`` programs run at a time and the rest
queue in the pool.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from env_servers.sandbox import launcher
from env_servers.sandbox.cgroups import SlotCgroup
from env_servers.sandbox.limits import ExecResult, Limits, SandboxError, check_files
from env_servers.sandbox.supervisor import Capture, supervise

CGROUP_OVERHEAD_MB = 128


@dataclass
class Slot:
    index: int
    uid: int | None
    cgroup: SlotCgroup


def supervise_slot_run(proc: subprocess.Popen[bytes], slot: Slot, limits: Limits) -> Capture:
    """Supervise a run started in its own session; past a limit, SIGKILL its process group and the slot's cgroup."""
    def kill_tree() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        slot.cgroup.kill()

    try:
        return supervise(proc, limits, kill_tree)
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def default_slots() -> int:
    return max(1, min(16, os.cpu_count() or 1))


_Backend = TypeVar("_Backend", bound="SlotBackend")


class SlotBackend:
    """Base of the bwrap, zygote and rlimit backends. Subclasses implement ``_run_slot``."""

    name = "local"

    def __init__(self, slots: int | None = None, *, use_cgroups: bool = True, cgroup_mem_mb: int | None = None):
        self.slots = slots or default_slots()
        if not 1 <= self.slots <= 16:
            raise ValueError(f"Expected 1 <= slots <= 16, got {self.slots}.")
        self._uid_block: int | None = None
        uids: list[int | None] = [None] * self.slots
        if launcher.is_root():
            self._uid_block, block_uids = launcher.allocate_uids(self.slots)
            uids = list(block_uids)
        self._slots: list[Slot] = []
        for i, uid in enumerate(uids):
            tag = f"p{os.getpid()}-{self.name}-{uid if uid is not None else i}"
            cg = SlotCgroup(tag, kind=None) if not use_cgroups else SlotCgroup(tag)
            self._slots.append(Slot(i, uid, cg))
        self._cgroup_mem_mb = cgroup_mem_mb
        self._free: queue.Queue[Slot] = queue.Queue()
        for slot in self._slots:
            self._free.put(slot)
        self._pool = ThreadPoolExecutor(max_workers=self.slots, thread_name_prefix=f"sandbox-{self.name}")
        self._closed = False
        self._lock = threading.Lock()
        self.runs = 0

    # -- public API ------------------------------------------------------------------------
    async def run(self, code: str, *, stdin: bytes = b"", files: dict[str, bytes] | None = None,
                  limits: Limits = Limits()) -> ExecResult:
        """Run ``code`` with ``/usr/bin/python3`` in the sandbox, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._run_blocking, code, stdin, files, limits)

    def run_sync(self, code: str, *, stdin: bytes = b"", files: dict[str, bytes] | None = None,
                 limits: Limits = Limits()) -> ExecResult:
        """Blocking version of :meth:`run` (same pool, same concurrency bound)."""
        return self._pool.submit(self._run_blocking, code, stdin, files, limits).result()

    def info(self) -> dict[str, Any]:
        """What ``/metadata`` reports about the sandbox."""
        kinds = {s.cgroup.kind for s in self._slots}
        return {"backend": self.name, "slots": self.slots, "isolation": self.isolation,
                "cgroups": next(iter(kinds)) if len(kinds) == 1 else sorted(map(str, kinds)),
                "uid_per_slot": self._slots[0].uid is not None, "runs": self.runs}

    isolation = "namespaces+seccomp"

    def close(self) -> None:
        """Stop workers and remove the slots' cgroups. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        for slot in self._slots:
            self._close_slot(slot)
            slot.cgroup.remove()
        if self._uid_block is not None:
            launcher.release_uids(self._uid_block)

    def __enter__(self: _Backend) -> _Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _run_blocking(self, code: str, stdin: bytes, files: dict[str, bytes] | None, limits: Limits) -> ExecResult:
        if self._closed:
            raise SandboxError(f"the {self.name} sandbox backend is closed; create a new one.")
        if not isinstance(code, str):
            raise ValueError(f"Expected code to be a str, got {type(code).__name__}.")
        checked = check_files(files)
        slot = self._free.get()
        try:
            self._ensure_cgroup(slot, limits)
            before = slot.cgroup.oom_kills()
            t0 = time.monotonic()
            result = self._run_slot(slot, code, bytes(stdin or b""), checked, limits)
            if slot.cgroup.oom_kills() > before:
                result.oom_killed = True
                self._after_oom(slot)
            result.duration_s = result.duration_s or time.monotonic() - t0
            result.backend = self.name
            self.runs += 1
            return result
        finally:
            self._free.put(slot)

    def _ensure_cgroup(self, slot: Slot, limits: Limits) -> None:
        mem = (self._cgroup_mem_mb or limits.mem_mb + CGROUP_OVERHEAD_MB) * 1024 * 1024
        pids = limits.nproc + 8
        if slot.cgroup.available and not slot.cgroup.dirs:
            slot.cgroup.create(mem, pids)
        else:
            slot.cgroup.set_limits(mem, pids)

    def _run_slot(self, slot: Slot, code: str, stdin: bytes, files: dict[str, bytes], limits: Limits) -> ExecResult:
        raise NotImplementedError

    def _after_oom(self, slot: Slot) -> None:
        """Hook: the zygote backend recycles its worker after an OOM kill."""

    def _close_slot(self, slot: Slot) -> None:
        """Hook: stop a slot's long-lived worker."""
