"""``local-rlimit``: the last-resort backend. NOT a security boundary.

Used only where neither bwrap nor Docker works. It runs the code as the slot's uid (when the
service is root) with rlimits, the slot cgroup, a scrubbed environment and a private scratch
directory, then kills everything the slot uid owns. It stops runaway loops, fork and memory
bombs and output floods, but not network access, reads of world-readable files, or writes to
world-writable directories. Treat it as protection against buggy code, not hostile code.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

from env_servers.sandbox import launcher
from env_servers.sandbox.base import Slot, SlotBackend, supervise_slot_run
from env_servers.sandbox.bwrap import to_result
from env_servers.sandbox.limits import ExecResult, Limits

log = logging.getLogger(__name__)

REAP_WAIT_S = 3.0  # at most, after a run, for the slot uid's killed processes to be reaped

INSECURE_WARNING = ("local-rlimit sandbox backend in use: this is NOT a security boundary (no network or "
                    "filesystem isolation). Install bubblewrap (apt-get install -y bubblewrap) or use the "
                    "docker backend before running untrusted code.")


class RlimitBackend(SlotBackend):
    """rlimits + uid drop + cgroup, without namespaces."""

    name = "local-rlimit"
    isolation = "rlimits-only (INSECURE)"

    def __init__(self, slots: int | None = None, **kwargs: Any):
        super().__init__(slots, **kwargs)
        log.warning(INSECURE_WARNING)

    def _run_slot(self, slot: Slot, code: str, stdin: bytes, files: dict[str, bytes], limits: Limits) -> ExecResult:
        scratch = tempfile.mkdtemp(prefix="envhub-sandbox-")
        stdin_fd = launcher.memfd(stdin, "stdin")
        try:
            self._populate(scratch, slot.uid, {"main.py": code.encode("utf-8", "surrogatepass"), **files})
            env = {**launcher.SANDBOX_ENV, "HOME": scratch, "TMPDIR": scratch}
            argv = launcher.chain(slot.uid, slot.cgroup.procs_files(), limits) + launcher.python_cmd(
                os.path.join(scratch, "main.py"))
            proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=scratch, env=env, start_new_session=True)

            cap = supervise_slot_run(proc, slot, limits)
            self._kill_escapees(slot)
            return to_result(cap)
        finally:
            os.close(stdin_fd)
            shutil.rmtree(scratch, ignore_errors=True)

    @staticmethod
    def _populate(scratch: str, uid: int | None, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            path = os.path.join(scratch, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        if uid is not None:
            for root, dirs, names in os.walk(scratch):
                for n in dirs + names:
                    os.chown(os.path.join(root, n), uid, uid)
            os.chown(scratch, uid, uid)
        os.chmod(scratch, 0o700)

    @staticmethod
    def _kill_escapees(slot: Slot) -> None:
        """Without a pid namespace, daemons that left the process group survive: kill all the slot uid owns,
        then wait (bounded) until it owns none: a fork bomb's killed children are orphans that init reaps
        slowly, and until then they count against the slot uid's RLIMIT_NPROC, so the next run on the slot
        could not start (``setpriv: failed to execute ... Resource temporarily unavailable``)."""
        slot.cgroup.kill()
        if slot.uid is not None:
            subprocess.run(["setpriv", f"--reuid={slot.uid}", f"--regid={slot.uid}", "--clear-groups",
                            "kill", "-9", "-1"], env={"PATH": launcher.HOST_PATH},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        slot.cgroup.wait_empty(0.5)
        if slot.uid is not None:
            deadline = time.monotonic() + REAP_WAIT_S
            while (left := uid_processes(slot.uid)) and time.monotonic() < deadline:
                time.sleep(0.01)
            if left:
                log.warning("slot %d: %d processes of uid %d not yet reaped %.0f s after the kill", slot.index,
                            left, slot.uid, REAP_WAIT_S)


def uid_processes(uid: int) -> int:
    """How many processes (zombies included) ``uid`` owns on the host, from ``/proc``."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:  # gone meanwhile
                pass
    return count
