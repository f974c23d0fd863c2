"""What one line of ``trajectories.jsonl`` (a training run) or ``results.jsonl`` (an eval) says, in one shape.

:func:`summarize` keeps the few fields the list filters on; :func:`conversation` turns a record into
messages (role, text and image parts, tool calls); :func:`token_view` gives the runs of text the loss
trains on (mask 1) and the rest (mask 0). A training record carries its text in ChatML (the policy's chat
template) plus ``segments`` (``[text, mask, n_tokens]`` runs) and token ids; an eval record carries
OpenAI chat messages.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

TITLE_CHARS = 120
_DATA_IMAGE = re.compile(r"^data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/=\s]*$")
# a turn ends at <|im_end|>, or (a reply cut off at its token limit) where the next turn starts
_BLOCK = re.compile(r"<\|im_start\|>(\w+)\n?(.*?)(?:<\|im_end\|>\n?|(?=<\|im_start\|>)|$)", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)
_IMAGE = re.compile(r"<\|vision_start\|>(?:<\|image_pad\|>)*<\|vision_end\|>")


@dataclass(frozen=True)
class EpisodeSummary:
    """The fields of one episode the list shows and filters on."""

    step: int | None
    reward: float | None
    stop_reason: str | None
    failure: str | None
    phase: str | None
    turns: int | None
    title: str


def _opt_int(record: dict[str, Any], key: str) -> int | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected {key!r} to be an integer, got {value!r}")
    return value


def _opt_float(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected {key!r} to be a number or null, got {value!r}")
    return None if math.isnan(value) else float(value)


def _opt_str(value: Any, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"expected {key!r} to be a string or null, got {value!r}")


def summarize(record: dict[str, Any], *, eval_result: bool) -> EpisodeSummary:
    """The list fields of a record (an ``envhub eval`` result when ``eval_result``, else a trainer
    trajectory); ValueError when a field has the wrong type (the line counts as bad)."""
    if eval_result:
        failure = record.get("failure")
        if isinstance(failure, str):  # a bare kind is read as {"kind": ...}
            failure = {"kind": failure}
        if failure is not None and not isinstance(failure, dict):
            raise ValueError(f"expected 'failure' to be null or an object, got {failure!r}")
        title = " · ".join(f"{k} {record[k]}" for k in ("task_index", "seed", "sample") if record.get(k) is not None)
        return EpisodeSummary(None, _opt_float(record.get("reward"), "reward"),
                              _opt_str(record.get("stop_reason"), "stop_reason"),
                              _opt_str((failure or {}).get("kind"), "failure.kind"), None, _opt_int(record, "turns"),
                              title[:TITLE_CHARS])
    task = record.get("task")
    if isinstance(task, dict):  # the reset arguments, the seed or index first: they tell episodes apart
        keys = sorted(task, key=lambda k: (k not in ("seed", "index"), k))
        title = " ".join(f"{k}={json.dumps(task[k], default=str)}" for k in keys)
    else:
        title = "" if task is None else json.dumps(task, default=str)
    return EpisodeSummary(_opt_int(record, "step"), _opt_float(record.get("reward"), "reward"),
                          _opt_str(record.get("stop_reason"), "stop_reason"), _opt_str(record.get("failure"), "failure"),
                          _opt_str(record.get("phase"), "phase") or "train", _opt_int(record, "num_turns"),
                          title[:TITLE_CHARS])


# -- conversation ---------------------------------------------------------------------------------
def conversation(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The episode as messages: ``{"role", "parts": [{"type": "text"|"image", ...}], "tool_calls", "trained"}``."""
    messages = record.get("messages")
    if isinstance(messages, list):
        return [_chat_message(m) for m in messages if isinstance(m, dict)]
    return _chatml_messages(record)


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": str(message.get("role", "?")), "parts": _content_parts(message.get("content"))}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_tool_call(c) for c in calls if isinstance(c, dict)]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _tool_call(call: dict[str, Any]) -> dict[str, str]:
    function = call["function"] if isinstance(call.get("function"), dict) else call
    arguments = function.get("arguments", "")
    return {"id": str(call.get("id", "")), "name": str(function.get("name", "?")),
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}


def _content_parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return [{"type": "text", "text": json.dumps(content, default=str)}]
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif isinstance(part, dict) and part.get("type") == "image_url":
            url = (part.get("image_url") or {}).get("url", "") if isinstance(part.get("image_url"), dict) else ""
            parts.append(_image_part(str(url)))
        else:
            parts.append({"type": "text", "text": json.dumps(part, default=str)})
    return parts


def _image_part(url: str) -> dict[str, Any]:
    # Only inline images are shown: the page never fetches a URL that a results file names.
    if _DATA_IMAGE.match(url[:64]) and _DATA_IMAGE.match(url):
        return {"type": "image", "src": url}
    return {"type": "image", "label": f"image not inline ({url[:60]}…)" if len(url) > 60 else f"image ({url})"}


def _chatml_messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    text = record.get("text")
    if not isinstance(text, str):
        return []
    trained = _trained_char_ranges(record)
    grids = [g for g in record.get("images") or [] if isinstance(g, list)]
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        return [{"role": "text", "parts": _text_with_images(text, grids, [0]), "trained": _overlaps(trained, 0, len(text))}]
    messages: list[dict[str, Any]] = []
    image_counter = [0]
    for block in blocks:
        role, body = block.group(1), block.group(2)
        message: dict[str, Any] = {"role": role, "trained": _overlaps(trained, block.start(2), block.end(2))}
        if role == "user" and _TOOL_RESPONSE.search(body):
            message["role"] = "tool"
            body = "\n".join(m.group(1) for m in _TOOL_RESPONSE.finditer(body))
        # only a reply's calls are calls: a system prompt that lists tools shows the format too
        calls = [_hermes_call(m.group(1)) for m in _TOOL_CALL.finditer(body)] if role == "assistant" else []
        if calls:
            message["tool_calls"] = calls
            body = _TOOL_CALL.sub("", body).strip()
        message["parts"] = _text_with_images(body, grids, image_counter)
        messages.append(message)
    return messages


def _hermes_call(payload: str) -> dict[str, str]:
    try:
        call = json.loads(payload)
    except ValueError:
        return {"id": "", "name": "(unparsed)", "arguments": payload}
    if not isinstance(call, dict):
        return {"id": "", "name": "(unparsed)", "arguments": payload}
    return _tool_call(call)


def _text_with_images(text: str, grids: list[list[Any]], counter: list[int]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    last = 0
    for match in _IMAGE.finditer(text):
        if match.start() > last:
            parts.append({"type": "text", "text": text[last:match.start()]})
        grid = grids[counter[0]] if counter[0] < len(grids) else None
        label = f"image {counter[0] + 1}" + (f" (grid {'×'.join(map(str, grid))}; pixels not logged)" if grid else "")
        parts.append({"type": "image", "label": label})
        counter[0] += 1
        last = match.end()
    if last < len(text) or not parts:
        parts.append({"type": "text", "text": text[last:]})
    return parts


def _trained_char_ranges(record: dict[str, Any]) -> list[tuple[int, int]] | None:
    segments = _segments(record)
    if segments is None:
        return None
    ranges, pos = [], 0
    for text, mask, _ in segments:
        if mask:
            ranges.append((pos, pos + len(text)))
        pos += len(text)
    return ranges


def _overlaps(ranges: list[tuple[int, int]] | None, start: int, end: int) -> bool | None:
    if ranges is None:
        return None
    return any(a < end and start < b for a, b in ranges)


# -- tokens ---------------------------------------------------------------------------------------
def _segments(record: dict[str, Any]) -> list[tuple[str, int, int]] | None:
    raw = record.get("segments")
    if not isinstance(raw, list):
        return None
    out = []
    for seg in raw:
        if not (isinstance(seg, list) and len(seg) == 3 and isinstance(seg[0], str) and seg[1] in (0, 1)
                and isinstance(seg[2], int)):
            return None
        out.append((seg[0], int(seg[1]), seg[2]))
    return out


def token_view(record: dict[str, Any]) -> dict[str, Any]:
    """Runs of equal mask: ``{"available", "segments": [{"mask", "text"?, "ids", "logprob_mean"?}], "trained_tokens"}``.

    Text comes from the record's ``segments`` (decoded by the trainer's tokenizer); a record without
    them shows its token ids.
    """
    tokens, mask = record.get("tokens"), record.get("mask")
    if not (isinstance(tokens, list) and isinstance(mask, list) and len(tokens) == len(mask)):
        why = ("eval results carry token counts, not token ids and masks" if isinstance(tokens, dict)
               else "this record has no token ids with a mask of the same length")
        return {"available": False, "why": why}
    if not all(m in (0, 1) and not isinstance(m, float) for m in mask):  # True/False pass: they are 1/0
        return {"available": False, "why": "this record's mask holds values other than 0 and 1"}
    logprobs = record.get("logprobs") if isinstance(record.get("logprobs"), list) else None
    if logprobs is not None and not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs):
        logprobs = None  # not numbers: shown without their mean
    texts = _segments(record)
    runs = _mask_runs(mask)
    if texts is not None and [(m, n) for _, m, n in texts] != [(m, e - s) for m, s, e in runs]:
        texts = None  # segments that disagree with the mask are not trusted
    out = []
    for i, (m, start, end) in enumerate(runs):
        seg: dict[str, Any] = {"mask": m, "ids": tokens[start:end]}
        if texts is not None:
            seg["text"] = texts[i][0]
        if m and logprobs is not None and len(logprobs) == len(tokens):
            seg["logprob_mean"] = round(sum(float(x) for x in logprobs[start:end]) / (end - start), 4)
        out.append(seg)
    return {"available": True, "segments": out, "trained_tokens": sum(1 for m in mask if m),
            "total_tokens": len(tokens), "decoded": texts is not None}


def _mask_runs(mask: list[Any]) -> list[tuple[int, int, int]]:
    runs, start = [], 0
    for end in range(1, len(mask) + 1):
        if end == len(mask) or mask[end] != mask[start]:
            runs.append((1 if mask[start] else 0, start, end))
            start = end
    return runs


def reward_components(record: dict[str, Any]) -> dict[str, float]:
    """Named reward components: an eval's ``rewards``, a trajectory's per-turn rewards."""
    named = record.get("rewards")
    if isinstance(named, dict):
        return {str(k): float(v) for k, v in named.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    turns = record.get("turn_rewards")
    if isinstance(turns, list):
        return {f"turn {i + 1}": float(v) for i, v in enumerate(turns) if isinstance(v, (int, float))}
    return {}
