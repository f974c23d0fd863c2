"""The ``openai`` package, unmodified, against a real sampler server: a chat completion with a tool call
(rendered by the chat template, parsed by the project's Hermes parser), /v1/models, and the bearer token."""

from __future__ import annotations

import json

import pytest

from tests.trainer.sampler_servers import TINY, ServerProcess
from trainer.core import AdamParams, Datum, TrainingClient
from trainer.model import ModelConfig
from trainer.sampling import RemoteSampler

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.live
SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
MESSAGES = [{"role": "user", "content": "add 1 and 2"}]
REPLY = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'


def taught_tool_call() -> TrainingClient:
    """A tiny policy trained (real optimizer steps) to answer MESSAGES with REPLY, the call in Hermes format."""
    client = TrainingClient.from_config(ModelConfig(**SHAPE, init_seed=0))
    tok = client.tokenizer
    prompt = tok.encode(tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    reply = tok.encode(REPLY, add_special_tokens=False)
    datum = Datum.from_sequence(prompt + reply, weights=[0] * len(prompt) + [1] * len(reply))
    for _ in range(80):  # greedy decoding gives REPLY after about 50 (seed 0)
        client.forward_backward([datum])
        client.optim_step(AdamParams(learning_rate=1e-2))
    return client


def test_the_openai_client_gets_a_parsed_tool_call_and_needs_the_token(tmp_path) -> None:
    server = ServerProcess(tmp_path, *TINY, "--token", "s3cret", "--served-name", "policy")
    try:
        client = taught_tool_call()
        sampler = RemoteSampler([server.url], client.model, token="s3cret")  # the trained weights, pushed
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret")
        assert [m.id for m in api.models.list().data] == ["policy"]
        out = api.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS, temperature=0,
                                          max_tokens=80)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
        assert out.usage.completion_tokens > 0

        # the call goes back in as an assistant message with a tool result: the template renders it
        follow = api.chat.completions.create(model="policy", max_tokens=4, messages=[
            *MESSAGES, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "3"}])
        assert follow.choices[0].message.role == "assistant"

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError):
            api.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=10**9)
        sampler.close()
    finally:
        server.stop()
