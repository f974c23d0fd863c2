"""One server-side session: an env instance, its runner and protocol state, and how a Call is executed.

A session outlives its socket when the client negotiated ``resume``: the connection that
owns it is only an attachment (``Attachment``) that a reconnect can replace. What a session
may use of its server is a :class:`SessionContext` (build a runner, retire an abandoned one,
count), never the session registry itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor, Future
from typing import Any, Protocol

from envhub.env import Env, EnvRunner
from envhub.errors import EnvExecutionError, EnvHubError, ErrorCode
from envhub.protocol import Call, SessionProtocol
from envhub.server.mcp import handle_jsonrpc
from envhub.server.metrics import Metrics


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


class Interrupts(Protocol):
    """Frames that may arrive while a request runs (the ``cancel`` extension): the shell's inbox."""

    def incoming(self) -> asyncio.Future[Any]:
        """The read in flight (started if there is none)."""

    def cancels(self, request_id: Any) -> bool:
        """Take the finished read: True when it cancels ``request_id``, else it waits its turn."""


class SessionContext:
    """All a session may use of its server: build a runner on a fresh env instance, retire an
    abandoned runner once its worker lets go of it, and count what happens (``metrics``).

    ``pool`` runs sync env methods (None: inline on the event loop); ``spawn`` keeps a background
    task alive; ``build_env`` and ``close_env`` make and close env instances.
    """

    __slots__ = ("_build_env", "_close_env", "_pool", "_spawn", "metrics")

    def __init__(self, *, build_env: Callable[[], Awaitable[Env]], close_env: Callable[[EnvRunner], Awaitable[None]],
                 pool: Executor | None, metrics: Metrics, spawn: Callable[[Coroutine[Any, Any, Any]], Any]):
        self.metrics = metrics
        self._build_env, self._close_env = build_env, close_env
        self._pool, self._spawn = pool, spawn

    def runner_for(self, env: Env) -> EnvRunner:
        """A runner for ``env``; its executor remembers the last job, so an abandoned one can be waited for."""
        return EnvRunner(env, executor=None if self._pool is None else SessionExecutor(self._pool))

    async def new_runner(self) -> EnvRunner:
        """A runner on a freshly built env instance (FACTORY_ERROR when the constructor raises)."""
        return self.runner_for(await self._build_env())

    def retire(self, runner: EnvRunner, task: asyncio.Future[Any]) -> None:
        """Close ``runner``'s env once ``task`` is over and no worker thread still uses the env."""
        self._spawn(self._close_after(runner, task))

    async def _close_after(self, runner: EnvRunner, task: asyncio.Future[Any]) -> None:
        job = runner.executor.busy_job() if isinstance(runner.executor, SessionExecutor) else None
        if job is not None:
            waiter = asyncio.wrap_future(job)
            await asyncio.wait((waiter,))
            _consume(waiter)
        await asyncio.wait((task,))
        await self._close_env(runner)


class Session:
    """An env instance with its runner and protocol state, registered in the hub under ``id``."""

    def __init__(self, context: SessionContext, protocol: SessionProtocol, env: Env, *, kind: str = "ws"):
        self.context = context
        self.id = protocol.session_id
        self.protocol = protocol
        self.kind = kind
        self.runner = context.runner_for(env)
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

    async def execute(self, call: Call, *, interrupts: Interrupts | None = None) -> dict[str, Any]:
        """Run one Call on the env and return the reply envelope. Never raises for env errors.

        ``interrupts``: frames read while it runs; a ``cancel`` naming it ends it (``CANCELLED``).
        """
        self.busy = True
        metrics = self.context.metrics
        start = time.perf_counter()
        try:
            if call.fresh_env:
                await self._replace_env()
            if call.timeout_s is None and interrupts is None:
                result = await self._invoke(call)
            else:
                task = asyncio.ensure_future(self._invoke(call))
                outcome = await self._watch(call, task, interrupts)
                if outcome is not None:
                    return self._abandon(call, task, outcome)
                result = task.result()
        except EnvHubError as exc:
            metrics.error(exc.code)
            return self.protocol.fail(call, exc)
        except Exception as exc:  # state() or an MCP handler raising: still only this request fails
            err = EnvExecutionError(f"{call.op} raised {type(exc).__name__}: {exc}")
            metrics.error(err.code)
            return self.protocol.fail(call, err)
        finally:
            self.busy = False
            self.last_active = time.monotonic()
        metrics.observe(call.op, time.perf_counter() - start)
        return self.protocol.complete(call, result)

    @staticmethod
    async def _watch(call: Call, task: asyncio.Future[Any], interrupts: Interrupts | None) -> str | None:
        """Wait for ``task``; None when it finished, else why it is given up (``STEP_TIMEOUT``, ``CANCELLED``)."""
        loop = asyncio.get_running_loop()
        deadline = None if call.timeout_s is None else loop.time() + call.timeout_s
        while True:
            waiters = (task,) if interrupts is None else (task, interrupts.incoming())
            left = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return None
            if not done:
                return ErrorCode.STEP_TIMEOUT
            if interrupts is not None and interrupts.cancels(call.request_id):
                return ErrorCode.CANCELLED

    def _invoke(self, call: Call) -> Awaitable[Any]:
        op = call.op
        if op == "step":
            return self.runner.step(call.payload)
        if op == "reset":
            return self.runner.reset(**call.payload)
        if op == "state":
            return self.runner.state()
        return handle_jsonrpc(call.payload, type(self.runner.env), runner=self.runner)

    def _abandon(self, call: Call, task: asyncio.Future[Any], code: str) -> dict[str, Any]:
        """Reply ``code`` (STEP_TIMEOUT or CANCELLED) now; close the stuck env once its worker lets go of it."""
        self.context.metrics.error(code)
        runner = self.runner
        reply = self.protocol.abandoned(call, code, episode_id=runner.episode_id, step_count=runner.step_count)
        executor = runner.executor
        if not (isinstance(executor, SessionExecutor) and executor.busy_job() is not None):
            task.cancel()  # async env code: cancellation really stops it
        task.add_done_callback(_consume)
        self.context.retire(runner, task)
        return reply

    async def _replace_env(self) -> None:
        self.runner = await self.context.new_runner()
        self.protocol.env_replaced()

    def stale(self) -> bool:
        """True when the current runner was abandoned by a timeout or a cancel (it is closed elsewhere)."""
        return self.protocol.stale_state is not None


def _consume(task: asyncio.Future[Any]) -> None:
    # An abandoned request's outcome is nobody's business any more; read it so asyncio stays quiet.
    if not task.cancelled():
        task.exception()
