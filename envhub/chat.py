"""Chat models in the OpenAI chat-completions shape: message conversions, the ``ChatModel`` interface, an httpx client.

A chat model answers ``reply(messages, tools) -> ChatReply``: OpenAI chat messages and tool
schemas in, one assistant message (``content``, ``tool_calls``) and its token counts out.
:class:`ChatCompletionsClient` is one for any server answering ``POST /v1/chat/completions``
(vLLM, SGLang, llama.cpp, a hosted API; no ``openai`` package needed); the trainer registers a
local one (a Hugging Face model in process) in the ``envhub.chat_models`` entry-point group.
``envhub eval`` and ``adapters.openai.run_agent`` drive either.

>>> assistant_message_from_text('<tool_call>\\n{"name": "guess", "arguments": {"n": 3}}\\n</tool_call>',
...                             call_ids=iter(["c1"]))["tool_calls"]
[{'id': 'c1', 'type': 'function', 'function': {'name': 'guess', 'arguments': '{"n": 3}'}}]
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from envhub.errors import EnvConnectionError
from envhub.parsers import ParseStatus
from envhub.types import ToolCall

_TRANSIENT = frozenset({429, 502, 503, 504})
_CONTEXT_MARKERS = ("context length", "context_length", "maximum context", "too many tokens", "prompt is too long")


class ChatModelError(EnvConnectionError):
    """The model endpoint failed: unreachable, an HTTP error, or a reply without an assistant message.

    An infrastructure failure, never the policy's fault. A ``ConnectionError`` (and an
    ``EnvConnectionError``, what the endpoint raised before this class existed).
    """


class ContextLengthError(ChatModelError):
    """The conversation no longer fits the model's context: the policy's episode is over (not an outage)."""


@dataclass
class ChatReply:
    """One assistant turn: the OpenAI message, its token counts and why generation stopped.

    ``finish_reason``: ``stop`` (the model ended its turn), ``tool_calls``, or ``length`` (cut off at
    the token limit). ``parse_errors``: tool calls the model wrote that did not parse (left out of
    ``message["tool_calls"]``; a local model reports them, an endpoint parses its own).
    """

    message: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    parse_errors: list[str] = field(default_factory=list)


class ChatModel(Protocol):
    """What ``envhub eval`` needs from a model: one assistant turn at a time, async.

    A model that batches the turns of concurrent episodes may also offer ``set_demand(live)``:
    ``live()`` is the number of episodes being played, so a batch can wait for all of their turns.
    """

    #: the model's name, recorded with the results
    name: str

    async def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> ChatReply: ...

    async def aclose(self) -> None: ...


# -- conversions -----------------------------------------------------------------------------------


def tool_call_from_openai(call: Any) -> ToolCall | None:
    """A ToolCall from an OpenAI tool call; None when it is not one (garbage from a model is data).

    ``arguments`` may be a JSON string (the API's shape) or already a dict; anything that does not
    decode to a JSON object gives None.
    """
    if not isinstance(call, dict):
        return None
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return None
    raw = fn.get("arguments")
    if raw is None or raw == "":
        raw = {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, dict):
        return None
    call_id = call.get("id")
    return ToolCall(name=fn["name"], arguments=raw, id=call_id if isinstance(call_id, str) else None)


def _new_call_ids() -> Iterator[str]:
    while True:
        yield f"call_{uuid.uuid4().hex[:12]}"


def assistant_message_from_text(text: str, *, parser: Any = "hermes", tools: list[dict[str, Any]] | None = None,
                                call_ids: Iterator[str] | None = None) -> dict[str, Any]:
    """An OpenAI assistant message from a model's raw turn, read with a tool-call parser of
    :mod:`envhub.tool_parsers` (``hermes``: ``<tool_call>{...}</tool_call>`` blocks; ``qwen3_coder``,
    ``llama3_json``, ``mistral``, or a parser function).

    Malformed calls are left out of ``tool_calls``; the text outside the calls is ``content``.
    ``tools`` (OpenAI schemas) type the arguments of formats that write them as text; ``call_ids``
    names the calls that carry no id of their own (default: random ``call_...`` ids).
    """
    return parse_assistant_text(text, parser=parser, tools=tools, call_ids=call_ids)[0]


def parse_assistant_text(text: str, *, parser: Any = "hermes", tools: list[dict[str, Any]] | None = None,
                         truncated: bool = False, call_ids: Iterator[str] | None = None
                         ) -> tuple[dict[str, Any], list[str]]:
    """:func:`assistant_message_from_text` plus the parse errors of the calls it left out."""
    from envhub.tool_parsers import get_tool_parser

    parsed = get_tool_parser(parser)(text, truncated=truncated, tools=tools)
    if parsed.status is ParseStatus.NO_CALL:
        return {"role": "assistant", "content": text}, []
    ids = call_ids or _new_call_ids()
    calls = [ToolCall(c.name, c.arguments, c.id or next(ids)) for c in parsed.calls]
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content.strip() or None}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message, list(parsed.errors)


def history_window(messages: list[dict[str, Any]], turns: int) -> list[dict[str, Any]]:
    """The messages a turn is prompted with under a history window of ``turns``: the leading system messages,
    then the conversation from the observation that prompted the ``turns``-th latest assistant reply on; with
    ``0``, what came after the latest reply alone (the newest observation; after tool calls, their results
    without the call). A conversation with ``turns`` replies or fewer is returned whole.

    >>> chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "board 1"},
    ...         {"role": "assistant", "content": "move 1"}, {"role": "user", "content": "board 2"}]
    >>> [m["content"] for m in history_window(chat, 0)], [m["content"] for m in history_window(chat, 1)]
    (['S', 'board 2'], ['S', 'board 1', 'move 1', 'board 2'])
    """
    if turns < 0:
        raise ValueError(f"Expected a history window of >= 0 turns, got {turns}.")
    head = 0
    while head < len(messages) and messages[head].get("role") == "system":
        head += 1
    replies = [i for i in range(head, len(messages)) if messages[i].get("role") == "assistant"]
    start = replies[-(turns + 1)] + 1 if len(replies) > turns else head
    return messages[:head] + messages[start:]


def tools_to_openai(tools: Iterable[Any]) -> list[dict[str, Any]]:
    """The ``tools=`` list of a chat-completions request from ToolSpecs, EnvTools or OpenAI/MCP dicts."""
    from envhub.types import ToolSpec

    out = []
    for tool in tools:
        spec = getattr(tool, "spec", tool)  # an EnvTool carries its ToolSpec
        if isinstance(spec, dict):
            spec = ToolSpec.from_openai(spec)
        out.append(spec.to_openai())
    return out


# -- the endpoint ----------------------------------------------------------------------------------


class ChatCompletionsClient:
    """A minimal client of an OpenAI-compatible ``POST {base_url}/chat/completions`` (httpx, sync and async).

    ``base_url`` usually ends in ``/v1``. ``params`` (temperature, max_tokens, seed...) go into every
    request. :meth:`reply` is the :class:`ChatModel` form (token counts, finish reason) and keeps one
    connection pool until :meth:`aclose`; :meth:`complete` / :meth:`acomplete` return the message alone.
    The async calls try ``retries`` more times, after ``backoff_s``, 2x, 4x... (or the server's
    ``Retry-After``, up to 30 s), when the endpoint is unreachable or answers 429, 502, 503 or 504.
    """

    def __init__(self, base_url: str, *, model: str = "default", api_key: str | None = None,
                 timeout_s: float = 120.0, retries: int = 2, backoff_s: float = 1.0, **params: Any):
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"Expected retries >= 0 and backoff_s >= 0, got {retries} and {backoff_s}.")
        self.retries, self.backoff_s = retries, backoff_s
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = self.name = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.params = params
        self._http: httpx.AsyncClient | None = None

    def _body(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self.params}
        if tools:
            body["tools"] = tools
        return body

    def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The first choice's assistant message."""
        try:
            resp = httpx.post(self.url, json=self._body(messages, tools), headers=self.headers, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise ChatModelError(f"POST {self.url} failed: {exc}") from exc
        return _read_reply(self.url, resp).message

    async def acomplete(self, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The async form of :meth:`complete` (a connection per call: safe across event loops)."""
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:
            return (await self._post(http, messages, tools)).message

    async def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> ChatReply:
        """One assistant turn with its token counts (``usage``) and finish reason, on a pool kept for
        this event loop until :meth:`aclose`."""
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.timeout_s)
        return await self._post(self._http, messages, tools)

    async def _post(self, http: httpx.AsyncClient, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None) -> ChatReply:
        body = self._body(messages, tools)
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                resp = await http.post(self.url, json=body, headers=self.headers)
            except httpx.TransportError as exc:  # unreachable, reset, timed out: worth another try
                if last:
                    raise ChatModelError(f"POST {self.url} failed: {type(exc).__name__}: {exc}") from exc
                await asyncio.sleep(self.backoff_s * 2**attempt)
                continue
            except httpx.HTTPError as exc:
                raise ChatModelError(f"POST {self.url} failed: {type(exc).__name__}: {exc}") from exc
            if resp.status_code not in _TRANSIENT or last:
                return _read_reply(self.url, resp)
            await asyncio.sleep(_retry_after(resp, self.backoff_s * 2**attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover

    async def aclose(self) -> None:
        """Close the connection pool :meth:`reply` opened."""
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()


def _read_reply(url: str, resp: httpx.Response) -> ChatReply:
    if resp.status_code != 200:
        error = ContextLengthError if resp.status_code == 400 and _mentions_context(resp.text) else ChatModelError
        raise error(f"Expected HTTP 200 from {url}, got {resp.status_code}: {resp.text[:500]}")
    try:
        body = resp.json()
        choice = body["choices"][0]
        message = dict(choice["message"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ChatModelError(f"Expected a chat completion with choices[0].message from {url}, "
                             f"got {resp.text[:500]!r}") from None
    message.setdefault("role", "assistant")
    if not message.get("tool_calls"):
        message.pop("tool_calls", None)
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    return ChatReply(message, _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")),
                     str(choice.get("finish_reason") or "stop"))


def _retry_after(resp: httpx.Response, default_s: float) -> float:
    """The server's ``Retry-After`` in seconds (capped at 30), else ``default_s``."""
    try:
        return min(max(float(resp.headers.get("retry-after", "")), 0.0), 30.0)
    except ValueError:
        return default_s


def _mentions_context(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in _CONTEXT_MARKERS)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


__all__ = ["ChatModel", "ChatReply", "ChatModelError", "ContextLengthError", "ChatCompletionsClient",
           "tool_call_from_openai", "assistant_message_from_text", "parse_assistant_text", "tools_to_openai",
           "history_window"]
