"""Connect to the env fleet: every service's health, metadata and tools, and one episode opened on each.

    envhub fleet up && python examples/connect_fleet.py && envhub fleet down   # the local twin
    docker compose -f compose/docker-compose.yml up -d && python examples/connect_fleet.py
    python examples/connect_fleet.py --start     # bring the local twin up on free ports, then down

Service URLs come from the compose file (published host ports, ``compose/.env`` and the shell
interpolated), so this script follows the same ``MATH_PORT``-style settings as the fleet. Pass
``--token`` when the fleet runs with ``ENVHUB_TOKEN``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from envhub import OpenEnv
from envhub.errors import EnvHubError
from envhub.fleet import Fleet, FleetError, load_services

COMPOSE = Path(__file__).resolve().parents[1] / "compose" / "docker-compose.yml"
PORT_VARIABLES = {"math": "MATH_PORT", "gomoku": "GOMOKU_PORT", "geometry": "GEOMETRY_PORT", "code": "CODE_PORT"}
FIRST_ACTIONS = {  # one step per env that shows what a model's turn looks like
    "math": ("text", {"text": "I think the answer is \\boxed{0}."}),
    "code": ("run_python", {"code": "print(6 * 7)"}),
}


def visit(name: str, url: str, token: str | None) -> dict[str, Any]:
    """Health, metadata, tools and a first observation of one service."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    health = httpx.get(f"{url}/health", timeout=10).raise_for_status().json()
    meta = httpx.get(f"{url}/metadata", headers=headers, timeout=10).raise_for_status().json()
    def to_action(tool: str, args: dict[str, Any]) -> dict[str, Any]:  # "text" sends a free-text action
        return args if tool == "text" else {"tool_name": tool, "arguments": args}

    with OpenEnv(url, env_kwargs={"token": token} if token else None, action_mapper=to_action) as env:
        first = env.reset(seed=0)
        tools = [t.name for t in env.tools()]
        row = {"service": name, "url": url.replace("http://", "ws://"), "health": health.get("status"),
               "env": meta.get("name"), "tools": tools, "prompt": first.observation.text[:120]}
        if "sandbox" in meta:
            row["sandbox"] = meta["sandbox"].get("backend")
        if name in FIRST_ACTIONS:
            result = env.step(*FIRST_ACTIONS[name])
            row.update(step=result.observation.text[:120], reward=result.reward, done=result.done)
    return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="where the fleet runs (default: 127.0.0.1)")
    parser.add_argument("--token", default=os.environ.get("ENVHUB_TOKEN") or None)
    parser.add_argument("--start", action="store_true", help="start the local twin on free ports first, stop it after")
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        if args.start:
            for variable in PORT_VARIABLES.values():
                os.environ[variable] = str(_free_port())
            os.environ.setdefault("SANDBOX_SLOTS", "1")
            fleet = Fleet(COMPOSE, state_dir=stack.enter_context(tempfile.TemporaryDirectory(prefix="envhub-fleet-")))
            stack.callback(fleet.down)  # before the state dir goes: it reads the records there
            try:
                fleet.up(wait_s=120)
            except FleetError as exc:
                sys.exit(f"connect_fleet: error: the fleet did not start: {exc}")
        rows = []
        for service in load_services(COMPOSE):
            url = f"http://{args.host}:{service.port}"
            try:
                rows.append(visit(service.name, url, args.token))
            except (httpx.HTTPError, ValueError, EnvHubError) as exc:  # ValueError: a reply that is not JSON
                down = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)) and not args.start
                hint = "; is the fleet up (`envhub fleet up`, or pass --start)?" if down else ""
                detail = str(exc).split("\n")[0]  # httpx adds a line with a link to the status code's docs
                sys.exit(f"connect_fleet: error: {service.name} at {url}: {type(exc).__name__}: {detail}{hint}")
    for row in rows:
        print(json.dumps(row, ensure_ascii=False))
    return 0 if all(r["health"] == "healthy" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
