"""Train with TRL's ``GRPOTrainer`` against envhub servers: an ``environment_factory`` class per env URL.

``GRPOTrainer(environment_factory=cls)`` builds one instance per rollout, calls
``reset(**dataset_row)`` (a returned string is appended to the last user message), exposes the
instance's public methods as tools, and scores a rollout with ``get_reward()``. Here every
instance holds one session on the env server:

- tool envs (the server publishes ``@tool`` methods): :func:`environment_factory` builds a class
  with one method per remote tool (name, typed arguments and docstring from the tool's JSON
  Schema, so TRL renders the same schema); a call is a remote ``step``; ``get_reward`` is the
  episode reward the env computed.
- text envs (no tools, the whole completion is the answer, e.g. the math env): the class has no
  tools and :func:`text_answer_reward` submits each completion's final text as the action and
  returns the env's reward (in the action's ``text`` field, or in its one string field: an OpenEnv
  server's ``{"message": ...}``; an action with several string fields and no ``text`` is refused).

:func:`grpo_kwargs` picks the right pair::

    from trl import GRPOConfig, GRPOTrainer
    from adapters.trl import grpo_kwargs, seed_dataset

    trainer = GRPOTrainer(model, args=GRPOConfig(...), train_dataset=seed_dataset(256),
                          processing_class=tokenizer, **grpo_kwargs("ws://localhost:8001"))

Several envs in one run: ``environment_factory={"math": environment_factory(url1), "geometry":
environment_factory(url2)}`` with an ``environment`` column in the dataset, and
``reward_funcs=[text_answer_reward]`` if any of them is a text env (it scores only text envs).

Rows of the dataset carry the task (``seed`` by default; other ``task_keys`` such as ``split``
or ``index`` pass through), so the ``num_generations`` rollouts of one row share one task, as
GRPO needs. An infrastructure failure (server down, session lost, timeout) makes the rollout's
reward ``None`` instead of a fake 0: a rollout no reward function scores is left out of its
group's baseline and gets zero advantage in TRL, so an outage is never trained on as failure.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import httpx

from envhub import _wire
from envhub.remote import OpenEnv
from envhub.types import StepResult, ToolSpec

_TEXT = ""  # the action name of a free-text answer (never a tool name)
_JSON_TYPES: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool,
                                "array": list, "object": dict}
_BASE_MEMBERS = frozenset({"reset", "get_reward"})


def _to_action(name: str, arguments: dict[str, Any], text_field: str = "text") -> dict[str, Any]:
    if name == _TEXT:
        return {text_field: arguments["text"]}
    return {"tool_name": name, "arguments": arguments}


class _Session:
    """What both environment kinds share: one remote session, the task keys, the infra-failure flag."""

    url: ClassVar[str] = ""
    client_kwargs: ClassVar[dict[str, Any]] = {}
    task_keys: ClassVar[tuple[str, ...]] = ("seed",)
    fixed_task: ClassVar[dict[str, Any]] = {}
    text_field: ClassVar[str] = "text"  # the action field a text env's completion goes into

    def __init__(self) -> None:
        if not self.url:
            raise TypeError(f"{type(self).__name__} has no server URL; build the class with "
                            "adapters.trl.environment_factory(url).")
        self._env = OpenEnv(self.url, env_kwargs=dict(self.client_kwargs),
                            action_mapper=functools.partial(_to_action, text_field=self.text_field),
                            on_infra_error="mark")
        self._infra_error: dict[str, Any] | None = None

    def reset(self, **row: Any) -> str | None:
        """Start an episode with the row's task keys; returns the env's prompt text."""
        task = {**self.fixed_task, **{k: row[k] for k in self.task_keys if row.get(k) is not None}}
        result = self._env.reset(**task)
        self._infra_error = result.info.get("infra_error")
        return result.observation.text or None

    def _step(self, name: str, arguments: dict[str, Any]) -> StepResult:
        if self._infra_error is not None:
            return StepResult(truncated=True, info={"infra_error": self._infra_error})
        result = self._env.step(name, arguments)
        if "infra_error" in result.info:
            self._infra_error = result.info["infra_error"]
        return result

    def _reward(self) -> float | None:
        return None if self._infra_error is not None else float(self._env.episode_reward)

    def _close(self) -> None:
        # Not __del__: garbage collection may run on the client's own event-loop thread.
        self._env.close()


class EnvhubEnvironment(_Session):
    """Base of the tool-env classes :func:`environment_factory` builds (a remote tool per method)."""

    def get_reward(self) -> float | None:
        """The episode reward the env computed (None after an infrastructure failure)."""
        return self._reward()

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        if self._env.done:
            return "Error: the episode has ended; no more tool calls are accepted."
        result = self._step(name, arguments)
        return result.observation.text


class EnvhubTextEnvironment(_Session):
    """Base of the text-env classes: no tools; :func:`text_answer_reward` submits the completion."""

    def _submit(self, text: str) -> float | None:
        if not self._env.done and self._infra_error is None:
            self._step(_TEXT, {"text": text})
        return self._reward()


def text_answer_reward(completions: list[Any], environments: list[Any] | None = None, **_: Any) -> list[float | None]:
    """TRL reward function: submit each completion's final text to its rollout's env, return the env's reward.

    A conversational completion (a list of messages) submits its last assistant message.
    """
    if environments is None:
        raise ValueError("Expected GRPOTrainer to pass `environments`; use text_answer_reward together with "
                         "environment_factory=<class from adapters.trl.environment_factory>.")
    return [env._submit(_final_text(c)) if isinstance(env, EnvhubTextEnvironment) else None
            for c, env in zip(completions, environments, strict=True)]


def _final_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    for message in reversed(list(completion or [])):
        if isinstance(message, dict) and message.get("role") == "assistant":
            content = message.get("content") or ""
            if isinstance(content, list):  # multimodal content parts
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content)
    return ""


# -- building classes --------------------------------------------------------------------------------


def _annotation(schema: dict[str, Any]) -> Any:
    kind = schema.get("type")
    if isinstance(kind, list):  # ["integer", "null"]
        kind = next((k for k in kind if k != "null"), "string")
    return _JSON_TYPES.get(kind, str) if isinstance(kind, str) else str


def _docstring(spec: ToolSpec) -> str:
    lines = [(spec.description or f"Call the env's {spec.name} tool.").strip(), "", "Args:"]
    for name, schema in (spec.parameters.get("properties") or {}).items():
        text = " ".join(str(schema.get("description") or f"the {name} argument").split())
        if isinstance(schema.get("enum"), list):
            text += f" (choices: {schema['enum']!r})".replace("'", '"')
        lines.append(f"    {name}: {text}")
    return "\n".join(lines)


def tool_method(spec: ToolSpec) -> Callable[..., str]:
    """A method whose name, signature, type hints and Google docstring render ``spec``'s schema in TRL."""
    if spec.name in _BASE_MEMBERS or spec.name.startswith("_") or not spec.name.isidentifier():
        raise ValueError(f"Expected a tool name usable as a Python method (not reset/get_reward, no leading _), "
                         f"got {spec.name!r}.")
    properties = spec.parameters.get("properties") or {}
    required = set(spec.parameters.get("required") or [])
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    for name, schema in properties.items():
        hint = _annotation(schema)
        default = inspect.Parameter.empty if name in required else None
        annotations[name] = hint if name in required else (hint | None)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotations[name]))

    def method(self: EnvhubEnvironment, **arguments: Any) -> str:
        return self._call_tool(spec.name, {k: v for k, v in arguments.items() if v is not None or k in required})

    method.__name__ = method.__qualname__ = spec.name
    method.__doc__ = _docstring(spec)
    method.__annotations__ = annotations
    # inspect.signature reads __signature__, which typeshed does not declare on functions
    method.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    return method


def environment_factory(url: str, *, mode: Literal["auto", "tools", "text"] = "auto",
                        task_keys: tuple[str, ...] = ("seed",), task: dict[str, Any] | None = None,
                        tools: list[ToolSpec | dict[str, Any]] | None = None, name: str | None = None,
                        **client_kwargs: Any) -> type[_Session]:
    """A class for ``GRPOTrainer(environment_factory=...)`` serving the env at ``url``.

    ``mode="auto"`` asks the server for its tools: a tool env if it has any, else a text env.
    ``task_keys``: dataset columns passed to the env's ``reset``; ``task``: fixed reset
    arguments (e.g. ``{"split": "train"}``); ``tools``: use these specs instead of asking;
    ``client_kwargs`` go to :class:`~envhub.client.EnvClient` (``token``, ``message_timeout_s``...).
    The class is named after the server's env (``GuessEnv``, ``MathEnv``) unless ``name`` is given;
    TRL logs a tool env's reward as ``rewards/<name>/mean``.
    """
    if mode not in ("auto", "tools", "text"):
        raise ValueError(f"Expected mode 'auto', 'tools' or 'text', got {mode!r}.")
    specs = [t if isinstance(t, ToolSpec) else ToolSpec.from_openai(t) for t in tools or []]
    if tools is None and mode != "text":
        with OpenEnv(url, env_kwargs=dict(client_kwargs)) as probe:
            specs = probe.tools()
    if mode == "tools" and not specs:
        raise ValueError(f"Expected the env at {url} to publish tools for mode='tools', got none; use mode='text'.")
    use_tools = bool(specs) and mode != "text"
    text_field = "text" if use_tools else _text_field(url, client_kwargs.get("token"))
    base = EnvhubEnvironment if use_tools else EnvhubTextEnvironment
    namespace: dict[str, Any] = {"url": url, "client_kwargs": dict(client_kwargs), "task_keys": tuple(task_keys),
                                 "text_field": text_field,
                                 "fixed_task": dict(task or {}), "__module__": __name__,
                                 "__doc__": f"The envhub env at {url} as a TRL environment."}
    if use_tools:
        namespace.update({spec.name: tool_method(spec) for spec in specs})
    default = "EnvhubToolEnv" if use_tools else "EnvhubTextEnv"
    return type(name or _class_name(url, client_kwargs.get("token")) or default, (base,), namespace)


def _text_field(url: str, token: str | None) -> str:
    """The action field a text env's completion goes into: ``text`` (envhub's text action), else the action's
    one string field (an OpenEnv server's ``{"message": ...}``, say); an action with neither is refused here,
    as every rollout would be rejected and scored 0."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        properties = httpx.get(_wire.http_url(url, "/schema"), headers=headers, timeout=10).json()["action"]["properties"]
        fields = {name: spec.get("type") for name, spec in properties.items() if name != "metadata"}
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return "text"  # no action schema to read: envhub's text action
    strings = [name for name, kind in fields.items() if kind == "string"]
    if "text" in fields:
        return "text"
    if len(strings) == 1:
        return str(strings[0])
    raise ValueError(f"Expected the env at {url} to take a free-text action (a 'text' field, or one string field) "
                     f"as a text env, its action has the fields {sorted(fields)}.")


def _class_name(url: str, token: str | None) -> str | None:
    """``GuessEnv`` / ``MathEnv`` from the server's ``/metadata`` name: TRL logs each env's reward under it."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        name = str(httpx.get(_wire.http_url(url, "/metadata"), headers=headers, timeout=10).json().get("name") or "")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    name = re.sub(r"\W+", "_", name).strip("_")
    if not name:
        return None
    name = name[0].upper() + name[1:]
    return name if name.endswith("Env") else name + "Env"


def grpo_kwargs(url: str, **kwargs: Any) -> dict[str, Any]:
    """``environment_factory`` (and ``reward_funcs`` for a text env) to splat into ``GRPOTrainer(...)``."""
    cls = environment_factory(url, **kwargs)
    out: dict[str, Any] = {"environment_factory": cls}
    if issubclass(cls, EnvhubTextEnvironment):
        out["reward_funcs"] = [text_answer_reward]
    return out


def seed_dataset(n: int, *, prompt: str = "", start: int = 0, **columns: Any) -> Any:
    """A ``datasets.Dataset`` of ``n`` rows: a one-message user prompt (the env's reset text is appended
    to it) and ``seed`` = ``start``..``start+n-1``; ``columns`` add constant columns (e.g. ``split="train"``)."""
    from datasets import Dataset

    rows = {"prompt": [[{"role": "user", "content": prompt}] for _ in range(n)], "seed": list(range(start, start + n))}
    rows.update({key: [value] * n for key, value in columns.items()})
    return Dataset.from_dict(rows)


__all__ = ["EnvhubEnvironment", "EnvhubTextEnvironment", "environment_factory", "grpo_kwargs", "seed_dataset",
           "text_answer_reward", "tool_method"]
