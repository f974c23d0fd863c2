"""``envhub fleet``: run the services of a docker compose file as local processes, no Docker needed.

The compose file is the single source of truth: each service's ``command``, ``environment``,
``ports`` (host side) and healthcheck port are read from it, so ``docker compose up`` and
``envhub fleet up`` start the same servers. Locally, ``--host`` replaces the container's
``0.0.0.0`` (loopback by default) and ``--port`` takes the published host port. A service's
``x-envhub-local: {environment: {...}}`` (an extension key docker compose ignores) overrides its
environment for the local process only.

State lives in ``--state-dir`` (default ``.envhub/fleet``): one JSON record per started process
(pid, process start time, URL, log file), so ``down`` ends exactly the processes ``up`` started,
never an unrelated process that reused a pid.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_COMPOSE = "compose/docker-compose.yml"
DEFAULT_STATE_DIR = ".envhub/fleet"


class FleetError(RuntimeError):
    """A fleet operation failed; the message says what and how to fix it."""


@dataclass
class Service:
    """One compose service as a local process."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"

    def url(self, host: str) -> str:
        return f"ws://{host}:{self.port}"


@dataclass
class Record:
    """What ``up`` wrote down about a process it started."""

    name: str
    pid: int
    start_ticks: int
    host: str
    port: int
    log: str
    argv: list[str]


# -- compose parsing -------------------------------------------------------------------------
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose-style ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``$VAR`` substitution."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        val = env.get(name)
        if op == ":-" and not val:
            return default
        if op == "-" and val is None:
            return default
        return val or ""

    return _VAR.sub(sub, value.replace("$$", "\0")).replace("\0", "$")


def _interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate_tree(v, env) for v in node]
    return node


def _dotenv(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, _, val = line.partition("=")
                values[key.strip()] = val.strip().strip("'\"")
    return values


def load_services(compose_file: str | Path, only: list[str] | None = None) -> list[Service]:
    """Read the services of a compose file (``.env`` beside it and ``os.environ`` interpolated)."""
    path = Path(compose_file)
    if not path.is_file():
        raise FleetError(f"compose file not found: {path} (pass -f/--file)")
    env = {**_dotenv(path.parent / ".env"), **os.environ}
    # Like compose: parse first, then interpolate string values (a value never changes the YAML structure).
    doc = _interpolate_tree(yaml.safe_load(path.read_text()) or {}, env)
    services = doc.get("services") or {}
    if only:
        missing = [n for n in only if n not in services]
        if missing:
            raise FleetError(f"unknown service(s) {missing}; the compose file has: {', '.join(services)}")
    out = []
    for name, spec in services.items():
        if only and name not in only:
            continue
        out.append(_service(name, spec or {}, env))
    return out


def _service(name: str, spec: dict[str, Any], env: dict[str, str]) -> Service:
    command = spec.get("command")
    if not command:
        raise FleetError(f"service {name!r} has no `command`; fleet needs one to run it as a process")
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    ports = spec.get("ports") or []
    if not ports:
        raise FleetError(f"service {name!r} publishes no port; add `ports: [\"HOST:CONTAINER\"]`")
    host_port = str(ports[0]).split(":")[-2] if ":" in str(ports[0]) else str(ports[0])
    # A key without a value passes the variable through only when it is set (as docker compose does).
    environment = {k: env.get(str(k)) if v is None else v for k, v in _mapping(spec.get("environment")).items()}
    # What differs for a local process (ignored by docker compose), e.g. the sandbox backend.
    local = spec.get("x-envhub-local") or {}
    environment.update(_mapping(local.get("environment")))
    return Service(name=name, argv=argv, port=int(host_port),
                   env={str(k): str(v) for k, v in environment.items() if v is not None})


def _mapping(environment: Any) -> dict[str, Any]:
    """A compose ``environment`` (mapping or ``KEY=VALUE`` list) as a dict."""
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment if "=" in item)
    return dict(environment or {})


def local_argv(service: Service, host: str) -> list[str]:
    """The command to run locally: this interpreter for ``python``, loopback host, published port."""
    argv = list(service.argv)
    if argv and os.path.basename(argv[0]) in ("python", "python3"):
        argv[0] = sys.executable
    elif argv and argv[0] == "envhub":
        argv = [sys.executable, "-m", "envhub", *argv[1:]]
    for flag, value in (("--host", host), ("--port", str(service.port))):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


# -- process bookkeeping ---------------------------------------------------------------------
def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # exited; a zombie child of ours until reaped
        _reap(pid)
        return None
    return int(fields[19])


def _alive(rec: Record) -> bool:
    return _start_ticks(rec.pid) == rec.start_ticks


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _healthy(host: str, port: int, path: str = "/health", timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Fleet:
    """Start, stop and inspect the local twin of a compose fleet."""

    def __init__(self, compose_file: str | Path = DEFAULT_COMPOSE, *, state_dir: str | Path = DEFAULT_STATE_DIR,
                 host: str = "127.0.0.1"):
        self.compose_file = Path(compose_file)
        self.state_dir = Path(state_dir)
        self.host = host

    def _record_path(self, name: str) -> Path:
        return self.state_dir / f"{name}.json"

    def records(self) -> list[Record]:
        if not self.state_dir.is_dir():
            return []
        return [Record(**json.loads(p.read_text())) for p in sorted(self.state_dir.glob("*.json"))]

    def up(self, services: list[str] | None = None, *, wait_s: float = 60.0) -> list[Record]:
        """Start the services, wait until each is healthy; on any failure stop what was started and raise."""
        wanted = load_services(self.compose_file, services)
        running = {r.name for r in self.records() if _alive(r)}
        todo = [s for s in wanted if s.name not in running]
        busy = [f"{s.name} (port {s.port})" for s in todo if not _port_free(self.host, s.port)]
        if busy:
            raise FleetError(f"port already in use for: {', '.join(busy)}. Stop what holds it, or change the "
                             "port in the compose file / its .env; nothing was started.")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        started: list[Record] = []
        try:
            for svc in todo:
                started.append(self._spawn(svc))
            self._wait_healthy(started, wait_s)
        except BaseException:
            for rec in started:
                self._stop(rec)
            raise
        return [r for r in self.records() if r.name in {s.name for s in wanted}]

    def _spawn(self, svc: Service) -> Record:
        log = self.state_dir / f"{svc.name}.log"
        argv = local_argv(svc, self.host)
        env = {**os.environ, **svc.env, "PYTHONUNBUFFERED": "1"}
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        rec = Record(svc.name, proc.pid, _start_ticks(proc.pid) or 0, self.host, svc.port, str(log), argv)
        self._record_path(svc.name).write_text(json.dumps(asdict(rec)))
        return rec

    def _wait_healthy(self, records: list[Record], wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        pending = list(records)
        while pending:
            for rec in list(pending):
                if not _alive(rec):
                    tail = "".join(Path(rec.log).read_text(errors="replace").splitlines(True)[-15:])
                    raise FleetError(f"service {rec.name!r} exited during start-up; last log lines "
                                     f"({rec.log}):\n{tail}")
                if _healthy(rec.host, rec.port):
                    pending.remove(rec)
            if pending and time.monotonic() > deadline:
                names = ", ".join(r.name for r in pending)
                raise FleetError(f"health check timed out after {wait_s:.0f}s for: {names} (see logs in {self.state_dir})")
            if pending:
                time.sleep(0.2)

    def _stop(self, rec: Record, grace_s: float = 10.0) -> None:
        if _alive(rec):
            try:
                os.killpg(rec.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace_s
            while _alive(rec) and time.monotonic() < deadline:
                _reap(rec.pid)
                time.sleep(0.05)
            if _alive(rec):
                try:
                    os.killpg(rec.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _reap(rec.pid)
        self._record_path(rec.name).unlink(missing_ok=True)

    def down(self, services: list[str] | None = None) -> list[str]:
        """Stop exactly the processes ``up`` recorded; returns the names stopped."""
        stopped = []
        for rec in self.records():
            if services and rec.name not in services:
                continue
            self._stop(rec)
            stopped.append(rec.name)
        return stopped

    def status(self) -> list[dict[str, Any]]:
        """One row per recorded service: name, url, pid, running, healthy, log."""
        rows = []
        for rec in self.records():
            alive = _alive(rec)
            rows.append({"name": rec.name, "url": f"ws://{rec.host}:{rec.port}", "pid": rec.pid, "running": alive,
                         "healthy": alive and _healthy(rec.host, rec.port), "log": rec.log})
        return rows


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of fleet status rows."""
    if not rows:
        return "no services running (start them with `envhub fleet up`)"
    lines = [f"{'SERVICE':<14} {'URL':<26} {'PID':>7}  HEALTH"]
    for r in rows:
        health = "healthy" if r["healthy"] else ("running, unhealthy" if r["running"] else "stopped")
        lines.append(f"{r['name']:<14} {r['url']:<26} {r['pid']:>7}  {health}")
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------
def add_arguments(fleet: Any) -> None:
    """Arguments of ``envhub fleet up|down|status|logs`` on an argparse parser."""
    fleet.add_argument("-f", "--file", default=DEFAULT_COMPOSE, help=f"compose file (default: {DEFAULT_COMPOSE})")
    fleet.add_argument("--state-dir", default=DEFAULT_STATE_DIR,
                       help=f"where pids and logs go (default: {DEFAULT_STATE_DIR})")
    fleet.add_argument("--host", default="127.0.0.1", help="address the services bind locally (default: 127.0.0.1)")
    sub = fleet.add_subparsers(dest="fleet_cmd", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="start the services and wait until each is healthy")
    up.add_argument("services", nargs="*", help="services to start (default: all)")
    up.add_argument("--wait", type=float, default=60.0, help="seconds to wait for health (default: 60)")
    down = sub.add_parser("down", help="stop the processes `up` started")
    down.add_argument("services", nargs="*", help="services to stop (default: all)")
    status = sub.add_parser("status", help="show each service's URL and health (exit 1 if any is unhealthy)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    logs = sub.add_parser("logs", help="print a service's log")
    logs.add_argument("service", help="service name")
    logs.add_argument("-n", "--lines", type=int, default=50, help="lines from the end (default: 50)")
    logs.add_argument("--follow", action="store_true", help="keep printing new lines (Ctrl-C to stop)")


def run_cli(args: Any) -> int:
    """Execute a parsed ``envhub fleet`` command; returns the exit status."""
    fleet = Fleet(args.file, state_dir=args.state_dir, host=args.host)
    try:
        if args.fleet_cmd == "up":
            fleet.up(args.services or None, wait_s=args.wait)
            print(format_table(fleet.status()))
        elif args.fleet_cmd == "down":
            stopped = fleet.down(args.services or None)
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        elif args.fleet_cmd == "status":
            rows = fleet.status()
            print(json.dumps(rows, indent=2) if args.json else format_table(rows))
            return 0 if all(r["healthy"] for r in rows) else 1
        elif args.fleet_cmd == "logs":
            return _print_logs(fleet, args.service, args.lines, args.follow)
    except FleetError as exc:
        print(f"envhub fleet: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _print_logs(fleet: Fleet, name: str, lines: int, follow: bool) -> int:
    log = fleet.state_dir / f"{name}.log"
    if not log.is_file():
        print(f"envhub fleet: error: no log for service {name!r} in {fleet.state_dir}", file=sys.stderr)
        return 1
    with open(log, errors="replace") as fh:
        for line in fh.readlines()[-lines:]:
            sys.stdout.write(line)
        sys.stdout.flush()
        try:
            while follow:
                line = fh.readline()
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                else:
                    time.sleep(0.2)
        except KeyboardInterrupt:
            pass
    return 0
