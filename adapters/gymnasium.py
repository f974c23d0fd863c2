"""Gymnasium in both directions: a Gymnasium env as an envhub ``Env``, and an envhub env as a ``gymnasium.Env``.

A Gymnasium env served over WebSocket for language agents (text observations, parsed actions)::

    # cartpole_env.py
    from adapters.gymnasium import from_gymnasium
    CartPole = from_gymnasium("CartPole-v1")          # envhub serve cartpole_env:CartPole

An envhub env (a local class or a server URL) as a Gymnasium env with ``Text`` spaces::

    env = EnvhubGymEnv("ws://localhost:8001")        # or EnvhubGymEnv(GuessEnv)
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("\\\\boxed{4}")

gymnasium is imported inside the functions that need it (``pip install envhub[gym]``).
"""

from __future__ import annotations

import asyncio
import json
import re
import string
from collections.abc import Callable
from typing import Annotated, Any

from envhub.env import Env, EnvRunner
from envhub.errors import ActionValidationError
from envhub.parsers import parse_tool_calls
from envhub.tools import tool
from envhub.types import Observation, StepResult

_ANSI_SPAN = re.compile(r"\x1b\[[0-9;]*[1-9][0-9;]*m(.*?)\x1b\[0?m", re.DOTALL)  # highlighted text
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")
#: what the Text spaces of :class:`EnvhubGymEnv` admit (observations are free text in practice)
TEXT_CHARSET = string.printable + "".join(chr(c) for c in range(0xA0, 0x2FFF))


# -- observations and actions as text (pure functions) ------------------------------------------------


def observation_to_text(obs: Any) -> str:
    """A readable rendering of a Gymnasium observation: numbers as JSON, arrays as nested lists (4 decimals)."""
    return json.dumps(_plain(obs), ensure_ascii=False)


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        value = value.tolist()
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def parse_action(text: Any, space: Any) -> Any:
    """The action of ``space`` written in ``text``, or None when the text does not hold a valid one.

    Discrete: the last integer in the text; Box / MultiDiscrete / MultiBinary: the numbers of a
    JSON list (or every number in the text), of the right count and inside the bounds; Text: the
    text itself. The result is checked with ``space.contains``.
    """
    from gymnasium import spaces

    if not isinstance(text, str):
        return None
    try:
        if isinstance(space, spaces.Text):
            value: Any = text
        elif isinstance(space, spaces.Discrete):
            numbers = re.findall(r"-?\d+", text)
            value = int(numbers[-1]) if numbers else None
        elif isinstance(space, (spaces.Box, spaces.MultiDiscrete, spaces.MultiBinary)):
            value = _numbers(text, space)
        else:
            return None
        return value if value is not None and space.contains(value) else None
    except (ValueError, TypeError, OverflowError):
        return None


def _numbers(text: str, space: Any) -> Any:
    import numpy as np

    numbers = [float(n) for n in _NUMBER.findall(text)]
    if len(numbers) != int(np.prod(space.shape)):
        return None
    array = np.asarray(numbers, dtype=space.dtype).reshape(space.shape)
    return array if np.allclose(array, np.asarray(numbers).reshape(space.shape)) else None


def describe_space(space: Any) -> str:
    """How to write an action of ``space`` (shown to the model in the tool description)."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        return f"an integer from {space.start} to {space.start + space.n - 1}"
    if isinstance(space, spaces.Box):
        return f"a JSON list of {int(space.shape[0]) if len(space.shape) == 1 else space.shape} numbers " \
               f"between {_plain(space.low.min())} and {_plain(space.high.max())}"
    if isinstance(space, spaces.MultiDiscrete):
        return f"a JSON list of integers below {_plain(space.nvec)}"
    if isinstance(space, spaces.MultiBinary):
        return f"a JSON list of {space.n} zeros and ones"
    if isinstance(space, spaces.Text):
        return f"text of at most {space.max_length} characters"
    return str(space)


# -- Gymnasium env -> envhub Env ---------------------------------------------------------------------


def from_gymnasium(env_id: str | Callable[[], Any], *, render: Callable[[Any, Any], str] | None = None,
                   name: str | None = None, **make_kwargs: Any) -> type[Env]:
    """An envhub ``Env`` class; each session runs its own ``gymnasium.make(env_id, **make_kwargs)``.

    ``env_id`` may also be a factory returning a ``gymnasium.Env``. Observations become text
    through ``render(obs, gym_env)`` (default: :func:`observation_to_text`, followed by the
    env's own ``ansi`` rendering when ``render_mode="ansi"``). Actions are free text, or a call
    of the ``act`` tool; either is parsed with :func:`parse_action`. An action that does not
    parse is answered with an error observation and does not advance the env.
    """
    import gymnasium

    def make() -> Any:
        return env_id() if callable(env_id) else gymnasium.make(env_id, **make_kwargs)

    probe = make()
    how = describe_space(probe.action_space)
    label = name or (env_id if isinstance(env_id, str) else str(getattr(env_id, "__name__", "GymEnv")))
    probe.close()
    render_fn = render or _default_render

    class GymnasiumEnv(Env):
        def __init__(self) -> None:
            self.gym = make()

        def reset(self, seed: int | None = None, **options: Any) -> Observation:
            obs, info = self.gym.reset(seed=seed, options=options or None)
            return Observation(text=render_fn(obs, self.gym), metadata={"info": _plain(info)})

        def on_text(self, text: str) -> StepResult:
            action = parse_action(text, self.gym.action_space)
            if action is None:
                return StepResult(Observation(text=f"Error: expected {how}, got {text[:200]!r}."),
                                  info={"invalid_action": True})
            obs, reward, terminated, truncated, info = self.gym.step(action)
            return StepResult(Observation(text=render_fn(obs, self.gym)), reward=float(reward),
                              done=bool(terminated), truncated=bool(truncated), info={"env_info": _plain(info)})

        def act(self, action: str) -> StepResult:
            """Take one action in the environment."""
            return self.on_text(action)

        # Set, not written: under postponed annotations the description (a local) could not be resolved.
        act.__annotations__ = {"action": Annotated[str, f"the action: {how}"], "return": StepResult}
        act = tool(act)

        def close(self) -> None:
            self.gym.close()

    GymnasiumEnv.__name__ = GymnasiumEnv.__qualname__ = re.sub(r"\W", "_", label)
    GymnasiumEnv.__doc__ = f"The Gymnasium env {label}; actions are {how}."
    GymnasiumEnv.env_name = label
    return GymnasiumEnv


def _default_render(obs: Any, gym_env: Any) -> str:
    text = observation_to_text(obs)
    if getattr(gym_env, "render_mode", None) == "ansi":
        # Colour is lost on the wire: a highlighted cell (e.g. the agent) is shown in brackets.
        text += "\n" + _ANSI.sub("", _ANSI_SPAN.sub(r"[\1]", str(gym_env.render()))).strip("\n")
    return text


# -- envhub env -> gymnasium.Env ---------------------------------------------------------------------


def to_action(action: Any) -> dict[str, Any]:
    """An envhub wire action from a Gymnasium action: a dict passes through; text holding a tool call
    (``{"name", "arguments"}`` JSON or a ``<tool_call>`` block) becomes one; other text is a text action."""
    if isinstance(action, dict):
        return action
    text = str(action)
    if "<tool_call>" in text:
        parsed = parse_tool_calls(text)
        if parsed.calls:
            return {"tool_name": parsed.calls[0].name, "arguments": parsed.calls[0].arguments}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("name") or data.get("tool_name"), str):
        args = data.get("arguments") or {}
        if isinstance(args, dict):
            return {"tool_name": data.get("name") or data["tool_name"], "arguments": args}
    return {"text": text}


def _build_gym_env_class() -> type:
    import gymnasium

    class TextSpace(gymnasium.spaces.Text):
        """``gymnasium.spaces.Text`` over :data:`TEXT_CHARSET`, printed by name (its repr lists every character)."""

        def __repr__(self) -> str:
            return f"Text({self.min_length}, {self.max_length}, charset=TEXT_CHARSET)"

    class EnvhubGymEnv(gymnasium.Env):
        """A ``gymnasium.Env`` over an envhub env: ``env`` is a server URL or a local ``Env`` class.

        Observations and actions are text (``gymnasium.spaces.Text``); an action may also be a
        wire action dict, or text holding a tool call (see :func:`to_action`); an action the env
        rejects comes back as an ``Error: ...`` observation with reward 0. ``reset(options=...)``
        passes the options to the env's ``reset`` as task arguments. ``step`` returns
        ``(text, reward, terminated, truncated, info)`` with the env's ``info``. A server URL uses
        :class:`~envhub.client.EnvClient` (``client_kwargs``: ``token``...); a class runs in process.
        """

        metadata = {"render_modes": ["ansi"]}

        def __init__(self, env: str | type[Env], *, max_length: int = 65536, env_config: dict[str, Any] | None = None,
                     render_mode: str | None = None, **client_kwargs: Any) -> None:
            if not isinstance(env, str) and not (isinstance(env, type) and issubclass(env, Env)):
                raise TypeError(f"Expected env to be a server URL or an envhub Env class (not an instance), "
                                f"got {env!r} ({type(env).__name__}).")
            self.observation_space = TextSpace(max_length, charset=TEXT_CHARSET)
            self.action_space = TextSpace(max_length, charset=TEXT_CHARSET)
            self.render_mode = render_mode
            self._backend = _Remote(env, client_kwargs) if isinstance(env, str) else _Local(env, env_config or {})
            self._last = ""

        def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
            super().reset(seed=seed)
            result = self._backend.reset(seed=seed, **(options or {}))
            self._last = result.observation.text
            return self._last, dict(result.info)

        def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
            try:
                result = self._backend.step(to_action(action))
            except ActionValidationError as exc:  # the model's mistake: shown to it, the episode goes on
                result = StepResult(Observation(text=f"Error: {exc.message}"), info={"action_error": exc.to_wire()})
            self._last = result.observation.text
            return self._last, float(result.reward), bool(result.done), bool(result.truncated), dict(result.info)

        def render(self) -> str | None:
            return self._last if self.render_mode == "ansi" else None

        def close(self) -> None:
            self._backend.close()

    EnvhubGymEnv.__module__ = __name__
    return EnvhubGymEnv


def __getattr__(name: str) -> Any:
    # ``EnvhubGymEnv`` subclasses gymnasium.Env, so it is built (and gymnasium imported) on first use.
    if name == "EnvhubGymEnv":
        cls = globals()[name] = _build_gym_env_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Local:
    """An envhub env class run in process on a private event loop."""

    def __init__(self, env_cls: type[Env], env_config: dict[str, Any]):
        self.loop = asyncio.new_event_loop()
        self.runner = EnvRunner(env_cls(**env_config))

    def reset(self, **task: Any) -> StepResult:
        return self.loop.run_until_complete(self.runner.reset(**task))

    def step(self, action: dict[str, Any]) -> StepResult:
        return self.loop.run_until_complete(self.runner.step(action))

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.run_until_complete(self.runner.close())
            self.loop.close()


class _Remote:
    """A remote envhub (or OpenEnv) server through the blocking client."""

    def __init__(self, url: str, client_kwargs: dict[str, Any]):
        from envhub.client import EnvClient

        self.client = EnvClient(url, **client_kwargs).sync()

    def reset(self, **task: Any) -> StepResult:
        return self.client.reset(**task)

    def step(self, action: dict[str, Any]) -> StepResult:
        return self.client.step(action)

    def close(self) -> None:
        self.client.close()


# EnvhubGymEnv is built on first use by __getattr__
__all__ = ["from_gymnasium", "EnvhubGymEnv", "observation_to_text", "parse_action", "describe_space", "to_action",  # noqa: F822
           "TEXT_CHARSET"]
