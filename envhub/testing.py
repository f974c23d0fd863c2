"""Test helpers for env authors: ``check_env``, a function-built ``FunctionEnv`` and the reference ``EchoEnv``.

Run the whole battery on your env in one line::

    from envhub.testing import check_env
    check_env(MyEnv)                 # raises AssertionError listing every failed check
    results = check_env(MyEnv, raise_on_error=False)   # or inspect CheckResult objects
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from envhub._wire import decode, encode
from envhub.env import Env, EnvRunner
from envhub.errors import EnvDefinitionError, EnvHubError
from envhub.tools import RESERVED_NAMES, tool
from envhub.types import Observation, StepResult


# -- reference envs ----------------------------------------------------------------------------
class EchoAction(BaseModel):
    """The echo env's action: one message."""

    model_config = ConfigDict(extra="forbid")
    message: str


class EchoObservation(Observation):
    """The echo env's observation: the message back and its length."""

    echoed_message: str = ""
    message_length: int = 0


class EchoEnv(Env):
    """Echoes each message back; reward = 0.1 per character. The shape of OpenEnv's echo env.

    Its work is trivially cheap, so it opts into ``run_inline`` (sync methods run on the
    server's event loop instead of a worker thread).
    """

    action_model = EchoAction
    observation_model = EchoObservation
    run_inline: ClassVar[bool] = True
    messages: int = 0

    def reset(self, seed: int | None = None, **task: Any) -> EchoObservation:
        self.messages = 0
        return EchoObservation(echoed_message="ready", message_length=0)

    def step(self, action: EchoAction) -> StepResult:
        self.messages += 1
        text = action.message
        return StepResult(observation=EchoObservation(echoed_message=text, message_length=len(text)),
                          reward=len(text) * 0.1)

    def state(self) -> dict[str, Any]:
        return {"messages": self.messages}


class FunctionEnv(Env):
    """A generic env built from two plain functions (see :meth:`from_functions`)."""

    _reset_fn: ClassVar[Callable[..., Any]]
    _step_fn: ClassVar[Callable[..., Any]]

    @classmethod
    def from_functions(cls, reset_fn: Callable[..., Any], step_fn: Callable[[dict[str, Any], Any], Any], *,
                       name: str = "FunctionEnv", action_model: type[BaseModel] | None = None,
                       max_steps: int | None = None) -> type[FunctionEnv]:
        """A new env class: ``reset_fn(state, rng, **task)`` and ``step_fn(state, action)`` share a per-session dict.

        ``reset_fn`` gets a fresh ``state`` dict, the seeded ``rng`` and the reset task kwargs;
        both may return anything an env method returns (``str``, ``Observation``, ``StepResult``).
        Without ``action_model`` the action is the default ``Action`` (text or tool call)::

            >>> Counter = FunctionEnv.from_functions(lambda s, rng: "0", lambda s, a: str(len(a.text)))
            >>> Counter.__name__
            'FunctionEnv'
        """
        attrs: dict[str, Any] = {"_reset_fn": staticmethod(reset_fn), "_step_fn": staticmethod(step_fn),
                                 "max_steps": max_steps, "__doc__": f"{name}: built from two functions."}
        if action_model is not None:
            attrs["action_model"] = action_model
        return type(name, (cls,), attrs)

    def reset(self, seed: int | None = None, **task: Any) -> Any:
        self.fstate: dict[str, Any] = {}
        return type(self)._reset_fn(self.fstate, self.rng, **task)

    def step(self, action: Any) -> Any:
        return type(self)._step_fn(self.fstate, action)

    def state(self) -> dict[str, Any]:
        return dict(getattr(self, "fstate", {}))


# -- check_env -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckResult:
    """The outcome of one named check."""

    name: str
    passed: bool
    detail: str = ""

    def __str__(self) -> str:
        return f"[{'ok' if self.passed else 'FAIL'}] {self.name}" + (f": {self.detail}" if self.detail else "")


def check_env(env_cls: type[Env], *, raise_on_error: bool = True, seed: int = 0,
              sample_action: Any = None, **config: Any) -> list[CheckResult]:
    """Run every check on ``env_cls(**config)``; raise ``AssertionError`` listing failures unless told not to.

    ``sample_action`` is the action dict used by the step check (default: the first tool
    with empty arguments, or ``{"text": "hello"}``).

    >>> from envhub.testing import EchoEnv, check_env
    >>> results = check_env(EchoEnv, sample_action={"message": "hi"})
    >>> print(results[0])
    [ok] reset returns an observation: EchoObservation with 5 field(s)
    >>> all(result.passed for result in results)
    True
    """
    if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
        raise TypeError(f"Expected an envhub.Env subclass, got {env_cls!r}.")
    results = [check(env_cls, config, seed, sample_action) for check in _CHECKS]
    failed = [r for r in results if not r.passed]
    if failed and raise_on_error:
        raise AssertionError(f"{env_cls.__name__} failed {len(failed)} check(s):\n"
                             + "\n".join(f"  {r}" for r in failed))
    return results


def _named(name: str) -> Callable[[Callable[..., str]], Callable[..., CheckResult]]:
    """Turn ``fn(...) -> detail`` (raising on failure) into a check returning a :class:`CheckResult`."""
    def wrap(fn: Callable[..., str]) -> Callable[..., CheckResult]:
        def run(*args: Any) -> CheckResult:
            try:
                return CheckResult(name, True, fn(*args) or "")
            except Exception as exc:  # a check reports, it never propagates
                return CheckResult(name, False, f"{type(exc).__name__}: {exc}")
        run.__name__ = fn.__name__
        return run
    return wrap


def _run(coro: Any) -> Any:
    """Run a coroutine to completion, also when called from inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _reset(env_cls: type[Env], config: dict[str, Any], seed: int) -> tuple[EnvRunner, StepResult]:
    runner = EnvRunner(env_cls(**config))
    return runner, await runner.reset(seed=seed)


@_named("reset returns an observation")
def _check_reset(env_cls: type[Env], config: dict[str, Any], seed: int, _: Any) -> str:
    _runner, first = _run(_reset(env_cls, config, seed))
    assert isinstance(first.observation, Observation), f"Expected an Observation, got {first.observation!r}"
    return f"{type(first.observation).__name__} with {len(first.observation.to_wire())} field(s)"


@_named("same seed gives the same first observation")
def _check_seeding(env_cls: type[Env], config: dict[str, Any], seed: int, _: Any) -> str:
    a = _run(_reset(env_cls, config, seed))[1].observation.to_wire()
    b = _run(_reset(env_cls, config, seed))[1].observation.to_wire()
    assert a == b, f"Expected equal first observations for seed={seed}, got {a!r} and {b!r}"
    return ""


@_named("observation survives the wire codec (JSON and msgpack)")
def _check_roundtrip(env_cls: type[Env], config: dict[str, Any], seed: int, _: Any) -> str:
    first = _run(_reset(env_cls, config, seed))[1]
    for binary in (False, True):
        frame = {"type": "observation", "data": first.to_wire(binary=binary)}
        back = StepResult.from_wire(decode(encode(frame, binary=binary), binary_ok=True)["data"])
        assert back.observation.to_wire() == first.observation.to_wire(), \
            f"Expected the {'msgpack' if binary else 'JSON'} round trip to keep the observation, got {back!r}"
    return ""


@_named("tool schemas are JSON Schema objects")
def _check_tool_schemas(env_cls: type[Env], *_: Any) -> str:
    for spec in env_cls.tools():
        params = spec.parameters
        assert params.get("type") == "object", f"Expected tool {spec.name!r} parameters of type object, got {params!r}"
        assert isinstance(params.get("properties"), dict), f"Expected 'properties' in tool {spec.name!r}"
        try:
            import jsonschema
        except ImportError:
            continue
        jsonschema.Draft202012Validator.check_schema(params)
    return f"{len(env_cls.tools())} tool(s)"


@_named("reserved names cannot become tools")
def _check_reserved(env_cls: type[Env], *_: Any) -> str:
    clash = RESERVED_NAMES & {spec.name for spec in env_cls.tools()}
    assert not clash, f"Expected no tool named {sorted(clash)}"
    try:
        type("Probe", (env_cls,), {"reset": tool(lambda self: "x")})
    except EnvDefinitionError:
        return ""
    raise AssertionError("Expected a @tool named 'reset' to be refused, but the subclass was created")


@_named("a sample action steps without crashing")
def _check_step(env_cls: type[Env], config: dict[str, Any], seed: int, sample_action: Any) -> str:
    action = copy.deepcopy(sample_action) if sample_action is not None else _default_action(env_cls)

    async def go() -> StepResult:
        runner, _ = await _reset(env_cls, config, seed)
        return await runner.step(action)
    try:
        result = _run(go())
    except EnvHubError as exc:
        if exc.code == "VALIDATION_ERROR" and sample_action is None:
            return f"skipped: pass sample_action= to check {env_cls.__name__}'s step ({exc.message})"
        raise
    assert isinstance(result.reward, float), f"Expected a float reward, got {result.reward!r}"
    return f"reward={result.reward:g} done={result.done}"


@_named("close works")
def _check_close(env_cls: type[Env], config: dict[str, Any], seed: int, _: Any) -> str:
    async def go() -> None:
        runner, _ = await _reset(env_cls, config, seed)
        await runner.state()
        await runner.close()
    _run(go())
    return ""


def _default_action(env_cls: type[Env]) -> dict[str, Any]:
    tools = env_cls.tools()
    if tools:
        return {"tool_name": tools[0].name, "arguments": _sample_arguments(tools[0].parameters)}
    if env_cls.action_model is EchoAction:
        return {"message": "hello"}
    return {"text": "hello"}


_SAMPLE_BY_TYPE = {"integer": 1, "number": 1.0, "string": "1", "boolean": False, "array": [], "object": {}}


def _sample_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Plausible values for a tool's required parameters (enum, default, else one per JSON type)."""
    props = schema.get("properties", {})
    args: dict[str, Any] = {}
    for name in schema.get("required", []):
        prop = props.get(name, {})
        if "enum" in prop:
            args[name] = prop["enum"][0]
        elif "default" in prop:
            args[name] = prop["default"]
        else:
            kind = prop.get("type") or next((p.get("type") for p in prop.get("anyOf", []) if p.get("type")), "string")
            args[name] = copy.deepcopy(_SAMPLE_BY_TYPE.get(kind, "1"))
    return args


_CHECKS = [_check_reset, _check_seeding, _check_roundtrip, _check_tool_schemas, _check_reserved, _check_step,
           _check_close]

__all__ = ["check_env", "CheckResult", "EchoEnv", "EchoAction", "EchoObservation", "FunctionEnv"]
