"""The trainer's local chat model behind ``envhub eval --model tiny``: the real tiny policy, real envs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from envhub.chat import ContextLengthError
from envhub.eval.runner import EvalConfig, run_eval
from examples.guess_env import GuessEnv
from trainer.chat_model import LocalChatModel, template_messages
from trainer.model import ModelConfig, load_tokenizer


def _eval(tmp_path: Path, url: str, name: str, **kwargs: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    out = tmp_path / name
    summary = run_eval(EvalConfig(env=url, model="tiny", out=str(out), **kwargs))
    return summary, [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_eval_with_the_local_tiny_model(tmp_path: Path, serve_env) -> None:
    url = serve_env(GuessEnv).url
    summary, records = _eval(tmp_path, url, "a", episodes=2, samples=2, max_tokens=12, max_turns=2, concurrency=1)
    assert sorted((r["task_index"], r["sample"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rec in records:
        assert rec["failure"] is None and rec["reward"] is not None, rec["failure"]
        assert 1 <= rec["turns"] <= 2 and rec["stop_reason"] in ("done", "max_turns")
        assert rec["tokens"]["prompt"] > 100 and 1 <= rec["tokens"]["completion"] <= 12 * rec["turns"]
        assert [m["role"] for m in rec["messages"][:3]] == ["system", "user", "assistant"]
        assert rec["messages"][1]["content"].startswith("I picked a number between 1 and 100")
    assert set(summary["pass_at_k"]) == {"1", "2"} and summary["episodes_done"] == 4
    assert summary["tokens"]["completion"] == sum(r["tokens"]["completion"] for r in records)
    # the same seed samples the same replies
    _, again = _eval(tmp_path, url, "b", episodes=2, samples=2, max_tokens=12, max_turns=2, concurrency=1)
    key = lambda rec: (rec["task_index"], rec["sample"])  # noqa: E731
    assert [r["messages"] for r in sorted(records, key=key)] == [r["messages"] for r in sorted(again, key=key)]


def test_the_chat_template_renders_openai_tool_calls_and_tool_messages() -> None:
    tok = load_tokenizer(ModelConfig(name="tiny"))
    messages = [{"role": "user", "content": "Find it."},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "guess", "arguments": '{"number": 5}'}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "guess", "content": "Higher."}]
    text = tok.apply_chat_template(template_messages(messages), tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "guess", "arguments": {"number": 5}}\n</tool_call>' in text
    assert "<tool_response>\nHigher.\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_a_prompt_past_the_context_is_a_context_length_error() -> None:
    model = LocalChatModel("tiny", max_tokens=8, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           max_position_embeddings=160)
    with pytest.raises(ContextLengthError, match="the context is 160"):
        asyncio.run(model.reply([{"role": "user", "content": "x" * 200}], None))
    reply = asyncio.run(model.reply([{"role": "user", "content": "hi"}], None))
    assert reply.message["role"] == "assistant" and 1 <= reply.completion_tokens <= 8 and reply.prompt_tokens < 152


def test_a_reply_is_read_for_tool_calls_only_when_the_env_offers_tools() -> None:
    model = LocalChatModel("tiny", max_tokens=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    text = 'Maybe <tool_call>\n{"name": "guess", "arguments": {"number": 5}}\n</tool_call>'
    ids = model.tokenizer.encode(text, add_special_tokens=False)

    async def generate(request: Any) -> Any:
        return SimpleNamespace(token_ids=ids, finish_reason="stop")

    model.sampler.generate = generate  # type: ignore[method-assign]
    messages = [{"role": "user", "content": "Find it."}]
    plain = asyncio.run(model.reply(messages, None))  # math, say: an answer that looks like a call is still text
    assert plain.message == {"role": "assistant", "content": text} and not plain.parse_errors
    tools = [{"type": "function", "function": {"name": "guess", "parameters": {
        "type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}}]
    called = asyncio.run(model.reply(messages, tools))
    assert called.message["tool_calls"][0]["function"]["name"] == "guess" and called.message["content"] == "Maybe"
