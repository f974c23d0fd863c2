"""The ``cancel`` extension: a client gives up a running request by id, and the session moves on."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import websockets

from envhub import Env, EnvClient, Observation
from envhub.errors import EpisodeStateError, StepTimeoutError
from envhub.protocol import Cancel, SessionProtocol

pytestmark = pytest.mark.live


class BlockingEnv(Env):
    """``block`` waits in its worker thread until the test releases it; ``wait`` awaits forever (async)."""

    release = threading.Event()
    closed: list[str] = []

    def reset(self, seed=None):
        self.steps = 0
        return Observation(text="ready")

    def on_text(self, text: str):
        if text == "block":
            BlockingEnv.release.wait(30)
        self.steps += 1
        return Observation(text=f"{text} {self.steps}")

    def close(self) -> None:
        BlockingEnv.closed.append("closed")


class AsyncBlockingEnv(Env):
    cancelled: list[str] = []

    async def reset(self, seed=None):
        return Observation(text="ready")

    async def on_text(self, text: str):
        try:
            await asyncio.sleep(30 if text == "wait" else 0)
        except asyncio.CancelledError:
            AsyncBlockingEnv.cancelled.append(text)
            raise
        return Observation(text=text)


@pytest.fixture(autouse=True)
def _unblock():
    BlockingEnv.release.clear()
    BlockingEnv.closed.clear()
    yield
    BlockingEnv.release.set()


async def ask(ws, message) -> dict:
    await ws.send(json.dumps(message))
    return json.loads(await asyncio.wait_for(ws.recv(), 10))


def test_cancel_needs_request_ids_and_changes_no_state_when_peeked():
    both = SessionProtocol("s", extensions=frozenset({"cancel", "request_id"}))
    assert both.cancellable and not SessionProtocol("s", extensions=frozenset({"cancel"})).cancellable
    assert both.receive('{"type": "cancel", "data": {"id": 3}}') == Cancel(3)
    assert both.cancel_target('{"type": "cancel", "data": {"id": "a"}}') == "a"
    assert both.cancel_target('{"type": "step", "data": {"id": "a"}}') is None
    assert both.receive('{"type": "cancel", "data": {}}').envelope["data"]["code"] == "VALIDATION_ERROR"
    plain = SessionProtocol("s", extensions=frozenset({"request_id"}))
    assert plain.receive('{"type": "cancel", "data": {"id": 3}}').envelope["data"]["code"] == "UNKNOWN_TYPE"


async def test_cancel_frees_the_session_from_a_blocked_sync_step(serve_env):
    srv = serve_env(BlockingEnv)
    async with websockets.connect(srv.ws_url + "?ext=request_id,cancel") as ws:
        assert "cancel" in json.loads(await ws.recv())["data"]["extensions"]
        await ask(ws, {"type": "reset", "id": 1})
        await ws.send(json.dumps({"type": "step", "data": {"text": "block"}, "id": 2}))
        await ws.send(json.dumps({"type": "cancel", "data": {"id": 2}}))
        cancelled = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert cancelled["id"] == 2 and cancelled["data"]["code"] == "CANCELLED"
        # the worker thread is still blocked, yet the session answers: the episode is over ...
        assert (await ask(ws, {"type": "step", "data": {"text": "x"}, "id": 3}))["data"]["code"] == "EPISODE_ENDED"
        assert (await ask(ws, {"type": "state", "id": 4}))["data"]["cancelled"] is True
        # ... and a reset gets a fresh env instance while the old one is still busy
        assert (await ask(ws, {"type": "reset", "id": 5}))["data"]["observation"]["text"] == "ready"
        assert (await ask(ws, {"type": "step", "data": {"text": "y"}, "id": 6}))["data"]["observation"]["text"] == "y 1"
        assert BlockingEnv.closed == []
        BlockingEnv.release.set()  # the abandoned env closes once its thread lets go of it
        for _ in range(100):
            if BlockingEnv.closed:
                break
            await asyncio.sleep(0.02)
        assert BlockingEnv.closed == ["closed"]


async def test_frames_sent_during_a_request_are_answered_in_order_after_it(serve_env):
    srv = serve_env(BlockingEnv)
    async with websockets.connect(srv.ws_url + "?ext=request_id,cancel") as ws:
        await ws.recv()
        await ask(ws, {"type": "reset", "id": 1})
        await ws.send(json.dumps({"type": "step", "data": {"text": "block"}, "id": 2}))
        await ws.send(json.dumps({"type": "cancel", "data": {"id": 99}}))  # not running: ignored
        await ws.send(json.dumps({"type": "state", "id": 3}))
        await ws.send("{not json")
        await asyncio.sleep(0.1)
        BlockingEnv.release.set()
        replies = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(3)]
        assert [r.get("id") for r in replies] == [2, 3, None]
        assert replies[0]["data"]["observation"]["text"] == "block 1" and replies[1]["data"]["step_count"] == 1
        assert replies[2]["data"]["code"] == "INVALID_JSON"


async def test_cancel_stops_async_env_code(serve_env):
    srv = serve_env(AsyncBlockingEnv)
    async with websockets.connect(srv.ws_url + "?ext=request_id,cancel") as ws:
        await ws.recv()
        await ask(ws, {"type": "reset", "id": 1})
        await ws.send(json.dumps({"type": "step", "data": {"text": "wait"}, "id": 2}))
        await asyncio.sleep(0.05)
        await ws.send(json.dumps({"type": "cancel", "data": {"id": 2}}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["data"]["code"] == "CANCELLED"
        await asyncio.sleep(0.05)
        assert AsyncBlockingEnv.cancelled == ["wait"]


async def test_client_timeout_cancels_the_step_so_the_next_request_does_not_queue(serve_env):
    srv = serve_env(BlockingEnv)
    async with EnvClient(srv.url, message_timeout_s=0.5) as env:
        assert "cancel" in env.extensions
        await env.reset()
        with pytest.raises(StepTimeoutError):
            await env.step({"text": "block"})
        with pytest.raises(EpisodeStateError, match="cancelled"):
            await env.step({"text": "x"})  # answered while the first step's thread is still blocked
        assert (await env.reset()).observation.text == "ready"
        assert (await env.step({"text": "y"})).observation.text == "y 1"


async def test_caller_cancellation_cancels_on_the_server_too(serve_env):
    srv = serve_env(BlockingEnv)
    async with EnvClient(srv.url, message_timeout_s=10) as env:
        await env.reset()
        step = asyncio.ensure_future(env.step({"text": "block"}))
        await asyncio.sleep(0.2)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert (await env.reset()).observation.text == "ready"  # not queued behind the blocked step
