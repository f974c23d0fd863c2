"""Action mappers: the action envhub would send, reshaped into the action a third-party env expects.

The engine's actions are envhub's default ones, ``{"text": reply}`` or ``{"tool_name": name,
"arguments": {...}}``. An OpenEnv server with a typed action (``{"message": ...}``,
``{"code": ...}``) needs them reshaped: ``env.action_mapper`` names a mapper, a function
``mapper(action: dict) -> dict`` (in Python, any callable), or one of the built-ins:

- ``"auto"`` (the default): read the action model from the server's ``/schema`` (in process: the
  env's ``action_model``). envhub's default action (or no ``/schema``) passes actions through; a
  tool-call action (OpenEnv's MCP ``CallToolAction``) takes tool calls and refuses text; an action
  with one string field takes the text reply in that field; an action with other fields becomes
  one tool (named after the action model, its fields as parameters) whose calls are the action;
- ``"identity"``: actions as they are;
- ``"field:NAME"``: ``{"text": t}`` -> ``{NAME: t}`` (``"message"`` and ``"code"`` are short for
  ``field:message`` and ``field:code``); a tool call's arguments pass through as the action;
- ``"arguments"``: a tool call's arguments are the action (the tool name is dropped);
- ``"call_tool"``: OpenEnv's MCP action, ``{"type": "call_tool", "tool_name": ..., "arguments": ...}``.

A mapper that raises ``ValueError`` (the reply does not fit the env's action) makes that turn an
env validation error, like a ``VALIDATION_ERROR`` from the server: a policy failure, not an outage.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from envhub.registry import import_target
from envhub.types import ToolSpec

ActionMapper = Callable[[dict[str, Any]], dict[str, Any]]
_DEFAULT_FIELDS = {"text", "tool_name", "arguments"}


def identity(action: dict[str, Any]) -> dict[str, Any]:
    return action


def field_mapper(name: str) -> ActionMapper:
    """``{"text": t}`` -> ``{name: t}``; a tool call's arguments are the action."""

    def to_field(action: dict[str, Any]) -> dict[str, Any]:
        if "tool_name" in action:
            return dict(action.get("arguments") or {})
        return {name: action.get("text", "")}

    to_field.__name__ = f"field_{name}"
    return to_field


def arguments(action: dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as the action; text has nowhere to go."""
    if "tool_name" not in action:
        raise ValueError("This env takes tool calls only (its action is a tool's arguments); got a text reply.")
    return dict(action.get("arguments") or {})


def arguments_with_name(action: dict[str, Any]) -> dict[str, Any]:
    """A tool call as it is; text has nowhere to go (an env whose action is a tool call only)."""
    if "tool_name" not in action:
        raise ValueError("This env takes tool calls only; got a text reply. Call one of its tools.")
    return action


def call_tool(action: dict[str, Any]) -> dict[str, Any]:
    """OpenEnv's MCP ``CallToolAction``."""
    if "tool_name" not in action:
        raise ValueError("This env takes tool calls only (an MCP call_tool action); got a text reply.")
    return {"type": "call_tool", "tool_name": action["tool_name"], "arguments": dict(action.get("arguments") or {})}


BUILTIN_MAPPERS: dict[str, ActionMapper] = {"identity": identity, "arguments": arguments, "call_tool": call_tool,
                                            "message": field_mapper("message"), "code": field_mapper("code")}


def load_action_mapper(spec: str | ActionMapper | None) -> ActionMapper | None:
    """A mapper from a built-in name, ``"field:NAME"``, ``"module:function"`` or a callable; ``None``
    and ``"auto"`` give ``None`` (the pool then reads ``/schema``)."""
    if spec is None or spec == "auto":
        return None
    if callable(spec):
        return spec
    if spec in BUILTIN_MAPPERS:
        return BUILTIN_MAPPERS[spec]
    if spec.startswith("field:") and spec[6:].isidentifier():
        return field_mapper(spec[6:])
    fn: object = import_target(spec, expected=f"env.action_mapper to be 'auto', one of {sorted(BUILTIN_MAPPERS)}, "
                                              "'field:NAME' or 'package.module:function'")
    if not callable(fn):
        raise ValueError(f"Expected {spec!r} to name a function mapper(action: dict) -> dict, got {fn!r}.")
    return fn


def from_action_schema(schema: Any) -> tuple[ActionMapper, list[ToolSpec]]:
    """The ``"auto"`` mapper (and tools) for an env whose ``/schema`` gives ``schema`` as its action model."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if isinstance(props, dict) and "tool_name" in props and "text" not in props:
        # a tool-call action (OpenEnv's MCP CallToolAction has a "type" discriminator): text has nowhere to go
        return (call_tool if "type" in props else arguments_with_name), []
    if not isinstance(props, dict) or _DEFAULT_FIELDS & set(props):
        return identity, []
    fields = {k: v for k, v in props.items() if k != "metadata"}
    required = [k for k in schema.get("required", []) if k in fields]
    strings = [k for k, v in fields.items() if isinstance(v, dict) and v.get("type") == "string"]
    if len(fields) == 1 and strings:
        return field_mapper(strings[0]), []
    title = str(schema.get("title") or "action")
    tool = ToolSpec(name=_snake(title), description=str(schema.get("description") or f"Send the env a {title}."),
                    parameters={"type": "object", "properties": fields, "required": required})
    return _schema_tool_mapper(tool.name, sorted(fields)), [tool]


def _schema_tool_mapper(tool_name: str, fields: list[str]) -> ActionMapper:
    def to_action(action: dict[str, Any]) -> dict[str, Any]:
        if action.get("tool_name") == tool_name:
            return dict(action.get("arguments") or {})
        if "tool_name" in action:
            raise ValueError(f"Unknown tool {action['tool_name']!r}; the env's only tool is {tool_name!r}.")
        raise ValueError(f"The env's action has the fields {fields}: answer with a {tool_name!r} tool call "
                         "(or set env.action_mapper to map text replies).")

    return to_action


def _snake(title: str) -> str:
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", title).lower()
    name = re.sub(r"[^a-z0-9_-]+", "_", name).strip("_") or "action"
    return name if name not in ("reset", "step", "state", "close") else f"{name}_action"


__all__ = ["ActionMapper", "BUILTIN_MAPPERS", "load_action_mapper", "from_action_schema",
           "field_mapper", "identity", "arguments", "arguments_with_name", "call_tool"]
