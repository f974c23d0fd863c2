"""The OpenAI-compatible face of a sampler server: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

The ``openai`` Python package works against it unmodified (``OpenAI(base_url=URL + "/v1", api_key=TOKEN)``).
``model`` is the server's served name (the base weights) or a loaded adapter's name. Chat messages
(and ``tools``) are rendered by the model's chat template; a reply's tool calls are parsed by the
project's parser for the model family (:mod:`envhub.tool_parsers`, ``--tool-parser``) and come back
as ``tool_calls`` with ``finish_reason == "tool_calls"``. ``stream: true`` answers in server-sent
events: the whole choice in one chunk once it is sampled (the decode is batched, not incremental),
then the finish chunk and ``[DONE]``. Supported: ``n``, ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``stop``, ``seed``, ``logprobs``; unknown fields are ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from envhub.tool_parsers import get_tool_parser
from trainer.sampler_server.protocol import (
    MAX_IDS,
    MAX_NAME_CHARS,
    MAX_STOPS,
    BadRequestError,
    NotFoundError,
    Sample,
    SampleJob,
    check_job,
)
from trainer.sampler_server.state import ServerState, read_json, server_state

router = APIRouter(prefix="/v1")
MAX_MESSAGES = 4096
MAX_TOOLS = 256


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(max_length=MAX_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class ChatBody(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False


class CompletionBody(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] = Field(max_length=MAX_IDS)
    logprobs: int | None = Field(None, ge=0, le=0)  # the sampled ids' log-probs only (no alternatives)
    echo: bool = False


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    names = [state.backend.model_name, *state.backend.adapters()]
    return {"object": "list", "data": [{"id": n, "object": "model", "created": int(state.started),
                                        "owned_by": "envhub"} for n in names]}


@router.post("/completions", response_model=None)
async def completions(request: Request) -> dict[str, Any] | StreamingResponse:
    state = server_state(request)
    body: CompletionBody = await read_json(request, CompletionBody, state.limits.max_request_bytes)
    if body.echo:
        raise BadRequestError("echo is not supported.")
    tok = state.backend.tokenizer
    prompt = list(tok.encode(body.prompt, add_special_tokens=False)) if isinstance(body.prompt, str) else body.prompt
    samples, job = await _sample(state, body, prompt, body.max_tokens or 16)
    choices = []
    for i, s in enumerate(samples):
        text = _trim(tok.decode(s.token_ids, skip_special_tokens=True), job.stop_strings)
        lps = ({"tokens": [tok.decode([t]) for t in s.token_ids], "token_logprobs": s.logprobs,
                "top_logprobs": None, "text_offset": None} if body.logprobs is not None else None)
        choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": s.finish_reason})
    out = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
           "model": body.model, "choices": choices, "usage": _usage(prompt, samples)}
    if body.stream:
        return _stream([{**out, "choices": [c]} for c in choices])
    return out


@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request) -> dict[str, Any] | StreamingResponse:
    state = server_state(request)
    body: ChatBody = await read_json(request, ChatBody, state.limits.max_request_bytes)
    tools = _tools_for(body)
    prompt = _render(state, body.messages, tools)
    # without a cap, a reply may fill the context (up to the server's max_new_tokens), as OpenAI's does
    room = min(state.limits.max_new_tokens, state.backend.max_context() - len(prompt))
    samples, job = await _sample(state, body, prompt, body.max_completion_tokens or body.max_tokens or room)
    parser = get_tool_parser(state.tool_parser, model_name=state.backend.model_name)
    choices = [_chat_choice(i, s, state, job, parser, tools, body.logprobs) for i, s in enumerate(samples)]
    created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return _stream([{"id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                         "choices": [chunk]} for c in choices for chunk in _chunks(c)])
    return {"id": cid, "object": "chat.completion", "created": created, "model": body.model, "choices": choices,
            "usage": _usage(prompt, samples)}


def _tools_for(body: ChatBody) -> list[dict[str, Any]] | None:
    if body.tool_choice in (None, "auto"):
        return body.tools or None
    if body.tool_choice == "none":
        return None
    raise BadRequestError(f"Expected tool_choice 'auto' or 'none', got {body.tool_choice!r}.")


def _render(state: ServerState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt ids of ``messages`` through the model's chat template (tool-call arguments as objects)."""
    tok = state.backend.tokenizer
    try:
        text = tok.apply_chat_template([_template_message(m) for m in messages], tools=tools, tokenize=False,
                                       add_generation_prompt=True)
    except Exception as exc:  # jinja errors, a message shape the template refuses
        raise BadRequestError(f"The chat template could not render these messages: {exc}") from exc
    return list(tok.encode(text, add_special_tokens=False))


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(message.get("role"), str):
        raise BadRequestError("Expected every message to have a string 'role'.")
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        fn = dict((call or {}).get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError as exc:
                raise BadRequestError(f"Expected tool-call arguments as a JSON object, got {fn['arguments']!r:.80}.") \
                    from exc
        fixed.append({**call, "function": fn})
    return {**message, "tool_calls": fixed}


async def _sample(state: ServerState, body: _Sampling, prompt: list[int],
                  max_tokens: int) -> tuple[list[Sample], SampleJob]:
    if not prompt:
        raise BadRequestError("Expected a non-empty prompt.")
    adapter = _adapter_for(state, body.model)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > MAX_STOPS:
        raise BadRequestError(f"Expected at most {MAX_STOPS} stop strings, got {len(stops)}.")
    if max_tokens < 1:
        raise BadRequestError(f"Expected a prompt shorter than the model's context, got {len(prompt)} tokens.")
    job = SampleJob(tuple(prompt), body.n, max_tokens, body.temperature, body.top_p, 0, None, tuple(stops),
                    body.seed, adapter)
    check_job(job, state.limits, state.backend.vocab_size(), state.backend.max_context())
    samples, _ = await state.batcher.submit(job)
    return samples, job


def _adapter_for(state: ServerState, model: str) -> str | None:
    if model == state.backend.model_name:
        return None
    if model in state.backend.adapters():
        return model
    raise NotFoundError(f"The model {model!r} does not exist here; served: "
                        f"{[state.backend.model_name, *state.backend.adapters()]}.")


def _chat_choice(index: int, sample: Sample, state: ServerState, job: SampleJob, parser: Any,
                 tools: list[dict[str, Any]] | None, logprobs: bool) -> dict[str, Any]:
    tok = state.backend.tokenizer
    text = _trim(_reply_text(tok, sample.token_ids, getattr(parser, "markers", ())), job.stop_strings)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = sample.finish_reason
    if tools:
        parsed = parser(text, truncated=finish == "length", tools=tools)
        if parsed.calls:
            message = {"role": "assistant", "content": parsed.content.strip() or None,
                       "tool_calls": [c.to_openai() for c in parsed.calls]}
            finish = "tool_calls"
    lps = None
    if logprobs:
        lps = {"content": [{"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode()),
                            "top_logprobs": []} for t, lp in zip(sample.token_ids, sample.logprobs)]}
    return {"index": index, "message": message, "logprobs": lps, "finish_reason": finish}


def _reply_text(tok: Any, ids: list[int], markers: tuple[str, ...]) -> str:
    """The reply without special tokens, except a tool-call format's own markers."""
    if not markers:
        return str(tok.decode(ids, skip_special_tokens=True))
    keep = {tok.convert_tokens_to_ids(m) for m in markers} - {tok.unk_token_id, None}
    special = set(tok.all_special_ids) - keep
    return str(tok.decode([i for i in ids if i not in special], skip_special_tokens=False))


def _trim(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to the first stop string (OpenAI leaves the stop string out)."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def _usage(prompt: list[int], samples: list[Sample]) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}


def _chunks(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice as stream deltas: the whole message, then the finish reason."""
    delta = {k: v for k, v in choice["message"].items() if v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
    return [{"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None},
            {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]


def _stream(events: list[dict[str, Any]]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(lines(), media_type="text/event-stream")


__all__ = ["router", "ChatBody", "CompletionBody"]
