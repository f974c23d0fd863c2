"""OpenEnv in both directions: an envhub ``Env`` as an OpenEnv ``Environment``, and an OpenEnv env as an envhub ``Env``.

Serve an envhub env with openenv-core's own server (its ``create_app``)::

    from adapters.openenv import openenv_app
    app = openenv_app(GuessEnv, max_concurrent_envs=64)      # uvicorn my_module:app

openenv-core publishes no tool list for it (no ``envhub`` block in ``/metadata``, no MCP): a client
that should see the env's ``@tool`` methods is given them, e.g. ``OpenEnv(url, tool_schema=GuessEnv.tools())``;
tool calls themselves (``{"tool_name": ..., "arguments": ...}``) work as under envhub's server.

Serve an OpenEnv ``Environment`` with envhub's server (request ids, msgpack, resume, auth...)::

    # my_openenv_env.py
    from adapters.openenv import from_openenv
    EchoEnv = from_openenv(EchoEnvironment, EchoAction)      # then: envhub serve my_openenv_env:EchoEnv

openenv-core is imported only by :func:`to_openenv` / :func:`openenv_app`; :func:`from_openenv`
needs nothing but the classes it is given.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ValidationError, create_model, model_validator
from pydantic_core import PydanticCustomError

from envhub.env import Env, EnvRunner
from envhub.remote import observation_text
from envhub.types import Action as EnvhubAction
from envhub.types import Observation, StepResult

# Sync envhub env methods run here, off the OpenEnv server's event loop (as under envhub's own server).
_POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="envhub-openenv")
_OPENENV_RESERVED = frozenset({"done", "reward", "metadata"})


# -- envhub Env -> OpenEnv Environment ---------------------------------------------------------------


def _fields_of(model: type[BaseModel], skip: frozenset[str]) -> dict[str, Any]:
    return {name: (info.annotation, info) for name, info in model.model_fields.items() if name not in skip}


def to_openenv(env_cls: type[Env], **env_config: Any) -> tuple[type, type, type]:
    """``(EnvironmentClass, ActionClass, ObservationClass)`` for openenv-core's ``create_app``.

    The action class has the env's action fields (``text`` / ``tool_name`` / ``arguments`` by
    default); the observation class has ``text``, ``images`` (base64 PNG), the env's own
    observation fields, ``truncated`` and ``info`` (reward components, ``episode_reward``).
    Each OpenEnv session gets a fresh ``env_cls(**env_config)``, driven by an ``EnvRunner``,
    so rewards, tool dispatch, validation and episode limits behave as under envhub's server.
    """
    # The classes are built in here: their bases come from openenv-core, which is imported lazily.
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action as OEAction
    from openenv.core.env_server.types import EnvironmentMetadata
    from openenv.core.env_server.types import Observation as OEObservation
    from openenv.core.env_server.types import State as OEState

    name = env_cls.env_name or env_cls.__name__

    def envhub_check(action: Any) -> Any:
        # The env's own validators too (e.g. "text xor tool call"), so openenv-core answers VALIDATION_ERROR.
        # A custom error keeps the reply JSON-serialisable (a ValueError in ``ctx`` would not be).
        try:
            env_cls.action_model.model_validate(_action_data(action, env_cls))
        except ValidationError as exc:
            message = "; ".join(e["msg"] for e in exc.errors())
            raise PydanticCustomError("envhub_action", "{message}", {"message": message}) from None
        return action

    # pydantic annotates __validators__ as plain callables; its own decorators (what create_model
    # takes at run time) return descriptor proxies
    validators: dict[str, Any] = {"envhub_check": model_validator(mode="after")(envhub_check)}
    action_cls = create_model(f"{name}Action", __base__=OEAction, **_fields_of(env_cls.action_model, frozenset()),
                              __validators__=validators)
    own = _fields_of(env_cls.observation_model, frozenset({"text", "images", "metadata"}) | _OPENENV_RESERVED)
    # Extra fields allowed, as on envhub observations (``Observation(text=..., board=...)``).
    config = {**OEObservation.model_config, "extra": "allow"}
    base = type("OpenEnvObservation", (OEObservation,), {"model_config": config})
    observation_cls: type[BaseModel] = create_model(
        f"{name}Observation", __base__=base, text=(str, ""), images=(list[str], []), truncated=(bool, False),
        info=(dict[str, Any], {}), **own)

    def to_observation(result: StepResult) -> Any:
        obs = result.observation
        extra = {k: _jsonable(v) for k, v in (obs.model_extra or {}).items() if k not in _OPENENV_RESERVED}
        fields = {k: getattr(obs, k) for k in own}
        return observation_cls(text=obs.text, images=[base64.b64encode(i).decode("ascii") for i in obs.images],
                               truncated=result.truncated, info=_jsonable(result.info), done=result.ended,
                               reward=result.reward, metadata=dict(obs.metadata), **fields, **extra)

    class EnvhubEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self.runner = EnvRunner(env_cls(**env_config), executor=_POOL)

        async def reset_async(self, seed: int | None = None, episode_id: str | None = None, **task: Any) -> Any:
            return to_observation(await self.runner.reset(seed=seed, episode_id=episode_id, **task))

        async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
            return to_observation(await self.runner.step(_action_data(action, env_cls)))

        def reset(self, seed: int | None = None, episode_id: str | None = None, **task: Any) -> Any:
            return asyncio.run(self.reset_async(seed=seed, episode_id=episode_id, **task))

        def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
            return asyncio.run(self.step_async(action))

        @property
        def state(self) -> Any:
            # Read on the server's event loop: only the runner's bookkeeping and a sync env.state().
            r = self.runner
            extra = {} if inspect.iscoroutinefunction(r.env.state) else (r.env.state() or {})
            base = {"episode_id": r.episode_id, "step_count": r.step_count, "done": r.ended,
                    "episode_reward": r.episode_reward}
            return OEState(**{**base, **_jsonable(extra)})  # env extras win, as in EnvRunner.state

        def get_metadata(self) -> Any:
            meta = env_cls.metadata()
            return EnvironmentMetadata(name=meta["name"], description=meta["description"] or meta["name"],
                                       readme_content=meta["readme_content"], version=meta["version"])

        def close(self) -> None:
            close = self.runner.env.close
            if inspect.iscoroutinefunction(close):
                asyncio.run(close())
            else:
                close()

    EnvhubEnvironment.__name__ = EnvhubEnvironment.__qualname__ = f"{name}Environment"
    return EnvhubEnvironment, action_cls, observation_cls


def _action_data(action: BaseModel, env_cls: type[Env]) -> dict[str, Any]:
    data = action.model_dump(exclude={"metadata"})
    if env_cls.action_model is EnvhubAction:  # unset text / tool_name are absent, not null
        data = {k: v for k, v in data.items() if v is not None}
    return data


def openenv_app(env_cls: type[Env], *, max_concurrent_envs: int = 64, **env_config: Any) -> Any:
    """openenv-core's FastAPI app (``create_app``) serving ``env_cls``, ``max_concurrent_envs`` sessions at once.

    The app does not list the env's tools; clients get them from ``env_cls.tools()`` (see the module docstring).
    """
    from openenv.core.env_server.http_server import create_app

    environment, action_cls, observation_cls = to_openenv(env_cls, **env_config)
    return create_app(environment, action_cls, observation_cls, env_name=env_cls.env_name or env_cls.__name__,
                      max_concurrent_envs=max_concurrent_envs)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return str(value)


# -- OpenEnv Environment -> envhub Env ---------------------------------------------------------------


def from_openenv(factory: Callable[[], Any], action_cls: type[BaseModel] | None = None, *,
                 name: str | None = None) -> type[Env]:
    """An envhub ``Env`` class whose sessions each drive one ``factory()`` OpenEnv environment.

    ``action_cls`` (the OpenEnv action model) becomes the env's ``action_model``, so it is
    validated and published in ``/schema`` as OpenEnv does; by default it is read from the
    ``Environment`` class's generic parameters. Observation fields other than ``reward``/``done``/
    ``metadata`` stay fields of the envhub observation, and ``text`` holds a readable rendering
    for text-based agents. ``reset`` keyword arguments pass through (seed, episode_id, task...).
    """
    if not callable(factory):
        raise TypeError(f"Expected an OpenEnv Environment class or a function returning one (each session builds "
                        f"its own), got an instance: {factory!r}. Pass from_openenv({type(factory).__name__}).")
    found = action_cls or _action_type(factory)
    if found is None:
        raise TypeError(f"Expected action_cls (the OpenEnv Action model) for {factory!r}; it could not be read "
                        "from the class's generic parameters. Pass from_openenv(EnvCls, ActionCls).")
    model: type[BaseModel] = found
    label = name or str(getattr(factory, "__name__", "OpenEnvEnv"))
    doc = inspect.getdoc(factory) or f"The OpenEnv environment {label}, served by envhub."

    class OpenEnvEnv(Env):
        action_model = model

        def __init__(self) -> None:
            self.inner = factory()

        def reset(self, seed: int | None = None, episode_id: str | None = None, **task: Any) -> StepResult:
            return _to_result(self.inner.reset(seed=seed, episode_id=episode_id, **task))

        def step(self, action: Any) -> StepResult:
            return _to_result(self.inner.step(action))

        def state(self) -> dict[str, Any]:
            state = self.inner.state
            return state.model_dump(mode="json") if isinstance(state, BaseModel) else dict(state or {})

        def close(self) -> None:
            close = getattr(self.inner, "close", None)
            if close is not None:
                close()

    OpenEnvEnv.__name__ = OpenEnvEnv.__qualname__ = label
    OpenEnvEnv.__doc__ = doc
    OpenEnvEnv.env_name = label
    return OpenEnvEnv


def _action_type(factory: Any) -> type[BaseModel] | None:
    for base in getattr(factory, "__orig_bases__", ()):
        for arg in getattr(base, "__args__", ()):
            if isinstance(arg, type) and issubclass(arg, BaseModel) and "Action" in arg.__name__:
                return arg
    return None


def _to_result(obs: Any) -> StepResult:
    if isinstance(obs, BaseModel):
        data = obs.model_dump(mode="json", exclude={"reward", "done", "metadata"})
        reward, done = getattr(obs, "reward", None), bool(getattr(obs, "done", False))
        metadata = dict(getattr(obs, "metadata", None) or {})
    else:
        data, reward, done, metadata = {"value": obs}, None, False, {}
    text = observation_text(data)
    fields = {k: v for k, v in data.items() if k not in ("text", "images")}
    observation = Observation(text=text, metadata=metadata, **fields)
    return StepResult(observation=observation, reward=float(reward or 0.0), done=done)


__all__ = ["to_openenv", "openenv_app", "from_openenv"]
