"""Hostile input at the edges: lone surrogates, deep nesting, multi-byte frames, bad token settings, invalid UTF-8."""

from __future__ import annotations

import asyncio
import json
import logging

import msgpack
import pytest
import websockets
from starlette.testclient import TestClient
from websockets.exceptions import ConnectionClosed

from envhub import EnvClient
from envhub.errors import ActionValidationError
from envhub.server import create_app
from envhub.settings import Settings
from envhub.testing import EchoEnv

pytestmark = pytest.mark.live

LONE = "\ud800"
DEEP = "[" * 100_000 + "]" * 100_000


async def ask(ws, message) -> dict:
    await ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
    reply = await asyncio.wait_for(ws.recv(), 10)
    return msgpack.unpackb(reply) if isinstance(reply, bytes) else json.loads(reply)


async def test_lone_surrogates_in_replies_keep_the_session(serve_env):
    srv = serve_env(EchoEnv)
    async with websockets.connect(srv.ws_url + "?ext=request_id") as ws:
        await ws.recv()  # hello
        await ask(ws, {"type": "reset"})
        # JSON escapes carry a lone surrogate losslessly, in echoed step data, type names and ids
        echoed = await ask(ws, {"type": "step", "data": {"message": LONE}, "id": 1})
        assert echoed["data"]["observation"]["echoed_message"] == LONE
        unknown = await ask(ws, {"type": "bogus" + LONE, "id": "x" + LONE})
        assert unknown["data"]["code"] == "UNKNOWN_TYPE" and unknown["id"] == "x" + LONE
        assert (await ask(ws, {"type": "step", "data": {"message": "ok"}, "id": 2}))["id"] == 2
    async with websockets.connect(srv.ws_url + "?ext=msgpack") as ws:
        await ws.recv()
        await ask(ws, msgpack.packb({"type": "reset"}))
        # msgpack cannot carry one: the server replaces it with U+FFFD
        echoed = await ask(ws, json.dumps({"type": "step", "data": {"message": "a" + LONE}}))
        assert echoed["data"]["observation"]["echoed_message"] == "a\ufffd"
        assert (await ask(ws, msgpack.packb({"type": "state"})))["type"] == "state"


@pytest.mark.parametrize("extensions", [(), ("request_id", "resume")])
async def test_json_client_sends_and_receives_lone_surrogates(serve_env, extensions):
    srv = serve_env(EchoEnv)
    async with EnvClient(srv.url, extensions=extensions) as env:
        await env.reset()
        assert (await env.step({"message": LONE})).observation.echoed_message == LONE
        assert (await env.step({"message": "still here"})).observation.echoed_message == "still here"


async def test_msgpack_client_refuses_lone_surrogates_with_an_envhub_error(serve_env):
    srv = serve_env(EchoEnv)
    async with EnvClient(srv.url, extensions=["msgpack", "request_id"]) as env:
        await env.reset()
        with pytest.raises(ActionValidationError, match="surrogate"):
            await env.step({"message": LONE})
        assert (await env.step({"message": "fine"})).observation.echoed_message == "fine"


def test_http_replies_with_lone_surrogates_and_deep_nesting():
    with TestClient(create_app(EchoEnv, settings=Settings(log_level="warning"))) as http:
        sid = http.post("/reset", json={}).json()["session_id"]
        body = json.dumps({"session_id": sid, "action": {"message": LONE}})
        step = http.post("/step", content=body, headers={"content-type": "application/json"})
        assert step.status_code == 200 and step.json()["observation"]["echoed_message"] == LONE
        for path in ("/step", "/reset"):
            deep = http.post(path, content=DEEP, headers={"X-Envhub-Session": sid})
            assert deep.status_code == 400 and deep.json()["code"] == "INVALID_JSON", path
        mcp = http.post("/mcp", content=DEEP)
        assert mcp.status_code == 200 and mcp.json()["error"]["code"] == -32700
        assert http.post("/step", json={"session_id": sid, "action": {"message": "ok"}}).status_code == 200


async def test_max_message_bytes_counts_utf8_bytes_of_text_frames(serve_env):
    srv = serve_env(EchoEnv, max_message_bytes=64 * 1024)
    async with websockets.connect(srv.ws_url, max_size=None) as ws:
        await ask(ws, {"type": "reset"})
        euros = json.dumps({"type": "step", "data": {"message": "€" * 30_000}}, ensure_ascii=False)
        assert len(euros) < 64 * 1024 < len(euros.encode())  # 30 000 characters, 90 000 bytes
        assert (await ask(ws, euros))["data"]["code"] == "MESSAGE_TOO_LARGE"
        fits = json.dumps({"type": "step", "data": {"message": "€" * 20_000}}, ensure_ascii=False)  # 60 000 bytes
        assert (await ask(ws, fits))["type"] == "observation"


async def test_invalid_utf8_frames_log_one_line_per_connection(serve_env, caplog):
    srv = serve_env(EchoEnv)
    caplog.set_level(logging.INFO)
    uvicorn_log = logging.getLogger("uvicorn.error")  # does not propagate to the root logger
    uvicorn_log.addHandler(caplog.handler)
    try:
        await _send_invalid_utf8_three_times(srv.port)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    lines = [r for r in caplog.records if "UTF-8" in r.getMessage()]
    assert len(lines) == 3, [r.getMessage() for r in caplog.records]


async def _send_invalid_utf8_three_times(port: int) -> None:
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        payload = b"\xff\xfe"
        # three masked text frames with bad UTF-8 in one write: the server sees them in one batch
        writer.write((bytes([0x81, 0x80 | len(payload)]) + b"\0\0\0\0" + payload) * 3)
        try:
            await writer.drain()
            closing = await asyncio.wait_for(reader.read(64), 5)
        except ConnectionError:  # the server closed first and the kernel reset the socket: fine
            closing = b""
        if closing:
            assert closing[:1] == b"\x88" and int.from_bytes(closing[2:4], "big") == 1007
        writer.close()
    await asyncio.sleep(0.2)


async def test_connection_survives_a_surrogate_in_a_raw_json_frame(serve_env):
    srv = serve_env(EchoEnv)
    async with websockets.connect(srv.ws_url) as ws:
        await ask(ws, {"type": "reset"})
        reply = await ask(ws, '{"type": "step", "data": {"message": "\\udfff"}}')
        assert reply["data"]["observation"]["echoed_message"] == "\udfff"
        try:
            assert (await ask(ws, {"type": "state"}))["type"] == "state"
        except ConnectionClosed as exc:  # pragma: no cover - the failure this guards against
            pytest.fail(f"connection closed: {exc}")
