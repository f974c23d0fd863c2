"""EnvClient, OpenEnv and EnvTool against a real envhub server (uvicorn on a loopback port 0)."""

import asyncio
import io
import time
from typing import Annotated, Any

import pytest

from envhub import Env, Observation, reward, tool
from envhub.client import EnvClient
from envhub.env_tool import EnvTool, ToolManager
from envhub.errors import (
    ActionValidationError,
    AuthError,
    CapacityError,
    EpisodeStateError,
    SessionLostError,
    StepTimeoutError,
)
from envhub.remote import OpenEnv
from envhub.server import ServerThread, create_app
from envhub.settings import Settings
from envhub.testing import EchoEnv

pytestmark = pytest.mark.live


class GuessEnv(Env):
    """Guess a secret integer; ``slow`` sleeps (in the server's thread pool) to script timeouts."""

    def reset(self, seed=None, secret: int = 7):
        self.secret, self.last, self.steps = secret, None, 0
        return Observation(text="Guess a number between 1 and 10.")

    @tool
    def guess(self, number: Annotated[int, "your guess"]) -> str:
        """Guess the secret number."""
        self.last, self.steps = number, self.steps + 1
        if number == self.secret:
            self.done = True
            return "Correct!"
        return "Higher." if number < self.secret else "Lower."

    @tool
    def slow(self, seconds: float) -> str:
        """Take a while."""
        self.steps += 1
        time.sleep(seconds)
        return f"slept {seconds}"

    @tool
    def picture(self) -> Observation:
        """Return a PNG."""
        return Observation(text="a picture", images=[PNG])

    @reward
    def solved(self) -> float:
        return float(self.last == self.secret)

    def state(self) -> dict[str, Any]:
        return {"tool_steps": self.steps}


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


def call(name: str, **args: Any) -> dict:
    return {"tool_name": name, "arguments": args}


@pytest.fixture(scope="module")
def guess_url():
    with ServerThread(create_app(GuessEnv, settings=Settings(log_level="warning"))) as srv:
        yield srv.url


def serve(env_cls=GuessEnv, **settings: Any) -> ServerThread:
    return ServerThread(create_app(env_cls, settings=Settings(log_level="warning", **settings)))


async def test_full_session_with_all_extensions(guess_url):
    async with EnvClient(guess_url) as env:
        first = await env.reset(seed=1, secret=4)
        assert env.extensions == {"request_id", "msgpack", "tools", "resume", "step_timeout", "cancel"}
        assert first.observation.text.startswith("Guess")
        assert [t.name for t in await env.tools()] == ["guess", "slow", "picture"]
        r = await env.step(call("guess", number=2))
        assert (r.observation.text, r.reward, r.done) == ("Higher.", 0.0, False)
        r = await env.step(call("guess", number=4))
        assert r.done and r.reward == 1.0 and r.info["rewards"] == {"solved": 1.0}
        assert (await env.state())["tool_steps"] == 2
        with pytest.raises(EpisodeStateError, match="EPISODE_ENDED"):
            await env.step(call("guess", number=4))
        with pytest.raises(ActionValidationError):
            await env.reset(difficulty="hard")


@pytest.mark.parametrize("extensions", ["auto", ()])
async def test_images_round_trip_byte_exact(guess_url, extensions):
    async with EnvClient(guess_url, extensions=extensions) as env:
        await env.reset()
        r = await env.step(call("picture"))
        assert r.observation.images == [PNG]  # raw bytes over msgpack, base64 over JSON


async def test_resume_after_drop_returns_the_in_flight_reply_once(guess_url):
    async with EnvClient(guess_url) as env:
        await env.reset()
        sid = env.session_id
        asyncio.get_running_loop().call_later(0.1, env._ws.transport.abort)  # the network drops mid-step
        r = await env.step(call("slow", seconds=0.4))
        assert r.observation.text == "slept 0.4"
        assert env.session_id == sid
        assert (await env.state())["tool_steps"] == 1  # not executed twice


async def test_the_upgrade_reply_names_the_session_for_sticky_proxies(guess_url):
    # compose/proxy/haproxy.cfg learns session -> replica from this header to route resumes back
    async with EnvClient(guess_url) as env:
        await env.reset()
        first = env._ws.response.headers["x-envhub-session"]
        assert first == env.session_id
        env._ws.transport.abort()
        await env.state()  # resumed on a new connection: same session, same header
        assert env._ws.response.headers["x-envhub-session"] == first


async def test_server_step_timeout_ends_the_episode(guess_url):
    async with EnvClient(guess_url, step_timeout_s=0.2) as env:
        await env.reset()
        with pytest.raises(StepTimeoutError, match="STEP_TIMEOUT"):
            await env.step(call("slow", seconds=0.6))
        with pytest.raises(EpisodeStateError):
            await env.step(call("guess", number=1))
        await env.reset()
        assert (await env.step(call("guess", number=7))).done


async def test_client_timeout_with_ids_keeps_replies_in_step(guess_url):
    # without the cancel extension the late step finishes on the server and its reply is discarded by id
    async with EnvClient(guess_url, extensions=["request_id", "msgpack"]) as env:
        await env.reset()
        env.message_timeout_s = 0.2
        with pytest.raises(StepTimeoutError):
            await env.step(call("slow", seconds=0.4))
        env.message_timeout_s = 5
        assert (await env.step(call("guess", number=1))).observation.text == "Higher."


async def test_client_timeout_cancels_the_step_and_ends_the_episode(guess_url):
    async with EnvClient(guess_url) as env:
        await env.reset()
        env.message_timeout_s = 0.2
        with pytest.raises(StepTimeoutError):
            await env.step(call("slow", seconds=0.4))
        env.message_timeout_s = 5
        with pytest.raises(EpisodeStateError, match="cancelled"):
            await env.step(call("guess", number=1))
        await env.reset()
        assert (await env.step(call("guess", number=1))).observation.text == "Higher."


async def test_auth_and_capacity():
    with serve(token="sekret", max_sessions=1) as srv:
        with pytest.raises(AuthError):
            await EnvClient(srv.url, retries=0).reset()
        async with EnvClient(srv.url, token="sekret") as env:
            await env.reset()
            with pytest.raises(CapacityError):
                await EnvClient(srv.url, token="sekret", retries=0).reset()


async def test_a_wrong_path_without_a_token_is_not_called_a_refused_token(guess_url):
    with pytest.raises(AuthError, match=r"refused the WebSocket handshake \(HTTP 403\); no token was given: check "
                                        r"the URL's path"):
        await EnvClient(f"{guess_url}/nowhere", retries=0).reset()


async def test_idle_reaper_close_is_session_lost():
    with serve(EchoEnv, idle_timeout_s=0.2, resume_grace_s=0.2) as srv:
        async with EnvClient(srv.url) as env:
            await env.reset()
            await asyncio.sleep(0.8)
            with pytest.raises(SessionLostError):
                await env.step({"message": "late"})
            assert (await env.reset()).observation.echoed_message == "ready"


def test_openenv_env_tools_and_tool_manager(guess_url):
    with OpenEnv(guess_url) as env:
        env.reset(secret=3)
        manager = ToolManager(EnvTool.from_env(env))
        guess = manager.tools["guess"]
        assert guess.tool_info()["function"]["parameters"]["required"] == ["number"]
        bad = manager({"id": "c9", "function": {"name": "guess", "arguments": '{"number": "many"}'}})
        assert bad["content"].startswith("Error: invalid arguments for tool 'guess'")  # from the env, as text
        msgs = [manager({"id": f"c{n}", "type": "function",
                         "function": {"name": "guess", "arguments": f'{{"number": {n}}}'}}) for n in (1, 3)]
        assert [m["content"] for m in msgs] == ["Higher.", "Correct!"]
        assert guess.done and guess.episode_reward == 1.0
        with pytest.raises(EpisodeStateError):  # stepping a finished episode is the caller's bug, not text
            manager({"id": "c10", "function": {"name": "guess", "arguments": '{"number": 3}'}})


def test_sync_client_against_real_server(guess_url):
    with EnvClient(guess_url).sync() as env:
        env.reset(secret=5)
        texts = [env.step(call("guess", number=n)).observation.text for n in (1, 9, 5)]
        assert texts == ["Higher.", "Lower.", "Correct!"]


class BlockingPlainClient:
    """An OpenEnv-style client class with blocking methods (no extensions), as older clients are."""

    def __init__(self, base_url: str):
        self.client = EnvClient(base_url, extensions=()).sync()

    def reset(self, **kwargs: Any):
        return self.client.reset(**kwargs)

    def step(self, action: dict):
        return self.client.step(action)

    def close(self) -> None:
        self.client.close()


async def test_openenv_with_a_blocking_client_class(guess_url):
    from envhub.remote import AsyncOpenEnv

    async with AsyncOpenEnv(guess_url, env_cls=BlockingPlainClient) as env:
        assert [t.name for t in await env.tools()] == ["guess", "slow", "picture"]  # from /metadata
        await env.reset(secret=2)
        r = await env.step("guess", {"number": 2})
        assert (r.observation.text, r.done, r.info["episode_reward"]) == ("Correct!", True, 1.0)
