"""Client plumbing: the shared background event loop behind the sync clients, and a cheap HTTP GET.

Private to the client family (``envhub.client``, ``envhub.remote``, ``envhub.env_tool``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from envhub.types import StepResult

T = TypeVar("T")

if sys.version_info >= (3, 11):
    deadline = asyncio.timeout  # no task per call: this sits on every request's hot path
else:  # pragma: no cover - Python 3.10
    @asynccontextmanager
    async def deadline(delay: float | None) -> AsyncIterator[None]:
        """``asyncio.timeout`` for 3.10: TimeoutError when ``delay`` passes, other cancellations untouched."""
        if delay is None:
            yield
            return
        task = asyncio.current_task()
        fired: list[int] = []

        def fire() -> None:
            fired.append(1)
            if task is not None:
                task.cancel()

        handle = asyncio.get_running_loop().call_later(delay, fire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise TimeoutError from None
            raise
        finally:
            handle.cancel()


class Watchdog:
    """A request deadline that costs one re-armed timer per client, not one timer per request.

    ``asyncio.timeout`` allocates and cancels a timer on every call (~10 us, a third of the
    client's per-step cost). Here the timer fires at most once per ``timeout_s`` and re-arms
    itself while requests keep finishing in time; when a request really overruns, its task is
    cancelled and :meth:`stop` reports it, so the caller raises ``TimeoutError`` instead.
    """

    __slots__ = ("_baseline", "_due", "_fired", "_handle", "_task")

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._fired = False
        self._baseline = 0

    def start(self, timeout_s: float | None) -> None:
        """Guard the current task until :meth:`stop` (no deadline when ``timeout_s`` is None)."""
        self._fired = False
        if timeout_s is None:
            self._task = None
            return
        loop = asyncio.get_running_loop()
        task = self._task = asyncio.current_task()
        self._baseline = task.cancelling() if hasattr(task, "cancelling") else 0  # type: ignore[union-attr]
        self._due = loop.time() + timeout_s
        handle = self._handle
        if handle is None or handle.when() > self._due:
            if handle is not None:
                handle.cancel()
            self._handle = loop.call_at(self._due, self._check)

    def stop(self) -> bool:
        """End the guard; True when the deadline passed (the task's cancellation is then undone)."""
        task, self._task = self._task, None
        fired, self._fired = self._fired, False
        if fired and task is not None and hasattr(task, "uncancel"):
            # Another cancellation arrived too: let it win, as asyncio.timeout does.
            return bool(task.uncancel() <= self._baseline)
        return fired

    def _check(self) -> None:
        self._handle = None
        task = self._task
        if task is None:
            return  # idle: the next request re-arms
        loop = asyncio.get_running_loop()
        if loop.time() >= self._due:
            self._fired = True
            task.cancel()
        else:
            self._handle = loop.call_at(self._due, self._check)


def close_code(exc: Any) -> int:
    """The code a ``ConnectionClosed`` stands for: the server's, else ours (1009: its reply was too big), else 1006."""
    if exc.rcvd is not None:
        return int(exc.rcvd.code)
    if exc.sent is not None:
        return int(exc.sent.code)
    return 1006


def closed_error(exc: Any, *, during: str) -> Any:
    """The typed error for a WebSocket close (``websockets.ConnectionClosed``), as the contract maps codes."""
    from envhub.errors import AuthError, CapacityError, MessageTooLargeError, SessionLostError

    code = close_code(exc)
    frame = exc.rcvd if exc.rcvd is not None else exc.sent
    reason = frame.reason if frame is not None else "no close frame"
    text = f"connection closed during {during} (code {code}: {reason or 'no reason'})"
    if code == 1008:
        return AuthError(text)
    if code == 1013:
        return CapacityError(text)
    if code == 1009:
        return MessageTooLargeError(text)
    return SessionLostError(text + "; call reset() to start a new session.")


class BackgroundLoop:
    """One daemon thread running an asyncio loop, shared by every sync client of the process."""

    _shared: BackgroundLoop | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="envhub-client-loop", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> BackgroundLoop:
        with cls._guard:
            if cls._shared is None or not cls._shared._thread.is_alive():
                cls._shared = cls()
            return cls._shared

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and block until it finishes; its exception is re-raised here."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("A sync envhub client was called from its own event-loop thread; "
                               "use the async API (await client.step(...)) inside coroutines.")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


# (metadata URL, token) -> (expiry on the monotonic clock, metadata). Many sessions of one trainer dial
# the same server; one GET per server every few seconds is enough (the hello frame is authoritative).
_METADATA: dict[tuple[str, str | None], tuple[float, dict[str, Any]]] = {}
METADATA_TTL_S = 10.0


async def cached_metadata(base_url: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    """The server's ``/metadata`` (``{}`` for a server without one); raises ``AuthError`` on 401/403."""
    from envhub import _wire
    from envhub.errors import AuthError

    url = _wire.http_url(base_url, "/metadata")
    now = time.monotonic()
    hit = _METADATA.get((url, token))
    if hit is not None and hit[0] > now:
        return hit[1]
    status, meta = await fetch_json(url, token, timeout_s)
    if status in (401, 403):
        raise AuthError(f"GET /metadata returned HTTP {status}: pass the server's token=...")
    meta = meta if status == 200 and isinstance(meta, dict) else {}
    _METADATA[(url, token)] = (now + METADATA_TTL_S, meta)
    return meta


def forget_metadata(base_url: str, token: str | None) -> None:
    """Drop a cached ``/metadata`` (after a failed connect, the server may have changed)."""
    from envhub import _wire

    _METADATA.pop((_wire.http_url(base_url, "/metadata"), token), None)


async def fetch_json(url: str, token: str | None, timeout_s: float) -> tuple[int, Any]:
    """GET ``url`` and return ``(status, parsed JSON or None)``; raises ``OSError``/``TimeoutError`` when unreachable.

    Plain ``http://`` uses one raw HTTP/1.1 exchange on a socket (no client object to build,
    which matters when thousands of sessions connect); ``https://`` goes through httpx.
    """
    parts = urlsplit(url)
    if parts.scheme == "https":
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            try:
                resp = await http.get(url, headers=headers)
            except httpx.TransportError as exc:
                raise OSError(str(exc)) from exc
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, None
    async with deadline(timeout_s):
        return await _raw_get(parts, token)


async def _raw_get(parts: Any, token: str | None) -> tuple[int, Any]:
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    reader, writer = await asyncio.open_connection(host, port)
    try:
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        path = parts.path or "/"
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAccept: application/json\r\n"
                     f"{auth}Connection: close\r\n\r\n".encode("latin-1"))
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return 0, None
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    try:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = _dechunk(body)
        return status, json.loads(body)
    except ValueError:
        return status, None


def _dechunk(body: bytes) -> bytes:
    out, i = bytearray(), 0
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            return bytes(out)
        size = int(body[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            return bytes(out)
        out += body[j + 2:j + 2 + size]
        i = j + 2 + size + 2


class _EpisodeSource(Protocol):
    """What a blocking env view reads from its async twin."""

    @property
    def episode_reward(self) -> float: ...
    @property
    def last_result(self) -> StepResult | None: ...
    @property
    def done(self) -> bool: ...


_View = TypeVar("_View", bound="SyncEpisodeView")


class SyncEpisodeView:
    """The blocking side shared by ``OpenEnv`` and ``LocalEnv``: episode state read from the async
    twin ``aenv``, and ``with`` closing it."""

    aenv: _EpisodeSource

    def close(self) -> None:
        raise NotImplementedError

    @property
    def episode_reward(self) -> float:
        return self.aenv.episode_reward

    @property
    def last_result(self) -> StepResult | None:
        return self.aenv.last_result

    @property
    def done(self) -> bool:
        return self.aenv.done

    def __enter__(self: _View) -> _View:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
