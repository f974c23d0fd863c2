"""Agents: how a conversation is built from observations and how a model's reply becomes actions.

The rollout engine owns the token record (sampled ids, log-probs, masks) and calls an agent only
for *messages* and *decisions*, so no agent can break masking: whatever an agent returns is
rendered by the engine with the chat template and appended with mask 0, after the sampled ids.

One agent instance plays one episode (the engine builds a fresh one per episode), so it may keep
state; ``self.history`` holds every message of the episode so far, the assistant replies as their
decoded text.

Message shapes (the Hugging Face chat-template shapes; Qwen2-VL's for images):

- text: ``{"role": "user", "content": "..."}``;
- with images (an observation's ``images`` when the renderer takes images, see ``images``):
  ``{"role": "user", "content": [{"type": "image", "image": <PNG bytes or PIL.Image>}, ...,
  {"type": "text", "text": "..."}]}`` — images first, then the text;
- a tool result: ``{"role": "tool", "name": tool_name, "content": "..."}`` (a list of parts, as
  above, when the tool result carries images).

Built-in agents, chosen with ``rollout.agent``:

- ``"auto"`` (:class:`Agent`): tool calls when the episode has tools (``rollout.tool_mode``), a
  plain answer otherwise;
- ``"answer"`` (:class:`AnswerAgent`): every reply is the text action ``{"text": reply}``;
- ``"tools"`` (:class:`ToolCallingAgent`): replies are parsed for tool calls with the parser
  ``rollout.tool_parser``; a reply without a call is the text answer.

A user-written agent subclasses :class:`Agent` and is named ``"package.module:Class"``; it
overrides :meth:`Agent.initial_messages`, :meth:`Agent.decide`, :meth:`Agent.observation_messages`
or :meth:`Agent.tool_messages`::

    class TerseAgent(Agent):
        def initial_messages(self, observation):
            return [{"role": "user", "content": "Answer with one number. " + self.text_of(observation)}]

        def decide(self, reply, *, truncated):
            return Decision(text=reply.strip().split()[-1] if reply.strip() else "")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envhub.chat import history_window
from envhub.parsers import ParseStatus
from envhub.registry import import_target
from envhub.remote import observation_text
from envhub.tool_parsers import get_tool_parser
from envhub.types import Observation, ToolCall, ToolSpec

Message = dict[str, Any]


@dataclass
class Decision:
    """What a reply asks the engine to do.

    ``text``: send the env the text action ``{"text": text}``. ``tool_calls``: run these calls
    (env tools and client-side tools) and show the results. ``errors``: tool calls that did not
    parse — the turn counts as a parse error, and each error goes back to the model as a tool
    message. ``truncated``: the reply was cut off inside a call (nothing of it is executed).
    A decision with neither text nor calls (only errors) takes no env step.
    """

    text: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    truncated: bool = False


@dataclass
class ToolResult:
    """One executed call, for :meth:`Agent.tool_messages`: its name, what it returned, images if any."""

    name: str
    text: str
    images: list[bytes] = field(default_factory=list)
    error: bool = False


class Agent:
    """The default agent (``rollout.agent = "auto"``): tool calls when the episode has tools, else text.

    ``system_prompt`` is used when the env sends none (``metadata["system_prompt"]``), or always
    with ``use_env_system_prompt=False``. ``tool_mode``: ``auto`` | ``text`` | ``tools``.
    ``images``: put observation images into messages as image parts (set by the engine from its
    renderer: only a vision-language renderer takes them).
    """

    def __init__(self, *, system_prompt: str | None = None, use_env_system_prompt: bool = True,
                 tool_mode: str = "auto", tool_parser: str | Callable[..., Any] = "hermes",
                 model_name: str | None = None, images: bool = False, **options: Any):
        self.system_prompt = system_prompt
        self.use_env_system_prompt = use_env_system_prompt
        self.tool_mode = tool_mode
        self.parse_tool_calls = get_tool_parser(tool_parser, model_name=model_name)
        self.images = images
        self.options = options  # rollout.agent_kwargs, for user-written agents
        self.history: list[Message] = []
        self.tools: list[dict[str, Any]] | None = None

    # -- what the model is shown -----------------------------------------------------------------
    def tool_schemas(self, specs: list[ToolSpec]) -> list[dict[str, Any]] | None:
        """The tools put in the prompt (OpenAI schemas), or ``None`` for a text-only episode."""
        if self.tool_mode == "text" or (self.tool_mode == "auto" and not specs):
            return None
        return [s.to_openai() for s in specs]

    def initial_messages(self, observation: Observation) -> list[Message]:
        """The first prompt: the system prompt (if any) and the reset observation as a user message."""
        system = observation.metadata.get("system_prompt") if isinstance(observation.metadata, dict) else None
        if not self.use_env_system_prompt or not system:
            system = self.system_prompt
        head = [{"role": "system", "content": system}] if system else []
        return head + [self.user_message(observation)]

    def observation_messages(self, observation: Observation) -> list[Message]:
        """What follows a text action: the env's observation as a user message."""
        return [self.user_message(observation)]

    def tool_messages(self, results: list[ToolResult]) -> list[Message]:
        """What follows tool calls: one tool message per call, in call order."""
        return [{"role": "tool", "name": r.name, "content": self.content(r.text, r.images)} for r in results]

    def window(self, turns: int) -> list[Message]:
        """What a turn is prompted with under a history window (``rollout.history_turns = turns``): the
        leading system messages, then the conversation from the observation that prompted the ``turns``-th
        latest reply on (:func:`envhub.chat.history_window`); with ``0``, the newest observation alone.
        Earlier replies appear as their decoded text."""
        return history_window(self.history, turns)

    # -- what a reply means ----------------------------------------------------------------------
    def decide(self, reply: str, *, truncated: bool) -> Decision:
        """Turn the reply's decoded text into a :class:`Decision` (``truncated``: it hit the token cap)."""
        if self.tools is None:
            return Decision(text=reply)
        parsed = self.parse_tool_calls(reply, truncated=truncated, tools=self.tools)
        if parsed.status is ParseStatus.NO_CALL:
            return Decision(text=parsed.content)
        cut = parsed.status is ParseStatus.TRUNCATED
        return Decision(tool_calls=[] if cut else list(parsed.calls), errors=list(parsed.errors), truncated=cut)

    # -- helpers for subclasses ------------------------------------------------------------------
    @staticmethod
    def text_of(observation: Any) -> str:
        """The text a model sees for any observation (typed OpenEnv fields, dicts, text): the same
        extraction as the ``OpenEnv`` client."""
        return observation_text(observation)

    def user_message(self, observation: Observation) -> Message:
        return {"role": "user", "content": self.content(self.text_of(observation), _images(observation))}

    def content(self, text: str, images: list[Any]) -> str | list[dict[str, Any]]:
        """Plain text, or image parts followed by a text part when there are images and they are wanted."""
        if not (self.images and images):
            return text
        return [*({"type": "image", "image": img} for img in images), {"type": "text", "text": text}]


class AnswerAgent(Agent):
    """Every reply is the text action ``{"text": reply}``; no tools in the prompt."""

    def tool_schemas(self, specs: list[ToolSpec]) -> list[dict[str, Any]] | None:
        return None


class ToolCallingAgent(Agent):
    """Tools always in the prompt; replies parsed for calls (a reply without one is the text answer)."""

    def tool_schemas(self, specs: list[ToolSpec]) -> list[dict[str, Any]] | None:
        return [s.to_openai() for s in specs]


BUILTIN_AGENTS: dict[str, type[Agent]] = {"auto": Agent, "answer": AnswerAgent, "tools": ToolCallingAgent}


def load_agent_class(name: str | type[Agent]) -> type[Agent]:
    """``"auto"`` / ``"answer"`` / ``"tools"``, ``"package.module:Class"`` (an :class:`Agent` subclass), or a class."""
    if isinstance(name, type):
        cls: Any = name
    elif name in BUILTIN_AGENTS:
        return BUILTIN_AGENTS[name]
    else:
        cls = import_target(name, expected=f"rollout.agent to be one of {sorted(BUILTIN_AGENTS)} or "
                                           "'package.module:Class'")
    if not (isinstance(cls, type) and issubclass(cls, Agent)):
        raise ValueError(f"Expected {name!r} to name a subclass of trainer.rollout.agents.Agent, got {cls!r}.")
    return cls


def _images(observation: Any) -> list[Any]:
    images = getattr(observation, "images", None)
    return list(images) if isinstance(images, list) else []


__all__ = ["Agent", "AnswerAgent", "ToolCallingAgent", "Decision", "ToolResult", "BUILTIN_AGENTS",
           "load_agent_class", "Message"]
