"""``EnvClient``: one WebSocket session with an envhub or OpenEnv env server (async, plus ``.sync()``).

>>> async def main():                                        # doctest: +SKIP
...     async with EnvClient("http://localhost:8000") as env:
...         first = await env.reset(seed=7)
...         result = await env.step({"tool_name": "guess", "arguments": {"number": 50}})
...         print(result.observation.text, result.reward, result.done)

Against an envhub server (``/metadata`` carries an ``envhub`` key) the client opts into the
announced extensions: request ids (a timed-out reply can never answer a later request),
msgpack frames, tool listing, per-step timeouts, session resume after a dropped connection, and
cancelling on the server a request the client gave up on (its timeout or the caller's
cancellation), so later requests do not queue behind it. Against an OpenEnv server it speaks
plain OpenEnv: no extra keys in any frame.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

import msgpack
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from envhub import _wire
from envhub._client_io import (
    BackgroundLoop,
    Watchdog,
    cached_metadata,
    close_code,
    closed_error,
    deadline,
    forget_metadata,
)
from envhub.errors import (
    ActionValidationError,
    AuthError,
    CapacityError,
    EnvConnectionError,
    EnvHubError,
    ErrorCode,
    ProtocolError,
    ServerError,
    SessionLostError,
    StepTimeoutError,
    error_for_code,
)
from envhub.types import StepResult, ToolSpec

MiB = 1024 * 1024
_WANTED = (_wire.EXT_REQUEST_ID, _wire.EXT_MSGPACK, _wire.EXT_TOOLS, _wire.EXT_RESUME, _wire.EXT_STEP_TIMEOUT,
           _wire.EXT_CANCEL)
_EXPECTED = {"reset": _wire.REPLY_OBSERVATION, "step": _wire.REPLY_OBSERVATION, "state": _wire.REPLY_STATE,
             "tools": _wire.REPLY_TOOLS, "mcp": _wire.REPLY_MCP}
# Close codes after which the server deliberately ended the session: resuming cannot help.
_NO_RESUME_CODES = {1000, 1001, 1008, 1009, 1013, 4404}

class EnvClient:
    """An async client for one env session over ``/ws``; connects lazily on the first call.

    ``extensions="auto"`` reads ``/metadata`` and opts into what an envhub server announces;
    ``None`` or ``()`` speaks plain OpenEnv; a list of names opts into exactly those without
    asking. ``step_timeout_s`` asks an envhub server to stop a step after that long
    (``STEP_TIMEOUT``); ``message_timeout_s`` bounds the wait for any reply client-side. When it
    passes (or the caller cancels a request) the client cancels the request on a server that
    offers the ``cancel`` extension: the episode is over there (the next ``step`` raises
    ``EpisodeStateError``, ``reset`` starts a new one) and nothing queues behind the abandoned step.

    >>> import asyncio
    >>> from envhub import EnvClient, create_app
    >>> from envhub.server import ServerThread
    >>> from envhub.testing import EchoEnv
    >>> async def episode(url):
    ...     async with EnvClient(url) as env:
    ...         await env.reset(seed=1)
    ...         return (await env.step({"message": "hi"})).reward
    >>> with ServerThread(create_app(EchoEnv)) as server:
    ...     asyncio.run(episode(server.url))
    0.2
    """

    def __init__(self, base_url: str, *, token: str | None = None, connect_timeout_s: float = 10.0,
                 message_timeout_s: float | None = 60.0, extensions: str | Iterable[str] | None = "auto",
                 retries: int = 3, backoff_s: float = 0.2, max_message_bytes: int = 100 * MiB,
                 ping_interval_s: float | None = 20.0, ping_timeout_s: float | None = 60.0,
                 compression: str | None = None, step_timeout_s: float | None = None):
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"Expected retries >= 0 and backoff_s >= 0, got {retries} and {backoff_s}.")
        if isinstance(extensions, str) and extensions != "auto":
            extensions = [e for e in extensions.split(",") if e]
        self.base_url = base_url
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.message_timeout_s = message_timeout_s
        self.step_timeout_s = step_timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self.max_message_bytes = max_message_bytes
        self.ping_interval_s, self.ping_timeout_s = ping_interval_s, ping_timeout_s
        self.compression = compression
        self._ext_mode = extensions if extensions == "auto" else tuple(extensions or ())
        self._ws: ClientConnection | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0
        self._lost: EnvHubError | None = None
        self.metadata: dict[str, Any] | None = None
        self.extensions: frozenset[str] = frozenset()
        self.session_id: str | None = None
        self._resume_token: str | None = None
        self._ids = self._binary = False
        self._watchdog = Watchdog()
        self._ws_loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task[None]] = set()

    # -- public API -------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._ws is not None

    async def connect(self) -> EnvClient:
        """Open the session now (normally it opens on the first call)."""
        async with self._lock:
            if self._ws is None:
                await self._open()
        return self

    async def reset(self, **kwargs: Any) -> StepResult:
        """Start an episode; ``kwargs`` go to the env's ``reset`` (``seed``, task fields...).

        After a lost session, ``reset`` opens a fresh one.
        """
        reply = await self._request("reset", kwargs, fresh_ok=True)
        return StepResult.from_wire(reply.get("data") or {})

    async def step(self, action: Any) -> StepResult:
        """Apply one action (a dict, or a pydantic model such as ``envhub.Action``)."""
        if hasattr(action, "model_dump"):
            action = action.model_dump(mode="python" if self._binary else "json")
        reply = await self._request("step", action)
        return StepResult.from_wire(reply.get("data") or {})

    async def state(self) -> dict[str, Any]:
        """The server-side episode state (episode_id, step_count, ...)."""
        reply = await self._request("state", None)
        data = reply.get("data")
        return data if isinstance(data, dict) else {}

    async def tools(self) -> list[ToolSpec]:
        """The env's tools as OpenAI function specs ([] when the server publishes none)."""
        async with self._lock:
            if self._ws is None and self._lost is None:
                await self._open()
        if _wire.EXT_TOOLS in self.extensions:
            data = (await self._request("tools", None)).get("data") or {}
            return [ToolSpec.from_openai(t) for t in data.get("tools", [])]
        hub = (self.metadata or {}).get("envhub")
        if isinstance(hub, dict):
            return [ToolSpec.from_openai(t) for t in hub.get("tools") or []]
        return await self._mcp_tools()

    async def _mcp_tools(self) -> list[ToolSpec]:
        # An OpenEnv server lists an MCP env's tools through the mcp passthrough; others answer an error.
        try:
            reply = await self._request("mcp", {"jsonrpc": "2.0", "method": "tools/list", "id": 1})
        except (ProtocolError, ServerError, ActionValidationError):
            return []
        tools = ((reply.get("data") or {}).get("result") or {}).get("tools")
        return [ToolSpec.from_openai(t) for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []

    async def close(self) -> None:
        """End the session: send ``close`` (the server drops the env) and close the socket."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            await ws.send(self._encode({"type": "close"}))
        except Exception:
            pass  # the socket may already be gone; closing it is all that is left to do
        try:
            await ws.close()
        except Exception:
            pass

    async def __aenter__(self) -> EnvClient:
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def sync(self) -> SyncEnvClient:
        """A blocking client with the same API, driving this one on a background event loop."""
        return SyncEnvClient(self)

    # -- connection ---------------------------------------------------------------------------
    async def _open(self, *, resume: bool = False) -> None:
        """Connect (with retries and exponential backoff) and read the hello frame if any."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                await self._open_once(resume=resume)
                self._lost = None
                return
            except (OSError, asyncio.TimeoutError, InvalidHandshake, EnvConnectionError) as exc:
                if isinstance(exc, (AuthError, CapacityError, SessionLostError)):
                    raise
                if isinstance(exc, InvalidStatus) and exc.response.status_code in (401, 403):
                    status = exc.response.status_code
                    if self.token is None:  # a web framework answers 403 to a WebSocket on a path it does not route
                        raise AuthError(f"the server at {self.base_url} refused the WebSocket handshake (HTTP {status})"
                                        "; no token was given: check the URL's path (envhub and OpenEnv serve /ws "
                                        "at the server's root), or pass token=... if it needs one") from None
                    raise AuthError(f"the server refused the token for {self.base_url} "
                                    f"(HTTP {status}); pass token=...") from None
                last = exc
                if self._ext_mode == "auto":
                    self.metadata = None
                    forget_metadata(self.base_url, self.token)
        raise EnvConnectionError(f"Could not connect to {self.base_url} after {self.retries + 1} attempt(s): "
                                 f"{type(last).__name__}: {last}. Is the server running?") from last

    async def _open_once(self, *, resume: bool) -> None:
        if self._ext_mode == "auto" and self.metadata is None:
            self.metadata = await cached_metadata(self.base_url, self.token, self.connect_timeout_s)
        wanted = self._wanted_extensions()
        query: dict[str, Any] = {"ext": ",".join(wanted) if wanted else None}
        if resume:
            query.update(resume=self.session_id, resume_token=self._resume_token)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        try:
            ws = await ws_connect(_wire.ws_url(self.base_url, **query), additional_headers=headers,
                                  open_timeout=self.connect_timeout_s, max_size=self.max_message_bytes,
                                  ping_interval=self.ping_interval_s, ping_timeout=self.ping_timeout_s,
                                  compression=self.compression, proxy=None)
        except InvalidURI as exc:
            raise ValueError(f"Expected an http(s):// or ws(s):// base URL, got {self.base_url!r}.") from exc
        self._ids = self._binary = False
        self.extensions = frozenset()
        if wanted:
            try:
                await self._read_hello(ws, resume)
            except BaseException:
                ws.transport.abort()  # no hello, no session: never leave the socket behind
                raise
        self._ws, self._ws_loop = ws, asyncio.get_running_loop()

    def _wanted_extensions(self) -> tuple[str, ...]:
        if self._ext_mode != "auto":
            return self._ext_mode  # type: ignore[return-value]
        announced = ((self.metadata or {}).get("envhub") or {}).get("extensions") or ()
        return tuple(e for e in _WANTED if e in announced)

    async def _read_hello(self, ws: ClientConnection, resume: bool) -> None:
        try:
            async with deadline(self.connect_timeout_s):
                msg = _wire.decode(await ws.recv(), binary_ok=True, max_bytes=self.max_message_bytes)
        except ConnectionClosed as exc:
            raise closed_error(exc, during="the handshake") from None
        if msg.get("type") == _wire.REPLY_ERROR:
            raise error_for_code(msg.get("data") or {})
        data = msg.get("data") or {}
        if msg.get("type") != _wire.REPLY_HELLO:
            raise ProtocolError(f"Expected a hello frame after opting into extensions, got {msg.get('type')!r}.")
        if resume and not data.get("resumed"):
            raise SessionLostError("the server did not resume the session; call reset() to start a new one.")
        self.extensions = frozenset(data.get("extensions") or ())
        self.session_id = data.get("session_id")
        self._resume_token = data.get("resume_token")
        self._ids = _wire.EXT_REQUEST_ID in self.extensions
        self._binary = _wire.EXT_MSGPACK in self.extensions

    # -- request / reply ----------------------------------------------------------------------
    def _encode(self, msg: dict[str, Any]) -> str | bytes:
        # Not lossy: msgpack cannot carry a lone surrogate, and the caller gets ActionValidationError
        # (nothing sent, the session intact) rather than a silently altered action.
        return _wire.encode(msg, binary=self._binary, lossy=False)

    async def _request(self, mtype: str, data: Any, *, fresh_ok: bool = False) -> dict[str, Any]:
        async with self._lock:
            if self._ws is None:
                if self._lost is not None and not fresh_ok:
                    raise SessionLostError(f"{self._lost}") from self._lost
                await self._open()
            elif self._ws_loop is not asyncio.get_running_loop():
                raise RuntimeError("This EnvClient's session belongs to the event loop it connected on; use one "
                                   "client per event loop, or client.sync() from blocking code.")
            msg: dict[str, Any] = {"type": mtype}
            if data is not None:
                msg["data"] = data
            rid = None
            if self._ids:
                self._next_id += 1
                rid = msg["id"] = self._next_id
            if self.step_timeout_s is not None and mtype == "step" and _wire.EXT_STEP_TIMEOUT in self.extensions:
                msg["timeout_s"] = self.step_timeout_s
            reply = await self._exchange(msg, rid)
        rtype = reply.get("type")
        if rtype == _EXPECTED[mtype]:
            return reply
        if rtype == _wire.REPLY_ERROR:
            err = error_for_code(reply.get("data") or {})
            if err.code in ErrorCode.FATAL or isinstance(err, EnvConnectionError):
                await self._drop(err)
            raise err
        # A reply of the wrong kind means the stream is out of step: never hand it to the caller.
        await self._drop(SessionLostError(f"session dropped: expected a {_EXPECTED[mtype]!r} reply to "
                                          f"{mtype!r}, got {rtype!r}; call reset() to start a new session."))
        raise ProtocolError(f"Expected a {_EXPECTED[mtype]!r} reply to {mtype!r}, got {rtype!r}.")

    async def _exchange(self, msg: dict[str, Any], rid: Any) -> dict[str, Any]:
        """Send one request and return its reply. Kept in one piece because the three ways a
        request can end badly (deadline, caller cancellation, dropped socket -> resume and
        re-send under the same id) must share the socket and id bookkeeping."""
        frame = self._encode(msg)
        resumes = 0
        dog = self._watchdog
        while True:
            ws = self._ws
            assert ws is not None
            dog.start(self.message_timeout_s)
            try:
                await ws.send(frame)
                return await self._receive(ws, rid)
            except asyncio.CancelledError:
                if dog.stop():
                    raise await self._timed_out(msg, rid) from None
                if not self._ids:  # the caller gave up mid-request: its reply must not answer the next one
                    self._abandon(SessionLostError("session dropped: a request was cancelled before its reply; "
                                                   "call reset() to start a new session."))
                else:  # cannot await while being cancelled: the cancel frame goes out in the background
                    task = asyncio.ensure_future(self._cancel_on_server(rid))
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
                raise
            except ConnectionClosed as exc:
                dog.stop()
                last_words = await self._buffered_reply(ws, rid)
                if last_words is not None:  # e.g. CAPACITY_REACHED sent right before the close
                    return last_words
                code = close_code(exc)
                can_resume = (_wire.EXT_RESUME in self.extensions and self._ids and self.session_id
                              and code not in _NO_RESUME_CODES and resumes < max(self.retries, 1))
                if not can_resume:
                    await self._drop(closed_error(exc, during=repr(msg["type"])))
                    raise self._lost from None  # type: ignore[misc]
                resumes += 1
                self._ws = None
                try:
                    await self._open(resume=True)
                except EnvHubError as err:
                    self._lost = err if isinstance(err, SessionLostError) else SessionLostError(str(err))
                    raise self._lost from None
                frame = self._encode(msg)  # the resumed session may speak another codec
            finally:
                dog.stop()

    async def _timed_out(self, msg: dict[str, Any], rid: Any) -> StepTimeoutError:
        err = StepTimeoutError(f"no reply to {msg['type']!r} within message_timeout_s={self.message_timeout_s}s")
        await self._cancel_on_server(rid)
        if not self._ids:
            # Without request ids a late reply would answer the next request: drop the socket.
            await self._drop(SessionLostError(f"session dropped after a timeout ({err}); "
                                              "call reset() to start a new session."))
        return err

    async def _cancel_on_server(self, rid: Any) -> None:
        """Ask the server to give up request ``rid`` (``cancel`` extension): its env stops where it
        can, and the next request does not wait behind it. Its late reply is discarded by id."""
        ws = self._ws
        if ws is None or rid is None or _wire.EXT_CANCEL not in self.extensions:
            return
        try:
            await ws.send(self._encode({"type": "cancel", "data": {"id": rid}}))
        except Exception:
            pass  # the socket is gone, and with it whatever ran on it

    async def _buffered_reply(self, ws: ClientConnection, rid: Any) -> dict[str, Any] | None:
        """A reply the server sent before closing, still queued on a closed socket (None if none)."""
        try:
            return await self._receive(ws, rid)
        except (ConnectionClosed, ProtocolError):
            return None

    async def _receive(self, ws: ClientConnection, rid: Any) -> dict[str, Any]:
        while True:
            raw = await ws.recv()
            if isinstance(raw, bytes):
                try:
                    msg = msgpack.unpackb(raw, raw=False, strict_map_key=False)
                except Exception as exc:
                    raise ProtocolError(f"Invalid msgpack frame from the server: {exc}") from None
            else:
                try:
                    msg = json.loads(raw)
                except ValueError as exc:
                    raise ProtocolError(f"Invalid JSON frame from the server: {exc}") from None
            if not isinstance(msg, dict):
                raise ProtocolError(f"Expected a JSON object frame from the server, got {type(msg).__name__}.")
            if rid is not None:
                got = msg.get("id")
                # A stale reply (its request timed out earlier) is discarded by id; an id-less
                # error is a server notice about the session and answers the pending request.
                if got != rid and not (got is None and msg.get("type") == _wire.REPLY_ERROR):
                    continue
            return msg

    def _abandon(self, reason: EnvHubError) -> None:
        """Drop the session without awaiting (usable while being cancelled)."""
        self._lost = reason
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.transport.abort()

    async def _drop(self, reason: EnvHubError) -> None:
        self._lost = reason
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                await ws.close()
            except Exception:
                pass


class SyncEnvClient:
    """The blocking face of :class:`EnvClient`; every call runs on a shared background event loop.

    >>> from envhub import create_app
    >>> from envhub.server import ServerThread
    >>> from envhub.testing import EchoEnv
    >>> with ServerThread(create_app(EchoEnv)) as server, EnvClient(server.url).sync() as env:
    ...     first = env.reset(seed=1)
    ...     env.step({"message": "hello"}).observation.echoed_message
    'hello'
    """

    def __init__(self, client: EnvClient):
        self.client = client
        self._loop = BackgroundLoop.shared()

    def connect(self) -> SyncEnvClient:
        self._loop.run(self.client.connect())
        return self

    def reset(self, **kwargs: Any) -> StepResult:
        return self._loop.run(self.client.reset(**kwargs))

    def step(self, action: Any) -> StepResult:
        return self._loop.run(self.client.step(action))

    def state(self) -> dict[str, Any]:
        return self._loop.run(self.client.state())

    def tools(self) -> list[ToolSpec]:
        return self._loop.run(self.client.tools())

    def close(self) -> None:
        self._loop.run(self.client.close())

    def __enter__(self) -> SyncEnvClient:
        return self.connect()

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["EnvClient", "SyncEnvClient"]
