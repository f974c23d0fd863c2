"""The compose fleet in real containers: up and healthy, OpenEnv-conformant, a rollout through the published
ports, a crashed server brought back by its restart policy, and ``down`` leaving nothing behind.

Needs a Docker engine and Compose v2 (``bash scripts/fleet-images.sh`` as root sets both up and
builds the images); skipped cleanly without one. The tests share one project and run in file order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import urllib.request

import pytest
from compose_project import (
    CONTAINER_PORTS,
    PORT_VARS,
    ComposeProject,
    build_images,
    engine_problem,
    health,
    listening,
    wait_for,
)

from envhub.client import EnvClient

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def fleet():
    problem = engine_problem()
    if problem:
        pytest.skip(problem)
    build_images()
    project = ComposeProject.create("envhub-test")
    try:
        project.up()
        yield project
    finally:
        project.down()


def _server_pid(container: dict) -> int:
    """The env server process: the only child of the container's init (``init: true``)."""
    init = container["State"]["Pid"]
    with open(f"/proc/{init}/task/{init}/children") as f:
        children = [int(p) for p in f.read().split()]
    assert len(children) == 1, children
    return children[0]


def test_every_service_is_up_healthy_and_hardened(fleet: ComposeProject) -> None:
    for service, port in CONTAINER_PORTS.items():
        [c] = fleet.containers(service)
        assert c["State"]["Health"]["Status"] == "healthy", service
        host = c["HostConfig"]
        assert c["Config"]["User"] == "10001:10001" and host["ReadonlyRootfs"] is True
        assert host["CapDrop"] == ["ALL"] and "no-new-privileges:true" in host["SecurityOpt"]
        assert host["PidsLimit"] == 256 and host["Memory"] > 0 and host["NanoCpus"] > 0
        assert host["RestartPolicy"]["Name"] == "unless-stopped" and host["Init"] is True
        [binding] = host["PortBindings"][f"{port}/tcp"]
        assert binding == {"HostIp": "127.0.0.1", "HostPort": str(fleet.ports[service])}
        assert health(fleet.url(service))


def test_openenv_validation_passes_on_every_published_port(fleet: ComposeProject) -> None:
    validation = pytest.importorskip("openenv.cli._validation")
    for service in PORT_VARS:
        report = validation.validate_running_environment(fleet.url(service))
        assert report["passed"] is True, (service, [c for c in report["criteria"] if not c["passed"]])


def test_the_code_server_runs_model_code_in_sandbox_containers(fleet: ComposeProject) -> None:
    with urllib.request.urlopen(f"{fleet.url('code')}/metadata", timeout=10) as resp:
        sandbox = json.load(resp)["sandbox"]
    assert sandbox["backend"] == "docker" and sandbox["isolation"] == "container", sandbox

    async def run() -> str:
        async with EnvClient(fleet.url("code", "ws")) as env:
            await env.reset(seed=0)
            result = await env.step({"tool_name": "run_python", "arguments": {
                "code": "import os, socket\nprint(os.getuid(), 6 * 7)\nsocket.create_connection(('1.1.1.1', 53), 2)"}})
            return result.observation.text

    text = asyncio.run(run())
    assert "65534 42" in text, text
    assert text.rstrip().splitlines()[-1].endswith(("PermissionError: [Errno 13] Permission denied",
                                                     "OSError: [Errno 101] Network is unreachable")), text  # no network
    workers = subprocess.run(["docker", "ps", "-q", "--filter", "label=envhub.sandbox.slot"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert workers, "no sandbox worker container is running"


def test_a_short_rollout_through_the_published_ports(fleet: ComposeProject) -> None:
    from trainer.rollout import EnvPool, RolloutConfig, RolloutEngine, StopReason, make_tasks
    from trainer.sampling import SampledSequence
    from trainer.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()

    class BoxedAnswer:  # a scripted policy: answers the sum in the prompt
        version = 0

        def update_weights(self, model, version: int) -> None:
            self.version = version

        async def generate(self, request):
            import re

            a, b = re.findall(r"(\d+) \+ (\d+)", tok.decode(request.prompt_ids))[-1]
            ids = tok.encode(f"\\boxed{{{int(a) + int(b)}}}", add_special_tokens=False) + [tok.eos_token_id]
            return SampledSequence(ids, [-0.5] * len(ids), "stop")

    urls = [fleet.url("math", "ws")]
    tasks = make_tasks([{"problem": f"{a} + {a + 1}", "answer": str(2 * a + 1)} for a in range(3)], 2, urls)
    engine = RolloutEngine(EnvPool(urls=urls), BoxedAnswer(), tok, RolloutConfig(max_turns=2))
    trajs = asyncio.run(engine.run(tasks))
    assert [t.stop_reason for t in trajs] == [StopReason.DONE] * 6
    assert [t.reward for t in trajs] == [1.0] * 6
    assert all(t.tokens and any(t.mask) for t in trajs)


def test_a_crashed_server_comes_back_and_only_its_episodes_are_lost(fleet: ComposeProject) -> None:
    outcomes: dict[str, list[str]] = {"math": [], "gomoku": []}
    stop = threading.Event()

    async def episodes(service: str) -> None:
        while not stop.is_set():
            try:
                async with EnvClient(fleet.url(service, "ws"), connect_timeout_s=2, retries=0) as env:
                    await env.reset(seed=1)
                    for _ in range(3):
                        if service == "math":
                            await env.step({"text": "\\boxed{1}"})
                            break
                        await asyncio.sleep(0.05)
                        await env.state()
                outcomes[service].append("ok")
            except Exception as exc:  # the run goes on: a lost episode is recorded, the loop continues
                outcomes[service].append(type(exc).__name__)
                await asyncio.sleep(0.2)

    async def run() -> None:
        await asyncio.gather(episodes("math"), episodes("gomoku"))

    runner = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    runner.start()
    try:
        wait_for(lambda: len(outcomes["math"]) >= 3, 60, "math episodes before the crash")
        [before] = fleet.containers("math")
        os.kill(_server_pid(before), signal.SIGKILL)  # the server process dies, as in a crash
        wait_for(lambda: not health(fleet.url("math")), 30, "the crash to take math down", 0.1)
        wait_for(lambda: fleet.containers("math")[0]["RestartCount"] > before["RestartCount"], 60,
                 "the restart policy to bring math back")
        wait_for(lambda: health(fleet.url("math")), 120, "math to answer /health again")
        done = len(outcomes["math"])
        wait_for(lambda: outcomes["math"][done:].count("ok") >= 3, 60, "math episodes after the restart")
    finally:
        stop.set()
        runner.join(30)
    [after] = fleet.containers("math")
    assert after["Id"] == before["Id"] and after["State"]["Running"]
    assert "ok" in outcomes["math"] and any(o != "ok" for o in outcomes["math"]), outcomes["math"]
    assert set(outcomes["gomoku"]) == {"ok"}, outcomes["gomoku"]  # other services never noticed
    wait_for(lambda: fleet.containers("math")[0]["State"]["Health"]["Status"] == "healthy", 60, "healthy")


def test_down_leaves_nothing_running_or_listening(fleet: ComposeProject) -> None:
    fleet.down()
    assert fleet.containers() == []
    workers = subprocess.run(["docker", "ps", "-aq", "--filter", "label=envhub.sandbox.slot"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert workers == [], "sandbox worker containers outlived the code server"
    assert not any(listening(port) for port in fleet.ports.values())
    networks = subprocess.run(["docker", "network", "ls", "-q", "--filter", f"label=com.docker.compose.project={fleet.name}"],
                              capture_output=True, text=True, check=True).stdout.split()
    assert networks == []
