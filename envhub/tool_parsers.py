"""Tool-call parsers as a registry: one per model family's format, chosen by name or by model name.

Every parser has the signature ``parse(text, *, truncated=False, tools=None) -> ToolCallParse``
and is pure: garbage from the model is data, never an exception. ``status`` keeps apart a plain
answer (``NO_CALL``), calls that all parsed (``OK``), a call marker whose body did not parse
(``MALFORMED``; ``calls`` holds the good ones) and a turn cut off inside a call (``TRUNCATED``).
``tools`` (OpenAI schemas) lets formats whose arguments are untyped text (Qwen3-Coder's XML)
convert them to the declared JSON types.

============  =====================================================================  ==========================
name          what the model writes                                                  model families
============  =====================================================================  ==========================
hermes        ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``       Qwen2.5, Qwen3, Hermes
qwen3_coder   ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>...``     Qwen3-Coder
llama3_json   ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``)  Llama 3.1 / 3.2 / 3.3
mistral       ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` or                   Mistral, Mixtral,
              ``[TOOL_CALLS]NAME[ARGS]{...}`` (v11+ tokenizers)                          Ministral, Devstral
============  =====================================================================  ==========================

>>> get_tool_parser("hermes")('<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>').calls
[ToolCall(name='f', arguments={'x': 1}, id=None)]
>>> parser_name_for_model("Qwen/Qwen3-Coder-30B-A3B-Instruct"), parser_name_for_model("meta-llama/Llama-3.1-8B")
('qwen3_coder', 'llama3_json')
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, overload

from envhub.parsers import ParseStatus, ToolCallParse, parse_tool_calls


class ToolCallParser(Protocol):
    """``parse(text, *, truncated=False, tools=None) -> ToolCallParse``.

    A parser may carry ``markers``: special tokens of its format (``[TOOL_CALLS]``) that a
    decode skipping special tokens would drop; the rollout engine keeps those in the text.
    """

    def __call__(self, text: Any, *, truncated: bool = False,
                 tools: list[dict[str, Any]] | None = None) -> ToolCallParse: ...


_REGISTRY: dict[str, ToolCallParser] = {}
_P = TypeVar("_P", bound=Callable[..., ToolCallParse])

# Checked in order against the lower-cased model name: more specific names first.
_FAMILIES: list[tuple[str, str]] = [
    (r"qwen3[-_.]?coder", "qwen3_coder"),
    (r"qwen|hermes|tiny", "hermes"),
    (r"llama[-_.]?3", "llama3_json"),
    (r"mistral|mixtral|ministral|magistral|devstral|codestral", "mistral"),
]


@overload
def register_tool_parser(name: str) -> Callable[[_P], _P]: ...


@overload
def register_tool_parser(name: str, parser: _P) -> _P: ...


def register_tool_parser(name: str, parser: _P | None = None) -> _P | Callable[[_P], _P]:
    """Add a parser under ``name`` (usable as a decorator); a name already taken is refused."""

    def add(fn: _P) -> _P:
        if not re.fullmatch(r"[a-z0-9_]+", name):
            raise ValueError(f"Expected a tool parser name of lower-case letters, digits and _, got {name!r}.")
        existing = _REGISTRY.get(name)
        if existing is not None and getattr(existing, "__wrapped__", existing) is not fn:
            raise ValueError(f"A tool parser named {name!r} is already registered.")
        _REGISTRY[name] = _takes_tools(fn)
        return fn

    return add(parser) if parser is not None else add


def tool_parser_names() -> list[str]:
    """The registered parser names, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


def parser_name_for_model(model_name: str | None) -> str:
    """The parser for a model family, from its name (``hermes`` when the name says nothing)."""
    name = (model_name or "").lower()
    for pattern, parser in _FAMILIES:
        if re.search(pattern, name):
            return parser
    return "hermes"


def get_tool_parser(name: str | Callable[..., ToolCallParse], *, model_name: str | None = None) -> ToolCallParser:
    """A parser by registered name, ``"auto"`` (from ``model_name``), ``"module:function"``, or a callable."""
    if callable(name):
        return _takes_tools(name)
    _load_builtin()
    if name == "auto":
        name = parser_name_for_model(model_name)
    if ":" in name:
        from envhub.registry import import_target

        fn = import_target(name, expected="a tool parser as 'module:function'")
        if not callable(fn):
            raise ValueError(f"Expected {name!r} to name a parser function, got {fn!r}.")
        return _takes_tools(fn)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"Unknown tool parser {name!r}; expected 'auto', 'module:function' or one of "
                         f"{tool_parser_names()}.") from None


def _takes_tools(fn: Callable[..., ToolCallParse]) -> ToolCallParser:
    """``fn`` itself, or a wrapper for a user parser written as ``fn(text, *, truncated=False)``."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    if "tools" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn

    def parse(text: Any, *, truncated: bool = False, tools: list[dict[str, Any]] | None = None) -> ToolCallParse:
        return fn(text, truncated=truncated)

    parse.markers = getattr(fn, "markers", ())  # type: ignore[attr-defined]
    parse.__wrapped__ = fn  # type: ignore[attr-defined]
    return parse


def hermes(text: Any, *, truncated: bool = False, tools: list[dict[str, Any]] | None = None) -> ToolCallParse:
    """Hermes / Qwen2.5 ``<tool_call>`` JSON blocks (see :func:`envhub.parsers.parse_tool_calls`)."""
    return parse_tool_calls(text, truncated=truncated)


register_tool_parser("hermes", hermes)


def _load_builtin() -> None:
    # The other formats live in their own module; importing it registers them.
    import envhub._tool_formats  # noqa: F401


__all__ = ["ToolCallParser", "ParseStatus", "ToolCallParse", "register_tool_parser", "get_tool_parser",
           "tool_parser_names", "parser_name_for_model", "hermes"]
