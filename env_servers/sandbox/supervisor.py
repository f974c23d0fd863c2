"""Watch one sandboxed process: collect capped output, enforce the wall clock, kill the whole tree.

Blocking code, run in a worker thread. Output beyond ``max_output_bytes`` per stream is dropped;
past ``kill_output_bytes`` in total the run is killed. A background child that inherited the
pipes keeps them open after the main process exits, so once the main process is gone the
pipes get a short drain window before the tree is killed.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from env_servers.sandbox.limits import Limits

DRAIN_S = 0.1
_CHUNK = 65536


@dataclass
class Capture:
    """Raw outcome of a supervised process."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    returncode: int | None = None
    timed_out: bool = False
    output_truncated: bool = False
    duration_s: float = 0.0


class _Streams:
    def __init__(self, proc: subprocess.Popen[bytes], limits: Limits, cap: Capture):
        self.sel = selectors.DefaultSelector()
        self.limits, self.cap, self.total = limits, cap, 0
        for pipe, buf in ((proc.stdout, cap.stdout), (proc.stderr, cap.stderr)):
            if pipe is not None:
                os.set_blocking(pipe.fileno(), False)
                self.sel.register(pipe, selectors.EVENT_READ, buf)

    @property
    def open(self) -> bool:
        return bool(self.sel.get_map())

    def pump(self, timeout: float) -> bool:
        """Read what is ready; False once the kill threshold is crossed."""
        for key, _ in self.sel.select(max(timeout, 0.0)):
            try:
                data = os.read(key.fd, _CHUNK)
            except BlockingIOError:
                continue
            if not data:
                self.sel.unregister(key.fileobj)
                continue
            self.total += len(data)
            buf: bytearray = key.data
            room = self.limits.max_output_bytes - len(buf)
            if room < len(data):
                self.cap.output_truncated = True
            if room > 0:
                buf += data[:room]
            if self.total > self.limits.kill_output_bytes:
                return False
        return True

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fileobj)
        self.sel.close()


def supervise(proc: subprocess.Popen[bytes], limits: Limits, kill_tree: Callable[[], None], *,
              started: float | None = None, deadline_s: float | None = None) -> Capture:
    """Run ``proc`` to completion under ``limits``; ``kill_tree`` must SIGKILL every process of the run."""
    cap = Capture()
    start = started if started is not None else time.monotonic()
    deadline = start + (deadline_s if deadline_s is not None else limits.timeout_s)
    streams = _Streams(proc, limits, cap)
    exited_at: float | None = None
    killed = False
    try:
        while streams.open or proc.poll() is None:
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if not killed and now >= deadline:
                cap.timed_out, killed = True, True
                kill_tree()
            if not killed and exited_at is not None and now - exited_at > DRAIN_S:
                killed = True
                kill_tree()
            if killed and exited_at is not None and now - exited_at > 1.0:
                break  # pipes held by something unkillable: give up on the rest of the output
            wait = min(deadline - now, 0.05) if not killed else 0.05
            if not streams.open:
                time.sleep(max(min(wait, 0.005), 0.0005))
                continue
            if not streams.pump(wait) and not killed:
                cap.output_truncated, killed = True, True
                kill_tree()
    finally:
        streams.close()
    cap.returncode = proc.wait()
    cap.duration_s = time.monotonic() - start
    return cap
