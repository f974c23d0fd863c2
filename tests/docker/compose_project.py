"""A compose project of the real fleet for the docker tests: free loopback ports, its own name, always torn down.

Every test here drives the images built by ``scripts/fleet-images.sh`` through ``docker compose``
exactly as a user would, on ports chosen free at start so a user's own fleet is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
REPLICAS = ROOT / "compose" / "replicas.yml"
PORT_VARS = {"math": "MATH_PORT", "gomoku": "GOMOKU_PORT", "geometry": "GEOMETRY_PORT", "code": "CODE_PORT"}
CONTAINER_PORTS = {"math": 8001, "gomoku": 8002, "geometry": 8003, "code": 8004}


def engine_problem() -> str | None:
    """Why the docker tests cannot run here (no CLI, no engine, no Compose v2), or None."""
    if shutil.which("docker") is None:
        return "no docker CLI; run `bash scripts/fleet-images.sh` as root to install and start an engine"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "no Docker engine answers `docker info`; run `bash scripts/fleet-images.sh` as root"
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode != 0:
        return "Compose v2 (`docker compose`) is missing; run `bash scripts/fleet-images.sh` as root"
    return None


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def docker_gid() -> str:
    """The group of the engine socket, which the code server joins to reach the engine."""
    return str(os.stat("/var/run/docker.sock").st_gid)


def build_images() -> None:
    """Build (or confirm from the layer cache) the images the compose files use."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "fleet-images.sh"), "--no-install"],
                          capture_output=True, text=True, timeout=1500)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/fleet-images.sh failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@dataclass
class ComposeProject:
    """One ``docker compose -p NAME`` project over the repository's compose files."""

    name: str
    files: list[Path] = field(default_factory=lambda: [COMPOSE])
    env: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, name: str, files: list[Path] | None = None, **env: str) -> ComposeProject:
        ports = dict(zip(PORT_VARS, free_ports(len(PORT_VARS))))
        full = {**{PORT_VARS[s]: str(p) for s, p in ports.items()}, "PUBLISH_ADDR": "127.0.0.1",
                "SANDBOX_SLOTS": "1", "DOCKER_GID": docker_gid(), **env}
        return cls(f"{name}-{os.getpid()}", files or [COMPOSE], full, ports)

    def compose(self, *args: str, timeout_s: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        argv = ["docker", "compose", "-p", self.name]
        for f in self.files:
            argv += ["-f", str(f)]
        proc = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **self.env})
        if check and proc.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}\n{self.logs()}")
        return proc

    def up(self, *services: str, wait_s: int = 240) -> None:
        """``up -d --no-build --wait``: returns once every started service is healthy."""
        self.compose("up", "-d", "--no-build", "--wait", "--wait-timeout", str(wait_s), *services,
                     timeout_s=wait_s + 60)

    def down(self) -> None:
        self.compose("down", "--remove-orphans", "--timeout", "20", timeout_s=180)

    def logs(self, tail: int = 40) -> str:
        argv = ["docker", "compose", "-p", self.name] + [a for f in self.files for a in ("-f", str(f))]
        proc = subprocess.run([*argv, "logs", "--no-color", "--tail", str(tail)], capture_output=True,
                              text=True, timeout=60, env={**os.environ, **self.env})
        return proc.stdout[-6000:]

    def containers(self, service: str | None = None) -> list[dict[str, Any]]:
        """``docker inspect`` of the project's containers (running or not), optionally one service's."""
        label = f"label=com.docker.compose.project={self.name}"
        filters = ["--filter", label] + (["--filter", f"label=com.docker.compose.service={service}"] if service else [])
        ids = subprocess.run(["docker", "ps", "-aq", *filters], capture_output=True, text=True,
                             timeout=60).stdout.split()
        if not ids:
            return []
        return json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True,
                                         timeout=60, check=True).stdout)

    def url(self, service: str, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.ports[service]}"


def health(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
