"""A real multi-node Ray cluster on this machine, started with ``ray start`` as a user would.

A head and worker nodes, each its own ``ray start`` (its own session and process group, its own
ports, fake ``--num-gpus``), all under one temporary directory. ``kill_raylet`` kills one node's
raylet (a node lost); ``shutdown`` kills every process of the cluster, including the job processes
the scheduler started on it, and waits until they are gone. Nothing here touches another Ray on the
machine: no ``ray stop``, no default ports.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
# a node lost is noticed in ~3 s instead of Ray's default ~30 s
_FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                "RAY_health_check_initial_delay_ms": "1000", "RAY_USAGE_STATS_ENABLED": "0"}
_WORKER_PORTS = 24  # per node: one per Ray worker process (each actor is one)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free now (held together while picked, so they differ)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


@dataclass
class RayNode:
    """One ``ray start`` of the cluster."""

    head: bool
    pgid: int  # the `ray start` process leads a session; the node's daemons stay in its group
    node_manager_port: int
    node_id: str = ""
    ip: str = ""
    alive: bool = True
    log: list[str] = field(default_factory=list)


class RayStartCluster:
    """A head and ``workers`` worker nodes, ``gpus`` fake GPUs and ``cpus`` CPUs each."""

    def __init__(self, workers: int = 1, gpus: int = 2, cpus: int = 1):
        self.gpus, self.cpus = gpus, cpus
        self.temp = tempfile.mkdtemp(prefix="ehray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.nodes: list[RayNode] = []
        self.address = ""
        try:
            self._start(head=True)
            for _ in range(workers):
                self._start(head=False)
        except BaseException:
            self.shutdown()
            raise

    @property
    def workers(self) -> list[RayNode]:
        return [n for n in self.nodes if not n.head]

    @property
    def alive_nodes(self) -> list[RayNode]:
        return [n for n in self.nodes if n.alive]

    def add_worker(self) -> RayNode:
        """Start one more worker node and return it."""
        return self._start(head=False)

    def _start(self, head: bool) -> RayNode:
        nm, om, agent_listen, agent_grpc, runtime_env, metrics, *extra = free_ports(9 + _WORKER_PORTS)
        gcs, client, dashboard = extra[:3]
        argv = [RAY, "start", f"--num-cpus={self.cpus}", f"--num-gpus={self.gpus}", "--disable-usage-stats",
                "--object-store-memory=80000000", f"--node-manager-port={nm}", f"--object-manager-port={om}",
                f"--dashboard-agent-listen-port={agent_listen}", f"--dashboard-agent-grpc-port={agent_grpc}",
                f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
                "--worker-port-list=" + ",".join(map(str, extra[3:]))]
        if head:
            argv += ["--head", f"--port={gcs}", f"--ray-client-server-port={client}", f"--dashboard-port={dashboard}",
                     "--include-dashboard=false", f"--temp-dir={self.temp}"]
        else:
            argv += [f"--address={self.address}"]
        env = {**os.environ, **_FAST_HEALTH, "RAY_TMPDIR": self.temp}
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180,
                              start_new_session=True)
        node = RayNode(head=head, pgid=0, node_manager_port=nm, log=[proc.stdout, proc.stderr])
        node.pgid = self._pgid_of_raylet(nm)
        self.nodes.append(node)
        if proc.returncode != 0:
            raise RuntimeError(f"`ray start` failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        cmdline = self._raylet_cmdline(nm)
        node.node_id = _flag(cmdline, "node_id")
        node.ip = _flag(cmdline, "node_ip_address")
        if head:
            self.address = f"{node.ip}:{gcs}"
        return node

    # -- processes ----------------------------------------------------------------------------
    def _raylet_pid(self, node_manager_port: int) -> int | None:
        for pid, argv in _cmdlines():
            if argv[:1] and argv[0].endswith("/raylet") and f"--node_manager_port={node_manager_port}" in argv \
                    and any(self.temp in a for a in argv):
                return pid
        return None

    def _raylet_cmdline(self, node_manager_port: int) -> list[str]:
        pid = self._raylet_pid(node_manager_port)
        if pid is None:
            raise RuntimeError(f"no raylet with --node_manager_port={node_manager_port} under {self.temp}")
        return _read_cmdline(pid)

    def _pgid_of_raylet(self, node_manager_port: int) -> int:
        pid = self._raylet_pid(node_manager_port)
        return os.getpgid(pid) if pid is not None else 0

    def kill_raylet(self, node: RayNode) -> None:
        """SIGKILL the node's raylet: the node is lost (its actors exit when they see it gone)."""
        pid = self._raylet_pid(node.node_manager_port)
        assert pid is not None, "the raylet to kill is not running"
        os.kill(pid, signal.SIGKILL)
        node.alive = False

    def processes(self) -> set[int]:
        """Every live process of the cluster: its nodes' groups, whatever names the temp dir, and their descendants."""
        groups = {n.pgid for n in self.nodes if n.pgid}
        stats = _stats()
        found = {pid for pid, (_, pgid) in stats.items() if pgid in groups}
        found |= {pid for pid, argv in _cmdlines() if any(self.temp in a for a in argv)}
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        stack = list(found)
        while stack:
            for child in children.get(stack.pop(), []):
                if child not in found:
                    found.add(child)
                    stack.append(child)
        found.discard(os.getpid())
        return found

    def shutdown(self) -> None:
        """Kill every process of the cluster (SIGKILL: a test cluster keeps nothing) and remove its files."""
        deadline = time.monotonic() + 30
        while (pids := self.processes()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.2)
        shutil.rmtree(self.temp, ignore_errors=True)


def _flag(argv: list[str], name: str) -> str:
    for arg in argv:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    raise RuntimeError(f"--{name} not on the raylet's command line")


def _read_cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _cmdlines() -> list[tuple[int, list[str]]]:
    return [(int(p.name), _read_cmdline(int(p.name))) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _stats() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) of every live (non-zombie) process."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            raw = (p / "stat").read_text()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2:].split()
        if rest[0] not in ("Z", "X"):
            out[int(p.name)] = (int(rest[1]), int(rest[2]))
    return out


def processes_with_marker(prefix: str) -> list[int]:
    """Pids of processes whose ``ENVHUB_SCHED_JOB`` starts with ``prefix``: ``"<job>."`` for all of a job on
    any node here, ``"<job>.<share>."`` for one share (the marker is ``<job>.<share>.<actor>``)."""
    pattern = re.compile(rb"(?:^|\0)ENVHUB_SCHED_JOB=" + re.escape(prefix.encode()))
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            environ = (p / "environ").read_bytes()
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X") and pattern.search(environ):
            pids.append(int(p.name))
    return pids
