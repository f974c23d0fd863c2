"""Live ``/ws`` sessions against uvicorn on a loopback port, driven by a raw ``websockets`` client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import msgpack
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from envhub import Env, Observation, StepResult
from envhub.testing import EchoEnv

pytestmark = pytest.mark.live


class CounterEnv(Env):
    """Counts text steps; ``crash`` raises, ``sleep:S`` sleeps S seconds in the worker thread."""

    closed: list[str] = []
    closed_event = threading.Event()

    def __init__(self, tag: str = "c"):
        self.tag = tag

    def reset(self, seed=None, start: int = 0):
        self.count = start
        return Observation(text=str(self.count))

    def on_text(self, text: str):
        if text == "crash":
            raise RuntimeError("env exploded")
        if text.startswith("sleep:"):
            time.sleep(float(text[6:]))
        self.count += 1
        return StepResult(observation=Observation(text=str(self.count)), reward=1.0)

    def state(self) -> dict[str, Any]:
        return {"count": self.count, "tag": self.tag}

    def close(self) -> None:
        CounterEnv.closed.append(self.tag)
        CounterEnv.closed_event.set()


class BrokenFactoryEnv(Env):
    def __init__(self):
        raise OSError("no GPU for you")


async def ask(ws, message: Any) -> dict[str, Any]:
    await ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
    reply = await asyncio.wait_for(ws.recv(), 10)
    return msgpack.unpackb(reply) if isinstance(reply, bytes) else json.loads(reply)


async def wait_for_closed(timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not CounterEnv.closed and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def closed_with(ws) -> int:
    with pytest.raises(ConnectionClosed) as info:
        await asyncio.wait_for(ws.recv(), 10)
    return info.value.rcvd.code if info.value.rcvd else 1006


async def test_openenv_session_reset_step_state_close(serve_env):
    srv = serve_env(EchoEnv)
    async with websockets.connect(srv.ws_url) as ws:
        first = await ask(ws, {"type": "reset"})
        assert first["type"] == "observation" and first["data"]["observation"]["echoed_message"] == "ready"
        reply = await ask(ws, {"type": "step", "data": {"message": "hello"}})
        assert reply["data"]["observation"] == {"text": "", "images": [], "metadata": {}, "echoed_message": "hello",
                                                "message_length": 5}
        assert reply["data"]["reward"] == pytest.approx(0.5) and reply["data"]["done"] is False
        state = await ask(ws, {"type": "state"})
        assert state["data"]["step_count"] == 1 and state["data"]["messages"] == 1
        await ws.send(json.dumps({"type": "close"}))
        assert await closed_with(ws) == 1000


async def test_every_error_keeps_the_session_alive(serve_env):
    srv = serve_env(CounterEnv)
    async with websockets.connect(srv.ws_url) as ws:
        assert (await ask(ws, {"type": "step", "data": {"text": "x"}}))["data"]["code"] == "EPISODE_NOT_STARTED"
        await ask(ws, {"type": "reset", "data": {"start": 5}})
        bad = [("{oops", "INVALID_JSON"), (b"\x01\x02", "INVALID_JSON"), ("[1,2]", "VALIDATION_ERROR"),
               ({"type": "fly"}, "UNKNOWN_TYPE"), ({"type": "step", "data": {"txt": "x"}}, "VALIDATION_ERROR"),
               ({"type": "reset", "data": {"level": 3}}, "VALIDATION_ERROR"),
               ({"type": "step", "data": {"text": "crash"}}, "EXECUTION_ERROR")]
        for message, code in bad:
            reply = await ask(ws, message)
            assert reply["type"] == "error" and reply["data"]["code"] == code, (message, reply)
        assert (await ask(ws, {"type": "step", "data": {"text": "ok"}}))["data"]["observation"]["text"] == "6"


async def test_capacity_reached_closes_1013_with_counts(serve_env):
    srv = serve_env(EchoEnv, max_sessions=1)
    async with websockets.connect(srv.ws_url) as first:
        await ask(first, {"type": "reset"})
        async with websockets.connect(srv.ws_url) as second:
            reply = json.loads(await second.recv())
            assert reply["data"]["code"] == "CAPACITY_REACHED"
            assert (reply["data"]["active_sessions"], reply["data"]["max_sessions"]) == (1, 1)
            assert await closed_with(second) == 1013
        assert (await ask(first, {"type": "state"}))["type"] == "state"


async def test_factory_error_closes_1011(serve_env):
    srv = serve_env(BrokenFactoryEnv)
    async with websockets.connect(srv.ws_url) as ws:
        reply = json.loads(await ws.recv())
        assert reply["data"]["code"] == "FACTORY_ERROR" and "no GPU" in reply["data"]["message"]
        assert await closed_with(ws) == 1011


async def test_idle_reaper_really_closes_the_socket_and_the_env(serve_env):
    CounterEnv.closed.clear()
    srv = serve_env(CounterEnv, idle_timeout_s=0.3, tag="idle")
    async with websockets.connect(srv.ws_url) as ws:
        await ask(ws, {"type": "reset"})
        assert await closed_with(ws) == 1001
    await wait_for_closed()  # env.close() runs in the pool right after the socket closed
    assert CounterEnv.closed == ["idle"]


async def test_step_timeout_replies_then_episode_ends_until_reset(serve_env):
    CounterEnv.closed.clear()
    srv = serve_env(CounterEnv, tag="slow")
    async with websockets.connect(srv.ws_url + "?ext=request_id,step_timeout") as ws:
        await ws.recv()  # hello
        await ask(ws, {"type": "reset", "id": 1})
        started = time.monotonic()
        reply = await ask(ws, {"type": "step", "data": {"text": "sleep:1.0"}, "timeout_s": 0.1, "id": 2})
        assert reply["data"]["code"] == "STEP_TIMEOUT" and reply["id"] == 2
        assert time.monotonic() - started < 0.9  # answered before the step itself returned
        assert (await ask(ws, {"type": "step", "data": {"text": "x"}}))["data"]["code"] == "EPISODE_ENDED"
        fresh = await ask(ws, {"type": "reset", "data": {"start": 10}})
        assert fresh["data"]["observation"]["text"] == "10"
        assert (await ask(ws, {"type": "step", "data": {"text": "x"}}))["data"]["observation"]["text"] == "11"
        await wait_for_closed()  # the stuck instance is closed once its thread returns
        assert CounterEnv.closed == ["slow"]


async def test_server_step_timeout_setting_applies_to_openenv_clients(serve_env):
    srv = serve_env(CounterEnv, step_timeout_s=0.1)
    async with websockets.connect(srv.ws_url) as ws:
        await ask(ws, {"type": "reset"})
        assert (await ask(ws, {"type": "step", "data": {"text": "sleep:0.4"}}))["data"]["code"] == "STEP_TIMEOUT"


async def test_resume_after_drop_replays_the_in_flight_reply(serve_env):
    srv = serve_env(CounterEnv, resume_grace_s=5)
    ws = await websockets.connect(srv.ws_url + "?ext=request_id,resume")
    hello = json.loads(await ws.recv())["data"]
    await ask(ws, {"type": "reset", "id": 1})
    await ws.send(json.dumps({"type": "step", "data": {"text": "sleep:0.3"}, "id": 2}))
    ws.transport.abort()  # the connection dies mid-request, without a close frame
    query = f"?ext=request_id,resume&resume={hello['session_id']}&resume_token={hello['resume_token']}"
    async with websockets.connect(srv.ws_url + query) as again:
        back = json.loads(await again.recv())["data"]
        assert back["resumed"] is True and back["session_id"] == hello["session_id"]
        replay = await ask(again, {"type": "step", "data": {"text": "sleep:0.3"}, "id": 2})
        assert replay["id"] == 2 and replay["data"]["observation"]["text"] == "1"
        state = await ask(again, {"type": "state", "id": 3})
        assert state["data"]["count"] == 1  # executed once, not twice


async def test_resume_of_unknown_session_is_4404(serve_env):
    srv = serve_env(EchoEnv)
    async with websockets.connect(srv.ws_url + "?ext=resume&resume=nope&resume_token=x") as ws:
        assert json.loads(await ws.recv())["data"]["code"] == "SESSION_EXPIRED"
        assert await closed_with(ws) == 4404


async def test_bearer_token_on_websocket(serve_env):
    srv = serve_env(EchoEnv, token="s3cret")
    async with websockets.connect(srv.ws_url) as ws:
        assert json.loads(await ws.recv())["data"]["code"] == "UNAUTHORIZED"
        assert await closed_with(ws) == 1008
    headers = {"Authorization": "Bearer s3cret"}
    async with websockets.connect(srv.ws_url, additional_headers=headers) as ws:
        assert (await ask(ws, {"type": "reset"}))["type"] == "observation"
    async with websockets.connect(srv.ws_url + "?token=s3cret") as ws:
        assert (await ask(ws, {"type": "reset"}))["type"] == "observation"


async def test_msgpack_and_tools_extensions(serve_env):
    srv = serve_env(EchoEnv)
    async with websockets.connect(srv.ws_url + "?ext=msgpack,tools,request_id") as ws:
        hello = json.loads(await ws.recv())  # hello is always JSON text
        assert hello["data"]["extensions"] == ["msgpack", "request_id", "tools"]
        reply = await ask(ws, msgpack.packb({"type": "reset", "id": "a"}))
        assert reply["id"] == "a" and reply["data"]["observation"]["echoed_message"] == "ready"
        assert (await ask(ws, msgpack.packb({"type": "tools"})))["data"] == {"tools": []}
        assert (await ask(ws, json.dumps({"type": "state"})))["type"] == "state"  # JSON text still accepted


async def test_frame_limits_message_too_large_then_1009(serve_env):
    srv = serve_env(EchoEnv, max_message_bytes=64 * 1024)
    async with websockets.connect(srv.ws_url, max_size=None) as ws:
        await ask(ws, {"type": "reset"})
        big = {"type": "step", "data": {"message": "x" * 100_000}}
        assert (await ask(ws, big))["data"]["code"] == "MESSAGE_TOO_LARGE"
        assert (await ask(ws, {"type": "step", "data": {"message": "small"}}))["type"] == "observation"
        await ws.send(json.dumps({"type": "step", "data": {"message": "x" * 200_000}}))
        assert await closed_with(ws) == 1009


class AsyncEnv(Env):
    """Async methods run on the event loop; ``wait:S`` awaits S seconds."""

    closed: list[str] = []

    async def reset(self, seed=None):
        return Observation(text="async ready")

    async def on_text(self, text: str):
        if text.startswith("wait:"):
            await asyncio.sleep(float(text[5:]))
        return Observation(text=text.upper())

    async def close(self) -> None:
        AsyncEnv.closed.append("closed")


async def test_slow_sync_step_does_not_stall_other_sessions(serve_env):
    srv = serve_env(CounterEnv)
    async with websockets.connect(srv.ws_url) as slow, websockets.connect(srv.ws_url) as fast:
        await ask(slow, {"type": "reset"})
        await ask(fast, {"type": "reset"})
        await slow.send(json.dumps({"type": "step", "data": {"text": "sleep:1.2"}}))
        started = time.monotonic()
        for _ in range(20):
            await ask(fast, {"type": "step", "data": {"text": "x"}})
        assert time.monotonic() - started < 1.0  # served while the other session's thread sleeps
        assert json.loads(await slow.recv())["data"]["observation"]["text"] == "1"


async def test_async_env_timeout_cancels_and_closes_the_instance(serve_env):
    AsyncEnv.closed.clear()
    srv = serve_env(AsyncEnv)
    async with websockets.connect(srv.ws_url) as ws:
        assert (await ask(ws, {"type": "reset"}))["data"]["observation"]["text"] == "async ready"
        assert (await ask(ws, {"type": "step", "data": {"text": "hi"}}))["data"]["observation"]["text"] == "HI"
        reply = await ask(ws, {"type": "step", "data": {"text": "wait:30"}, "timeout_s": 0.1})
        assert reply["data"]["code"] == "STEP_TIMEOUT"
        for _ in range(80):
            if AsyncEnv.closed:
                break
            await asyncio.sleep(0.05)
        assert AsyncEnv.closed == ["closed"]
        assert (await ask(ws, {"type": "reset"}))["type"] == "observation"


async def test_mcp_over_websocket_uses_the_session_env(serve_env):
    srv = serve_env(EchoEnv)
    async with websockets.connect(srv.ws_url) as ws:
        listed = await ask(ws, {"type": "mcp", "data": {"jsonrpc": "2.0", "method": "tools/list", "id": 1}})
        assert listed == {"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "result": {"tools": []}}}
        bad = await ask(ws, {"type": "mcp", "data": [1]})
        assert bad["data"]["error"]["code"] == -32600


async def test_metrics_follow_websocket_sessions(serve_env):
    import httpx
    srv = serve_env(EchoEnv)
    async with websockets.connect(srv.ws_url) as ws:
        await ask(ws, {"type": "reset"})
        await ask(ws, {"type": "step", "data": {"message": "a"}})
        await ask(ws, "garbage")
        async with httpx.AsyncClient() as http:
            text = (await http.get(srv.url + "/metrics")).text
    assert "envhub_sessions_active 1" in text and "envhub_steps_total 1" in text
    assert 'envhub_errors_total{code="INVALID_JSON"} 1' in text


class CircularInfoEnv(Env):
    def reset(self, seed=None):
        info: dict = {"big": 2 ** 80}
        info["loop"] = info if seed == 1 else None
        return StepResult(observation=Observation(text="x"), info=info)


async def test_unserialisable_reply_fails_only_that_request(serve_env):
    srv = serve_env(CircularInfoEnv)
    async with websockets.connect(srv.ws_url) as ws:
        reply = await ask(ws, {"type": "reset", "data": {"seed": 1}})
        assert reply["data"]["code"] == "EXECUTION_ERROR" and "serialised" in reply["data"]["message"]
        ok = await ask(ws, {"type": "reset", "data": {"seed": 2}})
        assert ok["data"]["info"]["big"] == 2 ** 80  # beyond 64 bits still encodes


async def test_dropped_resumable_session_expires_after_the_grace_period(serve_env):
    CounterEnv.closed.clear()
    srv = serve_env(CounterEnv, resume_grace_s=1.0, tag="grace")
    ws = await websockets.connect(srv.ws_url + "?ext=resume")
    hello = json.loads(await ws.recv())["data"]
    await ask(ws, {"type": "reset"})
    ws.transport.abort()
    await asyncio.sleep(0.1)
    assert CounterEnv.closed == []  # kept for a resume
    await wait_for_closed(timeout_s=5.0)
    assert CounterEnv.closed == ["grace"]
    query = f"?ext=resume&resume={hello['session_id']}&resume_token={hello['resume_token']}"
    async with websockets.connect(srv.ws_url + query) as again:
        assert json.loads(await again.recv())["data"]["code"] == "SESSION_EXPIRED"


async def test_resume_with_a_wrong_token_is_refused(serve_env):
    srv = serve_env(CounterEnv, resume_grace_s=5)
    ws = await websockets.connect(srv.ws_url + "?ext=resume")
    hello = json.loads(await ws.recv())["data"]
    ws.transport.abort()
    async with websockets.connect(srv.ws_url + f"?ext=resume&resume={hello['session_id']}&resume_token=guess") as bad:
        assert json.loads(await bad.recv())["data"]["code"] == "SESSION_EXPIRED"
        assert await closed_with(bad) == 4404


class SlowFactoryEnv(CounterEnv):
    def __init__(self, tag: str = "slowfactory"):
        time.sleep(0.4)
        super().__init__(tag)


async def test_client_leaving_during_env_construction_frees_the_slot(serve_env):
    import httpx
    CounterEnv.closed.clear()
    srv = serve_env(SlowFactoryEnv, max_sessions=1)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(websockets.connect(srv.ws_url), 0.1)
    await wait_for_closed()
    assert CounterEnv.closed == ["slowfactory"]
    async with httpx.AsyncClient() as http:
        assert "envhub_sessions_active 0" in (await http.get(srv.url + "/metrics")).text
    async with websockets.connect(srv.ws_url) as ws:  # the only slot is free again
        assert (await ask(ws, {"type": "reset"}))["type"] == "observation"


class DecidedEnv(Env):
    """``reset(over=True)`` is an episode that is over before its first step."""

    def reset(self, seed=None, over: bool = False):
        if over:
            return StepResult(observation=Observation(text="decided"), reward=3.0, done=True, info={"outcome": "win"})
        return Observation(text="go")

    def on_text(self, text: str):
        return StepResult(observation=Observation(text="moved"), reward=1.0, done=True)


async def test_a_done_reset_travels_as_done_and_refuses_steps(serve_env):
    srv = serve_env(DecidedEnv)
    async with websockets.connect(srv.ws_url) as ws:
        reply = await ask(ws, {"type": "reset", "data": {"over": True}})
        assert reply["type"] == "observation"
        data = reply["data"]
        assert data["done"] is True and data["reward"] == 3.0 and data["observation"]["text"] == "decided"
        assert (await ask(ws, {"type": "step", "data": {"text": "x"}}))["data"]["code"] == "EPISODE_ENDED"
        state = await ask(ws, {"type": "state"})
        assert state["data"]["done"] is True and state["data"]["episode_reward"] == 3.0
        assert (await ask(ws, {"type": "reset"}))["data"]["done"] is False
        assert (await ask(ws, {"type": "step", "data": {"text": "x"}}))["data"]["reward"] == 1.0
