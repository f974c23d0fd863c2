"""The math envs served for real: many concurrent WebSocket sessions, the envhub and OpenEnv clients, the CLI."""

import asyncio
import sys
import time
from pathlib import Path

import pytest

from env_servers.math_env import MathEnv, MathToolEnv
from envhub.client import EnvClient
from envhub.errors import ActionValidationError
from envhub.server import ServerThread, create_app
from envhub.settings import Settings

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def math_server():
    with ServerThread(create_app(MathEnv, settings=Settings(max_sessions=300, idle_timeout_s=60))) as server:
        yield server


def solve_add(text):
    a, op, b = text.split("?")[0].removeprefix("What is ").split()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


async def test_256_concurrent_sessions_each_graded_right(math_server):
    async def episode(i):
        async with EnvClient(math_server.url) as env:
            first = await env.reset(seed=i, kind="add", difficulty=2)
            value = solve_add(first.observation.text)
            answer = value if i % 2 == 0 else value + 1  # odd sessions answer wrong
            result = await env.step({"text": f"The answer is \\boxed{{{answer}}}."})
            return result.reward, result.done, result.info["correct"]

    start = time.monotonic()
    results = await asyncio.gather(*(episode(i) for i in range(256)))
    elapsed = time.monotonic() - start
    assert results == [(1.0, True, True) if i % 2 == 0 else (0.0, True, False) for i in range(256)]
    assert elapsed < 30, f"256 episodes took {elapsed:.1f}s"


async def test_prompt_comes_from_the_server_and_bad_reset_is_a_typed_error(math_server):
    async with EnvClient(math_server.url) as env:
        first = await env.reset(split="validation", index=3, kind="fraction")
        assert "\\boxed{}" in first.observation.text
        assert first.observation.metadata["split"] == "validation"
        with pytest.raises(ActionValidationError, match="kind"):
            await env.reset(kind="astrology")


@pytest.mark.interop
@pytest.mark.slow
def test_unmodified_openenv_generic_client_plays_an_episode(math_server):
    generic = pytest.importorskip("openenv.core.generic_client")
    with generic.GenericEnvClient(base_url=math_server.url).sync() as env:
        first = env.reset(problem="What is 6 * 7?", answer="42")
        assert "6 * 7" in first.observation["text"]
        result = env.step({"text": r"\boxed{42}"})
        assert result.reward == 1.0 and result.done


def test_tool_env_over_the_wire_lists_tools_and_runs_code():
    app = create_app(MathToolEnv, settings=Settings(max_sessions=8), python_runner="local-subprocess")

    async def play(url):
        async with EnvClient(url) as env:
            assert [t.name for t in await env.tools()] == ["run_python", "submit_answer"]
            await env.reset(problem="What is 2**10?", answer="1024")
            out = await env.step({"tool_name": "run_python", "arguments": {"code": "print(2**10)"}})
            final = await env.step({"tool_name": "submit_answer", "arguments": {"answer": out.observation.text}})
            return final.reward

    with ServerThread(app) as server:
        assert asyncio.run(play(server.url)) == 1.0


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "env_servers.math_env", "--format-reward", "0.5"],
    [sys.executable, "-m", "envhub.cli", "serve", "env_servers.math_env:MathEnv", "--set", "format_reward=0.5"],
], ids=["python-m", "envhub-serve"])
def test_both_launch_commands_serve_on_the_given_port(command, serve_process):
    server = serve_process([*command, "--host", "127.0.0.1", "--max-sessions", "4"])

    async def play():
        async with EnvClient(server.url) as env:
            await env.reset(problem="1+1?", answer="2")
            return (await env.step({"text": r"\boxed{2}"})).reward

    assert asyncio.run(play()) == 1.5


def test_math_agent_example_runs(capsys):
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "math_agent.py"), run_name="__main__")
    assert "solved 4 of 5" in capsys.readouterr().out
