"""Robustness under abuse and load: malformed frames at one session while others work; many concurrent sessions."""

from __future__ import annotations

import asyncio
import json
import random

import msgpack
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from envhub import Env, Observation, StepResult

pytestmark = pytest.mark.live


class TallyEnv(Env):
    """Each session appends its own tokens; state must only ever contain this session's tokens."""

    run_inline = True

    def reset(self, seed=None, owner: str = ""):
        self.owner, self.tokens = owner, []
        return Observation(text=owner)

    def on_text(self, text: str):
        self.tokens.append(text)
        return StepResult(observation=Observation(text=f"{self.owner}:{len(self.tokens)}"))

    def state(self):
        return {"owner": self.owner, "tokens": list(self.tokens)}


def garbage(rng: random.Random) -> str | bytes:
    """One malformed or hostile frame."""
    choices = [
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64))),
        lambda: "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(0, 40))),
        lambda: json.dumps(rng.choice([None, 1, 2.5, "s", [], [1, {"type": "step"}], True])),
        lambda: json.dumps({"type": rng.choice([None, 1, [], {}, "stepp", "", "RESET"])}),
        lambda: json.dumps({"type": "step", "data": rng.choice([None, [], "x", 5, {"text": 5}, {"text": "a", "z": 1}])}),
        lambda: json.dumps({"type": "reset", "data": rng.choice([[], "x", {"seed": "x"}, {"seed": -1.5}, {"bogus": 1}])}),
        lambda: json.dumps({"type": "step", "data": {"text": "x"}, "id": rng.choice([[], {}, 1.5, True])}),
        lambda: "[" * 50_000 + "]" * 50_000,  # deep nesting
        lambda: json.dumps({"type": "step", "data": {"text": "\u0000\u202e\U0001F600"}}),
        lambda: json.dumps({"type": "mcp", "data": rng.choice([None, [], {"jsonrpc": "1.0"}, {"jsonrpc": "2.0", "method": 3}])}),
        lambda: msgpack.packb({"type": "step", "data": {"text": "binary without negotiation"}}),
        lambda: json.dumps({"type": "step", "data": {"text": "y" * rng.randint(1000, 200_000)}}),
    ]
    return rng.choice(choices)()


async def test_fuzzed_session_survives_and_never_disturbs_a_neighbour(serve_env):
    srv = serve_env(TallyEnv, max_message_bytes=128 * 1024)
    rng = random.Random(1234)

    async def neighbour() -> list[str]:
        async with websockets.connect(srv.ws_url) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {"owner": "calm"}}))
            await ws.recv()
            for i in range(200):
                await ws.send(json.dumps({"type": "step", "data": {"text": f"t{i}"}}))
                reply = json.loads(await ws.recv())
                assert reply["data"]["observation"]["text"] == f"calm:{i + 1}"
            await ws.send(json.dumps({"type": "state"}))
            return json.loads(await ws.recv())["data"]["tokens"]

    async def fuzzer() -> int:
        replies = 0
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {"owner": "fuzz"}}))
            await ws.recv()
            for _ in range(300):
                await ws.send(garbage(rng))
                reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
                assert reply["type"] in ("error", "observation", "mcp", "state"), reply
                replies += 1
            await ws.send(json.dumps({"type": "step", "data": {"text": "still here"}}))
            assert json.loads(await ws.recv())["type"] == "observation"
        return replies

    tokens, replies = await asyncio.gather(neighbour(), fuzzer())
    assert tokens == [f"t{i}" for i in range(200)]
    assert replies == 300


async def test_frame_over_transport_limit_closes_only_that_socket(serve_env):
    srv = serve_env(TallyEnv, max_message_bytes=32 * 1024)
    async with websockets.connect(srv.ws_url) as calm:
        await calm.send(json.dumps({"type": "reset", "data": {"owner": "calm"}}))
        await calm.recv()
        async with websockets.connect(srv.ws_url, max_size=None) as rude:
            await rude.send("z" * 100_000)  # over the transport limit (2 x max_message_bytes)
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(rude.recv(), 10)
            assert info.value.rcvd.code == 1009
        await calm.send(json.dumps({"type": "step", "data": {"text": "ok"}}))
        assert json.loads(await calm.recv())["data"]["observation"]["text"] == "calm:1"


async def test_150_concurrent_sessions_keep_their_own_state(serve_env):
    srv = serve_env(TallyEnv, max_sessions=200)
    n_sessions, n_steps = 150, 20

    async def one(k: int) -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {"owner": f"s{k}"}}))
            await ws.recv()
            for i in range(n_steps):
                await ws.send(json.dumps({"type": "step", "data": {"text": f"s{k}-{i}"}}))
                assert json.loads(await ws.recv())["data"]["observation"]["text"] == f"s{k}:{i + 1}"
                if i % 7 == 0:
                    await asyncio.sleep(0)
            await ws.send(json.dumps({"type": "state"}))
            state = json.loads(await ws.recv())["data"]
            assert state["owner"] == f"s{k}" and state["tokens"] == [f"s{k}-{i}" for i in range(n_steps)]

    await asyncio.gather(*(one(k) for k in range(n_sessions)))


async def test_pipelined_requests_are_answered_in_order(serve_env):
    srv = serve_env(TallyEnv)
    async with websockets.connect(srv.ws_url + "?ext=request_id") as ws:
        await ws.recv()  # hello
        await ws.send(json.dumps({"type": "reset", "data": {"owner": "p"}, "id": 0}))
        for i in range(1, 301):  # far more than the transport queues before it applies backpressure
            await ws.send(json.dumps({"type": "step", "data": {"text": str(i)}, "id": i}))
        replies = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(301)]
    assert [r["id"] for r in replies] == list(range(301))
    assert replies[-1]["data"]["observation"]["text"] == "p:300"
