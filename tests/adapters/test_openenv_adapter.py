"""adapters.openenv both ways: openenv-core's server and client around an envhub env; envhub's around an OpenEnv env.

Importing openenv-core takes seconds (it pulls in its web UI), so these carry ``slow``.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("openenv.core.env_server.http_server")
pytestmark = [pytest.mark.interop, pytest.mark.live, pytest.mark.slow]

import uvicorn  # noqa: E402
from openenv.core.generic_client import GenericEnvClient  # noqa: E402

from adapters.openenv import from_openenv, openenv_app, to_openenv  # noqa: E402
from envhub.client import EnvClient  # noqa: E402
from envhub.errors import ActionValidationError, EnvExecutionError  # noqa: E402
from envhub.server import ServerThread, create_app  # noqa: E402
from envhub.settings import Settings  # noqa: E402
from envhub.testing import EchoEnv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.guess_env import GuessEnv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openenv_echo_env import EchoAction, EchoAsEnvhub, EchoEnvironment  # noqa: E402


def _serve_openenv(app: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not (server.started and server.servers):
        assert time.monotonic() < deadline, "openenv-core server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture
def openenv_served():
    running = []

    def serve(app: Any) -> str:
        server, thread, url = _serve_openenv(app)
        running.append((server, thread))
        return url

    yield serve
    for server, thread in running:
        server.should_exit = True
        thread.join(5)


# -- envhub Env through openenv-core's create_app, driven by its own client ---------------------------


async def test_openenv_client_plays_an_envhub_tool_env_on_openenv_core(openenv_served) -> None:
    url = openenv_served(openenv_app(GuessEnv, max_concurrent_envs=4))
    async with GenericEnvClient(base_url=url) as client:
        first = await client.reset(seed=3)
        assert first.observation["text"].startswith("I picked a number between 1 and 100")
        low, high, result = 1, 100, None
        for _ in range(7):
            number = (low + high) // 2
            result = await client.step({"tool_name": "guess", "arguments": {"number": number}})
            if result.done:
                break
            low, high = (number + 1, high) if result.observation["text"] == "Higher." else (low, number - 1)
        assert result.observation["text"] == "Correct!" and result.done and result.reward == 1.0
        assert result.observation["info"]["rewards"] == {"solved": 1.0}
        with pytest.raises(Exception, match="VALIDATION_ERROR"):
            await client.step({"text": "hi", "tool_name": "guess"})  # envhub's rule: text or a tool call
        state = await client.state()
        assert state["step_count"] == result.observation["info"]["step_count"] and state["done"] is True
    meta = httpx.get(url + "/metadata").json()
    assert meta["name"] == "GuessEnv" and meta["description"].startswith("Guess a secret integer")
    action_schema = httpx.get(url + "/schema").json()["action"]
    assert {"text", "tool_name", "arguments"} <= set(action_schema["properties"])


async def test_typed_observation_fields_and_bad_actions_on_openenv_core(openenv_served) -> None:
    environment, action_cls, observation_cls = to_openenv(EchoEnv)
    assert {"message", "metadata"} <= set(action_cls.model_fields)
    assert {"echoed_message", "message_length", "text", "truncated"} <= set(observation_cls.model_fields)
    url = openenv_served(openenv_app(EchoEnv))
    async with GenericEnvClient(base_url=url) as client:
        await client.reset()
        result = await client.step({"message": "hello"})
        assert result.observation["echoed_message"] == "hello" and result.reward == pytest.approx(0.5)
        with pytest.raises(Exception, match="VALIDATION_ERROR"):
            await client.step({"nope": 1})


# -- OpenEnv Environment through envhub's server, driven by envhub's client ----------------------------




async def test_envhub_client_plays_an_openenv_env_on_envhub_server() -> None:
    assert EchoAsEnvhub.action_model is EchoAction  # read from Environment[EchoAction, ...]
    with ServerThread(create_app(EchoAsEnvhub, settings=Settings(log_level="warning"))) as server:
        async with EnvClient(server.url) as env:
            first = await env.reset(seed=1, episode_id="ep-A", greeting="hi")
            assert first.observation.echoed_message == "ready:hi"
            result = await env.step({"message": "abc"})
            assert result.observation.echoed_message == "abc" and result.observation.message_length == 3
            assert result.reward == pytest.approx(0.3) and not result.done
            assert '"echoed_message": "abc"' in result.observation.text  # readable for text agents
            state = await env.state()
            assert state["episode_id"] == "ep-A" and state["step_count"] == 1
            with pytest.raises(ActionValidationError):
                await env.step({"msg": "typo"})
            with pytest.raises(EnvExecutionError, match="boom"):
                await env.step({"message": "boom"})
            last = await env.step({"message": "bye"})
            assert last.done and last.info["episode_reward"] == pytest.approx(0.6)
        schema = httpx.get(server.url + "/schema").json()
        assert schema["action"]["required"] == ["message"]


def test_from_openenv_needs_an_action_class_it_can_find() -> None:
    with pytest.raises(TypeError, match="Expected action_cls"):
        from_openenv(lambda: EchoEnvironment())
    assert from_openenv(lambda: EchoEnvironment(), EchoAction, name="Echo").env_name == "Echo"
    with pytest.raises(TypeError, match=r"got an instance: .*Pass from_openenv\(EchoEnvironment\)"):
        from_openenv(EchoEnvironment())  # each session needs its own environment


def test_envhub_serve_runs_a_wrapped_openenv_env(serve_process) -> None:
    server = serve_process([sys.executable, "-m", "envhub", "serve", "openenv_echo_env:EchoAsEnvhub",
                            "--log-level", "warning"], cwd=Path(__file__).resolve().parent, timeout_s=90)
    with EnvClient(server.url).sync() as env:
        env.reset(greeting="cli")
        assert env.step({"message": "bye"}).done
