"""The zygote: a warm Python inside one slot's sandbox that forks once per request.

Runs as pid 1 of its own bwrap sandbox under ``/usr/bin/python3`` (standard library only; the
host passes this file in through a memfd). It pre-imports the modules named on its command
line, makes itself non-dumpable (children cannot ptrace it or read its memory or fds through
/proc) and, as the namespace's pid 1, cannot be killed from inside. Protocol on stdin/stdout:
4-byte big-endian length + JSON, one request, one reply.

pid 1 never reads a request: for each one it forks a fresh *leader* that reads the request,
forks the run's child, collects its output, SIGKILLs and reaps every other process in the
namespace, wipes /sandbox, /tmp and /dev/shm, replies and exits. A run therefore inherits only
pid 1's pristine heap and its own request, never an earlier run's code, stdin or output (which
freed memory would otherwise still hold: another session's right answers). When a leader dies
any other way (the run killed it, the host closed stdin), pid 1 exits and the sandbox with it.
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import gc
import importlib
import json
import os
import random
import resource
import select
import shutil
import signal
import struct
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any, NoReturn

SCRATCH = ("/sandbox", "/tmp", "/dev/shm")
PROTO_IN, PROTO_OUT = 0, 1
WAKE_R = -1
LEADER_OK, LEADER_EOF = 0, 3
LIBC = ctypes.CDLL(None, use_errno=True)
# Where no bwrap applies the seccomp filter (the docker backend's containers), the host hands the
# same filter in through the environment and each run installs it itself (see install_seccomp).
SECCOMP_FILTER = base64.b64decode(os.environ.pop("ENVHUB_ZYGOTE_SECCOMP", ""))
# The OOM-kill counter of this container's memory cgroup (v1, then v2), read around each run.
OOM_COUNTERS = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events")


def drain_wakeup() -> None:
    try:
        while os.read(WAKE_R, 512):
            pass
    except BlockingIOError:
        pass


def read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def send(obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(PROTO_OUT, view):]


def wipe() -> bool:
    clean = True
    for top in SCRATCH:
        try:
            names = os.listdir(top)
        except OSError:
            continue
        for name in names:
            path = os.path.join(top, name)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    for root, dirs, _ in os.walk(path):
                        for d in dirs:
                            os.chmod(os.path.join(root, d), 0o700)
                    os.chmod(path, 0o700)
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except (OSError, RecursionError):  # RecursionError: directories nested thousands deep
                clean = False
    return clean


def remove_sysv_ipc() -> None:
    """Runs of a slot share its IPC namespace: drop SysV shared memory, queues and semaphores between runs."""
    libc = LIBC
    removers: tuple[tuple[str, Callable[[int], int]], ...] = (
        ("shm", lambda i: libc.shmctl(i, 0, None)), ("msg", lambda i: libc.msgctl(i, 0, None)),
        ("sem", lambda i: libc.semctl(i, 0, 0)))
    for kind, remove in removers:
        try:
            with open("/proc/sysvipc/" + kind) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            remove(int(row.split()[1]))  # IPC_RMID == 0


def kill_all() -> None:
    """SIGKILL and reap every other process in the namespace (setsid'd and double-forked ones too)."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def precompile(code: str) -> types.CodeType | BaseException:
    """Compile in the zygote, before fork: a child that compiles pays ~1 ms of copy-on-write faults."""
    try:
        return compile(code, "/sandbox/main.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        return exc.with_traceback(None)  # raised in the child, shown like python's own report


def child(req: dict[str, Any], stdin_fd: int, out_w: int, err_w: int, base_as: int) -> NoReturn:
    status = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        lim = req["limits"]
        set_limit(resource.RLIMIT_AS, lim["mem_mb"] * 1024 * 1024 + base_as)
        set_limit(resource.RLIMIT_CPU, int(lim["timeout_s"]) + 1)
        set_limit(resource.RLIMIT_FSIZE, lim["fsize_mb"] * 1024 * 1024)
        set_limit(resource.RLIMIT_NOFILE, lim["nofile"])
        set_limit(resource.RLIMIT_CORE, 0)
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 65536)
        sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
        if SECCOMP_FILTER:
            install_seccomp(SECCOMP_FILTER)
        status = run_main(req["compiled"])
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(status)


def run_main(compiled: types.CodeType | BaseException) -> int:
    os.chdir("/sandbox")
    sys.argv, sys.path[0] = ["/sandbox/main.py"], "/sandbox"
    main = types.ModuleType("__main__")
    main.__file__ = "/sandbox/main.py"
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    status = 0
    try:
        if isinstance(compiled, BaseException):
            raise compiled
        exec(compiled, main.__dict__)
        threading._shutdown()  # type: ignore[attr-defined]  # CPython's own exit hook, absent from typeshed
    except SystemExit as exc:
        status = exit_status(exc.code)
    except BaseException as exc:
        tb = exc.__traceback__  # drop run_main's own frame from the report
        traceback.print_exception(type(exc), exc, tb.tb_next if tb else None)
        status = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:
        pass
    return status


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_seccomp(program: bytes) -> None:
    """Install a raw ``struct sock_filter`` program on this process (no_new_privs first, as the kernel asks)."""
    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if LIBC.prctl(38, 1, 0, 0, 0) != 0 or LIBC.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # NO_NEW_PRIVS, SECCOMP
        raise OSError(ctypes.get_errno(), "cannot install the sandbox's seccomp filter")


def oom_kills() -> int | None:
    """OOM kills so far in this container's memory cgroup, or None where no counter is readable."""
    for path in OOM_COUNTERS:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None


def exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def set_limit(kind: int, value: int) -> None:
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def collect(pid: int, out_r: int, err_r: int, lim: dict[str, Any],
            start: float) -> tuple[bytearray, bytearray, int | None, bool, bool]:
    """Stream the child's output until it exits or is killed: (stdout, stderr, wait status or None
    where the zygote killed it, timed out, truncated)."""
    bufs, total = {out_r: bytearray(), err_r: bytearray()}, 0
    keep, kill_at = lim["max_output_bytes"], lim["kill_output_bytes"]
    deadline = start + lim["timeout_s"]
    status: int | None = None
    killed, timed_out, truncated, open_fds = False, False, False, [out_r, err_r]
    while status is None and not killed:
        ready, _, _ = select.select(open_fds + [WAKE_R], [], [], max(0.0, min(0.05, deadline - time.monotonic())))
        for fd in ready:
            if fd == WAKE_R:  # SIGCHLD arrived: fall through to waitpid
                drain_wakeup()
                continue
            data = os.read(fd, 65536)
            if not data:
                open_fds.remove(fd)
                continue
            total += len(data)
            truncated = truncated or len(bufs[fd]) + len(data) > keep
            bufs[fd] += data[:max(0, keep - len(bufs[fd]))]
        done_pid, st = os.waitpid(pid, os.WNOHANG)
        if done_pid:
            status = st
        elif total > kill_at or time.monotonic() >= deadline:
            timed_out = total <= kill_at
            truncated = truncated or not timed_out
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            killed = True
    kill_all()
    for fd in open_fds:  # every writer is dead now: the rest is buffered in the pipe
        while len(bufs[fd]) <= keep:
            data = os.read(fd, 65536)
            if not data:
                break
            truncated = truncated or len(bufs[fd]) + len(data) > keep
            bufs[fd] += data[:max(0, keep - len(bufs[fd]))]
    return bufs[out_r], bufs[err_r], status, timed_out, truncated


def handle(req: dict[str, Any], base_as: int) -> dict[str, Any]:
    for name, data in req.get("files", {}).items():
        path = os.path.join("/sandbox", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
    with open("/sandbox/main.py", "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(req["code"])
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, base64.b64decode(req.get("stdin", "")))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    req["compiled"] = precompile(req["code"])
    random.seed()  # fresh streams for every run (a forked child would otherwise repeat the zygote's)
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ooms_before = oom_kills()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(req, stdin_fd, out_w, err_w, base_as)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)
    out, err, status, timed_out, truncated = collect(pid, out_r, err_r, req["limits"], start)
    os.close(out_r)
    os.close(err_r)
    exit_code: int | None = None
    sig: int | None = None
    if status is None:  # killed by collect
        sig = signal.SIGKILL
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
    else:
        exit_code = os.WEXITSTATUS(status)
    return {"stdout": base64.b64encode(out).decode(), "stderr": base64.b64encode(err).decode(),
            "exit_code": exit_code, "signal": sig, "timed_out": timed_out or sig == signal.SIGXCPU,
            "output_truncated": truncated, "duration_s": time.monotonic() - start,
            "oom_killed": ooms_before is not None and (oom_kills() or 0) > ooms_before}


def serve_one(base_as: int) -> NoReturn:
    """The leader of one request (a fresh fork of pid 1): read it, run it, clean up, reply, exit."""
    global WAKE_R
    status = 1
    try:
        LIBC.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the run's orphans are reaped here
        WAKE_R, wake_w = os.pipe()
        os.set_blocking(WAKE_R, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() when the program exits
        try:
            (n,) = struct.unpack(">I", read_exact(PROTO_IN, 4))
            req = json.loads(read_exact(PROTO_IN, n))
        except EOFError:
            os._exit(LEADER_EOF)
        try:
            reply = handle(req, base_as)
        except OSError as exc:  # fork refused (pids limit), scratch full, ...
            kill_all()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        remove_sysv_ipc()
        reply["clean"] = wipe()
        send(reply)
        status = LEADER_OK
    finally:
        os._exit(status)


def main() -> None:
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    # children never collect the preloaded heap: a full GC would copy every page of it on write
    gc.freeze()
    LIBC.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    with open("/proc/self/statm") as f:
        base_as = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    send({"ready": True, "base_as": base_as})
    while True:
        leader = os.fork()
        if leader == 0:
            serve_one(base_as)
        _, status = os.waitpid(leader, 0)
        kill_all()  # whatever a dead leader left behind
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == LEADER_OK):
            return  # the host closed stdin, or the leader died mid-request: the host sees EOF and respawns


if __name__ == "__main__":
    main()
