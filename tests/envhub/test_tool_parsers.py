"""The tool-call parser registry and its formats, against replies rendered as the real chat templates render them.

The samples are the assistant text (after the generation prompt, without the end-of-turn token)
that each family's chat template writes for a tool call, following the templates in
vllm-project/vllm ``examples/``: ``tool_chat_template_qwen3coder.jinja`` (Qwen3-Coder),
``tool_chat_template_llama3.1_json.jinja`` (Llama 3.1/3.2 JSON), ``tool_chat_template_mistral_parallel.jinja``
(Mistral v3 tokenizers) and the v11 Mistral template (``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}``).
"""

import json

import pytest

from envhub.parsers import ParseStatus
from envhub.tool_parsers import get_tool_parser, parser_name_for_model, register_tool_parser, tool_parser_names
from envhub.types import ToolCall

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "zip": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}}
TOOLS = [WEATHER, SEARCH]

# -- samples, as the templates render an assistant message with tool_calls --------------------------
QWEN3_CODER_TWO = ("I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>"
                   "\n<tool_call>\n<function=search>\n<parameter=query>\nline one\nline two\n</parameter>\n"
                   "<parameter=filters>\n{\"lang\": \"en\"}\n</parameter>\n</function>\n</tool_call>")
LLAMA3_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
MISTRAL_V3_TWO = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123xyz"}, '
                  '{"name": "search", "arguments": "{\\"query\\": \\"rain\\"}", "id": "def456uvw"}]')
MISTRAL_V11_TWO = ('[TOOL_CALLS]get_weather[CALL_ID]abc123xyz[ARGS]{"city": "Paris", "days": 3}'
                   '[TOOL_CALLS]search[CALL_ID]def456uvw[ARGS]{"query": "rain"}')


def parse(name, text, **kw):
    return get_tool_parser(name)(text, **kw)


def test_registry_names_family_lookup_and_errors():
    assert {"hermes", "qwen3_coder", "llama3_json", "mistral"} <= set(tool_parser_names())
    assert parser_name_for_model("Qwen/Qwen2.5-7B-Instruct") == "hermes"
    assert parser_name_for_model("Qwen/Qwen3-Coder-480B-A35B-Instruct") == "qwen3_coder"
    assert parser_name_for_model("meta-llama/Llama-3.2-3B-Instruct") == "llama3_json"
    assert parser_name_for_model("mistralai/Mistral-Small-3.2-24B-Instruct-2506") == "mistral"
    assert parser_name_for_model(None) == "hermes"
    assert get_tool_parser("auto", model_name="mistralai/Ministral-8B") is get_tool_parser("mistral")
    with pytest.raises(ValueError, match="Unknown tool parser 'hermez'.*hermes"):
        get_tool_parser("hermez")
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("hermes", lambda text, **kw: None)


def test_a_parser_registered_by_name_or_module_path_is_found():
    register_tool_parser("test_xml_only", get_tool_parser("qwen3_coder"))
    assert get_tool_parser("test_xml_only") is get_tool_parser("qwen3_coder")
    assert get_tool_parser("envhub._tool_formats:mistral") is get_tool_parser("mistral")


# -- Qwen3-Coder XML --------------------------------------------------------------------------------
def test_qwen3_coder_two_calls_typed_by_the_tool_schemas():
    p = parse("qwen3_coder", QWEN3_CODER_TWO, tools=TOOLS)
    assert p.status is ParseStatus.OK and p.content == "I'll check."
    assert p.calls == [ToolCall("get_weather", {"city": "Paris", "days": 3, "zip": "75001"}),
                       ToolCall("search", {"query": "line one\nline two", "filters": {"lang": "en"}})]


def test_qwen3_coder_without_schemas_reads_numbers_and_json_but_keeps_text():
    p = parse("qwen3_coder", QWEN3_CODER_TWO)
    assert p.calls[0].arguments == {"city": "Paris", "days": 3, "zip": 75001}
    assert p.calls[1].arguments["filters"] == {"lang": "en"}


def test_qwen3_coder_no_call_malformed_and_truncated_are_apart():
    assert parse("qwen3_coder", "It is sunny.").status is ParseStatus.NO_CALL
    bad = parse("qwen3_coder", "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>" + QWEN3_CODER_TWO[13:])
    assert bad.status is ParseStatus.MALFORMED and "<function=NAME>" in bad.errors[0]
    assert [c.name for c in bad.calls] == ["get_weather", "search"]  # the good calls are kept
    unclosed_fn = parse("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>")
    assert unclosed_fn.status is ParseStatus.MALFORMED and "not closed" in unclosed_fn.errors[0]
    cut = parse("qwen3_coder", QWEN3_CODER_TWO[:QWEN3_CODER_TWO.rindex("</parameter>")])
    assert cut.status is ParseStatus.TRUNCATED and [c.name for c in cut.calls] == ["get_weather"]
    assert parse("qwen3_coder", QWEN3_CODER_TWO, truncated=True).status is ParseStatus.TRUNCATED


# -- Llama 3.x JSON -------------------------------------------------------------------------------
def test_llama3_one_call_and_python_tag():
    assert parse("llama3_json", LLAMA3_ONE).calls == [ToolCall("get_weather", {"city": "Paris", "days": 3})]
    tagged = parse("llama3_json", "<|python_tag|>" + LLAMA3_ONE)
    assert tagged.status is ParseStatus.OK and tagged.calls[0].name == "get_weather"


def test_llama3_several_calls_separated_by_semicolons():
    text = LLAMA3_ONE + "; " + '{"name": "search", "parameters": {"query": "rain"}}'
    p = parse("llama3_json", text)
    assert [c.name for c in p.calls] == ["get_weather", "search"] and p.status is ParseStatus.OK


def test_llama3_no_call_malformed_and_truncated_are_apart():
    answer = parse("llama3_json", "It is 18 degrees in Paris.")
    assert answer.status is ParseStatus.NO_CALL and answer.content == "It is 18 degrees in Paris."
    not_a_call = parse("llama3_json", '{"city": "Paris"}')
    assert not_a_call.status is ParseStatus.MALFORMED and "tool name" in not_a_call.errors[0]
    broken = parse("llama3_json", '{"name": "get_weather", "parameters": {"city": Paris}}')
    assert broken.status is ParseStatus.MALFORMED and "invalid JSON" in broken.errors[0]
    cut = parse("llama3_json", LLAMA3_ONE[:-5])
    assert cut.status is ParseStatus.TRUNCATED and cut.calls == []
    assert parse("llama3_json", "<|python_tag|>print(1)").status is ParseStatus.MALFORMED


# -- Mistral ----------------------------------------------------------------------------------------
def test_mistral_v3_array_with_ids_and_string_arguments():
    p = parse("mistral", MISTRAL_V3_TWO)
    assert p.status is ParseStatus.OK
    assert p.calls == [ToolCall("get_weather", {"city": "Paris"}, id="abc123xyz"),
                       ToolCall("search", {"query": "rain"}, id="def456uvw")]


def test_mistral_v11_one_marker_per_call():
    p = parse("mistral", MISTRAL_V11_TWO)
    assert p.status is ParseStatus.OK
    assert p.calls == [ToolCall("get_weather", {"city": "Paris", "days": 3}, id="abc123xyz"),
                       ToolCall("search", {"query": "rain"}, id="def456uvw")]
    no_id = parse("mistral", 'Checking.[TOOL_CALLS]search[ARGS]{"query": "x"}')
    assert no_id.calls == [ToolCall("search", {"query": "x"})] and no_id.content == "Checking."


def test_mistral_no_call_malformed_and_truncated_are_apart():
    assert parse("mistral", "Paris is sunny.").status is ParseStatus.NO_CALL
    bad = parse("mistral", '[TOOL_CALLS]search[ARGS]{"query": x}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')
    assert bad.status is ParseStatus.MALFORMED and "invalid JSON" in bad.errors[0]
    assert bad.calls == [ToolCall("get_weather", {"city": "Oslo"})]
    assert parse("mistral", "[TOOL_CALLS] []").status is ParseStatus.MALFORMED
    assert parse("mistral", '[TOOL_CALLS] [{"arguments": {}}]').status is ParseStatus.MALFORMED
    cut = parse("mistral", MISTRAL_V11_TWO[:-4])
    assert cut.status is ParseStatus.TRUNCATED and [c.name for c in cut.calls] == ["get_weather"]


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "llama3_json", "mistral"])
@pytest.mark.parametrize("garbage", [None, 42, "", "<tool_call>", "[TOOL_CALLS]", "{" * 5000, "\x00\uffff"])
def test_garbage_is_data_never_an_exception(name, garbage):
    p = parse(name, garbage)
    assert p.status in set(ParseStatus)
    json.dumps([c.arguments for c in p.calls])
