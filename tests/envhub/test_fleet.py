"""`envhub fleet`: the local twin of a compose fleet starts, reports, and stops exactly what it started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envhub.fleet import Fleet, FleetError, interpolate, load_services, local_argv

pytestmark = pytest.mark.live


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compose(tmp_path: Path, services: dict[str, str]) -> Path:
    lines = ["services:"]
    for name, command in services.items():
        port = _free_port()
        lines += [f"  {name}:", f"    command: {json.dumps(command)}", f"    ports: [\"{port}:{port}\"]",
                  "    environment:", "      ENVHUB_MAX_SESSIONS: \"8\""]
    path = tmp_path / "docker-compose.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


ECHO = "envhub serve envhub.testing:EchoEnv --host 0.0.0.0 --port 1"


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${MISSING-d} $SET $$HOME", env) == "x d  d x $HOME"


def test_local_argv_uses_this_interpreter_loopback_and_published_port(tmp_path: Path) -> None:
    svc = load_services(_compose(tmp_path, {"echo": "python -m env_servers.math_env --host 0.0.0.0 --port 8001"}))[0]
    argv = local_argv(svc, "127.0.0.1")
    assert argv[0] == sys.executable
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == str(svc.port)


def test_up_status_down(tmp_path: Path) -> None:
    fleet = Fleet(_compose(tmp_path, {"a": ECHO, "b": ECHO}), state_dir=tmp_path / "state")
    try:
        records = fleet.up(wait_s=60)
        assert sorted(r.name for r in records) == ["a", "b"]
        rows = fleet.status()
        assert all(r["healthy"] for r in rows), rows
        pids = [r["pid"] for r in rows]
    finally:
        stopped = fleet.down()
    assert sorted(stopped) == ["a", "b"]
    time.sleep(0.2)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert fleet.status() == []


def test_port_in_use_is_a_clear_error_and_starts_nothing(tmp_path: Path) -> None:
    compose = _compose(tmp_path, {"a": ECHO, "b": ECHO})
    taken = load_services(compose)[1].port
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", taken))
        blocker.listen()
        fleet = Fleet(compose, state_dir=tmp_path / "state")
        with pytest.raises(FleetError, match=f"port already in use for: b \\(port {taken}\\)"):
            fleet.up(wait_s=30)
    assert fleet.records() == []


def test_a_failing_service_leaves_nothing_running(tmp_path: Path) -> None:
    compose = _compose(tmp_path, {"good": ECHO, "bad": "python -c 'import sys; sys.exit(3)' --host 0.0.0.0 --port 1"})
    fleet = Fleet(compose, state_dir=tmp_path / "state")
    with pytest.raises(FleetError, match="'bad' exited during start-up"):
        fleet.up(wait_s=60)
    assert fleet.records() == []


def test_cli_up_and_down(tmp_path: Path) -> None:
    compose = _compose(tmp_path, {"echo": ECHO})
    base = [sys.executable, "-m", "envhub", "fleet", "-f", str(compose), "--state-dir", str(tmp_path / "s")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.run([*base, "up"], capture_output=True, text=True, timeout=90, env=env)
    try:
        assert up.returncode == 0, up.stderr
        assert "echo" in up.stdout and "healthy" in up.stdout
        status = subprocess.run([*base, "status", "--json"], capture_output=True, text=True, timeout=30)
        assert json.loads(status.stdout)[0]["healthy"] is True
    finally:
        down = subprocess.run([*base, "down"], capture_output=True, text=True, timeout=60)
    assert "stopped: echo" in down.stdout
