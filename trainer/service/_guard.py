"""The service's front door, an ASGI middleware in front of every route: who the client is, and bodies bounded.

Per request, before any route runs:

1. the API key (``X-API-Key`` or ``Authorization: Bearer``) is checked against ``--token`` (401 without
   one, 403 for a wrong one; ``healthz`` is open), and the client's identity, its *owner*, is a digest
   of the key: sessions, training runs, samplers, checkpoints and futures belong to the owner that made
   them, and no other owner can see or touch them (the service answers 404, as for ids that never
   existed). Without ``--token`` any key is accepted, and clients with different keys are still
   kept apart;
2. the body's size is known before it is read: ``Content-Length`` is required for a body (411), a
   body over its route's limit is refused (413: ``max_request_bytes`` for ``forward_backward``,
   ``max_json_bytes`` for the JSON routes), and bodies being received at once share
   ``max_inflight_bytes`` (429 past it: the SDK backs off and re-sends);
3. the content type and encoding must be the route's (415), and the body must arrive within
   ``body_timeout_s`` (408).

Routes find the owner in ``scope["envhub.owner"]`` and the whole body in ``scope["envhub.body"]``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from trainer.service._errors import (
    Forbidden,
    LengthRequired,
    PayloadTooLarge,
    RequestTimeout,
    ServiceError,
    TooManyRequests,
    Unauthorized,
    UnsupportedMediaType,
    UserError,
)
from trainer.service._settings import ServiceSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/api/v1/healthz"})
PROTOBUF_PATHS = frozenset({"/api/v1/forward_backward", "/api/v1/forward"})
ANONYMOUS = "anonymous"


def owner_of(key: str) -> str:
    """A client's identity: a digest of its API key (the key itself is never stored)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ANONYMOUS


class Guard:
    """ASGI middleware: authenticates, names the owner, and reads each body under its limits (see module doc)."""

    def __init__(self, app: ASGIApp, settings: ServiceSettings):
        self.app, self.settings = app, settings
        self._tokens = [t.encode() for t in settings.tokens]
        self.inflight_bytes = 0  # bodies being received now, all clients

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        try:
            scope["envhub.owner"] = self._owner(scope["path"], headers)
            size = self._body_size(scope["path"], headers)
        except ServiceError as exc:
            await send_error(send, exc)
            return
        if self.inflight_bytes and self.inflight_bytes + size > self.settings.max_inflight_bytes:
            await send_error(send, TooManyRequests(f"The service is receiving {self.inflight_bytes} bytes of "
                                                   "requests at once, its limit; send again shortly."))
            return
        self.inflight_bytes += size
        try:
            try:
                body = await asyncio.wait_for(_read_body(receive, size), self.settings.body_timeout_s)
            except asyncio.TimeoutError:
                await send_error(send, RequestTimeout(f"The request body did not arrive within "
                                                      f"{self.settings.body_timeout_s:.0f} s."))
                return
            except ServiceError as exc:
                await send_error(send, exc)
                return
            if body is None:
                return  # the client went away
            scope["envhub.body"] = body
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.inflight_bytes -= size

    def _owner(self, path: str, headers: dict[str, str]) -> str:
        key = headers.get("x-api-key") or _bearer(headers.get("authorization", ""))
        if self._tokens and path not in OPEN_PATHS:
            if not key:
                raise Unauthorized("missing API key: pass api_key=<the server's --token>")
            if not any(hmac.compare_digest(key.encode(), token) for token in self._tokens):
                raise Forbidden("wrong API key for this training service")
        return owner_of(key)

    def _body_size(self, path: str, headers: dict[str, str]) -> int:
        """The declared body size, checked against the route's limit, type and encoding."""
        if "transfer-encoding" in headers:
            raise LengthRequired("Expected a request body with a Content-Length (its size is checked before it "
                                 "is read), got a chunked one.")
        raw = headers.get("content-length", "0")
        if not raw.isdigit() or len(raw) > 18:
            raise UserError(f"Expected a Content-Length of digits, got {raw[:20]!r}.")
        size = int(raw)
        proto = path in PROTOBUF_PATHS
        limit = self.settings.max_request_bytes if proto else self.settings.max_json_bytes
        if size > limit:
            flag = "--max-request-mb" if proto else "max_json_bytes"
            raise PayloadTooLarge(f"Expected a request body of at most {limit} bytes ({flag}), got {size}"
                                  + ("; send smaller batches." if proto else "."))
        if size:
            _check_type(proto, headers)
        return size


def _check_type(proto: bool, headers: dict[str, str]) -> None:
    if headers.get("content-encoding", "identity") not in ("identity", ""):
        raise UnsupportedMediaType(f"Expected an uncompressed body, got Content-Encoding "
                                   f"{headers['content-encoding'][:40]!r} (the service never asks for one).")
    kind = headers.get("content-type", "")
    if proto and "protobuf" not in kind:
        raise UnsupportedMediaType(f"Expected Content-Type application/x-protobuf (a ForwardBackwardRequest, "
                                   f"tinker SDK >= 0.25), got {kind[:60]!r}.")
    if not proto and "json" not in kind:
        raise UnsupportedMediaType(f"Expected Content-Type application/json, got {kind[:60]!r}.")


async def _read_body(receive: Receive, size: int) -> bytes | None:
    """The whole body (at most ``size`` bytes, as declared); None when the client disconnects."""
    parts: list[bytes] = []
    received = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > size:
            raise UserError(f"Expected a body of {size} bytes (its Content-Length), got more.")
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    if received != size:
        raise UserError(f"Expected a body of {size} bytes (its Content-Length), got {received}.")
    return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the client's later messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _bearer(header: str) -> str:
    return header[7:].strip() if header.lower().startswith("bearer ") else ""


async def send_error(send: Send, exc: ServiceError) -> None:
    """Answer with ``exc``'s status and ``{"detail": ..., "category": ...}``; 408 and 429 say when to retry."""
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status in (408, 429):
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["ANONYMOUS", "Guard", "owner_of", "send_error"]
