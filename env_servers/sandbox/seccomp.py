"""A hand-assembled seccomp BPF filter for sandboxed code (x86_64), handed to bwrap through ``--seccomp FD``.

Defence in depth on top of the user and network namespaces: kill on a foreign architecture or
the x32 ABI; EPERM for kernel-attack-surface syscalls (ptrace, mounts, namespaces, keyrings,
bpf, perf, userfaultfd, io_uring, module and kexec loading, cross-process memory access, POSIX
message queues); ENOSYS for ``clone3`` (glibc then falls back to ``clone``); EACCES for
``socket`` with any domain other than AF_UNIX. Everything else is allowed.
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

# classic BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

# offsets in struct seccomp_data
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LO = 0, 4, 16

#: syscall numbers (x86_64) answered with EPERM
DENIED_EPERM = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "unshare": 272, "setns": 308,
    "add_key": 248, "request_key": 249, "keyctl": 250,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "acct": 163, "swapon": 167, "swapoff": 168, "reboot": 169, "settimeofday": 164, "clock_settime": 227,
    "personality": 135, "name_to_handle_at": 303, "open_by_handle_at": 304, "lookup_dcookie": 212,
    # POSIX message queues outlive the run in the IPC namespace a zygote's runs share, and cannot be listed
    "mq_open": 240,
}
DENIED_ENOSYS = {"clone3": 435}
SYS_SOCKET = 41
AF_UNIX = 1


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def build_filter() -> bytes:
    """The filter program as raw ``struct sock_filter`` bytes (what ``bwrap --seccomp`` reads)."""
    prog = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        _insn(_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
        _insn(_JGE_K, 0, 1, X32_SYSCALL_BIT),
        _insn(_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS),
    ]
    denied = [(nr, errno.EPERM) for nr in sorted(DENIED_EPERM.values())]
    denied += [(nr, errno.ENOSYS) for nr in DENIED_ENOSYS.values()]
    for nr, err in denied:
        prog.append(_insn(_JEQ_K, 0, 1, nr))
        prog.append(_insn(_RET_K, 0, 0, SECCOMP_RET_ERRNO | err))
    # socket(domain, ...): allow AF_UNIX only. Loading arg0 clobbers the accumulator, so this goes last.
    prog += [
        _insn(_JEQ_K, 0, 3, SYS_SOCKET),
        _insn(_LD_W_ABS, 0, 0, _OFF_ARG0_LO),
        _insn(_JEQ_K, 1, 0, AF_UNIX),
        _insn(_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EACCES),
        _insn(_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    return b"".join(prog)


def supported() -> bool:
    """The filter is written for x86_64; elsewhere the sandbox runs without it (and says so)."""
    return platform.machine() in ("x86_64", "AMD64")
