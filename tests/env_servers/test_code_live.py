"""CodeEnv served over a real WebSocket (uvicorn on loopback port 0) with the envhub client family."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from env_servers.code_env import CodeEnv
from env_servers.code_env.tasks import reference_solutions
from env_servers.sandbox import available_backends
from envhub import EnvClient, EnvTool, OpenEnv
from envhub.server import create_app
from envhub.server.run import ServerThread

pytestmark = [pytest.mark.live, pytest.mark.sandbox,
              pytest.mark.skipif(os.geteuid() != 0 or "local-zygote" not in available_backends(),
                                 reason="needs root and a working bubblewrap (apt-get install -y bubblewrap)")]


@pytest.fixture(scope="module")
def url():
    with ServerThread(create_app(CodeEnv)) as server:
        yield server.url


def test_metadata_and_tools_over_http(url):
    meta = httpx.get(f"{url}/metadata").json()
    assert meta["sandbox"]["backend"] == "local-zygote"
    assert meta["sandbox"]["isolation"] == "namespaces+seccomp"


async def test_scripted_session_over_websocket(url):
    async with EnvClient(url) as env:
        first = await env.reset(task_id="fizzbuzz")
        assert "fizzbuzz(n)" in first.observation.text
        assert [t.name for t in await env.tools()] == ["run_python", "submit"]
        ran = await env.step({"tool_name": "run_python", "arguments": {"code": "print(sum(range(10)))"}})
        assert "--- stdout ---\n45" in ran.observation.text and not ran.done
        partial = "def fizzbuzz(n):\n    return [str(i) for i in range(1, n + 1)]"
        result = await env.step({"tool_name": "submit", "arguments": {"code": partial}})
        assert result.done and result.reward == 0.5  # n=1 and n=0 are right, n=5 and n=15 are not


async def test_concurrent_sessions_share_the_sandbox_pool(url):
    async def episode(i: int) -> float:
        async with EnvClient(url) as env:
            await env.reset(task_id="gcd")
            code = reference_solutions()["gcd"] if i % 2 == 0 else "def gcd(a, b):\n    return 1"
            return (await env.step({"tool_name": "submit", "arguments": {"code": code}})).reward

    rewards = await asyncio.gather(*(episode(i) for i in range(6)))
    assert rewards[0::2] == [1.0, 1.0, 1.0] and all(r < 1.0 for r in rewards[1::2])


def test_openenv_and_envtool_drive_the_env(url):
    with OpenEnv(url) as env:
        env.reset(task_id="reverse_string")
        tools = {t.name: t for t in EnvTool.from_env(env)}
        assert "hello" in tools["run_python"](code="print('olleh'[::-1])")
        assert tools["submit"](code="def reverse_string(s):\n    return s[::-1]").startswith("Passed 4/4")
        assert tools["submit"].done and tools["submit"].episode_reward == 1.0


@pytest.mark.slow
def test_example_code_agent_solves_tasks_against_its_own_server(capsys, tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "code_agent.py"
    spec = importlib.util.spec_from_file_location("code_agent_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--tasks", "2", "--server-log", str(tmp_path / "code_env.log")])
    out = capsys.readouterr().out
    assert "mean reward over 2 tasks: 1.00" in out and "'backend': 'local-zygote'" in out
    assert "envhub serving env_servers.code_env.env.CodeEnv" in (tmp_path / "code_env.log").read_text()
