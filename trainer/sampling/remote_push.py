"""Weight pushes to sampler servers: what one carries (:class:`Push`: full weights or a LoRA adapter) and how it
travels to one server.

The body is the :mod:`.wire` stream (a safetensors file written straight from the parameters, no
file on disk); :class:`~trainer.sampling.pool.SamplerPool` sends it to every server at once. It travels
over the server's weight channel (a plain TCP port, named ``weight_port`` at ``/health``, read with
``recv_into`` straight into the new tensors) when the server has one and it can be reached
(:func:`put_through_channel`), else as the body of the HTTP request (:func:`put_as_body`; slower: the
HTTP server takes it in small pieces). Either way the HTTP request carries the bearer token and answers
once the weights were applied.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch

from trainer.sampling.hf import generation_model
from trainer.sampling.wire import TICKET_HEADER, encode

SOCKET_BUFFER_BYTES = 8 << 20


@dataclass(frozen=True)
class Push:
    """One weight update: its route (``/weights`` or ``/adapters/<name>``), tensors and safetensors metadata
    (``version``, ``kind``, a LoRA adapter's ``lora_config``)."""

    path: str
    tensors: Mapping[str, torch.Tensor]
    meta: Mapping[str, str]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def version(self) -> int:
        return int(self.meta["version"])


def payload(model: Any, version: int, *, lora: bool, adapter_name: str) -> Push:
    """``model``'s push as ``version``: its full weights, or its adapter alone (as ``adapter_name``) for LoRA."""
    inner = generation_model(model)
    if lora:
        if not hasattr(inner, "peft_config"):
            raise ValueError("Expected a peft model for a LoRA run's weight push, got a plain one.")
        from peft import get_peft_model_state_dict

        cfg = inner.peft_config[inner.active_adapter]
        tensors = get_peft_model_state_dict(inner, save_embedding_layers=False)  # not a LoRA'd output layer's base
        return lora_push(adapter_name, dict(tensors), version=version, rank=int(cfg.r),
                         alpha=cfg.lora_alpha, targets=cfg.target_modules, use_rslora=bool(cfg.use_rslora))
    return full_push(inner, version)


def lora_push(name: str, tensors: Mapping[str, torch.Tensor], *, version: int, rank: int, alpha: float,
              targets: Any, use_rslora: bool = False) -> Push:
    """Adapter ``name``'s push as ``version``: its LoRA tensors (peft state-dict names) and LoRA settings."""
    settings = {"r": int(rank), "lora_alpha": alpha, "use_rslora": use_rslora,
                "target_modules": sorted(targets) if targets is not None and not isinstance(targets, str)
                else targets or "all-linear"}
    meta = {"version": str(version), "kind": "lora", "lora_config": json.dumps(settings)}
    return Push(f"/adapters/{name}", tensors, meta)


def full_push(model: Any, version: int) -> Push:
    """A full-parameter push of ``model``'s weights as ``version`` (the live tensors: read as it streams)."""
    return Push("/weights", {n: p.detach() for n, p in model.named_parameters()}, {"version": str(version),
                                                                                   "kind": "full"})


def put_as_body(http: httpx.Client, url: str, push: Push) -> httpx.Response:
    """``PUT`` the push to the server at ``url`` as the HTTP request's streamed body."""
    chunks = encode(push.tensors, push.meta)
    first = next(chunks)
    size = len(first) + push.nbytes
    return http.put(f"{url}{push.path}", content=_prepend(first, chunks),
                    headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})


def put_through_channel(http: httpx.Client, url: str, weight_port: int, push: Push) -> httpx.Response | None:
    """Push over the server's weight channel: the HTTP request names a fresh ticket and answers once the body
    that came with the ticket on the channel was applied. None when the channel cannot be used (TLS: the plain
    channel would carry the weights in the clear) or reached."""
    host = urlsplit(url).hostname
    if host is None or not url.startswith("http://"):
        return None
    try:
        sock = socket.create_connection((host, weight_port), timeout=5.0)
    except OSError:
        return None
    ticket = secrets.token_hex(16)
    with sock, ThreadPoolExecutor(max_workers=1) as pool:
        sending = pool.submit(_send, sock, ticket, push)
        resp = None
        try:
            resp = http.put(f"{url}{push.path}", content=b"", headers={TICKET_HEADER: ticket})
        finally:
            if resp is None or resp.status_code != 200:  # refused (a wrong token, say), or the request failed:
                with contextlib.suppress(OSError):       # the server will not read the rest, stop sending it
                    sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):  # the server stopped reading a body it refused: its answer says why
            sending.result()
        return resp


def _send(sock: socket.socket, ticket: str, push: Push) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.settimeout(None)
    sock.sendall(ticket.encode())
    for chunk in encode(push.tensors, push.meta):
        sock.sendall(chunk)


def _prepend(first: bytes | memoryview, rest: Iterator[bytes | memoryview]) -> Iterator[bytes]:
    yield bytes(first)
    yield from rest  # type: ignore[misc]  # httpx writes memoryviews as they are


__all__ = ["Push", "payload", "put_as_body", "put_through_channel"]
