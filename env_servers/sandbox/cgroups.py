"""One cgroup per worker slot: memory and pids limits, an OOM counter, and kill-everything.

Two layouts are handled. Pure cgroup v2 (``/sys/fs/cgroup/cgroup.controllers`` lists memory and
pids): ``memory.max``, ``memory.swap.max``, ``pids.max``, ``memory.events`` and ``cgroup.kill``.
Hybrid hosts (v1 ``memory`` and ``pids`` hierarchies plus a v2 ``unified`` mount): the limits
live in v1 and the unified hierarchy is used only for ``cgroup.kill``. A slot's cgroup is
created once and reused; processes join it through the launcher chain (``cgroup.procs``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
PARENT = "envhub-sandbox"


def layout(root: Path = ROOT) -> str | None:
    """``"v2"``, ``"hybrid"`` or None when no writable memory+pids cgroups exist (or we are not root)."""
    if os.geteuid() != 0:
        return None
    controllers = root / "cgroup.controllers"
    if controllers.exists():
        names = controllers.read_text().split()
        return "v2" if {"memory", "pids"} <= set(names) and os.access(root, os.W_OK) else None
    if (root / "memory" / "memory.limit_in_bytes").exists() and (root / "pids").is_dir() \
            and os.access(root / "memory", os.W_OK):
        return "hybrid"
    return None


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError as exc:
        log.debug("cannot write %s to %s: %s", value, path, exc)
        return False


def _counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class SlotCgroup:
    """The cgroup(s) of one slot. Construct, then ``create(mem_bytes, pids)``; ``remove()`` at the end."""

    def __init__(self, tag: str, *, root: Path = ROOT, kind: str | None = None):
        self.tag = tag
        self.root = root
        self.kind = kind if kind is not None else layout(root)
        self.dirs: list[Path] = []
        self._mem_bytes = 0

    @property
    def available(self) -> bool:
        return self.kind is not None

    def _parents(self) -> list[Path]:
        if self.kind == "v2":
            return [self.root / PARENT]
        parents = [self.root / "memory" / PARENT, self.root / "pids" / PARENT]
        if (self.root / "unified" / "cgroup.procs").exists():
            parents.append(self.root / "unified" / PARENT)
        return parents

    def create(self, mem_bytes: int, pids: int) -> bool:
        """Make the cgroup and set its limits; False (and no cgroup) when the host refuses."""
        if not self.available:
            return False
        try:
            for parent in self._parents():
                parent.mkdir(exist_ok=True)
                _remove_stale(parent)
            if self.kind == "v2":
                _write(self.root / "cgroup.subtree_control", "+memory +pids")
                _write(self.root / PARENT / "cgroup.subtree_control", "+memory +pids")
            self.dirs = [parent / self.tag for parent in self._parents()]
            for d in self.dirs:
                d.mkdir(exist_ok=True)
        except OSError as exc:
            log.warning("cgroups unavailable (%s); the slot runs without memory/pids cgroup limits", exc)
            self.kind, self.dirs = None, []
            return False
        self.set_limits(mem_bytes, pids)
        return True

    def set_limits(self, mem_bytes: int, pids: int) -> None:
        if not self.dirs or mem_bytes == self._mem_bytes:
            return
        self._mem_bytes = mem_bytes
        if self.kind == "v2":
            d = self.dirs[0]
            _write(d / "memory.max", str(mem_bytes))
            _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(pids))
        else:
            mem, pid_dir = self.dirs[0], self.dirs[1]
            # the kernel keeps memsw >= limit, so one of the first two writes fails when the
            # limit moves; writing the limit again after memsw covers both directions
            _write(mem / "memory.limit_in_bytes", str(mem_bytes))
            _write(mem / "memory.memsw.limit_in_bytes", str(mem_bytes))
            _write(mem / "memory.limit_in_bytes", str(mem_bytes))
            _write(pid_dir / "pids.max", str(pids))

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid to, to join every hierarchy of the slot."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        """The slot's cumulative OOM-kill counter (compare before and after a run)."""
        if not self.dirs:
            return 0
        if self.kind == "v2":
            return _counter(self.dirs[0] / "memory.events", "oom_kill")
        return _counter(self.dirs[0] / "memory.oom_control", "oom_kill")

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def kill(self) -> None:
        """SIGKILL every process in the slot, setsid'd and double-forked ones included."""
        for d in self.dirs:
            if (d / "cgroup.kill").exists() and _write(d / "cgroup.kill", "1"):
                return
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_empty(self, timeout_s: float = 1.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.pids():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def remove(self) -> None:
        if not self.dirs:
            return
        self.kill()
        self.wait_empty()
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass
        self.dirs = []


def _remove_stale(parent: Path) -> None:
    """Remove leftover slot cgroups of processes that died without cleaning up (names start ``p<pid>-``)."""
    for child in parent.iterdir():
        if not child.is_dir() or not child.name.startswith("p"):
            continue
        pid_text = child.name[1:].split("-", 1)[0]
        if pid_text.isdigit() and not Path(f"/proc/{pid_text}").exists():
            try:
                child.rmdir()
            except OSError:
                pass
