"""What runs on each node of a Ray job: one supervisor actor per node that owns the job's process tree there.

The actor is placed in one bundle of the job's placement group, so Ray has reserved its GPUs; it
starts the node's share of the job in its own session with ``CUDA_VISIBLE_DEVICES`` set to the GPU
ids Ray gave it, keeps the output in a file on the node that the scheduler pulls by offset (so logs
cross hosts), and ends the whole tree with the same process-tree rules as the local backend.
The child carries ``PR_SET_PDEATHSIG`` so it dies with the actor when the node's raylet is killed,
and a reaper process (:mod:`trainer.scheduler._node_reaper`) ends the rest of the tree then, so a
grandchild that left the tree does not outlive a lost node either.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any

import ray

from trainer.scheduler import _procs

_PR_SET_PDEATHSIG = 1
_MAX_CHUNK_BYTES = 1 << 16  # bounds one log pull


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when its supervisor (the actor) dies."""
    os.setsid()
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class NodeSupervisor:
    """One node's share of a job: start it, report its output and exit code, end its tree."""

    def __init__(self, job_id: str, share: int, grace_s: float = 5.0, name: str = ""):
        self.job_id, self.name = job_id, name
        # per share and per actor: restarting one replica leaves its neighbours alone, and the reaper of
        # the actor it replaces cannot take the new one's processes for its own
        self.marker = f"{job_id}.{share}.{secrets.token_hex(3)}"
        fd, self.log_path = tempfile.mkstemp(prefix=f"envhub-sched-{job_id}-", suffix=".log")
        os.close(fd)
        self.proc: subprocess.Popen[bytes] | None = None
        self.offset = 0
        self._start_reaper(grace_s)

    def _start_reaper(self, grace_s: float) -> None:
        """Start the share's reaper, detached (it forks and its first process exits, which this waits for)."""
        me = os.getpid()
        env = {k: v for k, v in os.environ.items() if k != _procs.JOB_MARKER_ENV}  # it must not reap itself
        argv = [sys.executable, "-m", "trainer.scheduler._node_reaper", str(me), str(_procs.start_ticks(me)),
                self.marker, str(grace_s)]
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=env, start_new_session=True, check=True, timeout=60)

    def where(self) -> dict[str, Any]:
        """The node and GPU ids Ray placed this share on, and this actor's name (to find it again)."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
                "gpus": [int(g) for g in ray.get_gpu_ids()], "actor": self.name}

    def free_ports(self, count: int) -> list[int]:
        """``count`` TCP ports free on this node now (the rendezvous port of a multi-node job)."""
        socks = [socket.socket() for _ in range(count)]
        try:
            for sock in socks:
                sock.bind(("0.0.0.0", 0))
            return [int(sock.getsockname()[1]) for sock in socks]
        finally:
            for sock in socks:
                sock.close()

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None) -> int:
        """Start the share; returns its pid on this node."""
        full_env = dict(os.environ)
        full_env.update(env)
        full_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(g)) for g in ray.get_gpu_ids())
        full_env[_procs.JOB_MARKER_ENV] = self.marker
        with open(self.log_path, "ab", buffering=0) as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=cwd or None, env=full_env, preexec_fn=_die_with_parent)  # noqa: PLW1509 (the actor runs one method at a time)
        return self.proc.pid

    def poll(self) -> tuple[bytes, int | None]:
        """New output since the last poll and the exit code (None while it runs)."""
        code = self.proc.poll() if self.proc is not None else None
        with open(self.log_path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(_MAX_CHUNK_BYTES)
        self.offset += len(chunk)
        return chunk, code

    def stop(self, grace_s: float) -> int:
        """End the share's whole tree on this node; returns how many processes were signalled."""
        root = self.proc.pid if self.proc is not None else None
        return len(_procs.end_job_tree(self.marker, root, root, grace_s))


async def ref_result(ref: Any) -> Any:
    """Await a Ray object ref from the scheduler's event loop."""
    return await ref
