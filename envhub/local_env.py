"""``LocalEnv`` / ``AsyncLocalEnv``: an ``Env`` instance in this process behind the ``OpenEnv`` API.

``reset(**task)`` / ``step(tool_name, arguments)`` / ``tools()``, with the same bookkeeping the
server does (seeding, validation, rewards) through :class:`~envhub.env.EnvRunner`, and no
transport. :meth:`EnvTool.from_env <envhub.env_tool.EnvTool.from_env>` wraps an ``Env`` in one
on its own, so a local env's tools go to a chat model like a remote env's:

>>> from envhub.testing import EchoEnv
>>> env = LocalEnv(EchoEnv(), action_mapper=lambda tool_name, arguments: arguments)  # typed {"message"} action
>>> env.reset(seed=0).observation.echoed_message
'ready'
>>> result = env.step("env_action", {"message": "hi"})
>>> result.observation.echoed_message, result.reward
('hi', 0.2)
"""

from __future__ import annotations

from typing import Any, Callable

from envhub._client_io import BackgroundLoop
from envhub.env import Env, EnvRunner
from envhub.errors import ActionValidationError
from envhub.types import Observation, StepResult, ToolSpec

ActionMapper = Callable[[str, dict[str, Any]], dict[str, Any]]


class AsyncLocalEnv:
    """The async form. A step before any reset starts an episode with ``reset()`` first.

    ``action_mapper(tool_name, arguments) -> action`` reshapes the default action, as for
    :class:`~envhub.remote.AsyncOpenEnv`. An action the env refuses comes back as an error
    observation for the model (``info["action_error"]``); an env that crashes raises.
    """

    def __init__(self, env: Env, action_mapper: ActionMapper | None = None):
        if not isinstance(env, Env):
            raise TypeError(f"Expected an envhub.Env instance, got {type(env).__name__}.")
        self.env = env
        self.runner = EnvRunner(env)
        self.action_mapper = action_mapper
        self.episode_reward = 0.0
        self.last_result: StepResult | None = None

    @property
    def done(self) -> bool:
        return self.last_result is not None and self.last_result.ended

    async def reset(self, **task: Any) -> StepResult:
        self.episode_reward = 0.0
        result = await self.runner.reset(**task)
        result.info["episode_reward"] = 0.0
        self.last_result = result
        return result

    async def step(self, tool_name: str, arguments: dict[str, Any] | None = None) -> StepResult:
        arguments = dict(arguments or {})
        action = (self.action_mapper(tool_name, arguments) if self.action_mapper
                  else {"tool_name": tool_name, "arguments": arguments})
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
        return type(self.env).tools()

    async def close(self) -> None:
        await self.runner.close()


class LocalEnv:
    """The blocking form (runs its async twin on envhub's shared background loop)."""

    def __init__(self, env: Env, action_mapper: ActionMapper | None = None):
        self.aenv = AsyncLocalEnv(env, action_mapper)

    @property
    def env(self) -> Env:
        return self.aenv.env

    def reset(self, **task: Any) -> StepResult:
        return BackgroundLoop.shared().run(self.aenv.reset(**task))

    def step(self, tool_name: str, arguments: dict[str, Any] | None = None) -> StepResult:
        return BackgroundLoop.shared().run(self.aenv.step(tool_name, arguments))

    def tools(self) -> list[ToolSpec]:
        return self.aenv.tools()

    def close(self) -> None:
        BackgroundLoop.shared().run(self.aenv.close())

    @property
    def episode_reward(self) -> float:
        return self.aenv.episode_reward

    @property
    def last_result(self) -> StepResult | None:
        return self.aenv.last_result

    @property
    def done(self) -> bool:
        return self.aenv.done

    def __enter__(self) -> "LocalEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["LocalEnv", "AsyncLocalEnv"]
