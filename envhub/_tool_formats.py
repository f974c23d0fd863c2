"""The tool-call formats beyond Hermes: Qwen3-Coder XML, Llama 3.x JSON, Mistral ``[TOOL_CALLS]``.

Each follows what its model family's chat template renders for an assistant tool call (see
``docs/training.md``, "Tool-call parsers") and returns :class:`~envhub.parsers.ToolCallParse`.
Each call is parsed on its own: one bad call never hides the good ones.
"""

from __future__ import annotations

import json
import re
from typing import Any

from envhub.parsers import ParseStatus, ToolCallParse, decode_arguments
from envhub.tool_parsers import register_tool_parser
from envhub.types import ToolCall


def _status(calls: list[ToolCall], errors: list[str], *, cut_off: bool, truncated: bool) -> ParseStatus:
    if cut_off or (truncated and (calls or errors)):
        return ParseStatus.TRUNCATED
    if errors:
        return ParseStatus.MALFORMED
    return ParseStatus.OK if calls else ParseStatus.NO_CALL


def _call(name: Any, args: Any, call_id: Any = None) -> tuple[ToolCall | None, str | None]:
    if not isinstance(name, str) or not name.strip():
        return None, f"Expected the tool name to be a non-empty string, got {name!r}."
    args = decode_arguments(args)
    if not isinstance(args, dict):
        return None, f"Expected the arguments of {name!r} to be a JSON object, got {type(args).__name__}."
    return ToolCall(name=name.strip(), arguments=args, id=call_id if isinstance(call_id, str) else None), None


def _keep(call: ToolCall | None, error: str | None, calls: list[ToolCall], errors: list[str]) -> None:
    if call is not None:
        calls.append(call)
    else:
        errors.append(error or "unparseable tool call")


# -- Qwen3-Coder ---------------------------------------------------------------------------------
_Q3_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_Q3_FUNCTION = re.compile(r"^\s*<function=([^>\n]*)>(.*?)(</function>\s*$|$)", re.DOTALL)
_Q3_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@register_tool_parser("qwen3_coder")
def qwen3_coder(text: Any, *, truncated: bool = False, tools: list[dict[str, Any]] | None = None) -> ToolCallParse:
    """``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``.

    Parameter values are text; with ``tools`` they become the declared JSON type (integers,
    numbers, booleans, objects, arrays), else a value that reads as JSON other than a string
    is taken as such.
    """
    if not isinstance(text, str):
        return ToolCallParse(ParseStatus.MALFORMED, errors=[f"Expected text, got {type(text).__name__}."])
    types = _param_types(tools)
    calls, errors, cut_off = [], [], False
    for m in _Q3_CALL.finditer(text):
        if not m.group(2):
            cut_off = True
            errors.append("unterminated <tool_call> block (the generation was cut off)")
            break
        call, error = _q3_block(m.group(1), types)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error or "unparseable tool call")
    content = _Q3_CALL.sub("", text).strip()
    return ToolCallParse(_status(calls, errors, cut_off=cut_off, truncated=truncated), calls, errors, content)


def _q3_block(body: str, types: dict[str, dict[str, str]]) -> tuple[ToolCall | None, str | None]:
    fn = _Q3_FUNCTION.match(body)
    if fn is None:
        return None, "Expected <function=NAME> ... </function> inside <tool_call>."
    if not fn.group(3):
        return None, f"<function={fn.group(1)}> is not closed by </function>."
    name = fn.group(1).strip()
    args: dict[str, Any] = {}
    for p in _Q3_PARAM.finditer(fn.group(2)):
        key = p.group(1).strip()
        args[key] = _q3_value(_strip_one_newline(p.group(2)), types.get(name, {}).get(key))
    if "<parameter=" not in fn.group(2) and fn.group(2).strip():
        return None, f"Expected <parameter=NAME> blocks in <function={name}>, got {fn.group(2).strip()[:60]!r}."
    return _call(name, args)


def _strip_one_newline(value: str) -> str:
    # The template writes "<parameter=k>\n" + value + "\n</parameter>": those two newlines are framing.
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _q3_value(raw: str, declared: str | None) -> Any:
    if declared == "string":
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if declared is None and isinstance(value, (str, float)) and not re.fullmatch(r"-?\d+(\.\d+)?", raw.strip()):
        return raw
    return value


def _param_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[str(fn.get("name"))] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


# -- Llama 3.x JSON ------------------------------------------------------------------------------
_PYTHON_TAG = "<|python_tag|>"


@register_tool_parser("llama3_json")
def llama3_json(text: Any, *, truncated: bool = False, tools: list[dict[str, Any]] | None = None) -> ToolCallParse:
    """``{"name": NAME, "parameters": {...}}``, the whole reply (optionally after ``<|python_tag|>``).

    Several calls may follow one another, separated by ``;`` or whitespace. A reply that does not
    start with ``{`` (after the tag) is a plain answer; one that does but is not a call is malformed.
    """
    if not isinstance(text, str):
        return ToolCallParse(ParseStatus.MALFORMED, errors=[f"Expected text, got {type(text).__name__}."])
    tagged = text.lstrip().startswith(_PYTHON_TAG)
    body = text.lstrip()[len(_PYTHON_TAG):] if tagged else text
    if not body.lstrip().startswith("{"):
        if tagged:
            return ToolCallParse(_status([], ["Expected a JSON tool call after <|python_tag|>."], cut_off=False,
                                         truncated=truncated), [], ["Expected a JSON tool call after <|python_tag|>."],
                                 body.strip())
        return ToolCallParse(ParseStatus.NO_CALL, content=text.strip())
    calls, errors, cut_off = [], [], False
    decoder, pos = json.JSONDecoder(), 0
    while True:
        pos = _skip(body, pos, " \t\r\n;")
        if pos >= len(body):
            break
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except ValueError as exc:
            cut_off = _unclosed_json(body[pos:])
            errors.append("unterminated JSON tool call (the generation was cut off)" if cut_off
                          else f"invalid JSON in tool call: {exc}")
            break
        if not isinstance(obj, dict):
            errors.append(f"Expected a JSON object with 'name' and 'parameters', got {type(obj).__name__}.")
            continue
        call, error = _call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
        _keep(call, error, calls, errors)
    return ToolCallParse(_status(calls, errors, cut_off=cut_off, truncated=truncated), calls, errors, "")


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _unclosed_json(fragment: str) -> bool:
    """True when ``fragment`` is a JSON value cut off before its end (more opens than closes, outside strings)."""
    depth, in_str, escaped = 0, False, False
    for ch in fragment:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return in_str or depth > 0


# -- Mistral -------------------------------------------------------------------------------------
_TOOL_CALLS = "[TOOL_CALLS]"
_MISTRAL_V11 = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\](.*)", re.DOTALL)


@register_tool_parser("mistral")
def mistral(text: Any, *, truncated: bool = False, tools: list[dict[str, Any]] | None = None) -> ToolCallParse:
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]`` (v3 tokenizers) or, from
    the v11 tokenizers on, ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`` once per call."""
    if not isinstance(text, str):
        return ToolCallParse(ParseStatus.MALFORMED, errors=[f"Expected text, got {type(text).__name__}."])
    start = text.find(_TOOL_CALLS)
    if start < 0:
        return ToolCallParse(ParseStatus.NO_CALL, content=text.strip())
    content = text[:start].strip()
    calls, errors, cut_off = [], [], False
    for segment in text[start:].split(_TOOL_CALLS)[1:]:
        v11 = _MISTRAL_V11.match(segment)
        if v11:
            seg_calls, seg_errors, seg_cut = _mistral_args(v11.group(1), v11.group(2), v11.group(3))
        else:
            seg_calls, seg_errors, seg_cut = _mistral_array(segment)
        calls += seg_calls
        errors += seg_errors
        cut_off = cut_off or seg_cut
    return ToolCallParse(_status(calls, errors, cut_off=cut_off, truncated=truncated), calls, errors, content)


def _mistral_args(name: str, call_id: str | None, rest: str) -> tuple[list[ToolCall], list[str], bool]:
    try:
        args, _ = json.JSONDecoder().raw_decode(rest.strip())
    except ValueError as exc:
        if _unclosed_json(rest):
            return [], ["unterminated [ARGS] JSON (the generation was cut off)"], True
        return [], [f"invalid JSON in the [ARGS] of {name!r}: {exc}"], False
    call, error = _call(name, args, call_id)
    return ([call], [], False) if call is not None else ([], [error or "unparseable tool call"], False)


def _mistral_array(segment: str) -> tuple[list[ToolCall], list[str], bool]:
    try:
        value, _ = json.JSONDecoder().raw_decode(segment.strip())
    except ValueError as exc:
        if _unclosed_json(segment):
            return [], ["unterminated [TOOL_CALLS] JSON (the generation was cut off)"], True
        return [], [f"invalid JSON after [TOOL_CALLS]: {exc}"], False
    items = value if isinstance(value, list) else [value]
    calls, errors = [], []
    for item in items:
        if not isinstance(item, dict):
            errors.append(f"Expected a tool call object with 'name' and 'arguments', got {type(item).__name__}.")
            continue
        call, error = _call(item.get("name"), item.get("arguments", item.get("parameters")), item.get("id"))
        _keep(call, error, calls, errors)
    if not items:
        errors.append("[TOOL_CALLS] with an empty list of calls")
    return calls, errors, False


# Special tokens of these formats that a decode skipping special tokens would drop: the engine keeps them.
llama3_json.markers = (_PYTHON_TAG,)  # type: ignore[attr-defined]
mistral.markers = (_TOOL_CALLS, "[ARGS]", "[CALL_ID]")  # type: ignore[attr-defined]

__all__ = ["qwen3_coder", "llama3_json", "mistral"]
