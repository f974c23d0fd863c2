"""What the sampler server's routes share: its state, JSON bodies read within bounds, the OpenAI error shape."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from trainer.sampler_server.batcher import RequestBatcher
from trainer.sampler_server.channel import WeightChannel
from trainer.sampler_server.group import WeightGroups
from trainer.sampler_server.protocol import Backend, ServerLimits


class BodyTooLargeError(ValueError):
    """A JSON body over ``max_request_bytes`` (a 413)."""


@dataclass
class PushStats:
    """Weight updates for ``/metrics``."""

    count: int = 0
    bytes: int = 0
    last_s: float = 0.0
    failed: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)


@dataclass
class ServerState:
    """What the routes share: the backend, its request queue, limits, token and push counters."""

    backend: Backend
    batcher: RequestBatcher
    limits: ServerLimits
    token: str | None = None
    backend_kind: str = "hf"
    tool_parser: str = "auto"
    pushes: PushStats = field(default_factory=PushStats)
    channel: WeightChannel | None = None  # the plain TCP port weight bodies may come through
    groups: WeightGroups = field(default_factory=WeightGroups)  # torch.distributed groups joined with trainers
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    started: float = field(default_factory=time.time)
    #: this process's id, in every answer: a client that sees it change knows the server restarted (weights lost)
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)


def error_body(message: str, status: int) -> dict[str, Any]:
    """The OpenAI error shape (the ``openai`` package raises the matching exception from it)."""
    kind = {401: "authentication_error", 404: "not_found_error", 503: "server_overloaded"}.get(
        status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


async def read_json(request: Request, model: type[BaseModel], limit: int) -> Any:
    """``request``'s JSON body validated as ``model``, read only up to ``limit`` bytes (413 past it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(f"Expected a body of at most {limit} bytes, got {declared}.")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLargeError(f"Expected a body of at most {limit} bytes, got more.")
    return model.model_validate_json(bytes(body))


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.sampler
    return state


__all__ = ["BodyTooLargeError", "PushStats", "ServerState", "error_body", "read_json", "server_state"]
