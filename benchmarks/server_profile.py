"""Server-side throughput of envhub on the echo work, driven by a raw ``websockets`` client.

Starts the server in a subprocess (so client and server each get their own interpreter),
then runs N concurrent sessions doing reset + steps for a fixed time and prints steps/s.
``--ceiling`` measures a bare ``websockets`` echo server instead: the transport ceiling.
Server CPU microseconds per step (from /proc) are printed too: on a shared machine they are
steadier than steps/s.

    python benchmarks/server_profile.py --sessions 1 32 --seconds 5 --repeat 3
    python benchmarks/server_profile.py --openenv       # the same work on an openenv-core server
    python benchmarks/server_profile.py --ws websockets --no-inline   # another uvicorn ws, thread pool
    python benchmarks/server_profile.py --ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import websockets

STEP = json.dumps({"type": "step", "data": {"message": "hello world"}})
RESET = json.dumps({"type": "reset"})

SERVER_CODE = """
import sys, uvicorn
from envhub.server.app import create_app
from envhub.server.run import uvicorn_config
from envhub.settings import Settings
from envhub.testing import EchoEnv
port, ws_impl, inline = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
env_cls = EchoEnv if inline else type("ThreadedEchoEnv", (EchoEnv,), {"run_inline": False})
settings = Settings(port=port, max_sessions=1024, log_level="warning")
uvicorn.Server(uvicorn_config(create_app(env_cls, settings=settings), settings, ws=ws_impl)).run()
"""

# The same echo work on an openenv-core server, for a same-machine, same-minute comparison.
OPENENV_CODE = """
import sys, uuid, uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
class EchoAction(Action):
    message: str
class EchoObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0
class Echo(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
    def reset(self, seed=None, episode_id=None, **kw):
        return EchoObservation(echoed_message="ready", reward=0.0, done=False)
    def step(self, action, timeout_s=None, **kw):
        self._state.step_count += 1
        m = action.message
        return EchoObservation(echoed_message=m, message_length=len(m), reward=len(m) * 0.1, done=False)
    @property
    def state(self):
        return self._state
app = create_app(Echo, EchoAction, EchoObservation, max_concurrent_envs=1024)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""

CEILING_CODE = """
import asyncio, sys, json, websockets
REPLY = json.dumps({"type": "observation", "data": {"observation": {"echoed_message": "hello world",
    "message_length": 11}, "reward": 1.1, "done": False}})
async def handler(ws):
    async for _ in ws:
        await ws.send(REPLY)
async def main():
    async with websockets.serve(handler, "127.0.0.1", int(sys.argv[1]), compression=None):
        await asyncio.Future()
asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def session(url: str, deadline: float, counts: list[int], idx: int) -> None:
    async with websockets.connect(url, compression=None, max_size=None) as ws:
        await ws.send(RESET)
        await ws.recv()
        n = 0
        while time.perf_counter() < deadline:
            await ws.send(STEP)
            await ws.recv()
            n += 1
        counts[idx] = n


async def drive(url: str, sessions: int, seconds: float) -> float:
    counts = [0] * sessions
    start = time.perf_counter()
    await asyncio.gather(*(session(url, start + seconds, counts, i) for i in range(sessions)))
    return sum(counts) / (time.perf_counter() - start)


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process: a load-independent cost measure on a shared machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_up(port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--repeat", type=int, default=1, help="runs per scenario; the median is reported")
    parser.add_argument("--ws", default="envhub.server.transport:LeanWebSocketProtocol", help="uvicorn ws implementation")
    parser.add_argument("--no-inline", action="store_true", help="run EchoEnv.step in the thread pool")
    parser.add_argument("--ceiling", action="store_true", help="bare websockets echo server instead of envhub")
    parser.add_argument("--openenv", action="store_true", help="an openenv-core echo server instead of envhub")
    args = parser.parse_args()
    port = free_port()
    code = CEILING_CODE if args.ceiling else OPENENV_CODE if args.openenv else SERVER_CODE
    argv = [sys.executable, "-c", code, str(port), args.ws, "0" if args.no_inline else "1"]
    server = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_up(port)
        label = "bare websockets echo" if args.ceiling else "openenv-core echo" if args.openenv else \
            f"envhub ws={args.ws} {'threaded' if args.no_inline else 'inline'}"
        for n in args.sessions:
            runs = []
            for _ in range(args.repeat):
                cpu0 = cpu_seconds(server.pid)
                rate = asyncio.run(drive(f"ws://127.0.0.1:{port}/ws", n, args.seconds))
                runs.append((rate, (cpu_seconds(server.pid) - cpu0) * 1e6 / max(1.0, rate * args.seconds)))
            rate, cpu_us = sorted(runs)[len(runs) // 2]  # the median run
            print(f"{label}: {n:4d} session(s): {rate:8.0f} steps/s, server CPU {cpu_us:5.0f} us/step", flush=True)
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
