"""The one episode loop of ``envhub eval``, for every chat model: messages + tools in, assistant turn out, env steps.

1. ``reset(seed=..., **task)`` on the worker's session (:class:`EnvConnection`, reused from episode to
   episode), and the env's tools as OpenAI schemas;
2. messages = [system prompt], the first observation as a user message;
3. each turn: ``model.reply(messages, tools)`` -> an assistant message (with ``history_turns``, the model is
   shown :func:`envhub.chat.history_window` of the messages, as the trainer's ``rollout.history_turns``;
   the record keeps them all);
   - with tool calls: each call is one env step ``{"tool_name", "arguments"}``, answered by a tool message;
   - without: the reply's text is one env step ``{"text": ...}``, answered by a user message;
4. stop when the env ends the episode (``done``; ``max_turns`` when the env truncates it), after
   ``max_turns`` model turns, when the conversation outgrows the model's context (``max_tokens``),
   or on a failure.

A reply cut off at the per-reply token limit is still acted on (its text, or the calls that parsed),
as the trainer's rollout engine does. The model's own mistakes go back to it as messages and the
episode goes on: a call that does not parse (``malformed_tool_calls``), an action the env refuses
(``invalid_actions``). Failures that are not the policy's end the episode with ``reward`` null, never
scored as 0: the env's own (``env``: it raised inside reset or step), the model's (``model``: the
endpoint or the local model failed to answer) and the plumbing's (``infrastructure``: the env server
unreachable, a dropped session, a step timeout, the episode deadline).
Observation images travel as ``image_url`` content parts (PNG data URLs).
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from envhub.chat import (
    ChatModel,
    ChatModelError,
    ChatReply,
    ContextLengthError,
    history_window,
    tool_call_from_openai,
)
from envhub.client import EnvClient
from envhub.errors import ActionValidationError, EnvHubError
from envhub.eval import DEFAULT_SYSTEM_PROMPT
from envhub.remote import observation_text
from envhub.types import Observation, StepResult, add_named_numbers


@dataclass(frozen=True)
class EpisodeSpec:
    """Which episode to play: task ``task_index`` (reset with ``seed``, plus ``reset_kwargs``), sample ``sample``."""

    task_index: int
    sample: int
    seed: int
    reset_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class EpisodeLimits:
    """How far one episode may go."""

    max_turns: int = 10
    history_turns: int | None = None  # each turn sees the system prompt, the last k turns and the newest observation
    timeout_s: float | None = None
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    env_token: str | None = None
    env_message_timeout_s: float | None = 300.0


@dataclass
class EpisodeRecord:
    """One line of ``results.jsonl`` (``docs/eval.md`` lists every field)."""

    task_index: int
    seed: int
    sample: int
    turns: int = 0
    tool_calls: int = 0
    reward: float | None = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    stop_reason: str = "max_turns"
    failure: dict[str, Any] | None = None
    tokens: dict[str, int] = field(default_factory=lambda: {"prompt": 0, "completion": 0})
    seconds: float = 0.0
    malformed_tool_calls: int = 0
    invalid_actions: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)

    def fail(self, kind: str, message: str, stop_reason: str) -> None:
        """End the episode on a failure that is not the policy's (``env``, ``model``, ``infrastructure``):
        it has no reward."""
        self.failure = {"kind": kind, "message": message[:2000]}
        self.stop_reason = stop_reason
        self.reward = None

    def add_step(self, result: StepResult) -> None:
        self.reward = (self.reward or 0.0) + float(result.reward)
        add_named_numbers(self.rewards, result.info.get("rewards"))
        add_named_numbers(self.stats, result.info.get("stats"))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class EnvConnection:
    """One env session that plays episode after episode (a reset each), as the trainer's env pool does:
    no handshake, ``/metadata`` read or tool listing per episode. After an env failure or a deadline it
    is dropped, and the next episode opens a fresh one."""

    def __init__(self, url: str, limits: EpisodeLimits):
        self.url = url
        self.limits = limits
        self.client: EnvClient | None = None
        self.tools: list[dict[str, Any]] | None = None

    def open(self) -> EnvClient:
        if self.client is None:
            self.client = EnvClient(self.url, token=self.limits.env_token,
                                    message_timeout_s=self.limits.env_message_timeout_s)
            self.tools = None
        return self.client

    async def list_tools(self) -> list[dict[str, Any]] | None:
        """The env's tools as OpenAI schemas (None: no tools), read once per session."""
        if self.tools is None:
            self.tools = [t.to_openai() for t in await self.open().tools()]
        return self.tools or None

    async def drop(self) -> None:
        """Close the session, quietly: it may already be gone."""
        client, self.client = self.client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), 5.0)
            except Exception:
                pass  # closing a dead session has nothing left to report


async def play_episode(env: EnvConnection, model: ChatModel, spec: EpisodeSpec) -> EpisodeRecord:
    """Play one episode on ``env`` with ``model``; failures are recorded, never raised."""
    limits = env.limits
    record = EpisodeRecord(spec.task_index, spec.seed, spec.sample)
    start = time.monotonic()
    try:
        await asyncio.wait_for(_play(env, model, spec, limits, record), limits.timeout_s)
    except ContextLengthError as exc:
        if record.turns:
            record.stop_reason = "max_tokens"  # the conversation outgrew the model's context: scored, not a failure
        else:  # the env's first prompt does not fit: the policy never acted, a 0 would not be its score
            record.fail("model", f"the first prompt does not fit the model's context: {exc}", "model_error")
    except ChatModelError as exc:
        record.fail("model", str(exc), "model_error")
    except (EnvHubError, OSError, asyncio.TimeoutError) as exc:
        record.fail(*_env_failure(exc, start, limits.timeout_s))
    finally:
        record.seconds = round(time.monotonic() - start, 3)
        if record.failure is not None and record.failure["kind"] != "model":  # an env or infrastructure failure
            await env.drop()  # the session's state is unknown after an env failure or a cancelled step
    return record


def _env_failure(exc: BaseException, start: float, timeout_s: float | None) -> tuple[str, str, str]:
    """``(kind, message, stop_reason)`` of a failure on the env side: the plumbing (``infrastructure``:
    unreachable, dropped, refused, timed out) or the env itself (``env``: it raised, or broke the protocol)."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):  # a server-side step timeout, or our deadline
        if timeout_s is not None and time.monotonic() - start >= timeout_s and not isinstance(exc, EnvHubError):
            message = f"the episode ran past --episode-timeout {timeout_s:g} s"
        return "infrastructure", message, "timeout"
    if isinstance(exc, OSError):  # EnvConnectionError, SessionLostError, CapacityError, AuthError, sockets
        return "infrastructure", message, "env_error"
    return "env", message, "env_error"


async def _play(conn: EnvConnection, model: ChatModel, spec: EpisodeSpec, limits: EpisodeLimits,
                record: EpisodeRecord) -> None:
    env = conn.open()
    first = await env.reset(seed=spec.seed, **spec.reset_kwargs)
    tools = await conn.list_tools()
    system = _system_prompt(first.observation, limits.system_prompt)
    record.messages = ([{"role": "system", "content": system}] if system else []) + [user_message(first.observation)]
    if first.ended:  # an env may end the episode at reset (nothing to play)
        record.stop_reason = "done"
        return
    for _ in range(limits.max_turns):
        shown = record.messages if limits.history_turns is None else history_window(record.messages,
                                                                                     limits.history_turns)
        reply = await model.reply(shown, tools)
        _count_turn(record, reply)
        result = await _act(env, reply, record)
        if result is not None and result.ended:
            record.stop_reason = "done" if result.done else "max_turns"  # truncated: the env's own turn limit
            return
    record.stop_reason = "max_turns"


def _count_turn(record: EpisodeRecord, reply: ChatReply) -> None:
    record.turns += 1
    record.tokens["prompt"] += reply.prompt_tokens
    record.tokens["completion"] += reply.completion_tokens
    record.messages.append(reply.message)


async def _act(env: EnvClient, reply: ChatReply, record: EpisodeRecord) -> StepResult | None:
    """Send the reply's actions to the env; append what the model sees next; the last step's result."""
    calls = reply.message.get("tool_calls") or []
    record.malformed_tool_calls += len(reply.parse_errors)
    record.tool_calls += len(calls) + len(reply.parse_errors)  # every call the model wrote, parsed or not
    if not calls and reply.parse_errors:  # only unparseable calls: tell the model, take no env step
        record.messages.append({"role": "user", "content": "Error: your tool call did not parse: "
                                + "; ".join(reply.parse_errors)})
        return None
    if not calls:
        return await _text_step(env, str(reply.message.get("content") or ""), record)
    result: StepResult | None = None
    for raw in calls:
        call_id = raw.get("id") if isinstance(raw, dict) else None
        if result is not None and result.ended:
            record.messages.append(_tool_message(call_id, _call_name(raw), "Not run: the episode has ended."))
            continue
        call = tool_call_from_openai(raw)
        if call is None:
            record.malformed_tool_calls += 1
            record.messages.append(_tool_message(call_id, _call_name(raw),
                                                 "Error: the tool call's arguments are not a JSON object."))
            continue
        result = await _tool_step(env, call_id, call.name, call.arguments, record) or result
    return result


async def _text_step(env: EnvClient, text: str, record: EpisodeRecord) -> StepResult | None:
    try:
        result = await env.step({"text": text})
    except ActionValidationError as exc:
        record.invalid_actions += 1
        record.messages.append({"role": "user", "content": f"Error: {exc.message}"})
        return None
    record.add_step(result)
    record.messages.append(user_message(result.observation))
    return result


async def _tool_step(env: EnvClient, call_id: str | None, name: str, arguments: dict[str, Any],
                     record: EpisodeRecord) -> StepResult | None:
    try:
        result = await env.step({"tool_name": name, "arguments": arguments})
    except ActionValidationError as exc:
        record.invalid_actions += 1
        record.messages.append(_tool_message(call_id, name, f"Error: {exc.message}"))
        return None
    record.add_step(result)
    record.messages.append(_tool_message(call_id, name, observation_text(result.observation)))
    if result.observation.images:  # tool messages carry text only: the images follow as a user message
        record.messages.append({"role": "user", "content": _image_parts(result.observation.images)})
    return result


def user_message(observation: Observation) -> dict[str, Any]:
    """An observation as a user message: its text, or image parts followed by a text part."""
    text = observation_text(observation)
    if not observation.images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": _image_parts(observation.images) + [{"type": "text", "text": text}]}


def _image_parts(images: list[bytes]) -> list[dict[str, Any]]:
    return [{"type": "image_url",
             "image_url": {"url": "data:image/png;base64," + base64.b64encode(img).decode("ascii")}}
            for img in images]


def _tool_message(call_id: Any, name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id if isinstance(call_id, str) else None, "name": name,
            "content": content}


def _call_name(raw: Any) -> str:
    fn = raw.get("function", raw) if isinstance(raw, dict) else {}
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else ""


def _system_prompt(observation: Observation, default: str | None) -> str | None:
    env_prompt = observation.metadata.get("system_prompt") if isinstance(observation.metadata, dict) else None
    return env_prompt if isinstance(env_prompt, str) and env_prompt else default


__all__ = ["EpisodeSpec", "EpisodeLimits", "EpisodeRecord", "EnvConnection", "play_episode", "user_message",
           "DEFAULT_SYSTEM_PROMPT"]
