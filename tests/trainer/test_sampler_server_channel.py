"""The sampler server's weight channel in process: a push whose body comes over the plain TCP port, and the ways
one is refused (a ticket nobody streams, a stream nobody registered, a body that does not fit the model)."""

from __future__ import annotations

import asyncio
import secrets
import socket

import httpx
import pytest
import torch

from tests.trainer.test_sampler_server_app import TINY, trainer_logprobs
from trainer.model import ModelConfig, load_policy
from trainer.sampler_server.app import create_app
from trainer.sampler_server.backends import HFBackend
from trainer.sampler_server.channel import WeightChannel
from trainer.sampling.wire import TICKET_HEADER, encode


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    return HFBackend(TINY)


def stream(port: int, ticket: str, model: torch.nn.Module, version: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(ticket.encode())
        try:
            for chunk in encode(dict(model.named_parameters()), {"version": str(version)}):
                sock.sendall(chunk)
        except OSError:
            pass  # the server stopped reading a body it refused


async def push(http: httpx.AsyncClient, channel: WeightChannel, model: torch.nn.Module, version: int) -> httpx.Response:
    ticket = secrets.token_hex(16)
    answer = asyncio.ensure_future(http.put("/weights", headers={TICKET_HEADER: ticket}))
    await asyncio.to_thread(stream, channel.port, ticket, model, version)
    return await answer


async def test_a_push_through_the_channel_is_applied_and_refusals_say_why(backend) -> None:
    channel = WeightChannel("127.0.0.1", 0, ticket_wait_s=1.0)
    app = create_app(backend, channel=channel)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sampler") as http:
            assert (await http.get("/health")).json()["weight_port"] == channel.port
            model, _ = load_policy(TINY)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            for version in (3, 4):  # the second push is received into the tensors the first one freed
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.01)
                resp = await push(http, channel, model, version)
                assert resp.status_code == 200 and resp.json()["version"] == version, resp.text
                sample = (await http.post("/sample", json={"prompt_ids": [5, 6, 7], "max_tokens": 6})).json()
                ids, lps = sample["samples"][0]["token_ids"], sample["samples"][0]["logprobs"]
                assert sample["version"] == version
                assert (trainer_logprobs(model, [5, 6, 7], ids) - torch.tensor(lps)).abs().max() < 1e-4

            before = {n: p.detach().clone() for n, p in backend.base.named_parameters()}
            other, _ = load_policy(ModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1))
            wrong = await push(http, channel, other, 9)
            assert wrong.status_code == 400 and "model settings" in wrong.json()["error"]["message"]
            silent = await http.put("/weights", headers={TICKET_HEADER: secrets.token_hex(16)})
            assert silent.status_code == 400 and "No weight stream" in silent.json()["error"]["message"]
            bad = await http.put("/weights", headers={TICKET_HEADER: "not-a-ticket"})
            assert bad.status_code == 400 and "hex digits" in bad.json()["error"]["message"]
            assert backend.version == 4
            assert all(torch.equal(before[n], p) for n, p in backend.base.named_parameters())

        # a stream nobody registered is closed once the wait for its ticket is over
        with socket.create_connection(("127.0.0.1", channel.port), timeout=10) as sock:
            sock.sendall(secrets.token_hex(16).encode() + b"\0" * 64)
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:  # closed with our bytes unread
                pass
    finally:
        channel.close()


def test_without_a_channel_a_ticket_is_refused_with_the_reason(backend) -> None:
    app = create_app(backend)

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sampler") as http:
            assert (await http.get("/health")).json()["weight_port"] is None
            return await http.put("/weights", headers={TICKET_HEADER: secrets.token_hex(16)})

    resp = asyncio.run(run())
    assert resp.status_code == 400 and "no weight channel" in resp.json()["error"]["message"]
