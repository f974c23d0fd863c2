"""Env steps/s of a containerized env service: direct, and behind the HAProxy of compose/replicas.yml with 1 and 2 replicas.

    bash scripts/fleet-images.sh                       # engine, Compose v2 and the images, once
    .venv/bin/python benchmarks/replicas.py            # math, 32 sessions, 20 s per setup
    .venv/bin/python benchmarks/replicas.py --service gomoku --sessions 64 --seconds 30
    .venv/bin/python benchmarks/replicas.py --smoke    # seconds; without Docker: the same loop on a local server

Each setup is its own compose project on free loopback ports: ``direct`` is the plain compose
file (the service publishes its port, no proxy); ``proxy xN`` adds compose/replicas.yml with N
replicas. ``--sessions`` clients run episodes back to back (reset, then steps until done) from
this process; a step is one reset or step request. The ratio column compares each setup with
``direct``. The client shares the machine's cores with the servers: on a 2-core machine the
servers and the client compete, so read the ratio next to the CPU count printed above it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envhub.client import EnvClient  # noqa: E402

COMPOSE = ROOT / "compose" / "docker-compose.yml"
REPLICAS = ROOT / "compose" / "replicas.yml"
PORTS = {"math": ("MATH_PORT", "MATH_REPLICAS"), "gomoku": ("GOMOKU_PORT", "GOMOKU_REPLICAS"),
         "geometry": ("GEOMETRY_PORT", "GEOMETRY_REPLICAS")}
ACTIONS = {"math": {"text": "\\boxed{42}"}, "geometry": {"text": "\\boxed{42}"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Setup:
    """One compose project: ``replicas`` None = direct, else that many replicas behind the proxy."""

    def __init__(self, service: str, replicas: int | None):
        self.service, self.replicas, self.port = service, replicas, free_port()
        port_var, replicas_var = PORTS[service]
        self.name = f"envhub-bench-{os.getpid()}-{replicas or 0}"
        self.files = [COMPOSE] if replicas is None else [COMPOSE, REPLICAS]
        self.env = {**os.environ, port_var: str(self.port), replicas_var: str(replicas or 1)}
        self.label = "direct" if replicas is None else f"proxy x{replicas}"

    def compose(self, *args: str) -> None:
        argv = ["docker", "compose", "-p", self.name] + [a for f in self.files for a in ("-f", str(f))]
        proc = subprocess.run([*argv, *args], env=self.env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)}: {proc.stderr[-2000:]}")

    def __enter__(self) -> Setup:
        services = [self.service] + ([f"{self.service}-proxy"] if self.replicas else [])
        self.compose("up", "-d", "--no-build", "--wait", "--wait-timeout", "240", *services)
        return self

    def __exit__(self, *exc: object) -> None:
        self.compose("down", "--remove-orphans", "--timeout", "10")


async def drive(url: str, service: str, sessions: int, seconds: float) -> tuple[int, int]:
    """(steps, errors) of ``sessions`` clients running episodes back to back for ``seconds``."""
    steps = errors = 0
    deadline = time.monotonic() + seconds

    async def client(i: int) -> None:
        nonlocal steps, errors
        async with EnvClient(url) as env:
            while time.monotonic() < deadline:
                try:
                    result = await env.reset(seed=i)
                    steps += 1
                    while not result.done and time.monotonic() < deadline:
                        result = await env.step(await action(env, service))
                        steps += 1
                except Exception:  # counted, not fatal: the benchmark measures what gets through
                    errors += 1

    await asyncio.gather(*(client(i) for i in range(sessions)))
    return steps, errors


async def action(env: EnvClient, service: str) -> dict:
    if service in ACTIONS:
        return ACTIONS[service]
    state = await env.state()  # gomoku: the first empty point of the board
    board = state.get("board") or []
    for r, row in enumerate(board):
        for c, cell in enumerate(row):
            if cell in (0, ".", None, ""):
                return {"tool_name": "place_stone", "arguments": {"row": r, "col": c}}
    return {"text": "pass"}


def docker_ready() -> bool:
    """An engine, Compose v2 and the images (``scripts/fleet-images.sh --check``)."""
    check = subprocess.run(["bash", str(ROOT / "scripts" / "fleet-images.sh"), "--check"], capture_output=True)
    return check.returncode == 0


def measure_local(service: str, sessions: int, seconds: float) -> tuple[float, int]:
    """The client loop against the env served in this process (no containers): a smoke check."""
    from envhub.server import ServerThread, create_app
    from envhub.server.run import load_target

    env_cls = load_target(f"env_servers.{service}_env.env:{service.capitalize()}Env")
    with ServerThread(create_app(env_cls)) as srv:
        asyncio.run(drive(srv.ws_url, service, sessions, min(3.0, seconds)))  # warm-up: lazy imports
        t0 = time.monotonic()
        steps, errors = asyncio.run(drive(srv.ws_url, service, sessions, seconds))
        return steps / (time.monotonic() - t0), errors


def measure(setup: Setup, sessions: int, seconds: float) -> tuple[float, int]:
    url = f"ws://127.0.0.1:{setup.port}"
    asyncio.run(drive(url, setup.service, sessions, min(3.0, seconds)))  # warm-up: imports, first sessions
    t0 = time.monotonic()
    steps, errors = asyncio.run(drive(url, setup.service, sessions, seconds))
    return steps / (time.monotonic() - t0), errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--service", default="math", choices=sorted(PORTS))
    parser.add_argument("--sessions", type=int, default=32, help="concurrent client sessions (default 32)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per setup (default 20)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: checks that the script still runs (CI does this)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sessions, args.seconds = 2, 1.0
        if not docker_ready():
            rate, errors = measure_local(args.service, args.sessions, args.seconds)
            print("no Docker engine or images here (bash scripts/fleet-images.sh): measured the client loop "
                  f"against a local {args.service} server instead: {rate:.0f} steps/s, {errors} errors")
            return
    rows = []
    for replicas in (None, 1, 2):
        with Setup(args.service, replicas) as setup:
            rate, errors = measure(setup, args.sessions, args.seconds)
        rows.append((setup.label, rate, errors))
        print(f"  {setup.label}: {rate:.0f} steps/s", file=sys.stderr)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"{args.service}, {args.sessions} sessions, {args.seconds:g} s each; {os.cpu_count()} cores, "
          f"load average {load} at the end")
    print(f"{'setup':<10} {'steps/s':>8} {'ratio':>6} {'errors':>7}")
    for label, rate, errors in rows:
        print(f"{label:<10} {rate:>8.0f} {rate / rows[0][1]:>6.2f} {errors:>7}")


if __name__ == "__main__":
    main()
