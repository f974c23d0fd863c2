"""envhub tools and messages in the OpenAI chat-completions format, and an agent loop for any compatible endpoint.

Conversions (pure functions): :func:`tools_to_openai` / :func:`tool_from_openai`,
:func:`tool_call_to_openai` / :func:`tool_call_from_openai`, and Hermes assistant text
(``<tool_call>`` blocks, what a local model emits) to and from an OpenAI assistant message.

The loop drives an OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, SGLang, llama.cpp,
a hosted API...) against env servers through :class:`~envhub.env_tool.EnvTool`. It speaks HTTP
with httpx; the ``openai`` package is not needed::

    env = OpenEnv("ws://localhost:8001")
    first = env.reset(seed=0)
    tools = ToolManager(EnvTool.from_env(env))
    client = ChatCompletionsClient("http://localhost:8000/v1", model="qwen2.5-7b-instruct")
    result = run_agent(client, tools, [{"role": "user", "content": first.observation.text}])
    result.reward, result.stop_reason
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from envhub.env_tool import EnvTool, ToolManager
from envhub.errors import EnvConnectionError
from envhub.parsers import ParseStatus, format_tool_call
from envhub.types import ToolCall, ToolSpec

# -- conversions ---------------------------------------------------------------------------------


def tools_to_openai(tools: Iterable[ToolSpec | EnvTool | dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``tools=`` list of a chat-completions request from ToolSpecs, EnvTools or OpenAI/MCP dicts."""
    out = []
    for tool in tools:
        if isinstance(tool, EnvTool):
            tool = tool.spec
        elif isinstance(tool, dict):
            tool = ToolSpec.from_openai(tool)
        out.append(tool.to_openai())
    return out


def tool_from_openai(spec: dict[str, Any]) -> ToolSpec:
    """A ToolSpec from ``{"type": "function", "function": {...}}``, a bare function object or an MCP entry."""
    return ToolSpec.from_openai(spec)


def tool_call_to_openai(call: ToolCall) -> dict[str, Any]:
    """``{"id", "type": "function", "function": {"name", "arguments": "<json>"}}``."""
    return call.to_openai()


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


def assistant_message_from_text(text: str, *, parser: Any = "hermes",
                                tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An OpenAI assistant message from a model's raw turn, read with a tool-call parser of
    :mod:`envhub.tool_parsers` (``hermes``: ``<tool_call>{...}</tool_call>`` blocks; ``qwen3_coder``,
    ``llama3_json``, ``mistral``, or a parser function).

    Malformed calls are left out of ``tool_calls``; the text outside the calls is ``content``.
    ``tools`` (OpenAI schemas) type the arguments of formats that write them as text.
    """
    from envhub.tool_parsers import get_tool_parser

    parsed = get_tool_parser(parser)(text, tools=tools)
    if parsed.status is ParseStatus.NO_CALL:
        return {"role": "assistant", "content": text}
    calls = [ToolCall(c.name, c.arguments, c.id or f"call_{uuid.uuid4().hex[:12]}") for c in parsed.calls]
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content.strip() or None}
    if calls:
        message["tool_calls"] = [tool_call_to_openai(c) for c in calls]
    return message


def assistant_message_to_text(message: dict[str, Any]) -> str:
    """The Hermes text of an OpenAI assistant message: its content, then one ``<tool_call>`` block per call."""
    parts = [message.get("content") or ""]
    for raw in message.get("tool_calls") or []:
        call = tool_call_from_openai(raw)
        if call is not None:
            parts.append(format_tool_call(call))
    return "\n".join(p for p in parts if p)


def tool_message(call_id: str | None, name: str, content: str) -> dict[str, Any]:
    """A ``role: "tool"`` message answering one call."""
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


# -- the endpoint ----------------------------------------------------------------------------------


class ChatCompletionsClient:
    """A minimal client of an OpenAI-compatible ``POST {base_url}/chat/completions`` (httpx, sync and async).

    ``base_url`` usually ends in ``/v1``. ``params`` (temperature, max_tokens...) go into every request.
    """

    def __init__(self, base_url: str, *, model: str = "default", api_key: str | None = None,
                 timeout_s: float = 120.0, **params: Any):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.params = params

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
            raise EnvConnectionError(f"POST {self.url} failed: {exc}") from exc
        return _first_message(self.url, resp)

    async def acomplete(self, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The async form of :meth:`complete`."""
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as http:
                resp = await http.post(self.url, json=self._body(messages, tools), headers=self.headers)
        except httpx.HTTPError as exc:
            raise EnvConnectionError(f"POST {self.url} failed: {exc}") from exc
        return _first_message(self.url, resp)


def _first_message(url: str, resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code != 200:
        raise EnvConnectionError(f"Expected HTTP 200 from {url}, got {resp.status_code}: {resp.text[:500]}")
    try:
        message = resp.json()["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise EnvConnectionError(f"Expected a chat completion with choices[0].message from {url}, "
                                 f"got {resp.text[:500]!r}") from None
    message = dict(message)
    message.setdefault("role", "assistant")
    if not message.get("tool_calls"):
        message.pop("tool_calls", None)
    return message


# -- the agent loop --------------------------------------------------------------------------------


@dataclass
class AgentResult:
    """One episode of :func:`run_agent`: the full conversation and why it stopped.

    ``stop_reason``: ``done`` (an env ended the episode), ``answer`` (the model replied without
    tool calls), or ``max_turns``. ``reward`` is the sum of every env's episode reward.
    """

    messages: list[dict[str, Any]]
    turns: int
    stop_reason: str
    reward: float
    tool_calls: int = 0
    rewards: dict[str, float] = field(default_factory=dict)


async def arun_agent(client: ChatCompletionsClient, tools: ToolManager, messages: list[dict[str, Any]], *,
                     max_turns: int = 10) -> AgentResult:
    """Alternate model turns and tool execution until an env is done, the model answers, or ``max_turns``.

    Tool calls of one turn run through :meth:`ToolManager.execute_many` (calls on one env in
    order, different envs in parallel). Model mistakes come back to it as tool messages;
    infrastructure failures raise, so an outage is never scored as the model's fault.
    """
    if max_turns < 1:
        raise ValueError(f"Expected max_turns >= 1, got {max_turns}.")
    messages = list(messages)
    schemas = tools.tool_infos()
    calls_made, stop = 0, "max_turns"
    turn = 0
    for turn in range(1, max_turns + 1):  # noqa: B007 (the last turn is reported)
        reply = await client.acomplete(messages, schemas)
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        if not calls:
            stop = "answer"
            break
        calls_made += len(calls)
        messages.extend(await tools.execute_many(calls))
        if any(t.done for t in tools.tools.values()):
            stop = "done"
            break
    rewards = _episode_rewards(tools)
    return AgentResult(messages, turn, stop, sum(rewards.values()), calls_made, rewards)


def run_agent(client: ChatCompletionsClient, tools: ToolManager, messages: list[dict[str, Any]], *,
              max_turns: int = 10) -> AgentResult:
    """Blocking :func:`arun_agent` (for scripts; inside an event loop, await ``arun_agent``)."""
    return asyncio.run(arun_agent(client, tools, messages, max_turns=max_turns))


def _episode_rewards(tools: ToolManager) -> dict[str, float]:
    # Tools built from one env share its session: count each env once, under its first tool's name.
    seen: dict[int, tuple[str, float]] = {}
    for name, tool in tools.tools.items():
        seen.setdefault(id(tool.env), (name, tool.episode_reward))
    return dict(seen.values())


__all__ = ["tools_to_openai", "tool_from_openai", "tool_call_to_openai", "tool_call_from_openai",
           "assistant_message_from_text", "assistant_message_to_text", "tool_message", "ChatCompletionsClient",
           "AgentResult", "run_agent", "arun_agent"]
