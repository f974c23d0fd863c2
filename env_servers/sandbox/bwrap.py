"""``local-bwrap``: a fresh bubblewrap sandbox per run (about 15-50 ms each).

Layers, outermost first: slot uid and cgroup, rlimits, uid drop with no capabilities and
no-new-privs, bwrap namespaces (user, pid, net, ipc, uts, mount, cgroup) with a read-only
root, only ``/usr`` and three ``/etc`` files bound, sized tmpfs at ``/sandbox``, ``/tmp`` and ``/dev/shm``,
the seccomp filter, and Python as pid 1 (``--as-pid-1``): when the program exits every other
process of the run dies with the namespace. The code reaches the sandbox through a memfd, so
nothing is written on the host.
"""

from __future__ import annotations

import os
import signal
import subprocess

from env_servers.sandbox import launcher, seccomp
from env_servers.sandbox.base import Slot, SlotBackend, supervise_slot_run
from env_servers.sandbox.limits import ExecResult, Limits, decode_output
from env_servers.sandbox.supervisor import Capture

# statuses bwrap reports as 128 + signal; other exit codes above 128 are left as exit codes
_FATAL_SIGNALS = {signal.SIGKILL, signal.SIGSEGV, signal.SIGXCPU, signal.SIGXFSZ, signal.SIGABRT,
                  signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGSYS}
_SECCOMP_FILTER = seccomp.build_filter()


def status_from_returncode(rc: int | None) -> tuple[int | None, int | None]:
    """(exit_code, signal) from a launcher return code (negative: signal; 128+n: signal n inside bwrap)."""
    if rc is None:
        return None, None
    if rc < 0:
        return None, -rc
    if rc > 128 and (rc - 128) in _FATAL_SIGNALS:
        return None, rc - 128
    return rc, None


def to_result(cap: Capture) -> ExecResult:
    exit_code, sig = status_from_returncode(cap.returncode)
    timed_out = cap.timed_out or sig == signal.SIGXCPU
    if cap.timed_out:
        exit_code, sig = None, signal.SIGKILL
    return ExecResult(stdout=decode_output(bytes(cap.stdout)), stderr=decode_output(bytes(cap.stderr)),
                      exit_code=exit_code, signal=sig, timed_out=timed_out,
                      output_truncated=cap.output_truncated, duration_s=cap.duration_s)


class BwrapBackend(SlotBackend):
    """Spawn a bubblewrap sandbox per run; the default when a probe run of bwrap succeeds."""

    name = "local-bwrap"

    def _run_slot(self, slot: Slot, code: str, stdin: bytes, files: dict[str, bytes], limits: Limits) -> ExecResult:
        fds: list[int] = []
        try:
            file_fds = {"/sandbox/main.py": launcher.memfd(code.encode("utf-8", "surrogatepass"), "main.py")}
            for name, data in files.items():
                file_fds[f"/sandbox/{name}"] = launcher.memfd(data, "file")
            fds += file_fds.values()
            seccomp_fd = launcher.memfd(_SECCOMP_FILTER, "seccomp") if seccomp.supported() else None
            if seccomp_fd is not None:
                fds.append(seccomp_fd)
            stdin_fd = launcher.memfd(stdin, "stdin")
            fds.append(stdin_fd)
            argv = (launcher.chain(slot.uid, slot.cgroup.procs_files(), limits)
                    + launcher.bwrap_args(limits, seccomp_fd=seccomp_fd, files=file_fds)
                    + launcher.python_cmd())
            return self._spawn(slot, argv, stdin_fd, [fd for fd in fds if fd != stdin_fd], limits)
        finally:
            for fd in fds:
                os.close(fd)

    def _spawn(self, slot: Slot, argv: list[str], stdin_fd: int, pass_fds: list[int], limits: Limits) -> ExecResult:
        proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=pass_fds, env={"PATH": launcher.HOST_PATH}, start_new_session=True)

        cap = supervise_slot_run(proc, slot, limits)
        if slot.cgroup.pids():
            slot.cgroup.kill()
            slot.cgroup.wait_empty()
        return to_result(cap)
