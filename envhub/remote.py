"""``OpenEnv`` / ``AsyncOpenEnv``: a remote env as ``reset(**task)`` / ``step(tool_name, arguments)``.

>>> env = OpenEnv("http://localhost:8000")    # nothing is dialled yet      # doctest: +SKIP
>>> first = env.reset(seed=1)                                 # doctest: +SKIP
>>> result = env.step("guess", {"number": 50})                # doctest: +SKIP
>>> result.observation.text, result.reward, result.info["episode_reward"]   # doctest: +SKIP

Talks to envhub servers through :class:`envhub.client.EnvClient`, and to any OpenEnv server
either the same way or through an OpenEnv-style client class (``env_cls``), so OpenEnv's own
typed clients work too. Infrastructure failures are never disguised as an ordinary terminal
step with reward 0: they raise a typed error, or with ``on_infra_error="mark"`` come back as
a truncated result carrying ``info["infra_error"]``.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from envhub._client_io import BackgroundLoop, SyncEpisodeView, cached_metadata
from envhub.client import EnvClient
from envhub.errors import (
    ActionValidationError,
    EnvConnectionError,
    EnvHubError,
    SessionLostError,
    StepTimeoutError,
    error_for_code,
)
from envhub.types import Observation, StepResult, ToolSpec

ActionMapper = Callable[[str, dict[str, Any]], dict[str, Any]]
T = TypeVar("T")
_TEXT_KEYS = ("result", "output", "content", "text", "message")
_HOISTED = ("reward", "done", "metadata")
_SERVER_ERROR = re.compile(r"Server error: (?P<message>.*) \(code: (?P<code>[A-Z_]+)\)", re.DOTALL)


def observation_text(obs: Any) -> str:
    """The text a model should see for any observation shape.

    ``str`` as is; an envhub :class:`Observation` -> ``.text`` (its other fields, declared by a
    subclass or received from a server, when the text is empty); a dict -> the first of
    ``result, output, content, text, message``, else JSON; a typed object -> the same attribute
    order, else its fields as JSON.
    """
    if obs is None:
        return ""
    if isinstance(obs, str):
        return obs
    if isinstance(obs, Observation):  # a typed subclass's fields count like a server's extra fields
        if obs.text:
            return obs.text
        return _dict_text(obs.model_dump(mode="json", exclude={"text", "images", "metadata"}))
    if isinstance(obs, dict):
        return _dict_text(obs)
    for key in _TEXT_KEYS:
        value = getattr(obs, key, None)
        if value is not None:
            return value if isinstance(value, str) else _to_json(value)
    if hasattr(obs, "model_dump"):
        return _dict_text(obs.model_dump(mode="json", exclude=set(_HOISTED)))
    if hasattr(obs, "__dict__"):
        return _to_json({k: v for k, v in vars(obs).items() if not k.startswith("_")})
    return str(obs)


def _dict_text(d: dict[str, Any]) -> str:
    for key in _TEXT_KEYS:
        value = d.get(key)
        if value is not None and value != "":  # an envhub observation read as a dict has text=""
            return value if isinstance(value, str) else _to_json(value)
    # Envhub's empty defaults (text, images) and the OpenEnv fields hoisted to the envelope are noise here.
    rest = {k: v for k, v in d.items() if k not in _HOISTED and not (k in ("text", "images") and not v)}
    return _to_json(rest) if rest else ""


def _to_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def as_envhub_error(exc: BaseException) -> EnvHubError | None:
    """The typed envhub error an exception from any client stands for (None: not an env failure)."""
    if isinstance(exc, EnvHubError):
        return exc
    if isinstance(exc, RuntimeError):
        m = _SERVER_ERROR.search(str(exc))  # OpenEnv clients raise RuntimeError("Server error: ... (code: X)")
        if m:
            return error_for_code({"code": m["code"], "message": m["message"]})
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return StepTimeoutError(f"timed out: {exc}")
    if type(exc).__module__.startswith("websockets"):
        return SessionLostError(f"connection lost: {type(exc).__name__}: {exc}")
    if isinstance(exc, (ConnectionError, OSError)):
        return EnvConnectionError(f"{type(exc).__name__}: {exc}")
    return None


def _resolve(env_cls: Any) -> Any:
    if not isinstance(env_cls, str):
        return env_cls
    module, _, name = env_cls.replace(":", ".").rpartition(".")
    if not module:
        raise ValueError(f"Expected env_cls as 'package.module.Class', got {env_cls!r}.")
    return getattr(importlib.import_module(module), name)


class AsyncOpenEnv:
    """The async remote env: the same API as :class:`OpenEnv`, as coroutines.

    ``action_mapper(tool_name, arguments) -> dict`` reshapes the default action
    ``{"tool_name": ..., "arguments": ...}`` (e.g. ``lambda _, a: {"message": a["text"]}``).
    A ``VALIDATION_ERROR`` from the server (the action did not fit) comes back as an error
    observation for the model; every other failure is infrastructure (see ``on_infra_error``).
    """

    def __init__(self, base_url: str, env_cls: Any = None, env_kwargs: dict[str, Any] | None = None,
                 tool_schema: list[ToolSpec | dict[str, Any]] | None = None,
                 action_mapper: ActionMapper | None = None, *,
                 on_infra_error: Literal["raise", "mark"] = "raise"):
        if on_infra_error not in ("raise", "mark"):
            raise ValueError(f"Expected on_infra_error 'raise' or 'mark', got {on_infra_error!r}.")
        self.base_url = base_url
        self.env_cls = env_cls
        self.env_kwargs = dict(env_kwargs or {})
        self.tool_schema = None if tool_schema is None else [
            t if isinstance(t, ToolSpec) else ToolSpec.from_openai(t) for t in tool_schema]
        self.action_mapper = action_mapper
        self.on_infra_error = on_infra_error
        self.episode_reward = 0.0
        self.last_result: StepResult | None = None
        self._client: Any = None
        self._envhub = False

    @property
    def done(self) -> bool:
        """True once the current episode ended (terminated or truncated)."""
        return self.last_result is not None and self.last_result.ended

    async def _ensure(self) -> Any:
        if self._client is None:
            cls = _resolve(self.env_cls)
            if cls is None or (isinstance(cls, type) and issubclass(cls, EnvClient)):
                self._client, self._envhub = (cls or EnvClient)(self.base_url, **self.env_kwargs), True
            else:
                client = cls(base_url=self.base_url, **self.env_kwargs)
                connect = getattr(client, "connect", None)
                if connect is not None:
                    await _maybe_await(connect)
                self._client = client
        return self._client

    async def reset(self, **task: Any) -> StepResult:
        """Start an episode (task fields go to the env's ``reset``); the running reward restarts at 0."""
        self.episode_reward = 0.0
        try:
            client = await self._ensure()
            raw = await _maybe_await(client.reset, **task)
        except Exception as exc:
            return await self._failed(exc, "reset")
        result = self._convert(raw)
        result.info["episode_reward"] = 0.0
        self.last_result = result
        return result

    async def step(self, tool_name: str | None, arguments: dict[str, Any] | None = None) -> StepResult:
        """Send one tool call (through ``action_mapper`` when set) and return the result; ``tool_name`` None
        sends ``arguments["text"]`` as a text action (what an env without tools takes)."""
        arguments = dict(arguments or {})
        action = (self.action_mapper(tool_name or "", arguments) if self.action_mapper
                  else text_or_tool_action(tool_name, arguments))
        try:
            client = await self._ensure()
            raw = await _maybe_await(client.step, action)
        except Exception as exc:
            err = as_envhub_error(exc)
            if isinstance(err, ActionValidationError):
                result = StepResult(observation=Observation(text=f"Error: {err.message}"),
                                    info={"action_error": err.to_wire(), "episode_reward": self.episode_reward})
                self.last_result = result
                return result
            return await self._failed(exc, "step")
        result = self._convert(raw)
        self.episode_reward += result.reward
        result.info["episode_reward"] = self.episode_reward
        self.last_result = result
        return result

    async def tools(self) -> list[ToolSpec]:
        """``tool_schema`` if given, else the server's tools (tools extension, /metadata or MCP), else []."""
        if self.tool_schema is not None:
            return list(self.tool_schema)
        if _resolve(self.env_cls) is None or self._envhub:
            specs: list[ToolSpec] = await (await self._ensure()).tools()
            return specs
        try:  # an OpenEnv-style client has no tool listing: ask /metadata (envhub servers publish tools there)
            meta = await cached_metadata(self.base_url, self.env_kwargs.get("token"), 10.0)
        except (OSError, TimeoutError) as exc:
            raise EnvConnectionError(f"GET /metadata of {self.base_url} failed: {exc}") from exc
        hub = meta.get("envhub")
        return [ToolSpec.from_openai(t) for t in (hub.get("tools") if isinstance(hub, dict) else None) or []]

    async def close(self) -> None:
        """Close the session (never raises: the session may already be gone)."""
        client, self._client = self._client, None
        if client is None:
            return
        for name in ("close", "disconnect"):
            fn = getattr(client, name, None)
            if fn is not None:
                try:
                    await _maybe_await(fn)
                except Exception:
                    pass  # closing a dead session has nothing left to report
                return

    async def __aenter__(self) -> AsyncOpenEnv:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- results --------------------------------------------------------------------------
    def _convert(self, raw: Any) -> StepResult:
        if isinstance(raw, StepResult):
            obs = raw.observation
            if not obs.text:
                obs.text = observation_text(obs)
            return raw
        obs_raw = getattr(raw, "observation", raw)
        images = getattr(obs_raw, "images", None) if not isinstance(obs_raw, dict) else obs_raw.get("images")
        obs = Observation(text=observation_text(obs_raw),
                          images=[i for i in images or [] if isinstance(i, bytes)])
        return StepResult(observation=obs, reward=float(getattr(raw, "reward", 0.0) or 0.0),
                          done=bool(getattr(raw, "done", False)),
                          info={"raw_observation": obs_raw})

    async def _failed(self, exc: Exception, during: str) -> StepResult:
        err = as_envhub_error(exc)
        if err is None:
            raise exc
        if not self._envhub and isinstance(err, (EnvConnectionError, StepTimeoutError)):
            # OpenEnv clients keep a dead or desynchronised socket after these: start over next time.
            await self.close()
        if self.on_infra_error == "raise":
            if err is exc:
                raise err
            raise err from exc
        info = {"infra_error": {"type": type(err).__name__, "code": err.code, "message": err.message,
                                "during": during}, "episode_reward": self.episode_reward}
        result = StepResult(observation=Observation(text=f"Error: environment failure: {err.message}"),
                            truncated=True, info=info)
        self.last_result = result
        return result


async def _maybe_await(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


class OpenEnv(SyncEpisodeView):
    """A remote env behind a blocking API; connects lazily (nothing is dialled until the first call).

    ``env_cls=None`` uses envhub's :class:`EnvClient` (``env_kwargs`` go to it: ``token``,
    ``message_timeout_s``...); a class or dotted path uses an OpenEnv-style client class
    (``cls(base_url=..., **env_kwargs)``). Runs its async twin on a shared background loop.

    >>> from envhub import Env, Observation, OpenEnv, create_app, tool
    >>> from envhub.server import ServerThread
    >>> class DigitEnv(Env):
    ...     def reset(self, seed=None, **task):
    ...         return Observation(text="Guess a digit.")
    ...     @tool
    ...     def guess(self, digit: int) -> str:
    ...         '''Guess the digit.'''
    ...         self.done = digit == 7
    ...         return "Correct!" if self.done else "No."
    >>> with ServerThread(create_app(DigitEnv)) as server, OpenEnv(server.url) as env:
    ...     env.reset(seed=1).observation.text
    ...     env.step("guess", {"digit": 7}).observation.text
    'Guess a digit.'
    'Correct!'
    """

    aenv: AsyncOpenEnv

    def __init__(self, base_url: str, env_cls: Any = None, env_kwargs: dict[str, Any] | None = None,
                 tool_schema: list[ToolSpec | dict[str, Any]] | None = None,
                 action_mapper: ActionMapper | None = None, *,
                 on_infra_error: Literal["raise", "mark"] = "raise"):
        self.aenv = AsyncOpenEnv(base_url, env_cls, env_kwargs, tool_schema, action_mapper,
                                 on_infra_error=on_infra_error)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return BackgroundLoop.shared().run(coro)

    def reset(self, **task: Any) -> StepResult:
        return self._run(self.aenv.reset(**task))

    def step(self, tool_name: str | None, arguments: dict[str, Any] | None = None) -> StepResult:
        return self._run(self.aenv.step(tool_name, arguments))

    def tools(self) -> list[ToolSpec]:
        if self.aenv.tool_schema is not None:
            return list(self.aenv.tool_schema)
        return self._run(self.aenv.tools())

    def close(self) -> None:
        if self.aenv._client is not None:
            self._run(self.aenv.close())


def text_or_tool_action(tool_name: str | None, arguments: dict[str, Any]) -> dict[str, Any]:
    """The wire action of ``step(tool_name, arguments)``: a tool call, or with no tool name a text action."""
    if tool_name is None:
        return {"text": str(arguments.get("text", ""))}
    return {"tool_name": tool_name, "arguments": arguments}


__all__ = ["OpenEnv", "AsyncOpenEnv", "observation_text", "as_envhub_error", "text_or_tool_action"]
