"""The session registry of one server process: capacity, env construction, resume, idle reaping, draining."""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import secrets
import time
import uuid
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envhub.env import Env, EnvRunner
from envhub.errors import CapacityError, EnvHubError, ErrorCode
from envhub.protocol import CLOSE_GOING_AWAY, SessionProtocol
from envhub.server.metrics import Metrics
from envhub.server.session import Session, SessionContext
from envhub.settings import Settings

log = logging.getLogger("envhub.server")


def _has_async_methods(env_cls: type[Env]) -> bool:
    """Whether an env class defines any ``async def`` method of its own (beyond the ``Env`` base)."""
    return any(inspect.iscoroutinefunction(fn) for klass in env_cls.__mro__ if klass is not Env
               and issubclass(klass, Env) for fn in vars(klass).values())

#: HTTP sessions need some idle limit even when WebSocket sessions have none.
HTTP_IDLE_TIMEOUT_S = 600.0


class Hub:
    """Owns every live session of one process, the shared thread pool and the metrics."""

    def __init__(self, env_cls: type[Env], settings: Settings, env_config: dict[str, Any]):
        self.env_cls = env_cls
        self.settings = settings
        self.env_config = env_config
        # Per-class opt-in: trivially cheap sync envs may skip the worker-thread hop.
        self.inline = bool(getattr(env_cls, "run_inline", False))
        self.pool = ThreadPoolExecutor(settings.thread_pool_size, thread_name_prefix="envhub-env")
        self.sessions: dict[str, Session] = {}
        self.metrics = Metrics()
        self.shutting_down = False
        self._reserved = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._tools = env_cls.tools()
        # A cancel interrupts work in the thread pool or async env code, never sync code run inline.
        self.cancel_interrupts = not self.inline or _has_async_methods(env_cls)
        #: the part of the hub a session may use
        self.session_context = SessionContext(build_env=self.build_env, close_env=self.close_env,
                                              pool=None if self.inline else self.pool, metrics=self.metrics,
                                              spawn=self.spawn)

    # -- construction ------------------------------------------------------------------------
    def check_token(self, presented: str | None) -> bool:
        """True when no token is configured or ``presented`` matches it."""
        expected = self.settings.token
        if expected is None:
            return True
        return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())

    def capacity_error(self) -> CapacityError | None:
        active = len(self.sessions) + self._reserved
        if active < self.settings.max_sessions:
            return None
        return CapacityError(f"Server at capacity: {active} of {self.settings.max_sessions} sessions in use; "
                             "retry later or raise --max-sessions.",
                             details={"active_sessions": active, "max_sessions": self.settings.max_sessions})

    async def build_env(self) -> Env:
        """A new env instance (constructor in the pool unless inline); FACTORY_ERROR when it raises."""
        try:
            if self.inline:
                return self.env_cls(**self.env_config)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.pool, lambda: self.env_cls(**self.env_config))
        except Exception as exc:
            log.exception("env factory %s raised", self.env_cls.__name__)
            raise EnvHubError(f"Could not create {self.env_cls.__name__}: {type(exc).__name__}: {exc}",
                              code=ErrorCode.FACTORY_ERROR,
                              details={"factory_name": self.env_cls.__name__}) from exc

    async def new_runner(self) -> EnvRunner:
        """A runner on a fresh env, for throwaway MCP calls (not counted as a session)."""
        return EnvRunner(await self.build_env(), executor=None if self.inline else self.pool)

    async def open_session(self, extensions: frozenset[str] | None, *, kind: str = "ws") -> Session:
        """Reserve a slot, build the env, register the session. Raises CapacityError / FACTORY_ERROR."""
        if self.shutting_down:
            raise EnvHubError("Server is shutting down; reconnect to another replica.",
                              code=ErrorCode.SHUTTING_DOWN)
        full = self.capacity_error()
        if full is not None:
            raise full
        # The slot is held while the env builds, so slow constructors cannot overshoot the cap.
        self._reserved += 1
        try:
            env = await self.build_env()
        finally:
            self._reserved -= 1
        session_id = uuid.uuid4().hex
        protocol = SessionProtocol(session_id, extensions=extensions,
                                   max_message_bytes=self.settings.max_message_bytes,
                                   step_timeout_s=self.settings.step_timeout_s, tools=self._tools,
                                   resume_token=secrets.token_urlsafe(24))
        session = Session(self.session_context, protocol, env, kind=kind)
        self.sessions[session_id] = session
        self.metrics.session_opened()
        self._ensure_reaper()
        return session

    def find_resumable(self, session_id: str, token: str | None) -> Session | None:
        """The session to resume, or None when it is unknown, expired or the token is wrong."""
        session = self.sessions.get(session_id)
        if session is None or session.closed or not session.resumable or token is None:
            return None
        if not hmac.compare_digest(token.encode(), str(session.protocol.resume_token).encode()):
            return None
        return session

    # -- teardown ----------------------------------------------------------------------------
    async def close_session(self, session: Session, code: int | None = None, reason: str = "") -> None:
        """Unregister the session, close its socket with ``code`` (when attached) and its env. Idempotent."""
        if session.closed:
            return
        session.closed = True
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
            self.metrics.session_closed()
        attachment, session.attachment = session.attachment, None
        if attachment is not None and code is not None:
            try:
                await attachment.close(code, reason)
            except Exception:  # the peer is already gone
                pass
        if not session.stale():
            await self.close_env(session.runner)

    async def close_env(self, runner: EnvRunner) -> None:
        try:
            await runner.close()
        except Exception:
            log.exception("%s.close() raised", self.env_cls.__name__)

    def detach(self, session: Session, attachment: Any, *, clean: bool) -> None:
        """The socket behind ``attachment`` went away: keep the session for resume, or close it."""
        if session.attachment is not attachment or session.closed:
            return  # a resumed connection owns the session now
        session.attachment = None
        if session.resumable and not clean and not self.shutting_down and self.settings.resume_grace_s > 0:
            session.detached_at = time.monotonic()
            self._ensure_reaper()
            return
        self.spawn(self.close_session(session))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a background coroutine, keeping a reference so it is not garbage-collected."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- reaping -----------------------------------------------------------------------------
    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap_forever())

    def _reap_interval_s(self) -> float:
        limits = [t for t in (self.settings.idle_timeout_s, self.settings.resume_grace_s, HTTP_IDLE_TIMEOUT_S) if t]
        return min(5.0, max(0.05, min(limits) / 4))

    async def _reap_forever(self) -> None:
        interval = self._reap_interval_s()
        while self.sessions:
            await asyncio.sleep(interval)
            await self.reap(time.monotonic())

    async def reap(self, now: float) -> int:
        """Close idle sessions (socket closed with 1001, env closed) and expired detached ones."""
        idle_s = self.settings.idle_timeout_s
        victims = []
        for session in list(self.sessions.values()):
            if session.busy:
                continue
            if session.detached_at is not None and session.attachment is None:
                expired = now - session.detached_at > self.settings.resume_grace_s
            elif session.kind == "http":
                expired = now - session.last_active > (idle_s or HTTP_IDLE_TIMEOUT_S)
            else:
                expired = idle_s is not None and now - session.last_active > idle_s
            if expired:
                victims.append(session)
        for session in victims:
            log.info("reaping idle session %s", session.id)
            await self.close_session(session, CLOSE_GOING_AWAY, "idle timeout")
        return len(victims)

    async def drain(self, grace_s: float) -> None:
        """Graceful shutdown: refuse new sessions, let in-flight requests finish, then close everything (1001)."""
        self.shutting_down = True
        deadline = time.monotonic() + grace_s
        while True:
            # Idle sessions close at once; busy ones as soon as their reply has gone out (the frame
            # loop sends without yielding after a request completes, so "not busy" means "answered").
            timed_out = time.monotonic() >= deadline
            done = [s for s in self.sessions.values() if timed_out or not s.busy]
            await asyncio.gather(*(self.close_session(s, CLOSE_GOING_AWAY, "server shutting down") for s in done),
                                 return_exceptions=True)
            if not self.sessions or timed_out:
                break
            await asyncio.sleep(0.02)
        if self._reaper is not None:
            self._reaper.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
