"""The server with envhub's own client: every extension negotiated, and a resume the client drives itself."""

from __future__ import annotations

import pytest

from envhub import Env, Observation
from envhub.client import EnvClient
from envhub.testing import EchoEnv


class CounterEnv(Env):
    def reset(self, seed=None, start: int = 0):
        self.count = start
        return Observation(text=str(start))

    def on_text(self, text: str):
        self.count += 1
        return Observation(text=str(self.count))

pytestmark = pytest.mark.live


async def test_envhub_client_negotiates_every_extension(serve_env):
    srv = serve_env(EchoEnv)
    async with EnvClient(srv.url) as client:
        first = await client.reset(seed=3)
        assert first.observation.echoed_message == "ready"
        assert client.extensions == {"request_id", "msgpack", "tools", "resume", "step_timeout", "cancel"}
        result = await client.step({"message": "héllo ✓"})
        assert result.observation.message_length == 7 and result.reward == pytest.approx(0.7)
        assert (await client.state())["messages"] == 1


async def test_envhub_client_resumes_after_the_socket_dies(serve_env):
    srv = serve_env(CounterEnv, resume_grace_s=5)
    async with EnvClient(srv.url) as client:
        await client.reset(start=40)
        await client.step({"text": "a"})
        session_id = client.session_id
        client._ws.transport.abort()  # the network drops; the server keeps the session
        result = await client.step({"text": "b"})
        assert result.observation.text == "42"  # same env instance, episode continued
        assert client.session_id == session_id
