"""The session protocol as a pure state machine: decoded frames in, effects out. No sockets, no asyncio.

The server feeds every inbound frame to :meth:`SessionProtocol.receive`, which returns one
effect:

* :class:`Reply` -- send this envelope now (errors, cached replays, tool listings);
* :class:`Call` -- run ``op`` on the session's :class:`~envhub.env.EnvRunner`, then pass the
  outcome to :meth:`SessionProtocol.complete`, :meth:`SessionProtocol.fail` or
  :meth:`SessionProtocol.timed_out`, which return the reply envelope;
* :class:`Close` -- close the socket with ``code`` (``close`` requests; nothing is sent);
* :class:`Cancel` -- give up the running request with this id (``cancel`` extension; nothing is
  sent for the ``cancel`` itself: the cancelled request gets its ``CANCELLED`` reply).

Everything a session must remember between frames lives here: negotiated extensions, the
last reply (for replay after a resume) and whether a timeout ended the episode. That keeps
the transport shell thin and every rule of the wire contract unit-testable::

    >>> p = SessionProtocol("s1", extensions=None)
    >>> p.receive('{"type": "bogus"}').envelope["data"]["code"]
    'UNKNOWN_TYPE'
    >>> p.receive('{"type": "step", "data": {"text": "hi"}}').op
    'step'
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from envhub._wire import (
    ALL_EXTENSIONS,
    DEFAULT_MAX_MESSAGE_BYTES,
    EXT_CANCEL,
    EXT_MSGPACK,
    EXT_REQUEST_ID,
    EXT_RESUME,
    EXT_STEP_TIMEOUT,
    EXT_TOOLS,
    REPLY_ERROR,
    REPLY_HELLO,
    REPLY_MCP,
    REPLY_OBSERVATION,
    REPLY_STATE,
    REPLY_TOOLS,
    decode,
    encode,
    frame_bytes,
)
from envhub.errors import EnvHubError, ErrorCode, ProtocolError
from envhub.types import StepResult, ToolSpec

try:  # orjson encodes a reply ~10x faster than the stdlib; optional, same output
    import orjson
except ImportError:  # pragma: no cover - exercised where orjson is absent
    orjson = None  # type: ignore[assignment]

SERVER_NAME = "envhub/0.1.0"

# WebSocket close codes the server uses (RFC 6455 plus one private code).
CLOSE_NORMAL = 1000          # the client sent ``close``
CLOSE_GOING_AWAY = 1001      # idle reaper, server shutting down
CLOSE_POLICY = 1008          # bad or missing bearer token
CLOSE_TOO_BIG = 1009         # frame over the transport limit (sent by the transport itself)
CLOSE_INTERNAL = 1011        # the env factory raised
CLOSE_TRY_AGAIN = 1013       # session cap reached
CLOSE_SESSION_LOST = 4404    # resume of an unknown or expired session

_ENVELOPE_KEYS = frozenset({"type", "data", "id", "timeout_s"})
_NO_ID = object()


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``envelope`` to the client; nothing runs."""

    envelope: dict[str, Any]


@dataclass(slots=True)  # not frozen: built once per request, and a frozen __init__ costs ~2 us more
class Call:
    """Run ``op`` (``reset``, ``step``, ``state`` or ``mcp``) with ``payload`` on the session's runner.

    ``timeout_s`` is the deadline to enforce (None: none); ``fresh_env`` asks for a new env
    instance first, because a timed-out request left the old one busy. Treat it as read-only.
    """

    op: str
    payload: Any
    request_id: Any = None
    timeout_s: float | None = None
    fresh_env: bool = False


@dataclass(frozen=True, slots=True)
class Close:
    """Close the socket with ``code`` (``close`` requests get no reply)."""

    code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Cancel:
    """Give up the running request whose id is ``request_id`` (nothing when none is running)."""

    request_id: Any


Effect = Reply | Call | Close | Cancel


def negotiate(requested: str | None, offered: Iterable[str] = ALL_EXTENSIONS) -> frozenset[str] | None:
    """The extensions to accept for a ``?ext=`` query value; None when the client did not opt in.

    Unknown names are ignored, so newer clients can talk to older servers.

    >>> sorted(negotiate("msgpack,request_id,teleport"))
    ['msgpack', 'request_id']
    >>> negotiate(None) is None
    True
    """
    if requested is None:
        return None
    wanted = {name.strip() for name in requested.split(",") if name.strip()}
    return frozenset(wanted & set(offered))


def error_envelope(exc: EnvHubError, request_id: Any = None) -> dict[str, Any]:
    """The ``error`` envelope for a typed exception, echoing ``request_id`` when given."""
    frame: dict[str, Any] = {"type": REPLY_ERROR, "data": exc.to_wire()}
    if request_id is not None:
        frame["id"] = request_id
    return frame


class SessionProtocol:
    """One session's protocol state: what each inbound frame means and what goes back.

    ``extensions`` is the negotiated set, or None for a client that did not opt in (plain
    OpenEnv behaviour: no hello, JSON only, no envhub message types). ``tools`` are the env's
    tool specs, answered locally for the ``tools`` extension.
    """

    def __init__(self, session_id: str, *, extensions: frozenset[str] | None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, step_timeout_s: float | None = None,
                 tools: Iterable[ToolSpec] = (), resume_token: str | None = None):
        self.session_id = session_id
        self.opted_in = extensions is not None
        self.extensions: frozenset[str] = extensions or frozenset()
        self.binary = EXT_MSGPACK in self.extensions
        #: requests can be cancelled by id: the shell must keep reading frames while one runs
        self.cancellable = EXT_CANCEL in self.extensions and EXT_REQUEST_ID in self.extensions
        self.max_message_bytes = max_message_bytes
        self.step_timeout_s = step_timeout_s
        self.resume_token = resume_token if EXT_RESUME in self.extensions else None
        self._tools = [spec.to_openai() for spec in tools]
        self._replay = EXT_RESUME in self.extensions
        self._last_id: Any = _NO_ID
        self._last_reply: dict[str, Any] | None = None
        # Set when a timeout abandoned a request: the env instance is still busy in its thread.
        self.stale_state: dict[str, Any] | None = None
        self.closed = False

    # -- outbound helpers ------------------------------------------------------------------
    def hello(self, *, resumed: bool = False) -> dict[str, Any] | None:
        """The first frame of an opted-in connection (None for plain OpenEnv clients)."""
        if not self.opted_in:
            return None
        return {"type": REPLY_HELLO, "data": {
            "session_id": self.session_id, "extensions": sorted(self.extensions),
            "resume_token": self.resume_token, "resumed": resumed, "server": SERVER_NAME,
            "max_message_bytes": self.max_message_bytes}}

    def encode(self, envelope: dict[str, Any]) -> str | bytes:
        """Serialise an envelope for this session: msgpack bytes once negotiated, else JSON text."""
        if self.binary or orjson is None:
            return encode(envelope, binary=self.binary)
        try:
            return orjson.dumps(envelope, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:  # lone surrogates, integers beyond 64 bits and the like: the stdlib handles them
            return encode(envelope)

    # -- inbound ---------------------------------------------------------------------------
    def receive(self, frame: str | bytes) -> Effect:
        """Interpret one inbound frame. Never raises: bad input becomes an error :class:`Reply`."""
        if orjson is not None and type(frame) is str and frame_bytes(frame) <= self.max_message_bytes:
            try:  # fast path for well-formed text frames; anything odd takes the codec's path below
                msg = orjson.loads(frame)
            except orjson.JSONDecodeError:
                msg = None
            if type(msg) is dict and type(msg.get("type")) is str:
                return self.handle(msg)
        try:
            msg = decode(frame, binary_ok=self.binary, max_bytes=self.max_message_bytes)
        except EnvHubError as exc:
            return Reply(error_envelope(exc))
        return self.handle(msg)

    def handle(self, msg: dict[str, Any]) -> Effect:
        """Interpret one decoded envelope (``receive`` after the codec; used directly by HTTP routes)."""
        rid = msg.get("id")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
            return Reply(error_envelope(ProtocolError(
                f"Expected the request 'id' to be a string or integer, got {type(rid).__name__}.",
                code=ErrorCode.VALIDATION_ERROR)))
        if self._replay and rid is not None and rid == self._last_id and self._last_reply is not None:
            return Reply(self._last_reply)
        mtype = msg["type"]
        if not _ENVELOPE_KEYS.issuperset(msg):  # {"type": "reset", "seeed": 5} too, not only past two keys
            extra = sorted(k for k in msg if k not in _ENVELOPE_KEYS)
            return self._error(ProtocolError(
                f"Unexpected envelope key(s) {extra}; an envelope has 'type', 'data', 'id' and 'timeout_s'.",
                code=ErrorCode.VALIDATION_ERROR), rid)
        if mtype == "step":
            return self._request_call("step", msg.get("data"), rid, msg)
        if mtype == "reset":
            data = msg.get("data")
            if data is None:
                data = {}
            elif not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
                return self._error(ProtocolError(
                    "Expected reset 'data' to be an object of keyword arguments (string keys), "
                    f"got {type(data).__name__}.", code=ErrorCode.VALIDATION_ERROR), rid)
            return self._request_call("reset", data, rid, msg)
        if mtype == "state":
            if self.stale_state is not None:
                return Reply(self._remember(rid, self._with_id({"type": REPLY_STATE, "data": self.stale_state}, rid)))
            return Call("state", None, rid)
        if mtype == "close":
            self.closed = True
            return Close(CLOSE_NORMAL, "client closed the session")
        if mtype == "mcp":
            return Call("mcp", msg.get("data"), rid)
        if mtype == "cancel" and self.cancellable:
            return self._cancel(msg.get("data"), rid)
        if mtype == "tools" and EXT_TOOLS in self.extensions:
            return Reply(self._remember(rid, self._with_id({"type": REPLY_TOOLS, "data": {"tools": self._tools}}, rid)))
        return self._error(ProtocolError(f"Unknown message type: {mtype}", code=ErrorCode.UNKNOWN_TYPE), rid)

    def _cancel(self, data: Any, rid: Any) -> Effect:
        target = _cancel_id(data)
        if target is None:
            return self._error(ProtocolError(
                f"Expected cancel 'data' to be {{\"id\": <id of the request to cancel>}}, got {data!r}.",
                code=ErrorCode.VALIDATION_ERROR), rid)
        return Cancel(target)

    def cancel_target(self, frame: str | bytes) -> Any:
        """The request id a frame asks to cancel, or None when it is not a ``cancel``. Changes no state:
        the shell peeks at frames that arrive while a request runs and queues the rest, in order."""
        if not self.cancellable:
            return None
        try:
            msg = decode(frame, binary_ok=self.binary, max_bytes=self.max_message_bytes)
        except EnvHubError:
            return None
        return _cancel_id(msg.get("data")) if msg["type"] == "cancel" else None

    def _request_call(self, op: str, payload: Any, rid: Any, msg: dict[str, Any]) -> Effect:
        timeout_s = self.step_timeout_s
        asked = msg.get("timeout_s")
        if asked is not None:
            if isinstance(asked, bool) or not isinstance(asked, (int, float)) or not 0 < asked < math.inf:
                return self._error(ProtocolError(
                    f"Expected 'timeout_s' to be a positive number of seconds, got {asked!r}.",
                    code=ErrorCode.VALIDATION_ERROR), rid)
            # A client may only tighten the server's deadline, never extend it.
            timeout_s = float(asked) if timeout_s is None else min(timeout_s, float(asked))
        if self.stale_state is not None:
            if op == "step":
                return self._error(EnvHubError(
                    "the episode ended when a request timed out or was cancelled; call reset() to start a new one.",
                    code=ErrorCode.EPISODE_ENDED), rid)
            return Call(op, payload, rid, timeout_s, fresh_env=True)
        return Call(op, payload, rid, timeout_s)

    # -- outcomes of a Call ----------------------------------------------------------------
    def complete(self, call: Call, result: Any) -> dict[str, Any]:
        """The reply envelope for a call that returned ``result``."""
        if call.op == "state":
            envelope = {"type": REPLY_STATE, "data": result}
        elif call.op == "mcp":
            envelope = {"type": REPLY_MCP, "data": result}
        else:
            data = result.to_wire(binary=self.binary) if isinstance(result, StepResult) else result
            envelope = {"type": REPLY_OBSERVATION, "data": data}
        return self._remember(call.request_id, self._with_id(envelope, call.request_id))

    def fail(self, call: Call, exc: EnvHubError) -> dict[str, Any]:
        """The error envelope for a call that raised a typed error (the session stays alive)."""
        return self._remember(call.request_id, error_envelope(exc, call.request_id))

    def abandoned(self, call: Call, code: str = ErrorCode.STEP_TIMEOUT, *, episode_id: Any = None,
                  step_count: int = 0) -> dict[str, Any]:
        """The reply for a call given up before it finished: ``STEP_TIMEOUT`` (its deadline passed) or
        ``CANCELLED`` (the client cancelled it). The episode is over: the next ``step`` gets
        ``EPISODE_ENDED`` and the next ``reset`` asks for a fresh env instance (``Call.fresh_env``)."""
        self.stale_state = {"episode_id": episode_id, "step_count": step_count, "done": True,
                            "timed_out" if code == ErrorCode.STEP_TIMEOUT else "cancelled": True}
        if code == ErrorCode.STEP_TIMEOUT:
            exc = EnvHubError(f"{call.op} did not finish within {call.timeout_s:g} s; the episode is over, "
                              "call reset() to start a new one.", code=code, details={"timeout_s": call.timeout_s})
        else:
            exc = EnvHubError(f"{call.op} was cancelled by the client; the episode is over, call reset() to "
                              "start a new one.", code=code)
        return self._remember(call.request_id, error_envelope(exc, call.request_id))

    def timed_out(self, call: Call, *, episode_id: Any = None, step_count: int = 0) -> dict[str, Any]:
        """The ``STEP_TIMEOUT`` reply (see :meth:`abandoned`)."""
        return self.abandoned(call, ErrorCode.STEP_TIMEOUT, episode_id=episode_id, step_count=step_count)

    def env_replaced(self) -> None:
        """The shell built a fresh env instance for a ``fresh_env`` call: the session is usable again."""
        self.stale_state = None

    # -- internals -------------------------------------------------------------------------
    def _error(self, exc: EnvHubError, rid: Any) -> Reply:
        return Reply(self._remember(rid, error_envelope(exc, rid)))

    @staticmethod
    def _with_id(envelope: dict[str, Any], rid: Any) -> dict[str, Any]:
        if rid is not None:
            envelope["id"] = rid
        return envelope

    def _remember(self, rid: Any, envelope: dict[str, Any]) -> dict[str, Any]:
        if self._replay and rid is not None:
            self._last_id, self._last_reply = rid, envelope
        return envelope


def _cancel_id(data: Any) -> Any:
    """The request id in a ``cancel``'s data (a string or an integer), else None."""
    target = data.get("id") if isinstance(data, dict) else None
    return target if isinstance(target, (str, int)) and not isinstance(target, bool) else None


__all__ = ["SessionProtocol", "Reply", "Call", "Close", "Cancel", "Effect", "negotiate", "error_envelope", "SERVER_NAME",
           "CLOSE_NORMAL", "CLOSE_GOING_AWAY", "CLOSE_POLICY", "CLOSE_TOO_BIG", "CLOSE_INTERNAL",
           "CLOSE_TRY_AGAIN", "CLOSE_SESSION_LOST", "EXT_REQUEST_ID", "EXT_STEP_TIMEOUT", "EXT_CANCEL"]
