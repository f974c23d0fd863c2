"""OpenEnv / AsyncOpenEnv: lazy connection, action mapping, observation text, running reward, infra errors."""

import asyncio

import pytest
from pydantic import BaseModel
from test_client_ws import FakeServer

from envhub.errors import EnvConnectionError, EnvExecutionError, SessionLostError, StepTimeoutError
from envhub.remote import AsyncOpenEnv, OpenEnv, as_envhub_error, observation_text
from envhub.testing import EchoObservation
from envhub.types import Observation, ToolSpec

echo = lambda name, args: {"message": args.get("text", "")}  # noqa: E731


# -- observation text ---------------------------------------------------------------------------
class Typed(BaseModel):
    echoed_message: str
    reward: float = 0.0
    done: bool = False


class WithOutput(BaseModel):
    output: str
    content: str = "not this"


@pytest.mark.parametrize("obs,expected", [
    ("plain", "plain"),
    (None, ""),
    ({"result": "r", "output": "o"}, "r"),
    ({"message": "m", "other": 1}, "m"),
    ({"output": {"a": 1}}, '{"a": 1}'),
    ({"echoed_message": "hi", "reward": 1.0}, '{"echoed_message": "hi"}'),
    (Observation(text="t", extra_field=1), "t"),
    (Observation(content="from extras"), "from extras"),
    (Observation(echoed_message="x"), '{"echoed_message": "x"}'),
    (Observation(), ""),
    ({"text": "", "images": [], "metadata": {}, "echoed_message": "e"}, '{"echoed_message": "e"}'),  # envhub via a dict
    ({"text": "", "message": "m"}, "m"),
    ({}, ""),
    (Typed(echoed_message="typed"), '{"echoed_message": "typed"}'),
    (WithOutput(output="o"), "o"),
    (EchoObservation(echoed_message="sub", message_length=3), '{"echoed_message": "sub", "message_length": 3}'),
])
def test_observation_text(obs, expected):
    assert observation_text(obs) == expected


def test_openenv_client_errors_map_to_typed_errors():
    err = as_envhub_error(RuntimeError("Server error: boom (code: EXECUTION_ERROR)"))
    assert isinstance(err, EnvExecutionError) and "boom" in err.message
    assert isinstance(as_envhub_error(ConnectionError("refused")), EnvConnectionError)
    assert isinstance(as_envhub_error(TimeoutError()), StepTimeoutError)
    assert as_envhub_error(KeyError("x")) is None


# -- against the scripted server ---------------------------------------------------------------
async def test_lazy_and_tool_schema_needs_no_connection():
    async with FakeServer() as srv:
        spec = ToolSpec("move", "Play a move.")
        env = OpenEnv(srv.url, tool_schema=[spec.to_openai()])
        assert await asyncio.to_thread(env.tools) == [spec]
        assert srv.connections == 0
        env.close()


async def test_default_action_shape_and_running_reward():
    async with FakeServer() as srv:
        def run():
            with OpenEnv(srv.url) as env:
                first = env.reset(seed=2)
                results = [env.step("echo", {"message": f"m{i}"}) for i in range(3)]
                return first, results, env.tools()
        first, results, tools = await asyncio.to_thread(run)
        assert first.observation.text == "ready"
        assert [r.info["episode_reward"] for r in results] == [1.0, 2.0, 3.0]
        assert [t.name for t in tools] == ["echo"]
        steps = [f for f in srv.frames if f["type"] == "step"]
        assert steps[0]["data"] == {"tool_name": "echo", "arguments": {"message": "m0"}}


async def test_action_mapper_and_reset_restarts_reward():
    async with FakeServer() as srv:
        async with AsyncOpenEnv(srv.url, action_mapper=echo) as env:
            await env.reset()
            r = await env.step("say", {"text": "hello"})
            assert (r.observation.text, r.reward, env.episode_reward) == ("hello", 1.0, 1.0)
            await env.reset()
            assert env.episode_reward == 0.0
            assert (await env.step("say", {"text": "bye"})).done and env.done


async def test_validation_error_is_an_observation_for_the_model():
    async with FakeServer() as srv, AsyncOpenEnv(srv.url, action_mapper=echo) as env:
        await env.reset()
        r = await env.step("say", {"text": "error:VALIDATION_ERROR"})
        assert r.observation.text.startswith("Error: ") and not r.done and not r.truncated
        assert r.info["action_error"]["code"] == "VALIDATION_ERROR"
        assert (await env.step("say", {"text": "fine"})).observation.text == "fine"


async def test_dropped_session_raises_never_done_with_zero():
    async with FakeServer(extensions=["request_id"]) as srv, AsyncOpenEnv(srv.url, action_mapper=echo) as env:
        await env.reset()
        with pytest.raises(SessionLostError):
            await env.step("say", {"text": "drop"})


async def test_mark_mode_returns_truncated_result_with_infra_error():
    async with FakeServer(extensions=["request_id"]) as srv:
        async with AsyncOpenEnv(srv.url, action_mapper=echo, on_infra_error="mark") as env:
            await env.reset()
            await env.step("say", {"text": "a"})
            r = await env.step("say", {"text": "drop"})
            assert r.truncated and not r.done and r.reward == 0.0
            assert r.info["infra_error"]["type"] == "SessionLostError"
            assert r.info["episode_reward"] == 1.0
            assert (await env.reset()).observation.text == "ready"  # a fresh session


async def test_server_error_and_timeout_are_infra():
    async with FakeServer() as srv:
        env = AsyncOpenEnv(srv.url, action_mapper=echo, env_kwargs={"message_timeout_s": 0.5})
        await env.reset()
        with pytest.raises(EnvExecutionError):
            await env.step("say", {"text": "error:EXECUTION_ERROR"})
        with pytest.raises(StepTimeoutError):
            await env.step("say", {"text": "sleep:1.0"})
        await env.close()


async def test_unreachable_server():
    async with FakeServer() as srv:
        url = srv.url
    env = AsyncOpenEnv(url, env_kwargs={"retries": 0})
    with pytest.raises(EnvConnectionError):
        await env.reset()
    marked = AsyncOpenEnv(url, env_kwargs={"retries": 0}, on_infra_error="mark")
    r = await marked.reset()
    assert r.truncated and not r.done and r.info["infra_error"]["during"] == "reset"
