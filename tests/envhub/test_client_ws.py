"""EnvClient against a scripted fake server that follows the wire contract (hello, ids, msgpack, drops, delays).

The fake is a real ``websockets`` server on a loopback port: every byte crosses a socket.
Step actions script it: ``{"message": "sleep:0.3"}`` delays the reply, ``"drop"`` kills the
TCP connection after computing (and caching) the reply, ``"error:CODE"`` answers an error
frame, ``"close:CODE"`` closes the socket with that code.
"""

import asyncio
import json
import time
import uuid
from urllib.parse import parse_qs, urlsplit

import msgpack
import pytest
from websockets.asyncio.server import serve
from websockets.datastructures import Headers
from websockets.http11 import Response

from envhub.client import EnvClient
from envhub.errors import (
    ActionValidationError,
    AuthError,
    CapacityError,
    EnvConnectionError,
    EnvExecutionError,
    MessageTooLargeError,
    ProtocolError,
    SessionLostError,
    StepTimeoutError,
)

ALL_EXT = ["request_id", "msgpack", "tools", "resume", "step_timeout"]
TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo a message.",
                                           "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}}]


class FakeServer:
    """A contract-following env server in ~100 lines, scripted through step messages."""

    def __init__(self, extensions=ALL_EXT, token=None, envhub=True, reject=None):
        self.extensions, self.token, self.envhub, self.reject = list(extensions), token, envhub, reject
        self.frames: list = []          # every request envelope received, decoded
        self.connections = 0
        self.sessions: dict = {}        # session_id -> {"token", "steps", "last_id", "last_reply"}
        self.dropped_once: set = set()

    async def __aenter__(self):
        self._server = await serve(self._handle, "127.0.0.1", 0, process_request=self._http, compression=None)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self._server.close()
        await self._server.wait_closed()

    def _http(self, conn, request):
        if request.path.startswith("/ws"):
            if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
                return Response(401, "Unauthorized", Headers([("Content-Length", "0")]), b"")
            return None
        meta = {"name": "Fake", "description": "scripted"}
        if self.envhub:
            meta["envhub"] = {"version": "0.1.0", "protocol": 1, "extensions": self.extensions, "tools": TOOLS}
        body = json.dumps(meta).encode()
        return Response(200, "OK", Headers([("Content-Type", "application/json"),
                                            ("Content-Length", str(len(body)))]), body)

    async def _handle(self, ws):
        self.connections += 1
        if self.reject:  # OpenEnv style: an error frame straight after accept, then close 1000
            await ws.send(json.dumps({"type": "error", "data": {"code": self.reject, "message": "rejected"}}))
            await ws.close(1000)
            return
        q = {k: v[0] for k, v in parse_qs(urlsplit(ws.request.path).query).items()}
        ext = [e for e in q.get("ext", "").split(",") if e in self.extensions]
        if "resume" in q:
            sess = self.sessions.get(q["resume"])
            if sess is None or sess["token"] != q.get("resume_token"):
                await ws.send(json.dumps({"type": "error", "data": {"code": "SESSION_EXPIRED", "message": "gone"}}))
                await ws.close(4404)
                return
            sid = q["resume"]
        else:
            sid = uuid.uuid4().hex
            self.sessions[sid] = {"token": uuid.uuid4().hex, "steps": 0, "last_id": None, "last_reply": None}
        sess = self.sessions[sid]
        if ext:
            await ws.send(json.dumps({"type": "hello", "data": {
                "session_id": sid, "extensions": ext, "resume_token": sess["token"], "resumed": "resume" in q}}))
        binary = "msgpack" in ext
        async for raw in ws:
            msg = msgpack.unpackb(raw) if isinstance(raw, bytes) else json.loads(raw)
            self.frames.append(msg)
            if msg["type"] == "close":
                await ws.close(1000)
                return
            rid = msg.get("id")
            if rid is not None and rid == sess["last_id"]:
                reply = sess["last_reply"]  # resumed re-send: answer from the cache, do not re-execute
            else:
                reply = await self._reply(msg, sess, ws)
                if reply is None:
                    return
                if rid is not None:
                    reply["id"] = rid
                sess["last_id"], sess["last_reply"] = rid, reply
            if (msg.get("data") or {}).get("message") == "drop" and sid not in self.dropped_once:
                self.dropped_once.add(sid)
                ws.transport.abort()  # abnormal drop (1006) after the step ran
                return
            await ws.send(msgpack.packb(reply) if binary else json.dumps(reply))

    async def _reply(self, msg, sess, ws):
        t, data = msg["type"], msg.get("data") or {}
        if t == "reset":
            sess["steps"] = 0
            return {"type": "observation", "data": {"observation": {"text": "ready", "kwargs": data},
                                                    "reward": 0.0, "done": False}}
        if t == "state":
            return {"type": "state", "data": {"step_count": sess["steps"]}}
        if t == "tools":
            return {"type": "tools", "data": {"tools": TOOLS}}
        if t != "step":
            return {"type": "error", "data": {"code": "UNKNOWN_TYPE", "message": t}}
        m = str(data.get("message", ""))
        if m.startswith("sleep:"):
            await asyncio.sleep(float(m[6:]))
        if m == "wrong-kind":
            return {"type": "state", "data": {}}
        if m.startswith("error:"):
            return {"type": "error", "data": {"code": m[6:], "message": "scripted"}}
        if m == "big":
            m = "x" * 5000
        if m.startswith("close:"):
            await ws.close(int(m[6:]))
            return None
        sess["steps"] += 1
        return {"type": "observation", "data": {"observation": {"text": m, "timeout_s": msg.get("timeout_s")},
                                                "reward": 1.0, "done": m == "bye", "info": {"n": sess["steps"]}}}


async def test_plain_openenv_mode_sends_only_openenv_keys():
    async with FakeServer(envhub=False) as srv:
        async with EnvClient(srv.url) as env:
            assert env.extensions == frozenset()
            first = await env.reset(seed=3)
            assert first.observation.text == "ready" and first.observation.kwargs == {"seed": 3}
            r = await env.step({"message": "hi"})
            assert (r.observation.text, r.reward, r.done) == ("hi", 1.0, False)
            assert await env.state() == {"step_count": 1}
        assert all(set(f) <= {"type", "data"} for f in srv.frames), srv.frames
        assert srv.frames[-1] == {"type": "close"}


async def test_envhub_mode_negotiates_ids_msgpack_and_tools():
    async with FakeServer() as srv:
        env = EnvClient(srv.url, step_timeout_s=2.5)
        await env.reset()
        assert env.extensions == frozenset(ALL_EXT)
        assert env.session_id in srv.sessions
        r = await env.step({"message": "hi"})
        assert r.observation.text == "hi" and r.info == {"n": 1}
        assert r.observation.timeout_s == 2.5  # the step_timeout extension carried the deadline
        assert [t.name for t in await env.tools()] == ["echo"]
        ids = [f["id"] for f in srv.frames if "id" in f]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        await env.close()


async def test_explicit_extension_list_skips_metadata():
    async with FakeServer() as srv:
        async with EnvClient(srv.url, extensions=["request_id"]) as env:
            await env.reset()
            assert env.metadata is None and env.extensions == {"request_id"}
            assert (await env.step({"message": "x"})).observation.text == "x"


async def test_forced_extensions_against_plain_server_fail_fast_and_clean():
    async with FakeServer(envhub=False, extensions=[]) as srv:
        env = EnvClient(srv.url, extensions=["request_id"], connect_timeout_s=0.2, retries=1, backoff_s=0.01)
        with pytest.raises(EnvConnectionError, match="2 attempt"):
            await env.reset()
        assert srv.connections == 2 and not env.connected


async def test_client_is_lazy():
    async with FakeServer() as srv:
        env = EnvClient(srv.url)
        await asyncio.sleep(0.05)
        assert srv.connections == 0 and not env.connected
        await env.reset()
        assert srv.connections == 1
        await env.close()


@pytest.mark.parametrize("code,exc", [("VALIDATION_ERROR", ActionValidationError),
                                      ("EXECUTION_ERROR", EnvExecutionError)])
async def test_error_frames_raise_typed_errors_and_session_survives(code, exc):
    async with FakeServer() as srv, EnvClient(srv.url) as env:
        await env.reset()
        with pytest.raises(exc, match=code):
            await env.step({"message": f"error:{code}"})
        assert (await env.step({"message": "after"})).observation.text == "after"


async def test_capacity_error_frame_in_openenv_mode():
    async with FakeServer(envhub=False) as srv, EnvClient(srv.url) as env:
        with pytest.raises(CapacityError):
            await env.step({"message": "error:CAPACITY_REACHED"})
        assert not env.connected  # a fatal code drops the session


async def test_error_frame_sent_before_close_is_not_lost():
    async with FakeServer(envhub=False, reject="CAPACITY_REACHED") as srv, EnvClient(srv.url) as env:
        await asyncio.sleep(0.1)  # the error frame and the close arrive before the first request is sent
        with pytest.raises(CapacityError):
            await env.reset()


async def test_timeout_with_request_ids_never_pairs_a_stale_reply():
    async with FakeServer() as srv, EnvClient(srv.url) as env:
        await env.reset()
        env.message_timeout_s = 0.2
        with pytest.raises(StepTimeoutError):
            await env.step({"message": "sleep:0.4"})
        env.message_timeout_s = 5
        r = await env.step({"message": "second"})
        assert r.observation.text == "second"  # the late "sleep" reply was discarded by id
        assert (await env.step({"message": "third"})).observation.text == "third"


async def test_timeout_without_ids_drops_the_session():
    async with FakeServer(envhub=False) as srv, EnvClient(srv.url) as env:
        await env.reset()
        env.message_timeout_s = 0.2
        with pytest.raises(StepTimeoutError):
            await env.step({"message": "sleep:0.4"})
        with pytest.raises(SessionLostError):
            await env.step({"message": "second"})
        env.message_timeout_s = 5
        assert (await env.reset()).observation.text == "ready"  # reset opens a fresh session
        assert (await env.step({"message": "third"})).observation.text == "third"
        assert srv.connections == 2


async def test_drop_with_resume_replays_in_flight_request_once():
    async with FakeServer() as srv, EnvClient(srv.url) as env:
        await env.reset()
        sid = env.session_id
        r = await env.step({"message": "drop"})
        assert r.observation.text == "drop" and r.info == {"n": 1}  # cached reply, not executed twice
        assert env.session_id == sid and srv.connections == 2
        assert (await env.step({"message": "next"})).info == {"n": 2}


async def test_drop_without_resume_raises_session_lost():
    async with FakeServer(extensions=["request_id"]) as srv, EnvClient(srv.url) as env:
        await env.reset()
        with pytest.raises(SessionLostError, match="1006"):
            await env.step({"message": "drop"})
        with pytest.raises(SessionLostError):
            await env.state()
        await env.reset()
        assert (await env.step({"message": "ok"})).observation.text == "ok"


@pytest.mark.parametrize("code,exc", [(1008, AuthError), (1013, CapacityError), (4404, SessionLostError),
                                      (1011, SessionLostError)])
async def test_close_codes_map_to_typed_errors(code, exc):
    async with FakeServer(extensions=["request_id"]) as srv, EnvClient(srv.url) as env:
        await env.reset()
        with pytest.raises(exc):
            await env.step({"message": f"close:{code}"})


async def test_auth_token_is_sent_and_checked():
    async with FakeServer(token="s3cret") as srv:
        async with EnvClient(srv.url, token="s3cret") as env:
            assert (await env.reset()).observation.text == "ready"
        with pytest.raises(AuthError):
            await EnvClient(srv.url, token="wrong", retries=0).connect()


async def test_connect_retries_with_backoff_then_fails_typed():
    async with FakeServer() as srv:
        url = srv.url
    t0 = time.perf_counter()
    with pytest.raises(EnvConnectionError, match="3 attempt"):
        await EnvClient(url, retries=2, backoff_s=0.05).reset()
    assert time.perf_counter() - t0 >= 0.05 + 0.1


async def test_connect_succeeds_when_server_comes_up_during_backoff():
    async with FakeServer() as srv:
        port = int(srv.url.rsplit(":", 1)[1])
    env = EnvClient(f"http://127.0.0.1:{port}", retries=4, backoff_s=0.1)
    connecting = asyncio.ensure_future(env.reset())
    await asyncio.sleep(0.12)
    srv2 = FakeServer()
    srv2._server = await serve(srv2._handle, "127.0.0.1", port, process_request=srv2._http)
    try:
        assert (await connecting).observation.text == "ready"
        await env.close()
    finally:
        srv2._server.close()


async def test_pydantic_action_is_dumped():
    from pydantic import BaseModel

    class Say(BaseModel):
        message: str

    async with FakeServer() as srv, EnvClient(srv.url) as env:
        await env.reset()
        assert (await env.step(Say(message="typed"))).observation.text == "typed"


async def test_sync_client_same_api():
    async with FakeServer() as srv:
        def run():
            with EnvClient(srv.url).sync() as env:
                env.reset(seed=1)
                out = [env.step({"message": f"m{i}"}).observation.text for i in range(3)]
                return out, env.state(), [t.name for t in env.tools()]
        out, state, tools = await asyncio.to_thread(run)
        assert out == ["m0", "m1", "m2"] and state == {"step_count": 3} and tools == ["echo"]


@pytest.mark.parametrize("envhub", [False, True])
async def test_cancelled_request_never_desynchronises(envhub):
    async with FakeServer(envhub=envhub) as srv, EnvClient(srv.url) as env:
        await env.reset()
        pending = asyncio.ensure_future(env.step({"message": "sleep:0.3"}))
        await asyncio.sleep(0.05)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        if envhub:  # request ids: the session survives and the stale reply is skipped
            assert (await env.step({"message": "next"})).observation.text == "next"
        else:       # plain OpenEnv: the session is dropped rather than risk a shifted reply
            with pytest.raises(SessionLostError):
                await env.step({"message": "next"})


async def test_shortened_timeout_applies_to_the_next_request():
    async with FakeServer() as srv, EnvClient(srv.url, message_timeout_s=60) as env:
        await env.reset()
        await env.step({"message": "fast"})  # arms the deadline timer 60 s ahead
        env.message_timeout_s = 0.2
        t0 = time.perf_counter()
        with pytest.raises(StepTimeoutError):
            await env.step({"message": "sleep:1.0"})
        assert time.perf_counter() - t0 < 0.8


async def test_using_a_client_from_another_event_loop_is_a_clear_error():
    async with FakeServer() as srv, EnvClient(srv.url) as env:
        await env.reset()
        with pytest.raises(RuntimeError, match="event loop"):
            await asyncio.to_thread(asyncio.run, env.step({"message": "x"}))
        assert (await env.step({"message": "still fine"})).observation.text == "still fine"


@pytest.mark.parametrize("envhub", [False, True])
async def test_reply_over_the_client_frame_limit_is_typed_and_not_retried(envhub):
    async with FakeServer(envhub=envhub) as srv, EnvClient(srv.url, max_message_bytes=2000) as env:
        await env.reset()
        with pytest.raises(MessageTooLargeError):
            await env.step({"message": "big"})
        assert srv.connections == 1  # no resume loop re-fetching the same oversized reply


async def test_reply_of_the_wrong_kind_is_a_protocol_error_and_drops_the_session():
    async with FakeServer(envhub=False) as srv, EnvClient(srv.url) as env:
        await env.reset()
        with pytest.raises(ProtocolError, match="'observation' reply"):
            await env.step({"message": "wrong-kind"})
        with pytest.raises(SessionLostError):
            await env.step({"message": "next"})


async def test_sync_clients_from_many_threads_share_one_loop_safely():
    async with FakeServer() as srv:
        def episode(k):
            with EnvClient(srv.url).sync() as env:
                env.reset()
                return [env.step({"message": f"{k}-{i}"}).observation.text for i in range(10)]
        results = await asyncio.gather(*(asyncio.to_thread(episode, k) for k in range(6)))
        assert results == [[f"{k}-{i}" for i in range(10)] for k in range(6)]
