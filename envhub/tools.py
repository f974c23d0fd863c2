"""``@tool`` and ``@reward``: env methods as OpenAI function schemas and named reward components.

A ``@tool`` method's schema comes from its signature (type hints, ``Annotated`` descriptions,
defaults) and its docstring (first paragraph = description, ``Args:`` lines = parameter
descriptions). Arguments are validated with pydantic before the method runs; a validation
error or an exception inside the tool becomes an error observation for the model, never a
crashed session.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, get_args, get_origin, get_type_hints, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from envhub.errors import EnvDefinitionError
from envhub.types import ToolSpec

RESERVED_NAMES = frozenset({"reset", "step", "state", "close"})

_TOOL_ATTR = "__envhub_tool__"
_REWARD_ATTR = "__envhub_reward__"

#: a decorated method: ``@tool`` and ``@reward`` return it unchanged, with their info attached
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ToolInfo:
    """What ``@tool`` attaches to a method: its public spec and the pydantic model validating its arguments."""

    spec: ToolSpec
    args_model: type[BaseModel]
    method_name: str
    is_async: bool


@dataclass(frozen=True)
class RewardInfo:
    """What ``@reward`` attaches to a method."""

    name: str
    weight: float
    method_name: str
    is_async: bool


@overload
def tool(fn: F, /) -> F: ...
@overload
def tool(fn: None = None, *, name: str | None = None, description: str | None = None) -> Callable[[F], F]: ...
def tool(fn: F | None = None, *, name: str | None = None, description: str | None = None) -> F | Callable[[F], F]:
    """Expose an env method to the model as an OpenAI function tool.

    >>> from typing import Annotated
    >>> class Calc:
    ...     @tool
    ...     def add(self, a: Annotated[int, "first term"], b: int = 0) -> str:
    ...         '''Add two integers.'''
    ...         return str(a + b)
    >>> Calc.add.__envhub_tool__.spec.parameters["required"]
    ['a']
    """

    def wrap(f: F) -> F:
        tool_name = name or f.__name__
        if tool_name in RESERVED_NAMES:
            raise EnvDefinitionError(
                f"Tool name {tool_name!r} is reserved (reset, step, state, close are the env lifecycle); "
                "rename the method or pass @tool(name=...).")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]{0,63}", tool_name):
            raise EnvDefinitionError(f"Tool name {tool_name!r} is not a valid function name (letters, digits, _ and -).")
        desc, arg_docs = _parse_docstring(inspect.getdoc(f) or "")
        args_model = _args_model(f, tool_name, arg_docs)
        params = _clean_schema(args_model.model_json_schema())
        spec = ToolSpec(name=tool_name, description=description if description is not None else desc,
                        parameters=params)
        setattr(f, _TOOL_ATTR, ToolInfo(spec, args_model, f.__name__, inspect.iscoroutinefunction(f)))
        return f

    return wrap(fn) if fn is not None else wrap


@overload
def reward(fn: F, /) -> F: ...
@overload
def reward(fn: None = None, *, weight: float = 1.0, name: str | None = None) -> Callable[[F], F]: ...
def reward(fn: F | None = None, *, weight: float = 1.0, name: str | None = None) -> F | Callable[[F], F]:
    """Mark a method as a named reward component, evaluated after every step.

    The step reward is the sum of ``weight * component``; each component's value is reported
    in ``info["rewards"]``. Return 0 until the component applies (e.g. ``if not self.done``).

    >>> import asyncio
    >>> from envhub import Env, EnvRunner, Observation, StepResult
    >>> class ShortEnv(Env):
    ...     def reset(self, seed=None, **task):
    ...         self.reply = ""
    ...         return Observation(text="Say something short.")
    ...     def on_text(self, text):
    ...         self.reply, self.done = text, True
    ...         return "ok"
    ...     @reward(weight=0.5)
    ...     def brevity(self) -> float:
    ...         return 1.0 if len(self.reply) < 10 else 0.0
    >>> async def episode():
    ...     runner = EnvRunner(ShortEnv())
    ...     await runner.reset(seed=0)
    ...     return await runner.step({"text": "hi"})
    >>> result = asyncio.run(episode())
    >>> result.reward, result.info["rewards"]
    (0.5, {'brevity': 1.0})
    """

    def wrap(f: F) -> F:
        params = [p for p in inspect.signature(f).parameters.values() if p.name != "self"]
        if any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in params):
            raise EnvDefinitionError(f"@reward method {f.__name__!r} must take no arguments besides self; "
                                     "read what it needs from the env's attributes.")
        setattr(f, _REWARD_ATTR, RewardInfo(name or f.__name__, float(weight), f.__name__,
                                            inspect.iscoroutinefunction(f)))
        return f

    return wrap(fn) if fn is not None else wrap


def collect_tools(cls: type) -> dict[str, ToolInfo]:
    """All ``@tool`` methods of a class (including inherited ones), by tool name."""
    found: dict[str, ToolInfo] = {}
    for klass in reversed(cls.__mro__):
        for attr in vars(klass).values():
            info = getattr(attr, _TOOL_ATTR, None)
            if isinstance(info, ToolInfo):
                found[info.spec.name] = info
    return found


def collect_rewards(cls: type) -> dict[str, RewardInfo]:
    """All ``@reward`` methods of a class, by component name."""
    found: dict[str, RewardInfo] = {}
    for klass in reversed(cls.__mro__):
        for attr in vars(klass).values():
            info = getattr(attr, _REWARD_ATTR, None)
            if isinstance(info, RewardInfo):
                found[info.name] = info
    return found


def validate_arguments(info: ToolInfo, arguments: Any) -> dict[str, Any]:
    """Validated keyword arguments for a tool; raises ``ValueError`` with a message meant for the model."""
    if not isinstance(arguments, dict):
        raise ValueError(f"Expected the arguments of {info.spec.name!r} to be a JSON object, got {type(arguments).__name__}.")
    try:
        model = info.args_model.model_validate(arguments)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid arguments for tool {info.spec.name!r}: {problems}") from None
    return {k: getattr(model, k) for k in type(model).model_fields}


def _args_model(f: Callable[..., Any], tool_name: str, arg_docs: dict[str, str]) -> type[BaseModel]:
    sig = inspect.signature(f)
    try:
        hints = get_type_hints(f, include_extras=True)
    except Exception as exc:  # unresolvable forward references
        raise EnvDefinitionError(f"Cannot read the type hints of tool {tool_name!r}: {exc}") from exc
    fields: dict[str, Any] = {}
    for pname, param in sig.parameters.items():
        if pname == "self":
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise EnvDefinitionError(f"Tool {tool_name!r} cannot take *args or **kwargs: the model needs a fixed schema.")
        if pname not in hints:
            raise EnvDefinitionError(f"Tool {tool_name!r}: parameter {pname!r} needs a type hint (e.g. `{pname}: str`).")
        annotation, desc = _split_annotated(hints[pname])
        desc = desc or arg_docs.get(pname)
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (annotation, Field(default, description=desc))
    model_name = "".join(part.capitalize() for part in re.split(r"[_-]", tool_name)) + "Arguments"
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)


def _split_annotated(hint: Any) -> tuple[Any, str | None]:
    if get_origin(hint) is Annotated:
        base, *extras = get_args(hint)
        desc = next((e for e in extras if isinstance(e, str)), None)
        rest = tuple(e for e in extras if not isinstance(e, str))
        params = (base, *rest)  # Annotated[params] is Annotated[base, *rest]
        return (Annotated[params] if rest else base), desc
    return hint, None


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """First paragraph, and ``name: description`` lines of a Google-style ``Args:`` section."""
    paragraphs = doc.strip().split("\n\n")
    summary = " ".join(paragraphs[0].split()) if paragraphs and not paragraphs[0].lower().startswith("args:") else ""
    args: dict[str, str] = {}
    in_args = False
    current: str | None = None
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.lower() in ("args:", "arguments:", "parameters:"):
            in_args, current = True, None
            continue
        if in_args:
            if not stripped:
                continue
            m = re.match(r"^(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", stripped)
            if m and line.startswith((" ", "\t")) and (len(line) - len(line.lstrip())) <= 8:
                current = m.group(1)
                args[current] = m.group(3).strip()
            elif current and line.startswith((" ", "\t")):
                args[current] = (args[current] + " " + stripped).strip()
            else:
                in_args = False
    return summary, args


def _clean_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-friendly parameters schema: no titles, ``$defs`` kept only when referenced."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "title" or not isinstance(v, str)}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    out: dict[str, Any] = strip(schema)
    out["type"] = "object"
    out.setdefault("properties", {})
    out["additionalProperties"] = False
    return out


__all__ = ["tool", "reward", "ToolInfo", "RewardInfo", "collect_tools", "collect_rewards",
           "validate_arguments", "RESERVED_NAMES"]
