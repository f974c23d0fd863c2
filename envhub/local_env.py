"""``LocalEnv`` / ``AsyncLocalEnv``: an ``Env`` instance in this process behind the ``OpenEnv`` API.

``reset(**task)`` / ``step(tool_name, arguments)`` / ``tools()``, with the same bookkeeping the
server does (seeding, validation, rewards) through :class:`~envhub.env.EnvRunner`, and no
transport. :meth:`EnvTool.from_env <envhub.env_tool.EnvTool.from_env>` wraps an ``Env`` in one
on its own, so a local env's tools go to a chat model like a remote env's:

>>> from envhub.testing import EchoEnv
>>> env = LocalEnv(EchoEnv())
>>> [t.name for t in env.tools()]      # a typed action model (no @tool methods) is one tool
['echo_action']
>>> env.reset(seed=0).observation.echoed_message
'ready'
>>> result = env.step("echo_action", {"message": "hi"})
>>> result.observation.echoed_message, result.reward
('hi', 0.2)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from envhub._client_io import BackgroundLoop, SyncEpisodeView
from envhub.env import Env, EnvRunner
from envhub.errors import ActionValidationError
from envhub.remote import text_or_tool_action
from envhub.tools import _clean_schema
from envhub.types import Action, Observation, StepResult, ToolSpec

ActionMapper = Callable[[str, dict[str, Any]], dict[str, Any]]


class AsyncLocalEnv:
    """The async form. A step before any reset starts an episode with ``reset()`` first.

    ``action_mapper(tool_name, arguments) -> action`` reshapes the default action, as for
    :class:`~envhub.remote.AsyncOpenEnv`. An env with its own ``action_model`` and no ``@tool``
    methods lists one tool named after the model (``EchoAction`` -> ``echo_action``) whose
    arguments are the action. An action the env refuses comes back as an error observation for
    the model (``info["action_error"]``); an env that crashes raises.
    """

    def __init__(self, env: Env, action_mapper: ActionMapper | None = None):
        if not isinstance(env, Env):
            raise TypeError(f"Expected an envhub.Env instance, got {type(env).__name__}.")
        self.env = env
        self.runner = EnvRunner(env)
        self.action_mapper = action_mapper
        self.episode_reward = 0.0
        self.last_result: StepResult | None = None
        self.action_tool = _action_tool(type(env))

    @property
    def done(self) -> bool:
        return self.last_result is not None and self.last_result.ended

    async def reset(self, **task: Any) -> StepResult:
        self.episode_reward = 0.0
        result = await self.runner.reset(**task)
        result.info["episode_reward"] = 0.0
        self.last_result = result
        return result

    async def step(self, tool_name: str | None, arguments: dict[str, Any] | None = None) -> StepResult:
        arguments = dict(arguments or {})
        if self.action_mapper is not None:
            action = self.action_mapper(tool_name or "", arguments)
        elif self.action_tool is not None and tool_name == self.action_tool.name:
            action = arguments
        else:
            action = text_or_tool_action(tool_name, arguments)
        if not self.runner.started:
            await self.reset()
        try:
            result = await self.runner.step(action)
        except ActionValidationError as exc:
            result = StepResult(observation=Observation(text=f"Error: {exc.message}"),
                                info={"action_error": exc.to_wire()})
        self.episode_reward += result.reward
        result.info["episode_reward"] = self.episode_reward
        self.last_result = result
        return result

    def tools(self) -> list[ToolSpec]:
        return [self.action_tool] if self.action_tool is not None else type(self.env).tools()

    async def close(self) -> None:
        await self.runner.close()


def _action_tool(cls: type[Env]) -> ToolSpec | None:
    """The one tool of an env whose typed action model is all it takes (no ``@tool`` methods)."""
    model = cls.action_model
    if issubclass(model, Action) or cls.tools():
        return None
    schema = model.model_json_schema()
    schema.get("properties", {}).pop("metadata", None)  # OpenEnv actions carry it; not the model's to fill
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", model.__name__).lower()
    return ToolSpec(name=name, description=(model.__doc__ or f"Send the env a {model.__name__}.").strip(),
                    parameters=_clean_schema(schema))


class LocalEnv(SyncEpisodeView):
    """An ``Env`` instance behind the blocking ``OpenEnv`` API (its async twin runs on envhub's shared
    background loop); ``EnvTool.from_env`` wraps a local env in one.

    >>> from envhub import Env, EnvTool, Observation, tool
    >>> class Counter(Env):
    ...     def reset(self, seed=None, **task):
    ...         self.n = 0
    ...         return Observation(text="Count.")
    ...     @tool
    ...     def inc(self, by: int = 1) -> str:
    ...         '''Add to the counter.'''
    ...         self.n += by
    ...         return str(self.n)
    >>> env = LocalEnv(Counter())
    >>> env.reset(seed=0).observation.text
    'Count.'
    >>> [inc] = EnvTool.from_env(env)
    >>> inc(by=2), inc(by=3)
    ('2', '5')
    """

    aenv: AsyncLocalEnv

    def __init__(self, env: Env, action_mapper: ActionMapper | None = None):
        self.aenv = AsyncLocalEnv(env, action_mapper)

    @property
    def env(self) -> Env:
        return self.aenv.env

    def reset(self, **task: Any) -> StepResult:
        return BackgroundLoop.shared().run(self.aenv.reset(**task))

    def step(self, tool_name: str | None, arguments: dict[str, Any] | None = None) -> StepResult:
        return BackgroundLoop.shared().run(self.aenv.step(tool_name, arguments))

    def tools(self) -> list[ToolSpec]:
        return self.aenv.tools()

    def close(self) -> None:
        BackgroundLoop.shared().run(self.aenv.close())


__all__ = ["LocalEnv", "AsyncLocalEnv"]
