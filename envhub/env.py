"""The env contract: subclass ``Env``; ``EnvRunner`` drives one instance with the bookkeeping every transport needs.

A minimal env::

    from typing import Annotated
    from envhub import Env, Observation, tool, reward

    class GuessEnv(Env):
        '''Guess a secret integer between 1 and 100.'''

        def reset(self, seed=None, **task):
            self.secret, self.last = self.rng.randint(1, 100), None
            return Observation(text="I picked a number between 1 and 100. Call guess(number).")

        @tool
        def guess(self, number: Annotated[int, "your guess"]) -> str:
            '''Guess the secret number.'''
            self.last = number
            if number == self.secret:
                self.done = True
                return "Correct!"
            return "Higher." if number < self.secret else "Lower."

        @reward(weight=1.0)
        def solved(self) -> float:
            return float(self.last == self.secret)

Serve it with ``envhub serve my_env:GuessEnv``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import random
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, ClassVar, TypeAlias, TypeVar

from pydantic import BaseModel, ValidationError

from envhub.errors import (
    ActionValidationError,
    EnvDefinitionError,
    EnvExecutionError,
    EnvHubError,
    EpisodeStateError,
    ErrorCode,
)
from envhub.tools import RESERVED_NAMES, RewardInfo, ToolInfo, collect_rewards, collect_tools, validate_arguments
from envhub.types import Action, Observation, StepResult, ToolSpec

_T = TypeVar("_T")
#: what an overridable ``Env`` method returns: its value, or an awaitable of it for an ``async def``
MaybeAwaitable: TypeAlias = _T | Awaitable[_T]


class Env:
    """Base class of every envhub environment. Each session gets a fresh instance.

    Override ``reset`` (and ``step`` for text or custom actions); add ``@tool`` and ``@reward``
    methods. Any of ``reset``, ``step``, ``on_text``, ``state``, ``close`` and tools may be
    ``async def``. Before ``reset`` runs, ``self.rng`` is a ``random.Random`` seeded with the
    reset seed (:func:`seeded_rng`) and ``self.done`` is False; set ``self.done = True`` from a tool to end the episode.

    >>> from envhub import Env, Observation, tool
    >>> class CoinEnv(Env):
    ...     def reset(self, seed=None, **task):
    ...         self.side = self.rng.choice(["heads", "tails"])
    ...         return Observation(text="Call the coin.")
    ...     @tool
    ...     def call(self, side: str) -> str:
    ...         '''Call heads or tails.'''
    ...         self.done = True
    ...         return "right" if side == self.side else "wrong"
    >>> [spec.name for spec in CoinEnv.tools()]
    ['call']
    """

    #: the pydantic model actions are validated against (published in ``/schema``)
    action_model: ClassVar[type[BaseModel]] = Action
    #: the observation model (published in ``/schema``)
    observation_model: ClassVar[type[Observation]] = Observation
    #: steps after which the episode is truncated (None: no limit)
    max_steps: ClassVar[int | None] = None
    #: name shown in ``/metadata`` (default: the class name)
    env_name: ClassVar[str | None] = None
    env_version: ClassVar[str] = "0.1.0"
    #: run sync methods on the server's event loop instead of its thread pool. Only for envs whose
    #: every method is trivially cheap (microseconds): a slow inline step stalls every session and
    #: cannot be interrupted by the step timeout.
    run_inline: ClassVar[bool] = False

    _tools: ClassVar[dict[str, ToolInfo]] = {}
    _rewards: ClassVar[dict[str, RewardInfo]] = {}

    rng: random.Random
    done: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in RESERVED_NAMES:
            member = getattr(cls, name, None)
            if member is not None and hasattr(member, "__envhub_tool__"):
                raise EnvDefinitionError(f"{cls.__name__}.{name} is reserved and cannot be a @tool.")
        cls._tools = collect_tools(cls)
        cls._rewards = collect_rewards(cls)
        clash = set(cls._tools) & set(cls._rewards)
        if clash:
            raise EnvDefinitionError(f"{cls.__name__}: {sorted(clash)} used both as tool and reward name.")
        if not (isinstance(cls.action_model, type) and issubclass(cls.action_model, BaseModel)):
            raise EnvDefinitionError(f"{cls.__name__}.action_model must be a pydantic model class, "
                                     f"got {cls.action_model!r}.")

    # -- the methods env authors override -------------------------------------------------
    # Each may be ``async def``, hence the ``Awaitable`` returns. ``reset`` takes ``*args`` only so
    # that a type checker accepts subclasses that name their own task keywords (``*args: Any,
    # **task: Any`` reads as "any parameters"); the runner passes ``seed`` and the task by keyword.
    def reset(self, seed: int | None = None, *args: Any,
              **task: Any) -> MaybeAwaitable[StepResult | Observation | str]:
        """Start an episode and return the first observation (the prompt), or a ``StepResult`` holding it:
        one with ``done`` (or ``truncated``) set ends the episode before any step (the runner then
        refuses steps), its ``reward`` the episode's, as a match env does for a seat whose opponent
        ended the game before this seat's first turn."""
        return Observation()

    def step(self, action: Any) -> MaybeAwaitable[StepResult | Observation | str]:
        """Apply one action. The default dispatches tool calls to ``@tool`` methods and text to ``on_text``.

        Only called directly for custom action models; the runner dispatches default actions itself
        so that async tools work.
        """
        raise NotImplementedError(
            f"{type(self).__name__} declares action_model={type(action).__name__} and must implement step().")

    def on_text(self, text: str) -> MaybeAwaitable[StepResult | Observation | str]:
        """Handle a free-text action. Envs that take text override this (or ``step``)."""
        names = ", ".join(self._tools) or "none"
        raise ActionValidationError(
            f"{type(self).__name__} expects a tool call ({{'tool_name': ..., 'arguments': {{...}}}}), "
            f"got free text. Available tools: {names}.")

    def state(self) -> MaybeAwaitable[dict[str, Any]]:
        """Extra state to report (the runner adds episode_id, step_count, done, episode_reward)."""
        return {}

    def close(self) -> MaybeAwaitable[None]:
        """Release resources; called once when the session ends."""

    # -- class-level introspection -------------------------------------------------------
    @classmethod
    def tools(cls) -> list[ToolSpec]:
        """The env's tools as OpenAI function specs."""
        return [info.spec for info in cls._tools.values()]

    @classmethod
    def reward_components(cls) -> dict[str, float]:
        """Reward component names and their weights."""
        return {r.name: r.weight for r in cls._rewards.values()}

    @classmethod
    def metadata(cls) -> dict[str, Any]:
        """Name, description and version shown in ``/metadata``."""
        doc = inspect.getdoc(cls) or ""
        if cls.__doc__ is None or cls.__doc__ is Env.__doc__:
            doc = ""
        return {"name": cls.env_name or cls.__name__, "description": doc.split("\n\n")[0].strip(),
                "readme_content": doc or None, "version": cls.env_version, "author": None,
                "documentation_url": None}


def seeded_rng(seed: int | None) -> random.Random:
    """``random.Random`` for a reset seed, with a stream of its own for every seed: ``random.Random(-n)``
    is ``random.Random(n)`` (it seeds with the absolute value), so a negative seed draws from a string of it.

    >>> seeded_rng(3).random() == random.Random(3).random() != seeded_rng(-3).random()
    True
    """
    return random.Random(seed if seed is None or seed >= 0 else f"seed:{seed}")


def _overrides(env: Env, name: str) -> bool:
    return getattr(type(env), name) is not getattr(Env, name)


class EnvRunner:
    """Drives one ``Env`` instance: seeding, validation, dispatch, rewards, episode bookkeeping.

    Used by the server (one runner per session, sync methods in ``executor``) and for envs run
    in process. Every method is async; errors are typed :class:`EnvHubError` subclasses.

    >>> import asyncio
    >>> from envhub.testing import EchoEnv
    >>> async def episode():
    ...     runner = EnvRunner(EchoEnv())
    ...     await runner.reset(seed=0)
    ...     result = await runner.step({"message": "hi"})
    ...     await runner.close()
    ...     return result.reward, result.observation.echoed_message
    >>> asyncio.run(episode())
    (0.2, 'hi')
    """

    def __init__(self, env: Env, *, executor: Executor | None = None):
        self.env = env
        self.executor = executor
        self.episode_id: str | None = None
        self.step_count = 0
        self.episode_reward = 0.0
        self.ended = False
        self._reset_params = _accepted_kwargs(env.reset)
        self._rewards = list(type(env)._rewards.values())
        self._sync_path = not any(r.is_async for r in self._rewards)

    @property
    def started(self) -> bool:
        return self.episode_id is not None

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if _is_async(fn):
            return await fn(*args, **kwargs)
        if self.executor is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    # -- reset -----------------------------------------------------------------------------
    async def reset(self, seed: Any = None, episode_id: Any = None, **task: Any) -> StepResult:
        """Start a new episode. Unknown task keys are a validation error naming the accepted ones."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ActionValidationError(f"Expected 'seed' to be an integer or null, got {seed!r}.")
        if episode_id is not None and not isinstance(episode_id, (str, int)):
            raise ActionValidationError(f"Expected 'episode_id' to be a string, got {type(episode_id).__name__}.")
        accepted, any_kw = self._reset_params
        unknown = [k for k in task if k not in accepted and not any_kw]
        if unknown:
            names = ", ".join(sorted(accepted - {"seed"})) or "no task arguments"
            raise ActionValidationError(
                f"{type(self.env).__name__}.reset() got unknown argument(s) {unknown}; it accepts: {names}.",
                details={"errors": [{"loc": [k], "msg": "unexpected argument"} for k in unknown]})
        if "episode_id" in accepted:
            task["episode_id"] = episode_id
        self.env.rng = seeded_rng(seed)
        self.env.done = False
        self.episode_id = str(episode_id) if episode_id is not None else uuid.uuid4().hex
        self.step_count, self.episode_reward, self.ended = 0, 0.0, False
        try:
            raw = await self._call(self.env.reset, seed=seed, **task)
        except EnvHubError:
            raise
        except TypeError as exc:
            raise ActionValidationError(f"reset() rejected its arguments: {exc}") from exc
        except Exception as exc:
            raise EnvExecutionError(f"reset() raised {type(exc).__name__}: {exc}") from exc
        if isinstance(raw, StepResult):  # an episode may be over at once (a match the opponent already ended)
            raw.info.setdefault("episode_id", self.episode_id)
            self.episode_reward, self.ended = raw.reward, raw.ended
            return raw
        return StepResult(observation=_as_observation(raw), info={"episode_id": self.episode_id})

    # -- step ------------------------------------------------------------------------------
    def parse_action(self, action: Any) -> BaseModel:
        """Validate a wire action against the env's action model."""
        model = type(self.env).action_model
        if isinstance(action, model):
            return action
        if not isinstance(action, dict):
            raise ActionValidationError(f"Expected the action to be a JSON object, got {type(action).__name__}.")
        try:
            return model.model_validate(action)
        except ValidationError as exc:
            errors = json.loads(exc.json(include_url=False, include_context=False, include_input=False))
            raise ActionValidationError(f"Invalid action for {type(self.env).__name__}: "
                                        + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}"
                                                    for e in errors),
                                        details={"errors": errors}) from None

    async def step(self, action: Any) -> StepResult:
        """Apply one action; tool errors become error observations, env crashes ``EnvExecutionError``."""
        if not self.started:
            raise EpisodeStateError("step before reset: call reset() to start an episode.",
                                    code=ErrorCode.EPISODE_NOT_STARTED)
        if self.ended:
            raise EpisodeStateError("the episode has ended; call reset() to start a new one.",
                                    code=ErrorCode.EPISODE_ENDED)
        parsed = self.parse_action(action)
        fn, args = self._dispatch(parsed)
        try:
            if self._sync_path and not _is_async(fn):
                result, components = await self._call(self._step_sync, fn, args)
            else:
                result = _as_result(await self._call(fn, *args))
                components = {}
                for r in self._rewards:
                    components[r.name] = float(await self._call(getattr(self.env, r.method_name)) or 0.0)
        except EnvHubError:
            raise
        except Exception as exc:
            raise EnvExecutionError(f"step() raised {type(exc).__name__}: {exc}") from exc
        return self._finish_step(result, components)

    def _dispatch(self, action: BaseModel) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        env = self.env
        if _overrides(env, "step") or not isinstance(action, Action):
            return env.step, (action,)
        if action.tool_name is None:
            return env.on_text, (action.text,)
        info = type(env)._tools.get(action.tool_name)
        if info is None:
            names = ", ".join(type(env)._tools) or "none"
            return _tool_error, (f"Error: unknown tool {action.tool_name!r}. Available: {names}.", "unknown_tool")
        try:
            kwargs = validate_arguments(info, action.arguments)
        except ValueError as exc:
            return _tool_error, (f"Error: {exc}", "invalid_arguments")
        method = getattr(env, info.method_name)
        if info.is_async:
            async def run_async_tool() -> Any:
                try:
                    return await method(**kwargs)
                except EnvHubError:
                    raise
                except Exception as exc:
                    return _tool_error(f"Error: tool {info.spec.name!r} raised {type(exc).__name__}: {exc}", "tool_raised")
            return run_async_tool, ()
        return _run_sync_tool, (method, info.spec.name, kwargs)

    def _step_sync(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[StepResult, dict[str, float]]:
        # One executor hop for the whole step: action, then every reward component.
        result = _as_result(fn(*args))
        components = {r.name: float(getattr(self.env, r.method_name)() or 0.0) for r in self._rewards}
        return result, components

    def _finish_step(self, result: StepResult, components: dict[str, float]) -> StepResult:
        self.step_count += 1
        if components:
            result.reward += sum(r.weight * components[r.name] for r in self._rewards)
            result.info["rewards"] = components
        result.done = bool(result.done or self.env.done)
        limit = type(self.env).max_steps
        if limit is not None and self.step_count >= limit and not result.done:
            result.truncated = True
        self.episode_reward += result.reward
        result.info["episode_reward"] = self.episode_reward
        result.info["step_count"] = self.step_count
        self.ended = result.ended
        return result

    # -- state / close ---------------------------------------------------------------------
    async def state(self) -> dict[str, Any]:
        extra = await self._call(self.env.state)
        base = {"episode_id": self.episode_id, "step_count": self.step_count, "done": self.ended,
                "episode_reward": self.episode_reward}
        if isinstance(extra, dict):
            base.update(extra)
        return base

    async def close(self) -> None:
        await self._call(self.env.close)


_ASYNC_CACHE: dict[Any, bool] = {}


def _is_async(fn: Callable[..., Any]) -> bool:
    """``inspect.iscoroutinefunction``, memoised per code object (it is on every step's path).

    Keyed by ``__code__`` so that closures made per call share one entry and the cache stays bounded.
    """
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return inspect.iscoroutinefunction(fn)
    cached = _ASYNC_CACHE.get(code)
    if cached is None:
        cached = _ASYNC_CACHE[code] = inspect.iscoroutinefunction(fn)
    return cached


def _accepted_kwargs(fn: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    params = inspect.signature(fn).parameters.values()
    names = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def _tool_error(message: str, kind: str) -> StepResult:
    return StepResult(observation=Observation(text=message), info={"tool_error": kind})


def _run_sync_tool(method: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> Any:
    try:
        return method(**kwargs)
    except EnvHubError:
        raise
    except Exception as exc:
        return _tool_error(f"Error: tool {name!r} raised {type(exc).__name__}: {exc}", "tool_raised")


def _as_observation(raw: Any) -> Observation:
    if isinstance(raw, Observation):
        return raw
    if raw is None:
        return Observation()
    if isinstance(raw, str):
        return Observation(text=raw)
    if isinstance(raw, dict):
        return Observation.model_validate(raw)
    try:
        return Observation(text=json.dumps(raw, ensure_ascii=False, default=str))
    except (TypeError, ValueError):
        return Observation(text=str(raw))


def _as_result(raw: Any) -> StepResult:
    if isinstance(raw, StepResult):
        return raw
    return StepResult(observation=_as_observation(raw))
