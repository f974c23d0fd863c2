"""One server-side session: an env instance, its runner and protocol state, and how a Call is executed.

A session outlives its socket when the client negotiated ``resume``: the connection that
owns it is only an attachment (``Attachment``) that a reconnect can replace.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

from envhub.env import Env, EnvRunner
from envhub.errors import EnvExecutionError, EnvHubError
from envhub.protocol import Call, SessionProtocol
from envhub.server.mcp import handle_jsonrpc

if TYPE_CHECKING:  # pragma: no cover
    from envhub.server.hub import Hub


class SessionExecutor(Executor):
    """A view of the shared thread pool that remembers the session's last submitted job.

    A timed-out step keeps running in its worker thread; knowing that job lets the server
    close the abandoned env instance only after the thread has let go of it.
    """

    def __init__(self, pool: Executor):
        self._pool = pool
        self.last: Future[Any] | None = None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        job = self._pool.submit(fn, *args, **kwargs)
        self.last = job
        return job

    def busy_job(self) -> Future[Any] | None:
        job = self.last
        return job if job is not None and not job.done() else None


class Attachment:
    """The socket a session currently talks through: how to send to it and how to close it."""

    __slots__ = ("close", "send")

    def __init__(self, send: Callable[[str | bytes], Awaitable[None]],
                 close: Callable[[int, str], Awaitable[None]]):
        self.send = send
        self.close = close


class Session:
    """An env instance with its runner and protocol state, registered in the hub under ``id``."""

    def __init__(self, hub: Hub, protocol: SessionProtocol, env: Env, *, kind: str = "ws"):
        self.hub = hub
        self.id = protocol.session_id
        self.protocol = protocol
        self.kind = kind
        self.executor = None if hub.inline else SessionExecutor(hub.pool)
        self.runner = EnvRunner(env, executor=self.executor)
        self.last_active = time.monotonic()
        self.busy = False
        self.closed = False
        self.attachment: Attachment | None = None
        self.detached_at: float | None = None
        # HTTP requests on one session may arrive concurrently; WS frames are already sequential.
        self.lock = asyncio.Lock() if kind == "http" else None

    @property
    def resumable(self) -> bool:
        return self.protocol.resume_token is not None

    async def execute(self, call: Call) -> dict[str, Any]:
        """Run one Call on the env and return the reply envelope. Never raises for env errors."""
        self.busy = True
        start = time.perf_counter()
        try:
            if call.fresh_env:
                await self._replace_env()
            if call.timeout_s is None:
                result = await self._invoke(call)
            else:
                task = asyncio.ensure_future(self._invoke(call))
                done, _ = await asyncio.wait((task,), timeout=call.timeout_s)
                if not done:
                    return self._abandon(call, task)
                result = task.result()
        except EnvHubError as exc:
            self.hub.metrics.error(exc.code)
            return self.protocol.fail(call, exc)
        except Exception as exc:  # state() or an MCP handler raising: still only this request fails
            err = EnvExecutionError(f"{call.op} raised {type(exc).__name__}: {exc}")
            self.hub.metrics.error(err.code)
            return self.protocol.fail(call, err)
        finally:
            self.busy = False
            self.last_active = time.monotonic()
        self.hub.metrics.observe(call.op, time.perf_counter() - start)
        return self.protocol.complete(call, result)

    def _invoke(self, call: Call) -> Awaitable[Any]:
        op = call.op
        if op == "step":
            return self.runner.step(call.payload)
        if op == "reset":
            return self.runner.reset(**call.payload)
        if op == "state":
            return self.runner.state()
        return handle_jsonrpc(call.payload, self.hub.env_cls, runner=self.runner)

    def _abandon(self, call: Call, task: asyncio.Future[Any]) -> dict[str, Any]:
        """Reply STEP_TIMEOUT now; close the stuck env once its worker lets go of it."""
        self.hub.metrics.error("STEP_TIMEOUT")
        runner = self.runner
        reply = self.protocol.timed_out(call, episode_id=runner.episode_id, step_count=runner.step_count)
        job = self.executor.busy_job() if self.executor is not None else None
        if job is None:
            task.cancel()  # async env code: cancellation really stops it
        task.add_done_callback(_consume)
        self.hub.spawn(self._close_after(runner, task, job))
        return reply

    async def _close_after(self, runner: EnvRunner, task: asyncio.Future[Any], job: Future[Any] | None) -> None:
        if job is not None:
            waiter = asyncio.wrap_future(job)
            await asyncio.wait((waiter,))
            _consume(waiter)
        else:
            await asyncio.wait((task,))
        await self.hub.close_env(runner)

    async def _replace_env(self) -> None:
        env = await self.hub.build_env()
        self.executor = None if self.hub.inline else SessionExecutor(self.hub.pool)
        self.runner = EnvRunner(env, executor=self.executor)
        self.protocol.env_replaced()

    def stale(self) -> bool:
        """True when the current runner was abandoned by a timeout (it is closed elsewhere)."""
        return self.protocol.stale_state is not None


def _consume(task: asyncio.Future[Any]) -> None:
    # An abandoned request's outcome is nobody's business any more; read it so asyncio stays quiet.
    if not task.cancelled():
        task.exception()
