"""envhub's client family against an unmodified openenv-core 0.3 server (its create_app, uvicorn, loopback).

Importing openenv-core takes seconds (it pulls in its web UI), so these carry ``slow`` too.
"""

import asyncio
import threading
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.live]

openenv_server = pytest.importorskip("openenv.core.env_server.http_server")
uvicorn = pytest.importorskip("uvicorn")

from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from envhub.client import EnvClient  # noqa: E402
from envhub.errors import ActionValidationError, CapacityError, EnvExecutionError, SessionLostError, StepTimeoutError  # noqa: E402
from envhub.remote import AsyncOpenEnv, OpenEnv  # noqa: E402


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0


class EchoEnvironment(Environment):
    """OpenEnv's template echo env; ``sleep:S`` blocks the step, ``boom`` raises."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id="none", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any):
        self._state = State(episode_id=episode_id or "ep", step_count=0)
        return EchoObservation(echoed_message="ready", reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.message.startswith("sleep:"):
            time.sleep(float(action.message[6:]))
        if action.message == "boom":
            raise RuntimeError("boom")
        return EchoObservation(echoed_message=action.message, message_length=len(action.message),
                               reward=len(action.message) / 10, done=action.message == "bye")

    @property
    def state(self):
        return self._state


def _serve(max_envs: int):
    app = openenv_server.create_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=max_envs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not (server.started and server.servers):
        if time.monotonic() > deadline:
            raise RuntimeError("openenv-core server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def openenv_url():
    server, thread, url = _serve(64)
    yield url
    server.should_exit = True
    thread.join(5)


to_text = lambda name, args: {"message": args["text"]}  # noqa: E731


async def test_envhub_client_speaks_plain_openenv(openenv_url):
    async with EnvClient(openenv_url) as env:
        first = await env.reset(seed=1, episode_id="ep-A")
        assert env.extensions == frozenset()  # nothing announced: no ext, no ids, no hello
        assert first.observation.echoed_message == "ready"
        r = await env.step({"message": "hello"})
        assert (r.observation.echoed_message, r.reward, r.done) == ("hello", 0.5, False)
        assert await env.state() == {"episode_id": "ep-A", "step_count": 1}
        assert await env.tools() == []
        with pytest.raises(ActionValidationError):
            await env.step({"msg": "wrong field"})
        with pytest.raises(EnvExecutionError, match="boom"):
            await env.step({"message": "boom"})
        assert (await env.step({"message": "bye"})).done


async def test_timeout_drops_the_session_instead_of_desynchronising(openenv_url):
    async with EnvClient(openenv_url) as env:
        await env.reset()
        env.message_timeout_s = 0.3
        with pytest.raises(StepTimeoutError):
            await env.step({"message": "sleep:0.6"})
        with pytest.raises(SessionLostError):
            await env.step({"message": "second"})
        env.message_timeout_s = 10
        await env.reset()
        assert (await env.step({"message": "third"})).observation.echoed_message == "third"


def test_sync_openenv_with_action_mapper(openenv_url):
    with OpenEnv(openenv_url, action_mapper=to_text) as env:
        assert env.tools() == []
        env.reset()
        r = env.step("say", {"text": "abc"})
        assert r.observation.text == '{"echoed_message": "abc", "message_length": 3}'
        env.step("say", {"text": "de"})
        assert env.episode_reward == pytest.approx(0.5)


async def test_openenv_generic_client_class(openenv_url):
    env = AsyncOpenEnv(openenv_url, env_cls="openenv.core.generic_client.GenericEnvClient",
                       action_mapper=to_text, env_kwargs={"message_timeout_s": 1.0})
    await env.reset()
    r = await env.step("say", {"text": "typed"})
    assert r.observation.text == '{"echoed_message": "typed", "message_length": 5}'
    assert r.info["episode_reward"] == pytest.approx(0.5)
    with pytest.raises(EnvExecutionError, match="boom"):
        await env.step("say", {"text": "boom"})
    with pytest.raises(StepTimeoutError):
        await env.step("say", {"text": "sleep:1.5"})
    await asyncio.sleep(0.6)
    await env.reset()  # the desynchronised OpenEnv socket was dropped: a fresh one answers in step
    assert (await env.step("say", {"text": "x"})).observation.text == '{"echoed_message": "x", "message_length": 1}'
    await env.close()


async def test_capacity_reached_is_typed():
    server, thread, url = _serve(1)
    try:
        async with EnvClient(url) as first:
            await first.reset()
            with pytest.raises(CapacityError):
                await EnvClient(url).reset()
    finally:
        server.should_exit = True
        thread.join(5)


async def test_openenv_client_class_against_envhub_server():
    from envhub.server import ServerThread, create_app
    from envhub.settings import Settings
    from envhub.testing import EchoEnv

    with ServerThread(create_app(EchoEnv, settings=Settings(log_level="warning"))) as srv:
        env = AsyncOpenEnv(srv.url, env_cls="openenv.core.generic_client.GenericEnvClient", action_mapper=to_text)
        await env.reset()
        r = await env.step("say", {"text": "hub"})
        assert r.observation.text == '{"echoed_message": "hub", "message_length": 3}'
        assert r.reward == pytest.approx(0.3)
        with pytest.raises(KeyError):
            await env.step("say", {"wrong": 1})  # a broken action_mapper is the caller's bug: it propagates
        await env.close()
