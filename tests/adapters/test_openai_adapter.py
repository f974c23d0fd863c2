"""adapters.openai: format conversions, and the agent loop against a local OpenAI-compatible endpoint and a live env."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from adapters.openai import (
    ChatCompletionsClient,
    assistant_message_from_text,
    assistant_message_to_text,
    run_agent,
    tool_call_from_openai,
    tool_call_to_openai,
    tool_from_openai,
    tools_to_openai,
)
from envhub import EnvTool, OpenEnv, ToolCall, ToolManager, ToolSpec
from envhub.errors import EnvConnectionError
from envhub.server import ServerThread, create_app
from envhub.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.guess_env import GuessEnv


def test_tool_specs_round_trip_through_the_openai_shape() -> None:
    spec = GuessEnv.tools()[0]
    (openai_tool,) = tools_to_openai([spec])
    assert openai_tool["type"] == "function" and openai_tool["function"]["name"] == "guess"
    assert openai_tool["function"]["parameters"]["properties"]["number"]["type"] == "integer"
    assert tool_from_openai(openai_tool) == spec
    assert tool_from_openai({"name": "x", "inputSchema": {"type": "object"}}) == ToolSpec("x", "", {"type": "object"})


def test_tool_calls_convert_and_garbage_is_none() -> None:
    call = ToolCall("guess", {"number": 5}, id="c1")
    wire = tool_call_to_openai(call)
    assert wire["function"]["arguments"] == '{"number": 5}'
    assert tool_call_from_openai(wire) == call
    assert tool_call_from_openai({"function": {"name": "f", "arguments": {"a": 1}}}) == ToolCall("f", {"a": 1})
    assert tool_call_from_openai({"function": {"name": "f", "arguments": "{not json"}}) is None
    assert tool_call_from_openai({"function": {"name": "f", "arguments": "[1, 2]"}}) is None
    assert tool_call_from_openai({"function": {"arguments": "{}"}}) is None
    assert tool_call_from_openai("guess(5)") is None


def test_hermes_text_and_openai_messages_convert_both_ways() -> None:
    text = 'Let me try.\n<tool_call>\n{"name": "guess", "arguments": {"number": 50}}\n</tool_call>'
    message = assistant_message_from_text(text)
    assert message["content"] == "Let me try."
    (call,) = message["tool_calls"]
    assert tool_call_from_openai(call) == ToolCall("guess", {"number": 50}, id=call["id"])
    assert assistant_message_from_text("The answer is 4.") == {"role": "assistant", "content": "The answer is 4."}
    back = assistant_message_to_text(message)
    assert assistant_message_from_text(back)["tool_calls"][0]["function"] == call["function"]


def test_other_model_families_turns_become_openai_messages_with_their_parser() -> None:
    mistral = assistant_message_from_text('Checking.[TOOL_CALLS]guess[CALL_ID]a1b2c3d4e[ARGS]{"number": 7}',
                                          parser="mistral")
    assert mistral["content"] == "Checking." and mistral["tool_calls"][0]["id"] == "a1b2c3d4e"
    schema = [{"type": "function", "function": {"name": "guess", "parameters": {
        "type": "object", "properties": {"number": {"type": "integer"}}}}}]
    qwen3 = assistant_message_from_text("<tool_call>\n<function=guess>\n<parameter=number>\n7\n</parameter>\n"
                                        "</function>\n</tool_call>", parser="qwen3_coder", tools=schema)
    assert json.loads(qwen3["tool_calls"][0]["function"]["arguments"]) == {"number": 7}
    assert assistant_message_from_text("It is 7.", parser="llama3_json") == {"role": "assistant", "content": "It is 7."}


def _bisect(messages: list[dict[str, Any]]) -> int:
    low, high, last = 1, 100, None
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            last = json.loads(m["tool_calls"][0]["function"]["arguments"]).get("number")
        if m["role"] == "tool" and isinstance(last, int):
            if m["content"].startswith("Higher"):
                low = last + 1
            elif m["content"].startswith("Lower"):
                high = last - 1
    return (low + high) // 2


def _completion(message: dict[str, Any]) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "chat.completion", "model": "scripted",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def scripted_endpoint(script: list[dict[str, Any]] | None = None) -> FastAPI:
    """An OpenAI-compatible endpoint: plays ``script`` in order, then bisects the guessing game."""
    app = FastAPI()
    app.state.requests = []
    queue = list(script or [])

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append({"body": body, "auth": request.headers.get("authorization")})
        if queue:
            step = queue.pop(0)
            return JSONResponse(step["json"], status_code=step["status"]) if "status" in step else _completion(step)
        n = len(app.state.requests)
        return _completion({"role": "assistant", "content": None,
                            "tool_calls": [_call(f"c{n}", "guess", json.dumps({"number": _bisect(body["messages"])}))]})

    return app


@pytest.fixture
def guess_url():
    with ServerThread(create_app(GuessEnv, settings=Settings(log_level="warning"))) as server:
        yield server.url


@pytest.mark.live
def test_agent_loop_solves_the_env_through_env_tools(guess_url: str) -> None:
    app = scripted_endpoint()
    with ServerThread(app, log_level="warning") as llm, OpenEnv(guess_url) as env:
        first = env.reset(seed=3)
        tools = ToolManager(EnvTool.from_env(env))
        client = ChatCompletionsClient(llm.url + "/v1", model="scripted", api_key="sk-test", temperature=0.0)
        result = run_agent(client, tools, [{"role": "user", "content": first.observation.text}], max_turns=10)
    assert result.stop_reason == "done" and result.reward == 1.0
    assert result.messages[-1] == {"role": "tool", "tool_call_id": f"c{result.turns}", "name": "guess",
                                   "content": "Correct!"}
    assert result.turns == result.tool_calls <= 7  # bisection over 1..100
    request = app.state.requests[0]
    assert request["auth"] == "Bearer sk-test"
    assert request["body"]["model"] == "scripted" and request["body"]["temperature"] == 0.0
    assert [t["function"]["name"] for t in request["body"]["tools"]] == ["guess"]


@pytest.mark.live
def test_model_mistakes_come_back_as_tool_messages_then_a_plain_answer_stops(guess_url: str) -> None:
    script = [{"role": "assistant", "content": None, "tool_calls": [_call("a", "guess", "{oops"),
                                                                     _call("b", "shout", "{}")]},
              {"role": "assistant", "content": "I give up."}]
    with ServerThread(scripted_endpoint(script), log_level="warning") as llm, OpenEnv(guess_url) as env:
        env.reset(seed=0)
        result = run_agent(ChatCompletionsClient(llm.url + "/v1"), ToolManager(EnvTool.from_env(env)),
                           [{"role": "user", "content": "play"}])
    bad_json, unknown = result.messages[2], result.messages[3]
    assert bad_json["tool_call_id"] == "a" and bad_json["content"].startswith("Error: invalid JSON")
    assert unknown["tool_call_id"] == "b" and "unknown tool 'shout'" in unknown["content"]
    assert result.stop_reason == "answer" and result.turns == 2 and result.reward == 0.0


@pytest.mark.live
def test_an_endpoint_failure_is_an_infrastructure_error(guess_url: str) -> None:
    script = [{"status": 500, "json": {"error": "overloaded"}}]
    with ServerThread(scripted_endpoint(script), log_level="warning") as llm, OpenEnv(guess_url) as env:
        env.reset(seed=0)
        with pytest.raises(EnvConnectionError, match="Expected HTTP 200 .* got 500"):
            run_agent(ChatCompletionsClient(llm.url + "/v1"), ToolManager(EnvTool.from_env(env)),
                      [{"role": "user", "content": "play"}])
