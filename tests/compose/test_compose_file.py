"""compose/docker-compose.yml, validated without a Docker engine: structure, commands, ports, health, limits, hardening.

The image build and ``docker compose config`` run only where an engine answers (``docker`` marker).
"""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from envhub.fleet import load_services

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
ENV_EXAMPLE = ROOT / "compose" / ".env.example"
DOCKERFILE = ROOT / "compose" / "Dockerfile"

EXPECTED = {  # service -> (module, container port, host-port variable)
    "math": ("env_servers.math_env", 8001, "MATH_PORT"),
    "gomoku": ("env_servers.gomoku_env", 8002, "GOMOKU_PORT"),
    "geometry": ("env_servers.geometry_env", 8003, "GEOMETRY_PORT"),
    "code": ("env_servers.code_env", 8004, "CODE_PORT"),
}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _env_example() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _argv(spec: dict[str, Any]) -> list[str]:
    command = spec["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_one_service_per_env_server_with_its_module_and_port() -> None:
    services = _services()
    assert set(services) == set(EXPECTED)
    for name, (module, port, variable) in EXPECTED.items():
        argv = _argv(services[name])
        assert argv[:3] == ["python", "-m", module], argv
        assert argv[argv.index("--host") + 1] == "0.0.0.0"
        assert argv[argv.index("--port") + 1] == str(port)
        published = services[name]["ports"]
        assert len(published) == 1 and published[0].endswith(f"${{{variable}:-{port}}}:{port}"), published


def test_host_and_container_ports_are_unique() -> None:
    services = load_services(COMPOSE)
    assert len({s.port for s in services}) == len(services) == 4
    containers = [_argv(spec)[_argv(spec).index("--port") + 1] for spec in _services().values()]
    assert len(set(containers)) == 4


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_service_has_health_restart_limits_and_settings(name: str) -> None:
    spec = _services()[name]
    port = EXPECTED[name][1]
    test = " ".join(spec["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/health" in test and spec["healthcheck"]["retries"] >= 1
    assert spec["restart"] in ("unless-stopped", "always", "on-failure")
    limits = spec["deploy"]["resources"]["limits"]
    assert limits["memory"] and float(limits["cpus"]) > 0
    assert int(spec["pids_limit"]) > 0
    env = spec["environment"]
    for key in ("ENVHUB_MAX_SESSIONS", "ENVHUB_TOKEN", "ENVHUB_IDLE_TIMEOUT_S", "ENVHUB_STEP_TIMEOUT_S"):
        assert key in env, f"{name} lacks {key}"
    assert spec["build"] == {"context": "..", "dockerfile": "compose/Dockerfile"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_server_runs_non_root_read_only_without_capabilities(name: str) -> None:
    spec = _services()[name]
    assert spec["read_only"] is True
    assert spec["cap_drop"] == ["ALL"] and not spec.get("cap_add")
    assert "no-new-privileges:true" in spec["security_opt"]
    assert str(spec["user"]).split(":")[0] not in ("0", "root")
    assert not spec.get("privileged") and spec.get("network_mode") != "host"
    assert spec["init"] is True


def test_every_envhub_variable_is_a_real_setting_with_a_valid_value() -> None:
    # The servers ignore unknown ENVHUB_* variables, so a typo here would silently do nothing.
    import inspect
    from dataclasses import fields

    from env_servers.sandbox import SandboxConfig, probe
    from envhub.settings import Settings

    known = {f"ENVHUB_{f.name.upper()}" for f in fields(Settings)}
    sandbox = set(re.findall(r'"(ENVHUB_SANDBOX_[A-Z_]+)"', inspect.getsource(probe)))  # what from_env reads
    assert "ENVHUB_SANDBOX_BACKEND" in sandbox
    for service in load_services(COMPOSE):
        names = {k for k in service.env if k.startswith("ENVHUB_")}
        assert names <= known | sandbox, f"{service.name}: unknown {sorted(names - known - sandbox)}"
        Settings.from_env(service.env)  # parses: right types, valid ranges
        config = SandboxConfig.from_env(service.env)
        assert config.backend in ("auto", "docker")


def test_code_sandbox_runs_model_code_in_hardened_per_slot_containers() -> None:
    spec = _services()["code"]
    env = spec["environment"]
    assert env["ENVHUB_SANDBOX_BACKEND"] == "docker"
    assert env["ENVHUB_SANDBOX_DOCKER_IMAGE"] == spec["image"]
    # The engine socket is its only mount (no host paths, no code volumes).
    assert [v.rsplit(":", 1)[1] for v in spec["volumes"]] == ["/var/run/docker.sock"]
    # Locally, `envhub fleet` probes the host's own sandbox instead.
    code = next(s for s in load_services(COMPOSE) if s.name == "code")
    assert code.env["ENVHUB_SANDBOX_BACKEND"] == "auto"


class _FakeContainers:
    """Records the arguments of ``containers.run`` and hands back a container speaking the zygote hello."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}
        self.peers: list[socket.socket] = []

    def run(self, image: str, command: list[str], **kwargs: Any) -> Any:
        self.kwargs = {"image": image, "command": command, **kwargs}
        ours, theirs = socket.socketpair()
        self.peers.append(theirs)
        payload = b'{"ready": true}'
        framed = struct.pack(">I", len(payload)) + payload
        theirs.sendall(bytes([1, 0, 0, 0]) + struct.pack(">I", len(framed)) + framed)  # a stdout frame

        class Container:
            def attach_socket(self, params: dict) -> socket.socket:
                return ours

            def remove(self, force: bool = False) -> None:
                ours.close()

        return Container()


def test_docker_backend_starts_each_slot_container_locked_down(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    docker_types = types.ModuleType("docker.types")
    docker_types.Ulimit = lambda **kw: kw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "docker", types.ModuleType("docker"))
    monkeypatch.setitem(sys.modules, "docker.types", docker_types)
    from env_servers.sandbox.docker_backend import DockerBackend

    containers = _FakeContainers()
    backend = DockerBackend(1, image="envhub:local", client=types.SimpleNamespace(containers=containers))
    container, _ = backend._start(backend._slots[0])
    kw = containers.kwargs
    assert kw["image"] == "envhub:local"
    assert kw["network_mode"] == "none" and kw["read_only"] is True
    assert kw["cap_drop"] == ["ALL"] and "no-new-privileges:true" in kw["security_opt"]
    assert kw["user"] == "65534:65534" and kw["ipc_mode"] == "private"
    assert kw["pids_limit"] > 0 and kw["mem_limit"] == kw["memswap_limit"]
    assert not kw.get("privileged") and not kw.get("volumes")
    assert set(kw["tmpfs"]) == {"/sandbox", "/tmp"}
    container.remove(force=True)
    backend.close()
    for peer in containers.peers:
        peer.close()


def test_env_example_documents_every_variable_with_the_compose_default() -> None:
    text = COMPOSE.read_text()
    used = {m.group(1): m.group(2) for m in _VAR.finditer(text)}
    documented = _env_example()
    assert set(used) == set(documented), (f"missing from .env.example: {sorted(set(used) - set(documented))}; "
                                          f"unused: {sorted(set(documented) - set(used))}")
    for name, default in used.items():
        assert documented[name] == (default or ""), \
            f"{name}: .env.example says {documented[name]!r}, compose {default!r}"
    for name in documented:  # each variable is explained by a comment above it
        assert re.search(rf"#[^\n]*\n(#[^\n]*\n|[A-Z_]+=[^\n]*\n)*{name}=", ENV_EXAMPLE.read_text()), name


def test_dockerfile_copies_exist_and_survive_the_ignore_file() -> None:
    copies = [line.split()[1:-1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("COPY ")]
    sources = [s for srcs in copies for s in srcs if not s.startswith("--")]
    assert {"pyproject.toml", "envhub", "env_servers"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"COPY source {source} does not exist"
    ignore = (ROOT / "compose" / "Dockerfile.dockerignore").read_text()
    for source in sources:  # every COPY source is re-included after the leading `**`
        assert f"!{source}" in ignore, f"{source} is excluded from the build context"


@pytest.mark.slow
def test_service_commands_parse_with_their_own_cli() -> None:
    # `--help` after the real flags: argparse rejects a bad value before it prints the help.
    procs = {name: subprocess.Popen([sys.executable, *_argv(spec)[1:], "--help"], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, spec in _services().items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name}: {err[-2000:]}"
        assert "--port" in out and "--host" in out


def _docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0


@pytest.mark.docker
@pytest.mark.slow
def test_docker_compose_accepts_the_file_and_builds_the_image() -> None:
    if not _docker_engine():
        pytest.skip("no Docker engine answers `docker info`")
    config = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert config.returncode == 0, config.stderr
    build = subprocess.run(["docker", "build", "-f", str(DOCKERFILE), "-t", "envhub:test", str(ROOT)],
                           capture_output=True, text=True, timeout=1200)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run(["docker", "run", "--rm", "--read-only", "envhub:test", "python", "-m",
                          "env_servers.code_env", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--backend" in run.stdout, run.stderr


def test_docs_and_examples_never_serve_an_env_on_another_services_fleet_port() -> None:
    """``python -m env_servers.X_env ... --port P`` in a doc or example: P is X's fleet port or no fleet port."""
    module_on = {port: module for module, port, _ in EXPECTED.values()}
    command = re.compile(r"python -m (env_servers\.\w+)([^\n`]*?)--port (\d+)")
    texts = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("env_servers/*/README.md"),
             *ROOT.glob("examples/**/*.py"), *ROOT.glob("examples/**/*.toml")]
    clashes = []
    for path in texts:
        for m in command.finditer(path.read_text()):
            module, flags, port = m.group(1), m.group(2), int(m.group(3))
            owner = module_on.get(port)
            if owner is not None and (owner != module or "--two-agent" in flags):
                clashes.append(f"{path.relative_to(ROOT)}: {m.group(0)!r} (the fleet gives {port} to {owner})")
    assert not clashes, "\n".join(clashes)
