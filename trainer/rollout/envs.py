"""Where episodes run: one env session per episode, in process (``EnvRunner``) or over WebSocket (``EnvClient``).

``EnvPool`` opens sessions. Over WebSocket it retries a refused connection until
``connect_retry_s`` has passed, so a server that restarts costs only the episodes that were
on it: later episodes reconnect on their own. The extensions an envhub server announces are
read once per URL, not once per episode.

Every session's actions go through the pool's action mapper (see :mod:`trainer.rollout.actions`):
with ``action_mapper="auto"`` the mapper (and any tool made from a typed action) comes from the
server's ``/schema``, read once per URL. ``tools`` (OpenAI schemas) replace the tools a session
lists, for servers that publish none.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from envhub import Env, EnvRunner, StepResult, ToolSpec
from envhub.errors import ActionValidationError, AuthError, EnvConnectionError
from envhub.registry import import_target
from trainer.rollout.actions import ActionMapper, from_action_schema, identity, load_action_mapper


class EnvSession(Protocol):
    """One episode's env: reset, step, tools, close (all async)."""

    async def reset(self, **kwargs: Any) -> StepResult: ...

    async def step(self, action: dict[str, Any]) -> StepResult: ...

    async def tools(self) -> list[ToolSpec]: ...

    async def close(self) -> None: ...


class InProcessSession:
    """An ``Env`` instance driven by ``EnvRunner`` on the rollout's own event loop (no transport)."""

    def __init__(self, env: Env):
        self.runner = EnvRunner(env)

    async def reset(self, **kwargs: Any) -> StepResult:
        return await self.runner.reset(**kwargs)

    async def step(self, action: dict[str, Any]) -> StepResult:
        return await self.runner.step(action)

    async def tools(self) -> list[ToolSpec]:
        return type(self.runner.env).tools()

    async def close(self) -> None:
        await self.runner.close()


def load_env_class(path: str) -> type[Env]:
    """``"package.module:ClassName"`` -> the class (for in-process envs named in a config)."""
    cls = import_target(path, expected="an env class path like 'my_pkg.my_env:MyEnv'")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ValueError(f"Expected {path!r} to name an envhub.Env subclass, got {cls!r}.")
    return cls


class EnvPool:
    """Opens one session per episode: from env URLs (round-robin by task) or an in-process env class."""

    def __init__(self, urls: list[str] | None = None, env_cls: type[Env] | None = None, *,
                 connect_timeout_s: float = 10.0, connect_retry_s: float = 30.0,
                 message_timeout_s: float | None = 120.0, step_timeout_s: float | None = None,
                 token: str | None = None, reuse_sessions: bool = True,
                 action_mapper: str | ActionMapper | None = "auto", tools: list[Any] | None = None):
        if bool(urls) == (env_cls is not None):
            raise ValueError("Expected exactly one of env URLs or an in-process env class, got "
                             f"urls={urls!r}, env_cls={env_cls!r}.")
        self.urls = list(urls or [])
        self.env_cls = env_cls
        self.connect_timeout_s = connect_timeout_s
        self.connect_retry_s = connect_retry_s
        self.message_timeout_s = message_timeout_s
        self.step_timeout_s = step_timeout_s
        self.token = token
        self._extensions: dict[str, tuple[str, ...]] = {}
        self.reuse_sessions = reuse_sessions
        self._idle: dict[str, list[EnvSession]] = {}
        self.reconnects = 0  # connections that succeeded only after a retry
        self.mapper_spec = action_mapper
        self._mapper = load_action_mapper(action_mapper)  # None: "auto", resolved per URL from /schema
        self.tool_specs = None if tools is None else [t if isinstance(t, ToolSpec) else ToolSpec.from_openai(t)
                                                      for t in tools]
        self._adapters: dict[str, tuple[ActionMapper, list[ToolSpec]]] = {}

    def url_for(self, index: int) -> str | None:
        return self.urls[index % len(self.urls)] if self.urls else None

    async def open(self, url: str | None = None) -> EnvSession:
        """A connected session (in process, or to ``url`` / the first URL)."""
        if self.env_cls is not None:
            if self._mapper is not None:
                return self._adapt(InProcessSession(self.env_cls()), self._mapper, [])
            if "" not in self._adapters:  # "auto": from the env's own action model, as /schema publishes it
                self._adapters[""] = from_action_schema(self.env_cls.action_model.model_json_schema())
            return self._adapt(InProcessSession(self.env_cls()), *self._adapters[""])
        url = url or self.urls[0]
        idle = self._idle.get(url)
        while idle:
            session = idle.pop()
            if getattr(session, "connected", False):
                return session
        client = await self._connect(url)
        if self._mapper is not None:
            return self._adapt(client, self._mapper, [])
        if url not in self._adapters:
            self._adapters[url] = await self._schema_adapter(url)
        return self._adapt(client, *self._adapters[url])

    def _adapt(self, session: EnvSession, mapper: ActionMapper, schema_tools: list[ToolSpec]) -> EnvSession:
        tools = self.tool_specs if self.tool_specs is not None else (schema_tools or None)
        if mapper is identity and tools is None:
            return session
        return MappedSession(session, mapper, tools)

    async def _schema_adapter(self, url: str) -> tuple[ActionMapper, list[ToolSpec]]:
        """The "auto" mapper for ``url``: from the action model in its ``/schema`` (identity without one)."""
        from envhub import _wire
        from envhub._client_io import fetch_json

        try:
            status, schema = await fetch_json(_wire.http_url(url, "/schema"), self.token, self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError):
            return identity, []
        action = schema.get("action") if status == 200 and isinstance(schema, dict) else None
        return from_action_schema(action)

    async def release(self, session: EnvSession, url: str | None = None) -> None:
        """Give back a session whose episode ended cleanly: over WebSocket the next episode resets on it
        (saving a connection handshake per episode); anything else is closed."""
        if self.env_cls is None and self.reuse_sessions and getattr(session, "connected", False):
            self._idle.setdefault(url or self.urls[0], []).append(session)
            return
        await session.close()

    async def aclose(self) -> None:
        """Close every idle session."""
        idle, self._idle = self._idle, {}
        for clients in idle.values():
            for client in clients:
                try:
                    await asyncio.wait_for(client.close(), 5.0)
                except Exception:
                    pass  # the server may be gone already; nothing left to release

    async def _connect(self, url: str) -> EnvSession:
        from envhub.client import EnvClient

        deadline = time.monotonic() + self.connect_retry_s
        delay_s, attempt = 0.2, 0
        while True:
            ext = self._extensions.get(url, "auto")
            client = EnvClient(url, token=self.token, connect_timeout_s=self.connect_timeout_s,
                               message_timeout_s=self.message_timeout_s, step_timeout_s=self.step_timeout_s,
                               extensions=ext, retries=0)
            try:
                await client.connect()
            except AuthError:
                raise
            except (EnvConnectionError, OSError, asyncio.TimeoutError) as exc:
                await client.close()
                attempt += 1
                if time.monotonic() + delay_s > deadline:
                    raise EnvConnectionError(f"Could not connect to {url} for {self.connect_retry_s:.0f} s "
                                             f"({attempt} attempts): {exc}") from exc
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 2.0)
                continue
            self.reconnects += attempt > 0
            self._extensions.setdefault(url, tuple(sorted(client.extensions)))
            return client



class MappedSession:
    """An env session whose actions go through a mapper and whose tools may come from elsewhere."""

    def __init__(self, session: EnvSession, mapper: ActionMapper, tools: list[ToolSpec] | None = None):
        self.session = session
        self.mapper = mapper
        self.tool_specs = tools

    @property
    def connected(self) -> bool:
        return bool(getattr(self.session, "connected", False))

    async def reset(self, **kwargs: Any) -> StepResult:
        return await self.session.reset(**kwargs)

    async def step(self, action: dict[str, Any]) -> StepResult:
        try:
            mapped = self.mapper(action)
        except ValueError as exc:
            raise ActionValidationError(f"action mapper {getattr(self.mapper, '__name__', self.mapper)!r}: {exc}") \
                from exc
        if not isinstance(mapped, dict):
            raise TypeError(f"Expected the action mapper to return a dict, got {type(mapped).__name__} for {action!r}.")
        return await self.session.step(mapped)

    async def tools(self) -> list[ToolSpec]:
        return list(self.tool_specs) if self.tool_specs is not None else await self.session.tools()

    async def close(self) -> None:
        await self.session.close()

__all__ = ["EnvSession", "InProcessSession", "EnvPool", "MappedSession", "load_env_class"]
