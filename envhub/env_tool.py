"""``EnvTool`` and ``ToolManager``: a remote env's steps as ordinary OpenAI function tools.

>>> env = OpenEnv("http://localhost:8000")                         # doctest: +SKIP
>>> env.reset(seed=0)                                              # doctest: +SKIP
>>> manager = ToolManager(EnvTool.from_env(env))                   # doctest: +SKIP
>>> manager.tool_infos()            # pass as `tools=` to a chat model   # doctest: +SKIP
>>> manager({"id": "c1", "type": "function",
...          "function": {"name": "guess", "arguments": '{"number": 50}'}})   # doctest: +SKIP
{'role': 'tool', 'tool_call_id': 'c1', 'name': 'guess', 'content': 'Higher.'}

Model mistakes (unknown tool, bad JSON, a tool raising) come back as tool messages the model
can read; infrastructure failures (env down, dropped session, timeout) propagate, so a caller
never trains on an outage as if it were the policy's fault.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from envhub.errors import ActionValidationError, EnvHubError
from envhub.parsers import decode_arguments
from envhub.remote import observation_text
from envhub.types import StepResult, ToolCall, ToolSpec

DEFAULT_DESCRIPTION = "Execute an action in the environment."
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}
#: the one tool of an env that lists none: its calls are the env's text actions (``on_text``)
TEXT_TOOL = ToolSpec("env_action", "Reply to the environment: your answer, move or message, as text.",
                     {"type": "object", "properties": {"text": {"type": "string", "description": "the reply"}},
                      "required": ["text"]})


class _Session:
    """What every EnvTool on one env shares: the latest result and the locks that serialise its steps."""

    def __init__(self) -> None:
        self.last_result: StepResult | None = None
        self.thread_lock = threading.Lock()
        self.async_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()

    def async_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        lock = self.async_locks.get(loop)
        if lock is None:
            lock = self.async_locks[loop] = asyncio.Lock()
        return lock


_SESSIONS: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()
_SESSIONS_GUARD = threading.Lock()


def _session_of(env: Any) -> _Session:
    with _SESSIONS_GUARD:
        try:
            session = _SESSIONS.get(env)
        except TypeError:  # not weak-referenceable: keep the state on the tool itself
            return _Session()
        if session is None:
            session = _SESSIONS[env] = _Session()
        return session


def _is_async_env(env: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(env, "step", None))


class EnvTool:
    """One OpenAI function tool whose calls are ``env.step(tool_name, arguments)``.

    ``env`` is anything with ``step(tool_name, arguments) -> StepResult`` (sync, like
    :class:`~envhub.remote.OpenEnv`, or async, like :class:`~envhub.remote.AsyncOpenEnv`).
    Tools made from the same env share its session: ``done`` and ``episode_reward`` reflect the
    latest step through any of them, and their calls never overlap.

    >>> from envhub import Env, EnvTool, Observation, OpenEnv, create_app, tool
    >>> from envhub.server import ServerThread
    >>> class ShoutEnv(Env):
    ...     def reset(self, seed=None, **task):
    ...         return Observation(text="Say something.")
    ...     @tool
    ...     def shout(self, text: str) -> str:
    ...         '''Shout the text back.'''
    ...         self.done = True
    ...         return text.upper()
    >>> with ServerThread(create_app(ShoutEnv)) as server, OpenEnv(server.url) as env:
    ...     first = env.reset(seed=0)
    ...     (shout,) = EnvTool.from_env(env)     # one EnvTool per tool the server lists
    ...     shout(text="hello"), shout.done
    ('HELLO', True)
    """

    def __init__(self, env: Any, tool_name: str = "env_action", description: str = DEFAULT_DESCRIPTION,
                 parameters: dict[str, Any] | None = None, *, text: bool = False):
        if not callable(getattr(env, "step", None)):
            raise TypeError(f"Expected an env with step(tool_name, arguments), got {type(env).__name__}.")
        self.env = env
        self.name = tool_name
        self.description = description
        self.parameters = dict(parameters) if parameters else dict(_EMPTY_PARAMS)
        self.text = text  # calls are text actions: env.step(None, {"text": ...})
        self.is_async = _is_async_env(env)
        self._session = _session_of(env)

    @classmethod
    def from_env(cls, env: Any) -> list[EnvTool]:
        """One tool per entry of ``env.tools()`` (all sharing the env); for an env that lists none (it takes
        text, like the math env), one ``env_action(text)`` tool whose calls are its text actions.

        ``env`` is a remote env (:class:`~envhub.remote.OpenEnv`) or a local ``envhub.Env``
        instance, wrapped in a :class:`~envhub.local_env.LocalEnv` (``tools[0].env``; reset it
        there for a seeded task, else the first call starts an episode with ``reset()``).
        For an async env, call ``await EnvTool.afrom_env(env)`` instead.
        """
        from envhub.env import Env
        from envhub.local_env import LocalEnv

        env = LocalEnv(env) if isinstance(env, Env) else env
        return cls._build(env, env.tools() if hasattr(env, "tools") else [])

    @classmethod
    async def afrom_env(cls, env: Any) -> list[EnvTool]:
        """:meth:`from_env` for an async env (its ``tools()`` is a coroutine); an ``envhub.Env``
        instance is wrapped in an :class:`~envhub.local_env.AsyncLocalEnv`."""
        from envhub.env import Env
        from envhub.local_env import AsyncLocalEnv

        env = AsyncLocalEnv(env) if isinstance(env, Env) else env
        specs = env.tools() if hasattr(env, "tools") else []
        return cls._build(env, await specs if inspect.isawaitable(specs) else specs)

    @classmethod
    def _build(cls, env: Any, specs: Iterable[Any]) -> list[EnvTool]:
        tools = []
        for spec in specs or []:
            spec = spec if isinstance(spec, ToolSpec) else ToolSpec.from_openai(spec)
            tools.append(cls(env, spec.name, spec.description or "", spec.parameters))
        return tools or [cls(env, TEXT_TOOL.name, TEXT_TOOL.description, TEXT_TOOL.parameters, text=True)]

    # -- schema ------------------------------------------------------------------------------
    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters)

    def tool_info(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        return self.spec.to_openai()

    # -- calls -------------------------------------------------------------------------------
    def __call__(self, /, **arguments: Any) -> str:
        """Step the env with this tool and return the observation text."""
        if self.is_async:
            raise TypeError(f"Tool {self.name!r} wraps an async env; use `await tool.acall(...)`.")
        with self._session.thread_lock:
            return self._record(self.env.step(*self._action(arguments)))

    async def acall(self, /, **arguments: Any) -> str:
        """The async form of ``__call__`` (a sync env runs in a worker thread)."""
        if not self.is_async:
            return await asyncio.to_thread(self.__call__, **arguments)
        async with self._session.async_lock():
            return self._record(await self.env.step(*self._action(arguments)))

    def _action(self, arguments: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
        """``env.step``'s arguments: this tool's call, or (the text tool) a text action, tool name None."""
        return (None, {"text": str(arguments.get("text", ""))}) if self.text else (self.name, arguments)

    def _record(self, result: StepResult) -> str:
        self._session.last_result = result
        return observation_text(result.observation)

    # -- episode view ------------------------------------------------------------------------
    @property
    def last_result(self) -> StepResult | None:
        """The env's latest result; an env that tracks its own (``OpenEnv``) is asked, so a reset shows."""
        if hasattr(self.env, "last_result"):
            result: StepResult | None = self.env.last_result
            return result
        return self._session.last_result

    @property
    def done(self) -> bool:
        """True once the last step (through any tool on this env) ended the episode."""
        r = self.last_result
        return r is not None and r.ended

    @property
    def episode_reward(self) -> float:
        """``info["episode_reward"]`` of the last step if present, else its reward; 0 before any step."""
        r = self.last_result
        if r is None:
            return 0.0
        return float(r.info.get("episode_reward", r.reward))


class ToolManager:
    """Executes OpenAI tool calls against a set of tools and returns ``role: "tool"`` messages.

    Tools are :class:`EnvTool` s and client-side tools: plain Python functions (sync or async,
    schemas by the ``@tool`` rules) or :class:`~envhub.function_tool.FunctionTool` s, side by side.
    ``infra_errors="raise"`` (default) lets infrastructure failures propagate; ``"message"``
    turns them into tool messages as well (for agent loops that must never stop).

    >>> from envhub import Env, EnvTool, Observation, OpenEnv, ToolManager, create_app, tool
    >>> from envhub.server import ServerThread
    >>> class AddEnv(Env):
    ...     def reset(self, seed=None, **task):
    ...         return Observation(text="Add numbers.")
    ...     @tool
    ...     def add(self, a: int, b: int) -> str:
    ...         '''Add two integers.'''
    ...         return str(a + b)
    >>> with ServerThread(create_app(AddEnv)) as server, OpenEnv(server.url) as env:
    ...     first = env.reset(seed=0)
    ...     manager = ToolManager(EnvTool.from_env(env))
    ...     [info["function"]["name"] for info in manager.tool_infos()]
    ...     manager({"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}})
    ...     manager({"id": "c2", "type": "function", "function": {"name": "mul", "arguments": "{}"}})["content"]
    ['add']
    {'role': 'tool', 'tool_call_id': 'c1', 'name': 'add', 'content': '5'}
    "Error: unknown tool 'mul'. Available: add."
    >>> def double(x: int) -> int:   # a plain function is a tool next to the env's
    ...     "Twice x."
    ...     return 2 * x
    >>> ToolManager([double])({"name": "double", "arguments": {"x": 4}})["content"]
    '8'
    """

    def __init__(self, tools: Iterable[Any], *, infra_errors: str = "raise"):
        from envhub.function_tool import FunctionTool

        if infra_errors not in ("raise", "message"):
            raise ValueError(f"Expected infra_errors 'raise' or 'message', got {infra_errors!r}.")
        self.tools: dict[str, Any] = {}
        for t in tools:
            if not isinstance(t, (EnvTool, FunctionTool)):
                t = FunctionTool(t)
            if t.name in self.tools:
                raise ValueError(f"Two tools are named {t.name!r}; tool names must be unique.")
            self.tools[t.name] = t
        self.infra_errors = infra_errors

    def tool_infos(self) -> list[dict[str, Any]]:
        """Every tool's OpenAI schema, for the ``tools=`` argument of a chat model."""
        return [t.tool_info() for t in self.tools.values()]

    def __call__(self, tool_call: Any) -> dict[str, Any]:
        """Execute one call (an OpenAI tool-call dict, ``{"name", "arguments"}``, or a ToolCall)."""
        call_id, name, tool, args, error = self._prepare(tool_call)
        if error is None:
            try:
                content = tool(**args)
            except Exception as exc:
                content = self._error_text(name, exc)
        return _message(call_id, name, error if error is not None else content)

    async def acall(self, tool_call: Any) -> dict[str, Any]:
        """The async form of ``__call__``."""
        call_id, name, tool, args, error = self._prepare(tool_call)
        if error is None:
            try:
                content = await tool.acall(**args)
            except Exception as exc:
                content = self._error_text(name, exc)
        return _message(call_id, name, error if error is not None else content)

    async def execute_many(self, tool_calls: Iterable[Any]) -> list[dict[str, Any]]:
        """Execute calls concurrently, results in call order: calls on one env session run one
        after another, calls on different sessions and client-side function calls in parallel."""
        return list(await asyncio.gather(*(self.acall(c) for c in tool_calls)))

    def _prepare(self, tool_call: Any) -> tuple[str | None, str, Any, dict[str, Any], str | None]:
        raw: Any  # a ToolCall's arguments are a dict; a raw tool call's may be JSON text
        if isinstance(tool_call, ToolCall):
            call_id, name, raw = tool_call.id, tool_call.name, tool_call.arguments
        elif isinstance(tool_call, dict) and isinstance(tool_call.get("function", tool_call), dict):
            fn = tool_call.get("function", tool_call)
            call_id, name, raw = tool_call.get("id"), str(fn.get("name", "")), fn.get("arguments")
        else:
            return None, "", None, {}, f"Error: expected a tool call object, got {type(tool_call).__name__}."
        tool = self.tools.get(name)
        if tool is None:
            return call_id, name, None, {}, f"Error: unknown tool {name!r}. Available: {', '.join(self.tools) or 'none'}."
        if isinstance(raw, str):
            try:
                raw = json.loads(raw) if raw.strip() else {}
            except ValueError as exc:
                return call_id, name, tool, {}, f"Error: invalid JSON in arguments: {exc}"
        args = decode_arguments(raw)
        if not isinstance(args, dict):
            return call_id, name, tool, {}, f"Error: expected the arguments to be a JSON object, got {type(args).__name__}."
        return call_id, name, tool, args, None

    def _error_text(self, name: str, exc: Exception) -> str:
        if isinstance(exc, EnvHubError) and not isinstance(exc, ActionValidationError) \
                and self.infra_errors == "raise":
            raise exc
        return f"Error: tool {name!r} raised {type(exc).__name__}: {exc}"


def _message(call_id: str | None, name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


__all__ = ["EnvTool", "ToolManager"]
