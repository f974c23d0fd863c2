"""``local-zygote``: one warm, pre-forked Python per slot inside the same bwrap sandbox (about 1-3 ms per run).

Each slot runs :mod:`zygote_main` as pid 1 of a long-lived bwrap sandbox, with the slot's uid,
cgroup, rlimits and seccomp filter. A run is one length-prefixed JSON request; the zygote forks,
applies the run's rlimits in the child, collects capped output under the deadline, then kills
and reaps every process in the namespace and wipes the scratch space. The host keeps a
watchdog (timeout + 5 s): a wedged or dead zygote is killed with its whole cgroup and
respawned on the next run. Workers are recycled after ``max_runs`` runs, after an OOM kill,
or when the scratch wipe failed.

Differences from ``python main.py``: runs in one slot share the slot's IPC namespace until the
worker is recycled; the hash seed is the zygote's; ``tmpfs_mb`` is fixed per worker.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import signal
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from env_servers.sandbox import launcher, seccomp
from env_servers.sandbox.base import Slot, SlotBackend
from env_servers.sandbox.limits import ExecResult, Limits, SandboxError, decode_output

ZYGOTE_SOURCE = (Path(__file__).parent / "zygote_main.py").read_bytes()
WATCHDOG_EXTRA_S = 5.0
START_TIMEOUT_S = 30.0
DEFAULT_PRELOAD = ("numpy",)
_SECCOMP_FILTER = seccomp.build_filter()


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    runs: int = 0
    base_as: int = 0
    broken: bool = False


class ZygoteBackend(SlotBackend):
    """A pool of pre-forked zygotes, one per slot: the throughput backend for RL."""

    name = "local-zygote"

    def __init__(self, slots: int | None = None, *, preload: tuple[str, ...] = DEFAULT_PRELOAD,
                 max_runs: int = 500, limits: Limits = Limits(), **kwargs: Any):
        super().__init__(slots, **kwargs)
        self.preload = tuple(preload)
        self.max_runs = max_runs
        self.worker_limits = limits
        self._workers: dict[int, Worker] = {}
        self.spawned = 0

    def warm(self) -> None:
        """Start every slot's zygote now (otherwise each starts on its slot's first run)."""
        futures = [self._pool.submit(self._warm_one) for _ in range(self.slots)]
        for f in futures:
            f.result()

    def _warm_one(self) -> None:
        slot = self._free.get()
        try:
            self._ensure_cgroup(slot, self.worker_limits)
            self._worker(slot)
        finally:
            self._free.put(slot)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "preload": list(self.preload), "workers_spawned": self.spawned}

    # -- worker lifecycle ------------------------------------------------------------------
    def _worker(self, slot: Slot) -> Worker:
        worker = self._workers.get(slot.index)
        if worker is not None and (worker.broken or worker.runs >= self.max_runs or worker.proc.poll() is not None):
            self._close_slot(slot)
            worker = None
        if worker is None:
            worker = self._spawn(slot)
            self._workers[slot.index] = worker
        return worker

    def _spawn(self, slot: Slot) -> Worker:
        lim = self.worker_limits
        src_fd = launcher.memfd(ZYGOTE_SOURCE, "zygote")
        seccomp_fd = launcher.memfd(_SECCOMP_FILTER, "seccomp") if seccomp.supported() else None
        fds = [fd for fd in (src_fd, seccomp_fd) if fd is not None]
        # the zygote's own rlimits are ceilings; each run lowers them in its child
        argv = (launcher.chain(slot.uid, slot.cgroup.procs_files(), lim, rlimits={"cpu": "unlimited",
                                                                                   "as": "unlimited"})
                + launcher.bwrap_args(lim, seccomp_fd=seccomp_fd, files={"/zygote.py": src_fd})
                + launcher.python_cmd("/zygote.py") + list(self.preload))
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    pass_fds=fds, env={"PATH": launcher.HOST_PATH}, start_new_session=True)
        finally:
            for fd in fds:
                os.close(fd)
        worker = Worker(proc)
        try:
            hello = self._read_reply(worker, time.monotonic() + START_TIMEOUT_S)
        except SandboxError:
            self._kill(slot, worker)
            raise
        if hello is None or not hello.get("ready"):
            self._kill(slot, worker)
            raise SandboxError(f"the zygote of slot {slot.index} did not start (got {hello!r}); "
                               "check that bwrap works: bwrap --ro-bind /usr /usr /usr/bin/true")
        worker.base_as = int(hello.get("base_as", 0))
        self.spawned += 1
        return worker

    def _kill(self, slot: Slot, worker: Worker) -> None:
        try:
            os.killpg(worker.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        slot.cgroup.kill()
        for pipe in (worker.proc.stdin, worker.proc.stdout):
            if pipe is not None:
                pipe.close()
        worker.proc.wait()
        slot.cgroup.wait_empty()

    def _close_slot(self, slot: Slot) -> None:
        worker = self._workers.pop(slot.index, None)
        if worker is not None:
            self._kill(slot, worker)

    def _after_oom(self, slot: Slot) -> None:
        worker = self._workers.get(slot.index)
        if worker is not None:
            worker.broken = True

    # -- one run ---------------------------------------------------------------------------
    def _run_slot(self, slot: Slot, code: str, stdin: bytes, files: dict[str, bytes], limits: Limits) -> ExecResult:
        worker = self._worker(slot)
        request = {"code": code, "stdin": base64.b64encode(stdin).decode(),
                   "files": {k: base64.b64encode(v).decode() for k, v in files.items()},
                   "limits": limits.to_dict()}
        start = time.monotonic()
        try:
            self._send(worker, request)
            reply = self._read_reply(worker, start + limits.timeout_s + WATCHDOG_EXTRA_S)
        except (OSError, SandboxError):
            reply = None
        worker.runs += 1
        if reply is None or "error" in reply:
            # the zygote died (OOM kill of pid 1, pids exhausted...) or wedged: start afresh next time
            worker.broken = True
            self._close_slot(slot)
            detail = (reply or {}).get("error", "the sandbox worker died during the run")
            timed_out = time.monotonic() - start >= limits.timeout_s
            return ExecResult(stderr=f"[sandbox] {detail}", signal=signal.SIGKILL, timed_out=timed_out,
                              duration_s=time.monotonic() - start)
        if not reply.get("clean", True):
            worker.broken = True
        return ExecResult(stdout=decode_output(base64.b64decode(reply["stdout"])),
                          stderr=decode_output(base64.b64decode(reply["stderr"])),
                          exit_code=reply["exit_code"], signal=reply["signal"], timed_out=reply["timed_out"],
                          output_truncated=reply["output_truncated"], duration_s=reply["duration_s"])

    @staticmethod
    def _send(worker: Worker, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        assert worker.proc.stdin is not None
        worker.proc.stdin.write(struct.pack(">I", len(data)) + data)
        worker.proc.stdin.flush()

    @staticmethod
    def _read_reply(worker: Worker, deadline: float) -> dict[str, Any] | None:
        """One framed reply, or None on EOF; raises SandboxError when the watchdog deadline passes."""
        stdout = worker.proc.stdout
        assert stdout is not None
        fd = stdout.fileno()
        buf = bytearray()
        need = 4
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while len(buf) < need:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SandboxError("the sandbox worker did not answer before the watchdog deadline")
                if not sel.select(remaining):
                    continue
                chunk = os.read(fd, max(need - len(buf), 65536) if need > 4 else 4 - len(buf))
                if not chunk:
                    return None
                buf += chunk
                if need == 4 and len(buf) >= 4:
                    need = 4 + struct.unpack(">I", bytes(buf[:4]))[0]
        reply: dict[str, Any] = json.loads(bytes(buf[4:need]))  # the zygote sends only objects
        return reply
