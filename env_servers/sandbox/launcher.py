"""The exec chain that puts a process in a slot: cgroup join (as root), rlimits, uid drop, bwrap.

``sh`` joins the slot's cgroups, ``prlimit`` sets rlimits, ``setpriv`` drops to the slot's own
uid with no capabilities and no-new-privs, then bwrap builds the namespaces. Python 3.11 has no
``os.unshare`` and ``preexec_fn`` is unsafe in a threaded server, hence exec, not fork hooks.
bwrap is started *as the unprivileged slot uid*: started by root it would map the sandbox uid
onto host root, making root-only files readable. The launcher runs with an empty environment
(bwrap's own init would otherwise expose it through ``/proc/1/environ``).
"""

from __future__ import annotations

import os
import shutil
import threading

from env_servers.sandbox.limits import Limits

SANDBOX_PYTHON = "/usr/bin/python3"
HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/sandbox",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    # BLAS thread pools reserve address space per thread; RLIMIT_AS would break them
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
SANDBOX_UID_INSIDE = 1000

_blocks_in_use: set[int] = set()
_block_lock = threading.Lock()
UID_BLOCKS = 16


def allocate_uids(slots: int) -> tuple[int, list[int]]:
    """(block, uids): 16 host uids for one backend instance, distinct per process and per live instance.

    RLIMIT_NPROC counts per real uid across the whole host, so two sandboxes must never share one.
    Give the block back with :func:`release_uids` when the backend closes.
    """
    if slots > 16:
        raise ValueError(f"Expected at most 16 slots per backend, got {slots}.")
    with _block_lock:
        free = [k for k in range(UID_BLOCKS) if k not in _blocks_in_use]
        if not free:
            raise RuntimeError(f"Expected at most {UID_BLOCKS} sandbox backends open at once in one process; "
                               "close() the ones you no longer use.")
        block = free[0]
        _blocks_in_use.add(block)
    base = 100_000 + (os.getpid() % 30_000) * 256 + block * 16
    return block, [base + i for i in range(slots)]


def release_uids(block: int) -> None:
    with _block_lock:
        _blocks_in_use.discard(block)


def is_root() -> bool:
    return os.geteuid() == 0


def have_tools(*names: str) -> bool:
    return all(shutil.which(n, path=HOST_PATH) for n in names)


def chain(uid: int | None, cgroup_procs: list[str], limits: Limits, *,
          rlimits: dict[str, str] | None = None) -> list[str]:
    """argv prefix: join cgroups, set rlimits, drop to ``uid`` (None: stay, for non-root hosts).

    ``rlimits`` overrides single prlimit values by name (``{"cpu": "unlimited"}``).
    """
    argv: list[str] = []
    if cgroup_procs:
        argv += ["/bin/sh", "-c", 'IFS=:; for f in $0; do echo $$ > "$f" || exit 125; done; exec "$@"',
                 ":".join(cgroup_procs)]
    values = {"cpu": str(int(limits.timeout_s) + 1), "as": str(limits.mem_mb * 1024 * 1024),
              "nproc": str(limits.nproc), "fsize": str(limits.fsize_mb * 1024 * 1024),
              "nofile": str(limits.nofile), "core": "0", **(rlimits or {})}
    argv += ["prlimit", *(f"--{name}={value}" for name, value in values.items())]
    if uid is not None:
        argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--no-new-privs"]
    return argv


def bwrap_args(limits: Limits, *, seccomp_fd: int | None, files: dict[str, int],
               as_pid_1: bool = True) -> list[str]:
    """bwrap options for a fresh, read-only, network-less root with sized tmpfs scratch at /sandbox."""
    size = str(limits.tmpfs_mb * 1024 * 1024)
    args = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--hostname", "sandbox",
            "--uid", str(SANDBOX_UID_INSIDE), "--gid", str(SANDBOX_UID_INSIDE),
            "--ro-bind", "/usr", "/usr"]
    if as_pid_1:
        args.append("--as-pid-1")
    for name in ("lib", "lib64", "bin", "sbin"):
        if os.path.islink(f"/{name}"):
            args += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
        elif os.path.isdir(f"/{name}"):
            args += ["--ro-bind", f"/{name}", f"/{name}"]
    # numpy's BLAS is resolved through /etc/alternatives and the loader cache; nothing else from /etc
    for path in ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", path, path]
    # /dev is bwrap's own tmpfs: writable and unbounded, and a zygote's runs would share whatever is left
    # in it. Only the sized /dev/shm mounted over it stays writable (POSIX semaphores live there).
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/sandbox"]
    for dest, fd in files.items():
        args += ["--file", str(fd), dest]
    # after every file is in place: bwrap's root tmpfs is otherwise writable and unbounded
    args += ["--remount-ro", "/", "--clearenv"]
    for key, value in SANDBOX_ENV.items():
        args += ["--setenv", key, value]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args += ["--chdir", "/sandbox"]
    return args


def memfd(data: bytes, name: str = "sandbox") -> int:
    """An anonymous in-memory file holding ``data``, positioned at 0 (no host scratch files)."""
    fd = os.memfd_create(name, 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def python_cmd(script: str = "/sandbox/main.py") -> list[str]:
    return [SANDBOX_PYTHON, "-B", "-E", "-s", script]


def sandbox_python_ok() -> bool:
    return os.access(SANDBOX_PYTHON, os.X_OK)
