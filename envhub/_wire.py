"""Frame codec shared by the server and the client: envelopes, extension names, URL building.

Frames are OpenEnv envelopes ``{"type": ..., "data": ...}`` as JSON text, or the same
envelope as msgpack in a binary frame once both sides negotiated ``msgpack``. With the
``request_id`` extension the client adds ``"id"`` to each request and the server echoes it.
Pure functions only: no sockets here.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import msgpack

from envhub.errors import ActionValidationError, ErrorCode, MessageTooLargeError, ProtocolError

PROTOCOL_VERSION = 1

# Extensions: announced in /metadata["envhub"]["extensions"], opted into with ?ext=a,b on /ws.
EXT_REQUEST_ID = "request_id"
EXT_MSGPACK = "msgpack"
EXT_TOOLS = "tools"
EXT_RESUME = "resume"
EXT_STEP_TIMEOUT = "step_timeout"
EXT_CANCEL = "cancel"  # {"type": "cancel", "data": {"id": ...}} gives up a running request (needs request_id)
ALL_EXTENSIONS = (EXT_REQUEST_ID, EXT_MSGPACK, EXT_TOOLS, EXT_RESUME, EXT_STEP_TIMEOUT, EXT_CANCEL)

# Client -> server message types (OpenEnv's, then envhub's, which need an opted-in extension).
REQUEST_TYPES = frozenset({"reset", "step", "state", "close", "mcp", "tools", "cancel"})
# Server -> client
REPLY_OBSERVATION = "observation"
REPLY_STATE = "state"
REPLY_ERROR = "error"
REPLY_MCP = "mcp"
REPLY_TOOLS = "tools"
REPLY_HELLO = "hello"  # first frame on an opted-in connection: session id, accepted extensions, resume token

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_json_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str).encode
_json_dumps_ascii = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), default=str).encode
_SURROGATE = re.compile("[\ud800-\udfff]")


def encode(message: Any, *, binary: bool = False, lossy: bool = True) -> str | bytes:
    """Serialise one envelope: msgpack bytes when ``binary``, else compact JSON text.

    A lone surrogate (``"\\ud800"``, valid in a JSON escape, invalid in UTF-8) stays a ``\\uXXXX``
    escape in JSON, so text frames carry it losslessly. msgpack cannot carry one: with ``lossy``
    it becomes U+FFFD (a server reply must go out), else :class:`ActionValidationError` (the
    client's caller can fix its input; nothing was sent).

    >>> encode({"type": "step", "data": "\\ud800"})
    '{"type":"step","data":"\\\\ud800"}'
    >>> encode({"data": "a\\ud800"}, binary=True) == encode({"data": "a\\ufffd"}, binary=True)
    True
    """
    if binary:
        try:
            packed: bytes = msgpack.packb(message, use_bin_type=True, default=str)
            return packed
        except UnicodeEncodeError as exc:
            if not lossy:
                raise ActionValidationError(
                    f"Expected valid Unicode text, got a lone surrogate {exc.object[exc.start:exc.end]!r}; "
                    "msgpack frames carry UTF-8 only (replace it, or connect without the msgpack "
                    "extension: JSON escapes carry it).") from None
            replaced: bytes = msgpack.packb(replace_surrogates(message), use_bin_type=True, default=str)
            return replaced
    text = _json_dumps(message)
    if not text.isascii() and _SURROGATE.search(text) is not None:
        return _json_dumps_ascii(message)
    return text


def replace_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings (keys included) replaced by U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {replace_surrogates(k): replace_surrogates(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [replace_surrogates(v) for v in value]
    return value


def frame_bytes(frame: str | bytes) -> int:
    """The size of a frame on the wire: UTF-8 bytes for text, so a limit means the same for ``€`` as for ``e``."""
    if isinstance(frame, str) and not frame.isascii():  # isascii() is O(1) on CPython
        return len(frame.encode("utf-8", "surrogatepass"))
    return len(frame)


def decode(frame: str | bytes, *, binary_ok: bool = False,
           max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Parse one frame into an envelope dict, or raise a typed :class:`ProtocolError`.

    Non-JSON -> ``INVALID_JSON``; a binary frame when msgpack was not negotiated -> ``INVALID_JSON``
    with a hint; a non-object or a missing/unknown ``type`` -> ``UNKNOWN_TYPE`` or
    ``VALIDATION_ERROR``. Never raises anything else.
    """
    size = frame_bytes(frame)
    if size > max_bytes:
        raise MessageTooLargeError(f"frame of {size} bytes exceeds the limit of {max_bytes} bytes",
                                   details={"max_message_bytes": max_bytes})
    if isinstance(frame, (bytes, bytearray, memoryview)):
        if not binary_ok:
            raise ProtocolError("Binary frame received but msgpack was not negotiated; send JSON text frames "
                                "or connect with ?ext=msgpack.", code=ErrorCode.INVALID_JSON)
        try:
            msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception as exc:
            raise ProtocolError(f"Invalid msgpack: {exc}", code=ErrorCode.INVALID_JSON) from None
    else:
        try:
            msg = json.loads(frame)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"Invalid JSON: {exc}", code=ErrorCode.INVALID_JSON) from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"Expected a JSON object envelope {{\"type\": ..., \"data\": ...}}, "
                            f"got {type(msg).__name__}.", code=ErrorCode.VALIDATION_ERROR)
    mtype = msg.get("type")
    if not isinstance(mtype, str):
        raise ProtocolError(f"Unknown message type: {mtype!r}", code=ErrorCode.UNKNOWN_TYPE)
    return msg


def error_frame(code: str, message: str, request_id: Any = None, **details: Any) -> dict[str, Any]:
    """An ``error`` envelope."""
    frame: dict[str, Any] = {"type": REPLY_ERROR, "data": {"message": message, "code": code, **details}}
    if request_id is not None:
        frame["id"] = request_id
    return frame


def ws_url(base_url: str, *, path: str = "/ws", **query: Any) -> str:
    """The WebSocket URL for a base URL: http->ws, https->wss, ``/ws`` appended, query merged.

    >>> ws_url("http://localhost:8000", ext="msgpack,request_id")
    'ws://localhost:8000/ws?ext=msgpack%2Crequest_id'
    """
    parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    p = parts.path.rstrip("/")
    if not p.endswith(path):
        p = p + path
    q = urlencode({k: v for k, v in query.items() if v is not None})
    return urlunsplit((scheme, parts.netloc, p, q, ""))


def http_url(base_url: str, path: str = "") -> str:
    """The HTTP URL for a base URL given as http(s):// or ws(s)://, with any ``/ws`` suffix removed."""
    parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    p = parts.path.rstrip("/")
    if p.endswith("/ws"):
        p = p[:-3]
    return urlunsplit((scheme, parts.netloc, p + path, "", ""))
