"""Weight pushes to sampler servers: what a push carries (full weights or a LoRA adapter) and one push to one server.

The body is the :mod:`.wire` stream (a safetensors file written straight from the parameters, no
file on disk); :class:`~trainer.sampling.remote.RemoteSampler` pushes it to every server at once.
It travels over the server's weight channel (a plain TCP port, named ``weight_port`` at ``/health``,
read with ``recv_into`` straight into the new tensors) when the server has one and it can be
reached, else as the body of the HTTP request (slower: the HTTP server takes it in small pieces).
Either way the HTTP request carries the bearer token and answers once the weights were applied.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch

from trainer.sampling.hf import generation_model
from trainer.sampling.wire import TICKET_HEADER, encode

SOCKET_BUFFER_BYTES = 8 << 20


@dataclass
class ServerSlot:
    """One server as the trainer sees it."""

    url: str
    in_rotation: bool = False
    version: int | None = None  # the version it took last (None: none yet)
    in_flight: int = 0  # turns queued for it or in its batch
    instance: str | None = None  # the server process that took the weights (a restarted one has another)
    last_error: str = "never reached"
    weight_port: int | None = None  # its weight channel (from /health); None: weights go as HTTP bodies


def payload(model: Any, version: int, *, lora: bool,
            adapter_name: str) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """The route, tensors and metadata of ``model``'s push as ``version`` (its adapter alone for LoRA)."""
    inner = generation_model(model)
    if lora:
        if not hasattr(inner, "peft_config"):
            raise ValueError("Expected a peft model for a LoRA run's weight push, got a plain one.")
        from peft import get_peft_model_state_dict

        cfg = inner.peft_config[inner.active_adapter]
        settings = {"r": int(cfg.r), "lora_alpha": cfg.lora_alpha, "use_rslora": bool(cfg.use_rslora),
                    "target_modules": sorted(cfg.target_modules) if not isinstance(cfg.target_modules, str)
                    else cfg.target_modules}
        tensors = dict(get_peft_model_state_dict(inner))
        meta = {"version": str(version), "kind": "lora", "lora_config": json.dumps(settings)}
        return f"/adapters/{adapter_name}", tensors, meta
    tensors = {n: p.detach() for n, p in inner.named_parameters()}
    return "/weights", tensors, {"version": str(version), "kind": "full"}


def push(http: httpx.Client, server: ServerSlot, path: str, tensors: dict[str, torch.Tensor],
         meta: dict[str, str]) -> str | None:
    """Stream the weights to ``server``; None once it took them (its ``instance`` noted), else the reason it did not.

    A server out of rotation is asked ``/health`` first (which names its weight channel). A transport
    error is tried once more if the server still answers ``/health`` (a kept-alive connection it
    closed meanwhile); the server applies a body only once it arrived whole."""
    for attempt in (1, 2):
        try:
            if not server.in_rotation or attempt == 2:
                health = http.get(f"{server.url}/health", timeout=2.0)
                health.raise_for_status()
                server.weight_port = health.json().get("weight_port")
            channel = _through_channel(http, server, path, tensors, meta)
            resp = channel if channel is not None else _as_body(http, server.url, path, tensors, meta)
            break
        except httpx.TransportError as exc:
            if attempt == 2:
                return f"{type(exc).__name__}: {exc}"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {reason(resp)}"
    server.instance = resp.json().get("instance")
    return None


def _as_body(http: httpx.Client, url: str, path: str, tensors: dict[str, torch.Tensor],
             meta: dict[str, str]) -> httpx.Response:
    chunks = encode(tensors, meta)
    first = next(chunks)
    size = len(first) + sum(t.numel() * t.element_size() for t in tensors.values())
    return http.put(f"{url}{path}", content=_prepend(first, chunks),
                    headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})


def _through_channel(http: httpx.Client, server: ServerSlot, path: str, tensors: dict[str, torch.Tensor],
                     meta: dict[str, str]) -> httpx.Response | None:
    """Push over the server's weight channel: the HTTP request names a fresh ticket and answers once the body
    that came with the ticket on the channel was applied. None when there is no channel to reach (it is then
    not tried again until the next ``/health``)."""
    host = urlsplit(server.url).hostname
    if server.weight_port is None or host is None or not server.url.startswith("http://"):
        return None  # no channel, or TLS: the plain channel would carry the weights in the clear
    try:
        sock = socket.create_connection((host, server.weight_port), timeout=5.0)
    except OSError:
        server.weight_port = None
        return None
    ticket = secrets.token_hex(16)
    with sock, ThreadPoolExecutor(max_workers=1) as pool:
        sending = pool.submit(_send, sock, ticket, tensors, meta)
        resp = None
        try:
            resp = http.put(f"{server.url}{path}", content=b"", headers={TICKET_HEADER: ticket})
        finally:
            if resp is None or resp.status_code != 200:  # refused (a wrong token, say), or the request failed:
                with contextlib.suppress(OSError):       # the server will not read the rest, stop sending it
                    sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):  # the server stopped reading a body it refused: its answer says why
            sending.result()
        return resp


def _send(sock: socket.socket, ticket: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.settimeout(None)
    sock.sendall(ticket.encode())
    for chunk in encode(tensors, meta):
        sock.sendall(chunk)


def reason(resp: httpx.Response) -> str:
    """The error message of a server's answer (the OpenAI error shape), else the start of its text."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def _prepend(first: bytes | memoryview, rest: Iterator[bytes | memoryview]) -> Iterator[bytes]:
    yield bytes(first)
    yield from rest  # type: ignore[misc]  # httpx writes memoryviews as they are


__all__ = ["ServerSlot", "payload", "push", "reason"]
