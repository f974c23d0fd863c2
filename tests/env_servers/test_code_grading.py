"""Host-side grading of the code env: typed encoding, report parsing, comparison, reward modes (pure, no sandbox)."""

from __future__ import annotations

import pytest

from env_servers.code_env import grading


def test_typed_encoding_tells_bool_int_and_float_apart():
    assert not grading.values_match(grading.encode_value(True), grading.encode_value(1))
    assert not grading.values_match(grading.encode_value(1), grading.encode_value(1.0))
    assert grading.values_match(grading.encode_value(0.1 + 0.2), grading.encode_value(0.3))
    assert grading.values_match(grading.encode_value((1, [2, {"a": None}])), grading.encode_value([1, [2, {"a": None}]]))
    assert not grading.values_match(grading.encode_value({1, 2}), grading.encode_value([1, 2]))


def test_subclasses_and_custom_objects_are_refused():
    class AlwaysEqual(int):
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError, match="unsupported return type AlwaysEqual"):
        grading.encode_value(AlwaysEqual(3))
    with pytest.raises(TypeError, match="unsupported return type object"):
        grading.encode_value([object()])


def test_decode_round_trips_examples():
    value = {"k": [1, 2.5, "s", None, True], (1, 2): {3}}
    assert grading.decode_value(grading.encode_value(value)) == {"k": [1, 2.5, "s", None, True], (1, 2): {3}}


def test_parse_call_output_ignores_lines_without_the_nonce_and_keeps_one_report_per_test():
    stdout = ("hello\nabc 0 ok {\"int\": \"1\"}\n"
              "n1 0 ok {\"int\": \"5\"}\nn1 0 ok {\"int\": \"6\"}\nn1 2 error ZeroDivisionError\nn1 9 ok {}\nn1 1 ok {bad\n")
    reports = grading.parse_call_output(stdout, "n1", 4)
    assert reports == [("ok", {"int": "5"}), ("error", "unparsable output"), ("error", "ZeroDivisionError"), None]


def test_stdout_comparison_ignores_trailing_whitespace_only():
    assert grading.stdout_matches("1 2 \n3\n\n", "1 2\n3")
    assert not grading.stdout_matches("1  2\n3", "1 2\n3")
    assert not grading.stdout_matches("", "0")


def test_score_modes():
    assert grading.score(3, 4) == 0.75
    assert grading.score(3, 4, "all_or_nothing") == 0.0
    assert grading.score(4, 4, "all_or_nothing") == 1.0
    assert grading.score(0, 0) == 0.0


def test_harness_embeds_inputs_never_expected_outputs():
    code, nonce = grading.call_harness("def f(x): return x", "f", [[1], [2]])
    assert nonce in code and "[[1], [2]]" in code
    compile(code, "harness", "exec")
