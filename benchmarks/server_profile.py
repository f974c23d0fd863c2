"""Server-side throughput of envhub on the echo work, driven by a raw ``websockets`` client.

Starts the server in a subprocess (so client and server each get their own interpreter),
then runs N concurrent sessions doing reset + steps for a fixed time and prints steps/s.
``--ceiling`` and ``--openenv`` measure the same baselines as ``ws_throughput.py`` (a bare
``websockets`` echo server, an openenv-core echo server) under the same raw client.
Server CPU microseconds per step (from /proc) are printed too: on a shared machine they are
steadier than steps/s.

    python benchmarks/server_profile.py --sessions 1 32 --seconds 5 --repeat 3
    python benchmarks/server_profile.py --openenv       # the same work on an openenv-core server
    python benchmarks/server_profile.py --ws websockets --no-inline   # another uvicorn ws, thread pool
    python benchmarks/server_profile.py --ceiling
    python benchmarks/server_profile.py --ext request_id,cancel   # what a negotiated extension costs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import websockets

STEP = json.dumps({"type": "step", "data": {"message": "hello world"}})
RESET = json.dumps({"type": "reset"})

# The openenv-core echo server and the bare-websockets ceiling are ws_throughput's own (one
# definition of the baseline for both scripts); only the envhub server here has profiling knobs.
from ws_throughput import START_TIMEOUT_S, cpu_seconds, start_server  # noqa: E402  (sibling script)

from trainer import local_server, while_parent  # noqa: E402
from trainer.local_server import free_port  # noqa: E402


def serve_envhub(port: int, ws_impl: str, inline: bool) -> None:
    """The envhub echo server this script profiles (run in its own process: ``--serve PORT``)."""
    import uvicorn

    from envhub.server.app import create_app
    from envhub.server.run import uvicorn_config
    from envhub.settings import Settings
    from envhub.testing import EchoEnv

    env_cls = EchoEnv if inline else type("ThreadedEchoEnv", (EchoEnv,), {"run_inline": False})
    settings = Settings(port=port, max_sessions=1024, log_level="warning")
    uvicorn.Server(uvicorn_config(create_app(env_cls, settings=settings), settings, ws=ws_impl)).run()


async def session(url: str, deadline: float, counts: list[int], idx: int, ext: str | None) -> None:
    step = STEP
    if ext:
        url += f"?ext={ext}"
        if "request_id" in ext.split(","):
            step = json.dumps({"type": "step", "data": {"message": "hello world"}, "id": 1})
    async with websockets.connect(url, compression=None, max_size=None) as ws:
        if ext:
            await ws.recv()  # hello
        await ws.send(RESET)
        await ws.recv()
        n = 0
        while time.perf_counter() < deadline:
            await ws.send(step)
            await ws.recv()
            n += 1
        counts[idx] = n


async def drive(url: str, sessions: int, seconds: float, ext: str | None = None) -> float:
    counts = [0] * sessions
    start = time.perf_counter()
    await asyncio.gather(*(session(url, start + seconds, counts, i, ext) for i in range(sessions)))
    return sum(counts) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--repeat", type=int, default=1, help="runs per scenario; the median is reported")
    parser.add_argument("--ext", default=None, help="extensions the client opts into, e.g. request_id,cancel")
    parser.add_argument("--ws", default="envhub.server.transport:LeanWebSocketProtocol", help="uvicorn ws implementation")
    parser.add_argument("--no-inline", action="store_true", help="run EchoEnv.step in the thread pool")
    parser.add_argument("--ceiling", action="store_true", help="bare websockets echo server instead of envhub")
    parser.add_argument("--openenv", action="store_true", help="an openenv-core echo server instead of envhub")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: checks that the script still runs (CI does this)")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve_envhub(args.serve, args.ws, not args.no_inline)
        return
    if args.smoke:
        args.sessions, args.seconds, args.repeat = [1, 4], 0.3, 1
    if args.ceiling or args.openenv:
        server, base = start_server("ceiling" if args.ceiling else "openenv")
    else:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        # through while_parent: the server ends with this run, however it ends
        argv = while_parent.argv(os.path.abspath(__file__), "--serve", str(port), "--ws", args.ws,
                                 *(["--no-inline"] if args.no_inline else []))
        server = local_server.start(argv, base, Path(tempfile.gettempdir()) / "server_profile_envhub.log",
                                    timeout_s=START_TIMEOUT_S, what="the envhub echo server")
    url = base.replace("http://", "ws://", 1) + "/ws"
    try:
        label = "bare websockets echo" if args.ceiling else "openenv-core echo" if args.openenv else \
            f"envhub ws={args.ws} {'threaded' if args.no_inline else 'inline'} ext={args.ext or '-'}"
        for n in args.sessions:
            runs = []
            for _ in range(args.repeat):
                cpu0 = cpu_seconds(server.pid)
                rate = asyncio.run(drive(url, n, args.seconds, args.ext))
                runs.append((rate, (cpu_seconds(server.pid) - cpu0) * 1e6 / max(1.0, rate * args.seconds)))
            rate, cpu_us = sorted(runs)[len(runs) // 2]  # the median run
            print(f"{label}: {n:4d} session(s): {rate:8.0f} steps/s, server CPU {cpu_us:5.0f} us/step", flush=True)
    finally:
        local_server.stop(server)


if __name__ == "__main__":
    main()
