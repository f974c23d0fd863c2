"""compose/docker-compose.yml, validated without a Docker engine: structure, commands, ports, health, limits, hardening.

The image build and ``docker compose config`` run only where an engine answers (``docker`` marker).
"""

from __future__ import annotations

import re
import shlex
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
REPLICAS = ROOT / "compose" / "replicas.yml"
ENV_EXAMPLE = ROOT / "compose" / ".env.example"
DOCKERFILE = ROOT / "compose" / "Dockerfile"

EXPECTED = {  # service -> (module, container port, host-port variable)
    "math": ("env_servers.math_env", 8001, "MATH_PORT"),
    "gomoku": ("env_servers.gomoku_env", 8002, "GOMOKU_PORT"),
    "geometry": ("env_servers.geometry_env", 8003, "GEOMETRY_PORT"),
    "code": ("env_servers.code_env", 8004, "CODE_PORT"),
}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's ``!reset`` tag (an override that empties a list), read as ``("!reset", value)``."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: ("!reset", loader.construct_sequence(node)))


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
    # only under deploy: Compose v2 refuses a `pids_limit` that differs from `deploy...pids`
    assert int(limits["pids"]) > 0 and "pids_limit" not in spec
    env = spec["environment"]
    for key in ("ENVHUB_MAX_SESSIONS", "ENVHUB_TOKEN", "ENVHUB_IDLE_TIMEOUT_S", "ENVHUB_STEP_TIMEOUT_S"):
        assert key in env, f"{name} lacks {key}"
    assert spec["build"] == {"context": "..", "dockerfile": "compose/Dockerfile",
                             "args": {"BASE_IMAGE": "${ENVHUB_BASE_IMAGE:-python:3.11-slim}"}}


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


class _FakeEngine:
    """Records the container's create arguments and hands back a container speaking the zygote hello."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}
        self.peers: list[socket.socket] = []
        self.api = self
        self.containers = self

    def create_host_config(self, **kwargs: Any) -> dict[str, Any]:
        return kwargs

    def create_container_config(self, image: str, command: list[str], **kwargs: Any) -> dict[str, Any]:
        return {"image": image, "command": command, **kwargs}

    def create_container_from_config(self, config: dict[str, Any]) -> dict[str, str]:
        self.kwargs = {**config, **config.pop("host_config")}
        return {"Id": "c0"}

    def get(self, container_id: str) -> Any:
        ours, theirs = socket.socketpair()
        self.peers.append(theirs)
        payload = b'{"ready": true}'
        framed = struct.pack(">I", len(payload)) + payload
        theirs.sendall(bytes([1, 0, 0, 0]) + struct.pack(">I", len(framed)) + framed)  # a stdout frame

        class Container:
            def start(self) -> None:
                pass

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

    engine = _FakeEngine()
    backend = DockerBackend(1, image="envhub:local", client=engine)
    container, _ = backend._start(backend._slots[0])
    kw = engine.kwargs
    assert kw["image"] == "envhub:local"
    assert kw["network_mode"] == "none" and kw["read_only"] is True
    assert kw["cap_drop"] == ["ALL"] and "no-new-privileges:true" in kw["security_opt"]
    assert kw["user"] == "65534:65534" and kw["ipc_mode"] == "private"
    assert kw["pids_limit"] > 0 and kw["mem_limit"] == kw["memswap_limit"]
    assert not kw.get("privileged") and not kw.get("volumes") and not kw.get("binds")
    assert set(kw["tmpfs"]) == {"/sandbox", "/tmp"}
    # a worker never outlives its server: stdin closes with the server's attach socket, then it is removed
    assert kw["StdinOnce"] is True and kw["auto_remove"] is True
    container.remove(force=True)
    backend.close()
    for peer in engine.peers:
        peer.close()


def test_env_example_documents_every_variable_with_the_compose_default() -> None:
    text = COMPOSE.read_text() + REPLICAS.read_text()
    used: dict[str, str] = {}
    for m in _VAR.finditer(text):
        assert used.setdefault(m.group(1), m.group(2)) == m.group(2), f"{m.group(1)}: two different defaults"
    documented = _env_example()
    assert set(used) == set(documented), (f"missing from .env.example: {sorted(set(used) - set(documented))}; "
                                          f"unused: {sorted(set(documented) - set(used))}")
    for name, default in used.items():
        assert documented[name] == (default or ""), \
            f"{name}: .env.example says {documented[name]!r}, compose {default!r}"
    for name in documented:  # each variable is explained by a comment above it
        assert re.search(rf"#[^\n]*\n(#[^\n]*\n|[A-Z_]+=[^\n]*\n)*{name}=", ENV_EXAMPLE.read_text()), name


def test_replicas_put_each_scaled_service_behind_a_hardened_proxy_on_its_port() -> None:
    base, over = _services(), yaml.load(REPLICAS.read_text(), Loader=_ComposeLoader)["services"]
    for name in ("math", "gomoku", "geometry"):
        assert over[name]["deploy"]["replicas"].startswith("${"), name
        assert over[name]["ports"] == ("!reset", [])  # the replicas publish nothing; the proxy does
        proxy = over[f"{name}-proxy"]
        assert proxy["ports"] == base[name]["ports"]  # clients keep their URL
        upstream = proxy["environment"]["PROXY_UPSTREAM"]
        assert upstream == f"{name}:{EXPECTED[name][1]}" and proxy["environment"]["PROXY_PORT"] == str(EXPECTED[name][1])
        assert proxy["read_only"] is True and proxy["cap_drop"] == ["ALL"] and proxy["restart"] == "unless-stopped"
        assert f"127.0.0.1:{EXPECTED[name][1]}/health" in " ".join(proxy["healthcheck"]["test"])
    assert "code" not in over  # its sandbox slots, not replicas, scale it
    cfg = (ROOT / "compose" / "proxy" / "haproxy.cfg").read_text()
    assert "stick match url_param(resume)" in cfg and "stick store-response res.hdr(x-envhub-session)" in cfg


@pytest.mark.parametrize("dockerfile", ["compose/Dockerfile", "compose/proxy/Dockerfile"])
def test_dockerfile_copies_exist_and_survive_the_ignore_file(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "FROM ${BASE_IMAGE}" in text
    copies = [line.split()[1:-1] for line in text.splitlines()
              if line.startswith("COPY ") and "--from=" not in line]  # build-stage copies are not context
    sources = [s for srcs in copies for s in srcs if not s.startswith("--")]
    ignore = (ROOT / ".dockerignore").read_text()  # the classic builder reads only this one
    for source in sources:
        if "[" in source:  # an optional file (the build's CA bundle): a glob that may match nothing
            assert "!" + source.replace("[", "").replace("]", "") in ignore
            continue
        assert (ROOT / source).exists(), f"COPY source {source} does not exist"
        assert f"!{source}" in ignore or f"!{source.rsplit('/', 1)[0]}/**" in ignore, \
            f"{source} is excluded from the build context"


def test_the_final_image_runs_as_a_non_root_user_without_build_tools() -> None:
    final_stage = DOCKERFILE.read_text().rsplit("\nFROM ", 1)[1]
    assert "USER 10001" in final_stage and "COPY --from=build /opt/envhub /opt/envhub" in final_stage
    assert "pip install" not in final_stage and "build-ca" not in final_stage


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


@pytest.mark.docker
@pytest.mark.slow
def test_docker_compose_accepts_the_files_and_the_image_runs() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "docker"))
    from compose_project import build_images, engine_problem

    problem = engine_problem()
    if problem:
        pytest.skip(problem)
    for files in ([COMPOSE], [COMPOSE, REPLICAS]):
        argv = ["docker", "compose"] + [a for f in files for a in ("-f", str(f))] + ["config", "--quiet"]
        config = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert config.returncode == 0, config.stderr
    build_images()
    run = subprocess.run(["docker", "run", "--rm", "--read-only", "envhub:local", "python", "-m",
                          "env_servers.code_env", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--backend" in run.stdout, run.stderr
    user = subprocess.run(["docker", "run", "--rm", "envhub:local", "id", "-u"], capture_output=True, text=True,
                          timeout=60)
    assert user.stdout.strip() == "10001"
    size = subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", "envhub:local"], capture_output=True,
                          text=True, timeout=60, check=True)
    assert int(size.stdout) < 600 * 1024 ** 2, f"envhub:local is {int(size.stdout) / 1024 ** 2:.0f} MB"


def test_fleet_images_script_parses_and_explains_itself() -> None:
    script = str(ROOT / "scripts" / "fleet-images.sh")
    assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0
    shown = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0
    for word in ("--no-install", "--check", "ENVHUB_BASE_IMAGE", "ENVHUB_BUILD_CA", "Exit status"):
        assert word in shown.stdout, word
    bad = subprocess.run(["bash", script, "--bogus"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--help" in bad.stderr


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
