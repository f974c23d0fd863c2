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
from dataclasses import dataclass, field
from typing import Any

from envhub.chat import (
    ChatCompletionsClient,
    assistant_message_from_text,
    tool_call_from_openai,
    tools_to_openai,
)
from envhub.env_tool import ToolManager
from envhub.parsers import format_tool_call
from envhub.types import ToolCall, ToolSpec

# The conversions and the endpoint client live in envhub.chat (envhub eval uses them too); this module
# re-exports them next to the agent loop.


def tool_from_openai(spec: dict[str, Any]) -> ToolSpec:
    """A ToolSpec from ``{"type": "function", "function": {...}}``, a bare function object or an MCP entry."""
    return ToolSpec.from_openai(spec)


def tool_call_to_openai(call: ToolCall) -> dict[str, Any]:
    """``{"id", "type": "function", "function": {"name", "arguments": "<json>"}}``."""
    return call.to_openai()


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
