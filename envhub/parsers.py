"""Parsers of model output: Hermes ``<tool_call>`` blocks, ``\\boxed{}`` answers, XML-style tags.

Every parser is a pure ``str -> value | None`` function: garbage from the model is data,
never an exception. The render helpers produce the exact Hermes/Qwen2.5 text the chat
template would, so a trainer can append tool results token-exactly.

>>> parse_tool_calls('<tool_call>\\n{"name": "guess", "arguments": {"n": 3}}\\n</tool_call>').calls
[ToolCall(name='guess', arguments={'n': 3}, id=None)]
>>> extract_boxed(r"so the answer is \\boxed{\\frac{1}{2}}.")
'\\\\frac{1}{2}'
>>> extract_tag("<move>3,4</move>", "move")
'3,4'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from envhub.types import ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


class ParseStatus(str, Enum):
    """How a turn's tool calls parsed."""

    NO_CALL = "no_call"      # no <tool_call> block: a plain answer
    OK = "ok"                # every block parsed
    MALFORMED = "malformed"  # at least one block failed; ``calls`` holds the good ones
    TRUNCATED = "truncated"  # an unterminated final block (generation cut off): do not execute


@dataclass
class ToolCallParse:
    """The result of :func:`parse_tool_calls`."""

    status: ParseStatus
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""  # the text outside the tool-call blocks

    @property
    def ok(self) -> bool:
        return self.status is ParseStatus.OK


def parse_tool_calls(text: Any, *, truncated: bool = False) -> ToolCallParse:
    """Parse every ``<tool_call>...</tool_call>`` block of an assistant turn, each on its own.

    ``truncated=True`` (the sampler stopped on its token limit) marks a turn with calls as
    TRUNCATED even when every block closed, since the turn did not finish.
    """
    if not isinstance(text, str):
        return ToolCallParse(ParseStatus.MALFORMED, errors=[f"Expected text, got {type(text).__name__}."])
    calls: list[ToolCall] = []
    errors: list[str] = []
    outside: list[str] = []
    cut_off = False
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:
            cut_off = True
            errors.append("unterminated <tool_call> block (the generation was cut off)")
            break
        call, error = _parse_block(text[body_start:end])
        if call is not None:
            calls.append(call)
        else:
            errors.append(error or "unparseable tool call")
        pos = end + len(TOOL_CALL_CLOSE)
    content = "".join(outside)
    if TOOL_CALL_CLOSE in content:
        errors.append("</tool_call> without a matching <tool_call>")
        content = content.replace(TOOL_CALL_CLOSE, "")
    content = content.strip()
    if cut_off or (truncated and (calls or errors)):
        status = ParseStatus.TRUNCATED
    elif errors:
        status = ParseStatus.MALFORMED
    elif calls:
        status = ParseStatus.OK
    else:
        status = ParseStatus.NO_CALL
    return ToolCallParse(status, calls, errors, content)


def _parse_block(body: str) -> tuple[ToolCall | None, str | None]:
    raw = body.strip()
    fenced = _FENCE.match(raw)
    if fenced:
        raw = fenced.group(1)
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return None, f"invalid JSON in tool call: {exc}"
    if not isinstance(obj, dict):
        return None, f"Expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}."
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f"Expected 'name' to be a non-empty string, got {name!r}."
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    args = decode_arguments(args)
    if not isinstance(args, dict):
        return None, f"Expected 'arguments' of {name!r} to be a JSON object, got {type(args).__name__}."
    return ToolCall(name=name, arguments=args), None


def decode_arguments(args: Any, *, max_depth: int = 2) -> Any:
    """Undo string-encoding of tool arguments (models sometimes double- or triple-encode them).

    Returns the decoded value, or the input unchanged when a level is not valid JSON;
    ``None`` becomes ``{}``.
    """
    if args is None:
        return {}
    for _ in range(max_depth):
        if not isinstance(args, str):
            break
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            break
    return args


# -- \boxed{} --------------------------------------------------------------------------------
_BOX_CMDS = ("\\boxed", "\\fbox")
_SPACE_BOX = re.compile(r" +([^\s$]+)")  # "\boxed 5"


def extract_boxed(text: Any) -> str | None:
    """The stripped content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``).

    The one answer extractor of envhub: math and geometry grading use it too. Braces are matched,
    so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. The space form takes the text up to the
    next ``$`` or whitespace. A last box left unclosed by a truncated generation is skipped in
    favour of an earlier complete one. ``None`` when there is none, or the box is empty.

    >>> extract_boxed(r"\\boxed{1} then, truncated, \\boxed{2")
    '1'
    """
    if not isinstance(text, str):
        return None
    starts = sorted({m.start() for cmd in _BOX_CMDS for m in re.finditer(re.escape(cmd), text)}, reverse=True)
    closing: dict[int, int] | None = None  # built once: scanning from each unclosed box to the end was quadratic
    for start in starts:
        i = start + len(next(c for c in _BOX_CMDS if text.startswith(c, start)))
        if i < len(text) and text[i] == "{":
            closing = _matching_braces(text) if closing is None else closing
            value = text[i + 1:closing[i]] if i in closing else None
        elif i < len(text) and text[i] == " ":
            m = _SPACE_BOX.match(text, i)  # "\boxed 5": the answer up to a $ or a space
            value = m.group(1) if m else None
        else:
            value = None  # e.g. "\boxedfoo": not a box
        if value is not None:
            return value.strip() or None
    return None


def _matching_braces(text: str) -> dict[int, int]:
    """``{index of an opening brace: index of its closing brace}`` for every matched pair of ``text``."""
    opened: list[int] = []
    pairs: dict[int, int] = {}
    for j, ch in enumerate(text):
        if ch == "{":
            opened.append(j)
        elif ch == "}" and opened:
            pairs[opened.pop()] = j
    return pairs


# -- XML-style tags --------------------------------------------------------------------------
def _tag_pattern(tag: str) -> re.Pattern[str]:
    t = re.escape(tag)
    return re.compile(rf"<{t}(?:\s[^>]*)?>(.*?)</{t}\s*>", re.DOTALL | re.IGNORECASE)


def extract_tags(text: Any, tag: str) -> list[str]:
    """The stripped contents of every closed ``<tag>...</tag>``, in order ([] when none)."""
    if not isinstance(text, str) or not isinstance(tag, str) or not tag:
        return []
    return [m.strip() for m in _tag_pattern(tag).findall(text)]


def extract_tag(text: Any, tag: str, *, last: bool = True) -> str | None:
    """The stripped content of the last (or first) closed ``<tag>...</tag>``, or ``None``.

    >>> extract_tag("<move>1,1</move> no, <move> 3,4 </move>", "move")
    '3,4'
    """
    found = extract_tags(text, tag)
    if not found:
        return None
    return found[-1] if last else found[0]


# -- Hermes render helpers -------------------------------------------------------------------
def format_tool_call(call: ToolCall | dict[str, Any]) -> str:
    """One call as the Qwen2.5/Hermes template renders it (arguments always as a JSON object).

    Accepts a :class:`ToolCall`, an OpenAI tool call, or ``{"name", "arguments"}``; string
    arguments are decoded first so they are never rendered as a quoted string.

    >>> format_tool_call(ToolCall("guess", {"number": 3}))
    '<tool_call>\\n{"name": "guess", "arguments": {"number": 3}}\\n</tool_call>'
    """
    if isinstance(call, ToolCall):
        name, args = call.name, call.arguments
    else:
        fn = call.get("function", call)
        name, args = fn.get("name"), decode_arguments(fn.get("arguments"))
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def format_tool_response(text: str) -> str:
    """A tool result as the template renders it inside the user turn."""
    return f"{TOOL_RESPONSE_OPEN}\n{text}\n{TOOL_RESPONSE_CLOSE}"


__all__ = ["ParseStatus", "ToolCallParse", "parse_tool_calls", "decode_arguments", "extract_boxed",
           "extract_tag", "extract_tags", "format_tool_call", "format_tool_response"]
