"""The real compose file through ``envhub fleet``: all four env servers come up healthy as local processes."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest

from envhub.fleet import Fleet, load_services

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
PORT_VARS = {"math": "MATH_PORT", "gomoku": "GOMOKU_PORT", "geometry": "GEOMETRY_PORT", "code": "CODE_PORT"}


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_values_are_interpolated_after_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compose = tmp_path / "docker-compose.yml"
    compose.write_text('services:\n  a:\n    command: python -m x --port 1\n    ports: ["${P:-9}:1"]\n'
                       '    environment:\n      TOKEN: ${TOKEN:-}\n      FLAG: ${FLAG:-false}\n'
                       '    x-envhub-local: {environment: {FLAG: "local"}}\n')
    monkeypatch.setenv("TOKEN", "a: b # c")  # would change the YAML if substituted before parsing
    monkeypatch.setenv("P", "7001")
    (svc,) = load_services(compose)
    assert svc.port == 7001
    assert svc.env == {"TOKEN": "a: b # c", "FLAG": "local"}


def test_a_key_without_value_passes_the_variable_through_only_when_set(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    compose = tmp_path / "docker-compose.yml"
    compose.write_text('services:\n  a:\n    command: python -m x\n    ports: ["9:1"]\n'
                       '    environment:\n      ENVHUB_TOKEN:\n')
    monkeypatch.delenv("ENVHUB_TOKEN", raising=False)
    assert load_services(compose)[0].env == {}  # unset: no token, so no auth, and never an empty one
    (tmp_path / ".env").write_text("ENVHUB_TOKEN=from-dotenv\n")
    assert load_services(compose)[0].env == {"ENVHUB_TOKEN": "from-dotenv"}


@pytest.mark.live
@pytest.mark.slow
def test_fleet_up_brings_every_service_up_healthy_then_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ports = dict(zip(PORT_VARS, _free_ports(len(PORT_VARS))))
    for name, variable in PORT_VARS.items():
        monkeypatch.setenv(variable, str(ports[name]))
    monkeypatch.setenv("SANDBOX_SLOTS", "1")  # one warm sandbox worker is enough here
    fleet = Fleet(COMPOSE, state_dir=tmp_path / "fleet")
    try:
        records = fleet.up(wait_s=120)
        assert sorted(r.name for r in records) == sorted(PORT_VARS)
        rows = {row["name"]: row for row in fleet.status()}
        for name, port in ports.items():
            assert rows[name]["healthy"], (name, Path(rows[name]["log"]).read_text()[-2000:])
            assert rows[name]["url"] == f"ws://127.0.0.1:{port}"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metadata", timeout=10) as resp:
                meta = json.load(resp)
            assert meta["name"], meta
    finally:
        stopped = fleet.down()
    assert sorted(stopped) == sorted(PORT_VARS)
    assert fleet.status() == []
