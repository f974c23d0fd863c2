"""Model-output parsers: tool-call blocks, \\boxed{} answers, XML tags, Hermes rendering."""

import json

import pytest

from envhub.parsers import (
    ParseStatus,
    decode_arguments,
    extract_boxed,
    extract_tag,
    extract_tags,
    format_tool_call,
    format_tool_response,
    parse_tool_calls,
)
from envhub.types import ToolCall


def block(obj) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"<tool_call>\n{body}\n</tool_call>"


# -- parse_tool_calls ---------------------------------------------------------------------------
def test_plain_answer_is_no_call():
    p = parse_tool_calls("The answer is 4.")
    assert p.status is ParseStatus.NO_CALL
    assert p.calls == [] and p.errors == []
    assert p.content == "The answer is 4."


def test_single_call_and_surrounding_content():
    text = "Let me guess.\n" + block({"name": "guess", "arguments": {"number": 50}})
    p = parse_tool_calls(text)
    assert p.status is ParseStatus.OK and p.ok
    assert p.calls == [ToolCall("guess", {"number": 50})]
    assert p.content == "Let me guess."


def test_parallel_calls_keep_order():
    text = block({"name": "a", "arguments": {}}) + "\n" + block({"name": "b", "arguments": {"x": 1}})
    p = parse_tool_calls(text)
    assert [c.name for c in p.calls] == ["a", "b"]
    assert p.calls[1].arguments == {"x": 1}


@pytest.mark.parametrize("encoded", [
    json.dumps({"q": "x"}),                  # OpenAI-style string arguments
    json.dumps(json.dumps({"q": "x"})),      # double-encoded (a Qwen2.5 habit)
])
def test_string_arguments_decoded_up_to_two_levels(encoded):
    text = '<tool_call>{"name": "search", "arguments": ' + json.dumps(encoded) + "}</tool_call>"
    p = parse_tool_calls(text)
    assert p.status is ParseStatus.OK
    assert p.calls[0].arguments == {"q": "x"}


def test_triple_encoded_arguments_are_rejected_not_crashing():
    enc = json.dumps(json.dumps(json.dumps({"q": "x"})))
    p = parse_tool_calls('<tool_call>{"name": "s", "arguments": ' + json.dumps(enc) + "}</tool_call>")
    assert p.status is ParseStatus.MALFORMED
    assert "JSON object" in p.errors[0]


def test_parameters_alias_and_missing_arguments():
    p = parse_tool_calls(block({"name": "a", "parameters": {"k": 2}}) + block({"name": "b"}))
    assert p.calls == [ToolCall("a", {"k": 2}), ToolCall("b", {})]


def test_each_block_parsed_on_its_own():
    text = block({"name": "good", "arguments": {}}) + block("{not json") + block({"name": "also", "arguments": {}})
    p = parse_tool_calls(text)
    assert p.status is ParseStatus.MALFORMED
    assert [c.name for c in p.calls] == ["good", "also"]
    assert len(p.errors) == 1 and "invalid JSON" in p.errors[0]


@pytest.mark.parametrize("body,needle", [
    ('[1, 2]', "JSON object"),
    ('{"arguments": {}}', "'name'"),
    ('{"name": 5, "arguments": {}}', "'name'"),
    ('{"name": "x", "arguments": [1]}', "'arguments'"),
    ('{"name": "x", "arguments": "plain words"}', "'arguments'"),
    ('', "invalid JSON"),
])
def test_malformed_blocks_report_why(body, needle):
    p = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert p.status is ParseStatus.MALFORMED
    assert p.calls == []
    assert needle in p.errors[0]


def test_unterminated_final_block_is_truncated_and_not_executed():
    text = block({"name": "a", "arguments": {}}) + '\n<tool_call>\n{"name": "b", "argum'
    p = parse_tool_calls(text)
    assert p.status is ParseStatus.TRUNCATED
    assert [c.name for c in p.calls] == ["a"]
    assert "unterminated" in p.errors[0]


def test_length_capped_turn_with_calls_is_truncated():
    p = parse_tool_calls(block({"name": "a", "arguments": {}}), truncated=True)
    assert p.status is ParseStatus.TRUNCATED
    assert parse_tool_calls("just text", truncated=True).status is ParseStatus.NO_CALL


def test_fenced_json_inside_block_is_accepted():
    p = parse_tool_calls('<tool_call>```json\n{"name": "a", "arguments": {"x": 1}}\n```</tool_call>')
    assert p.calls == [ToolCall("a", {"x": 1})]


def test_stray_closing_tag_is_malformed():
    p = parse_tool_calls("hello </tool_call>")
    assert p.status is ParseStatus.MALFORMED
    assert p.content == "hello"


@pytest.mark.parametrize("garbage", [None, 42, b"<tool_call>", "<tool_call>" * 3, "\x00\uffff", "{" * 5000])
def test_garbage_never_raises(garbage):
    p = parse_tool_calls(garbage)
    assert p.status in set(ParseStatus)


def test_deeply_nested_json_is_an_error_not_a_crash():
    p = parse_tool_calls("<tool_call>" + "[" * 100000 + "]" * 100000 + "</tool_call>")
    assert p.status is ParseStatus.MALFORMED


def test_decode_arguments():
    assert decode_arguments(None) == {}
    assert decode_arguments('{"a": 1}') == {"a": 1}
    assert decode_arguments("not json") == "not json"
    assert decode_arguments({"a": 1}) == {"a": 1}


# -- extract_boxed: the one table (math and geometry grading use the same function) -------------
@pytest.mark.parametrize("text,expected", [
    (r"\boxed{4}", "4"),
    (r"The answer is \boxed{5}.", "5"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"first \boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"nested \boxed{\frac{a}{\sqrt{b}}} done", r"\frac{a}{\sqrt{b}}"),
    (r"$\boxed{x^{2}+\sqrt{3}}$", r"x^{2}+\sqrt{3}"),
    (r"\boxed{(1, 2)}", "(1, 2)"),
    (r"\boxed{ 6 }", "6"),
    (r"\fbox{7}", "7"),
    (r"so $\boxed 5$.", "5"),
    (r"so $\boxed 5$ is it", "5"),
    (r"\boxed 12 apples", "12"),
    (r"\boxed{3} and then \boxed{4", "3"),  # an unclosed last box falls back to the complete one
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text", ["no box here", r"\boxed{unclosed", r"\boxedx", "", None, 3, r"\boxed ",
                                  r"\boxed", r"\boxed{}", r"empty \boxed{ }", r"\boxed{3} then \boxed{}"])
def test_extract_boxed_none(text):
    assert extract_boxed(text) is None


def test_math_grading_uses_the_same_extract_boxed():
    grading = pytest.importorskip("env_servers.math_grading.grading")
    assert grading.extract_boxed is extract_boxed
    assert grading.grade(r"\boxed{3} and then \boxed{4", "3").correct


# -- tags ---------------------------------------------------------------------------------------
def test_extract_tag_last_and_first():
    text = "<think>hmm</think><move>1,1</move> wait <move> 3,4 </move>"
    assert extract_tag(text, "move") == "3,4"
    assert extract_tag(text, "move", last=False) == "1,1"
    assert extract_tag(text, "think") == "hmm"
    assert extract_tags(text, "move") == ["1,1", "3,4"]


def test_extract_tag_multiline_case_and_attributes():
    assert extract_tag("<ANSWER>\n42\n</answer>", "answer") == "42"
    assert extract_tag('<answer type="int">7</answer>', "answer") == "7"


def test_extract_tag_missing_or_unclosed():
    assert extract_tag("<move>3,4", "move") is None
    assert extract_tag("nothing", "move") is None
    assert extract_tag(None, "move") is None
    assert extract_tags("<a>1</a>", "") == []
    assert extract_tag("<a.b>1</a.b>", "a.b") == "1"  # regex characters in tag names are literal


# -- render helpers -----------------------------------------------------------------------------
def test_format_tool_call_matches_template_and_round_trips():
    call = ToolCall("guess", {"number": 3, "note": "héllo"})
    text = format_tool_call(call)
    assert text == '<tool_call>\n{"name": "guess", "arguments": {"number": 3, "note": "héllo"}}\n</tool_call>'
    assert parse_tool_calls(text).calls == [call]


def test_format_tool_call_never_renders_string_arguments():
    openai = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert format_tool_call(openai) == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def test_format_tool_response():
    assert format_tool_response("Higher.") == "<tool_response>\nHigher.\n</tool_response>"
