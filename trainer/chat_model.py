"""A local policy as an envhub chat model: ``envhub eval --model tiny`` (or a path to a Hugging Face model).

Registered in the ``envhub.chat_models`` entry-point group as ``local``, so envhub finds it without
importing the trainer. Each turn renders the OpenAI chat messages and tool schemas with the model's
chat template (:class:`~trainer.rollout.render.ChatRenderer`), samples with the trainer's HF sampler
(concurrent episodes share one batched call, :class:`~trainer.sampling.HFSampler`), and reads
tool calls from the reply with the model family's parser (:mod:`envhub.tool_parsers`).

>>> model = LocalChatModel("tiny", max_tokens=8, hidden_size=32, num_layers=1, num_heads=2)  # doctest: +SKIP
>>> reply = asyncio.run(model.reply([{"role": "user", "content": "2+2?"}], None))           # doctest: +SKIP
>>> reply.completion_tokens <= 8                                                             # doctest: +SKIP
True
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from envhub.chat import ChatModelError, ChatReply, ContextLengthError, parse_assistant_text
from envhub.tool_parsers import get_tool_parser
from trainer.model import ModelConfig, load_policy
from trainer.rollout.render import ChatRenderer
from trainer.sampling import GenRequest, HFSampler, SamplingConfig


class LocalChatModel:
    """A Hugging Face causal LM (``model.name`` as envhub-train takes it) answering chat turns in process.

    ``temperature`` 0 samples greedily; ``seed`` seeds torch's RNG once, so a run is reproducible.
    ``tool_parser``: a name of :mod:`envhub.tool_parsers` or ``"auto"`` (from the model name).
    ``model_options`` go to :class:`~trainer.model.ModelConfig` (e.g. the tiny model's shape).
    """

    def __init__(self, name: str, *, max_tokens: int = 1024, temperature: float = 1.0, seed: int = 0,
                 tool_parser: str = "auto", device: str | None = None, **model_options: Any):
        torch.manual_seed(seed)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.name = name
        self.config = ModelConfig(name=name, **model_options)
        self.model, self.tokenizer = load_policy(self.config, device)
        self.model.eval()
        self.renderer = ChatRenderer(self.tokenizer)
        self.greedy = temperature == 0
        self.sampler = HFSampler(self.model, self.tokenizer, SamplingConfig(temperature=temperature or 1.0))
        self.max_tokens = max_tokens
        self.parser = get_tool_parser(tool_parser, model_name=name)
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self._ids = (f"call_{i}" for i in range(1 << 62))

    async def reply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> ChatReply:
        """One assistant turn; a failure inside the model is a :class:`~envhub.chat.ChatModelError`."""
        try:
            prompt = self.renderer.prompt_ids(template_messages(messages), tools)
        except Exception as exc:  # a template that cannot render these messages is the model's failure
            raise ChatModelError(f"{self.name}: the chat template failed: {type(exc).__name__}: {exc}") from exc
        budget = self.max_tokens if not self.context else min(self.max_tokens, self.context - len(prompt))
        if budget < 1:
            raise ContextLengthError(f"{self.name}: the prompt has {len(prompt)} tokens; the context is {self.context}")
        try:
            result = await self.sampler.generate(GenRequest(prompt, budget, greedy=self.greedy))
        except Exception as exc:  # the sampler's errors end the episode as a model failure, not a crash
            raise ChatModelError(f"{self.name}: generation failed: {type(exc).__name__}: {exc}") from exc
        cut = result.finish_reason == "length"
        errors: list[str] = []
        if not tools:  # an env without tools: the reply is text, as an endpoint answers a request without tools
            message: dict[str, Any] = {"role": "assistant", "content": self._decode(result.token_ids)}
        else:
            message, errors = parse_assistant_text(self._decode(result.token_ids), parser=self.parser, tools=tools,
                                                   truncated=cut, call_ids=self._ids)
            if errors and "tool_calls" not in message:  # keep what the model wrote: the call that did not parse
                message["content"] = self._decode(result.token_ids)
        return ChatReply(message, len(prompt), len(result.token_ids), "length" if cut else "stop", errors)

    def set_demand(self, live_episodes: Callable[[], int]) -> None:
        """How many episodes are being played: a batch waits (briefly) until each of them asks for its turn."""
        self.sampler.set_demand(live_episodes)

    def _decode(self, ids: list[int]) -> str:
        """The reply's text without special tokens, except the tool-call format's own markers."""
        markers = getattr(self.parser, "markers", ())
        if not markers:
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))
        keep = {self.tokenizer.convert_tokens_to_ids(m) for m in markers}
        special = set(self.tokenizer.all_special_ids) - keep
        return str(self.tokenizer.decode([i for i in ids if i not in special], skip_special_tokens=False))

    async def aclose(self) -> None:
        """Nothing to release: the model lives as long as this object."""


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages in the shape Hugging Face chat templates render: no ``None`` contents, tool-call
    arguments as objects (the templates serialise them themselves), image parts as ``{"type": "image"}``."""
    out = []
    for msg in messages:
        msg = dict(msg)
        if msg.get("content") is None:
            msg["content"] = ""
        elif isinstance(msg["content"], list):
            msg["content"] = [_part(p) for p in msg["content"]]
        if msg.get("tool_calls"):
            msg["tool_calls"] = [_call(c) for c in msg["tool_calls"]]
        out.append(msg)
    return out


def _call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # left as the text the model wrote
    return {**call, "function": fn}


def _part(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") == "image_url":
        return {"type": "image", "image": (part.get("image_url") or {}).get("url", "")}
    return part


__all__ = ["LocalChatModel", "template_messages"]
