"""The ``/ws`` endpoint as a raw ASGI app: the thin I/O shell around :class:`~envhub.protocol.SessionProtocol`.

Raw ASGI rather than Starlette's ``WebSocket`` wrapper: the per-frame path is one
``receive``, one protocol call and one ``send``, with no wrapper state machine in between
(measured: Starlette's ``receive``/``send`` add about 3 us per request, against about 40 us of
server CPU per echo step with 32 sessions).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from envhub._wire import EXT_MSGPACK, encode
from envhub.errors import AuthError, EnvHubError, ErrorCode
from envhub.protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_SESSION_LOST,
    CLOSE_TRY_AGAIN,
    Call,
    Cancel,
    Close,
    Reply,
    SessionProtocol,
    error_envelope,
    negotiate,
)
from envhub.server.hub import Hub
from envhub.server.session import Attachment, Session

log = logging.getLogger("envhub.server")

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
#: the session id in every accepted upgrade (the HTTP routes' ``X-Envhub-Session``), for sticky proxies
SESSION_HEADER_WS = b"x-envhub-session"

_CLOSE_FOR_CODE = {ErrorCode.CAPACITY_REACHED: CLOSE_TRY_AGAIN, ErrorCode.FACTORY_ERROR: CLOSE_INTERNAL,
                   ErrorCode.SHUTTING_DOWN: CLOSE_GOING_AWAY, ErrorCode.UNAUTHORIZED: CLOSE_POLICY,
                   ErrorCode.SESSION_EXPIRED: CLOSE_SESSION_LOST}


def bearer_token(headers: list[tuple[bytes, bytes]], query: dict[str, list[str]] | None = None) -> str | None:
    """The token from an ``Authorization: Bearer`` header, else from a ``?token=`` query parameter."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    if query and query.get("token"):
        return query["token"][0]
    return None


class WebSocketEndpoint:
    """ASGI app serving one session per connection (mounted at ``/ws``)."""

    def __init__(self, hub: Hub):
        self.hub = hub

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        hub = self.hub
        if not hub.check_token(bearer_token(scope.get("headers", []), query)):
            return await self._reject(send, AuthError("Missing or wrong bearer token; send 'Authorization: "
                                                      "Bearer <token>' or ?token=<token>."))
        extensions = negotiate(query["ext"][0] if "ext" in query else None)
        resumed = "resume" in query
        if resumed:
            session = hub.find_resumable(query["resume"][0], query.get("resume_token", [None])[0])
            if session is None:
                return await self._reject(send, EnvHubError(
                    "Session is unknown or its resume grace period expired; start a new session.",
                    code=ErrorCode.SESSION_EXPIRED))
        else:
            try:
                session = await hub.open_session(extensions)
            except EnvHubError as exc:
                return await self._reject(send, exc)
        try:
            # The session id in the 101 reply lets a proxy route this session's resume back here.
            await send({"type": "websocket.accept", "headers": [(SESSION_HEADER_WS, session.id.encode())]})
        except OSError:  # the client left while its env was being built
            if not resumed:
                await hub.close_session(session)
            return
        if session.closed:  # expired between the lookup and the accept
            return await self._close_expired(send)
        attachment = self._attach(session, send)
        hub.metrics.resumes_total += resumed
        clean = False
        try:
            clean = await self._serve(session, attachment, receive, send, resumed)
        finally:
            hub.detach(session, attachment, clean=clean)

    async def _reject(self, send: Send, exc: EnvHubError) -> None:
        """Accept only to say why (an error frame, JSON), then close with the code the client maps."""
        self.hub.metrics.error(exc.code)
        try:
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "text": encode(error_envelope(exc))})
            await send({"type": "websocket.close", "code": _CLOSE_FOR_CODE.get(exc.code, CLOSE_INTERNAL),
                        "reason": exc.code})
        except OSError:
            pass  # the client hung up first

    async def _close_expired(self, send: Send) -> None:
        exc = EnvHubError("Session expired while resuming; start a new session.", code=ErrorCode.SESSION_EXPIRED)
        self.hub.metrics.error(exc.code)
        try:
            await send({"type": "websocket.send", "text": encode(error_envelope(exc))})
            await send({"type": "websocket.close", "code": CLOSE_SESSION_LOST, "reason": exc.code})
        except OSError:
            pass

    def _attach(self, session: Session, send: Send) -> Attachment:
        binary = EXT_MSGPACK in session.protocol.extensions

        async def send_frame(frame: str | bytes) -> None:
            await send({"type": "websocket.send", "bytes": frame} if binary else
                       {"type": "websocket.send", "text": frame})

        async def close(code: int, reason: str) -> None:
            await send({"type": "websocket.close", "code": code, "reason": reason})

        previous, session.attachment = session.attachment, Attachment(send_frame, close)
        session.detached_at = None
        if previous is not None:  # resumed while the old socket still looked alive: retire it
            self.hub.spawn(_quiet(previous.close(CLOSE_GOING_AWAY, "session resumed on another connection")))
        return session.attachment

    async def _serve(self, session: Session, attachment: Attachment, receive: Receive, send: Send,
                     resumed: bool) -> bool:
        """The frame loop. Returns True when the session ended cleanly (``close`` or a normal close)."""
        proto, hub = session.protocol, self.hub
        while resumed and session.busy:  # the dropped connection's request finishes first
            await asyncio.sleep(0.005)
        hello = proto.hello(resumed=resumed)
        if hello is not None:
            await send({"type": "websocket.send", "text": encode(hello)})
        # Reading on while a request runs costs a task per request: only where a cancel can stop something.
        inbox = Inbox(receive, proto) if proto.cancellable and hub.cancel_interrupts else None
        try:
            return await self._frame_loop(session, attachment, receive if inbox is None else inbox.next, inbox)
        finally:
            if inbox is not None:
                inbox.close()

    async def _frame_loop(self, session: Session, attachment: Attachment, next_message: Receive,
                          inbox: Inbox | None) -> bool:
        proto, hub = session.protocol, self.hub
        send_frame = attachment.send
        while True:
            message = await next_message()
            if message["type"] != "websocket.receive":
                return message.get("code", 1000) in (CLOSE_NORMAL, None) or session.closed
            frame = message.get("text")
            effect = proto.receive(frame if frame is not None else message.get("bytes") or b"")
            if type(effect) is Call:
                envelope = await session.execute(effect, interrupts=inbox)
            elif type(effect) is Reply:
                envelope = effect.envelope
                if envelope["type"] == "error":
                    hub.metrics.error(envelope["data"]["code"])
                session.last_active = time.monotonic()
            elif type(effect) is Cancel:
                continue  # nothing runs under that id any more: its reply has gone out already
            else:
                assert type(effect) is Close
                await hub.close_session(session, effect.code, effect.reason)
                return True
            if session.attachment is not attachment:
                return False  # closed by the reaper or taken over by a resume; the reply is cached
            try:
                await send_frame(_encode(proto, envelope))
            except OSError:
                return False  # peer vanished mid-reply; a resume will replay it from the cache


class Inbox:
    """The frames of one connection when requests can be cancelled: a read may be in flight while a
    request runs, and frames that are not its ``cancel`` queue up for the frame loop, in order."""

    __slots__ = ("_pending", "_protocol", "_receive", "backlog")

    def __init__(self, receive: Receive, protocol: SessionProtocol):
        self._receive = receive
        self._protocol = protocol
        self._pending: asyncio.Future[dict[str, Any]] | None = None
        self.backlog: deque[dict[str, Any]] = deque()

    async def next(self) -> dict[str, Any]:
        if self.backlog:
            return self.backlog.popleft()
        if self._pending is not None:
            await self._pending
            return self.take()
        return await self._receive()

    def incoming(self) -> asyncio.Future[dict[str, Any]]:
        """The read in flight (started if there is none)."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._receive())
        return self._pending

    def take(self) -> dict[str, Any]:
        """The message of the finished read in flight."""
        pending, self._pending = self._pending, None
        assert pending is not None
        return pending.result()

    def cancels(self, request_id: Any) -> bool:
        message = self.take()
        if message["type"] == "websocket.receive":
            frame = message.get("text")
            target = self._protocol.cancel_target(frame if frame is not None else message.get("bytes") or b"")
            if target is not None and target == request_id:
                return True
        self.backlog.append(message)  # a disconnect too: the frame loop sees it after the reply
        return False

    def close(self) -> None:
        """Stop the read in flight (the connection is done with)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None


def _encode(proto: SessionProtocol, envelope: dict[str, Any]) -> str | bytes:
    """Encode a reply; an env value the codec cannot carry fails this request only."""
    try:
        return proto.encode(envelope)
    except Exception as exc:
        err = EnvHubError(f"The reply could not be serialised ({type(exc).__name__}: {exc}); return JSON-friendly "
                          "values (str, numbers, lists, dicts, bytes) from the env.", code=ErrorCode.EXECUTION_ERROR)
        return proto.encode(error_envelope(err, envelope.get("id")))


async def _quiet(coro: Awaitable[None]) -> None:
    try:
        await coro
    except Exception:
        pass
