"""Grading of math answers: extraction, normalisation, sympy equivalence, hostile input."""

import time

import pytest

from env_servers.math_grading import bounded, grading
from env_servers.math_grading.expressions import ExpressionError, is_cheap, parse_expression, try_parse
from env_servers.math_grading.grading import (
    GRADE_TIMEOUT_S,
    grade,
    grade_answer,
    has_think_then_boxed,
    is_equiv,
    strip_string,
)


@pytest.fixture
def warm_worker():
    """An idle deadline worker, so timings below measure grading, not interpreter start-up."""
    assert bounded.call("env_servers.math_grading.expressions:is_cheap", "1", timeout_s=30) is True


@pytest.mark.parametrize("raw, normalised", [
    (r"\dfrac{1}{2}", r"\frac{1}{2}"), (r"\tfrac12", r"\frac{1}{2}"), ("0.5", r"\frac{1}{2}"),
    ("1/2", r"\frac{1}{2}"), (r"\left( 1, 2 \right)", "(1,2)"), (r"90^\circ", "90"), (r"\$5", "5"),
    (r"50\%", "50"), ("x = 3", "3"), (r"\sqrt3", r"\sqrt{3}"), (r"12\text{ cm}", "12"), (".25", "0.25"),
])
def test_strip_string_applies_hendrycks_normalisation(raw, normalised):
    assert strip_string(raw) == normalised


@pytest.mark.parametrize("prediction, truth", [
    (r"\frac{1}{2}", "0.5"), ("0.5", r"\frac{1}{2}"), ("1/2", r"\frac{1}{2}"), (r"50\%", r"\frac{1}{2}"),
    (r"\dfrac12", "1/2"), ("x=3", "3"), ("(1, 2)", "(1,2)"), ("2, -3", "-3, 2"), (r"2\sqrt{2}", r"\sqrt{8}"),
    (r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2"), (r"\frac{\pi}{2}", r"\pi/2"), ("1,000", "1000"), ("x^2+2x+1", "(x+1)^2"),
    ("30^\\circ", "30"), ("12 cm", "12"), (r"5\text{cm}^2", "5"), (r"12\,\mathrm{cm}^{2}", "12"),
    ("[0, 1)", "[0,1)"), (r"(-\infty, 3]", r"(-\infty,3]"), ("5.00", "5"),
    ("1+2i", "2i+1"), (r"\text{(A)}", "(A)"), (r"\pm 5", "5, -5"), (r"2 \pm \sqrt{3}", r"2-\sqrt{3}, 2+\sqrt{3}"),
    ("−4", "-4"), ("3π", r"3\pi"), ("√2", r"\sqrt{2}"),
])
def test_equivalent_notations_are_correct(prediction, truth):
    assert is_equiv(prediction, truth)


@pytest.mark.parametrize("prediction, truth", [
    ("1", "10"), ("10", "1"), ("(2, 1)", "(1, 2)"), ("[0, 1]", "[0, 1)"), ("0.333", r"\frac{1}{3}"),
    ("1.414", r"\sqrt{2}"), ("x+1", "x+2"), ("hello", "3"), ("", "3"), ("3", ""), ("2, 3", "2, 3, 4"),
    (r"\pm 5", "5"),
])
def test_different_values_are_wrong(prediction, truth):
    assert not is_equiv(prediction, truth)


@pytest.mark.parametrize("prediction, truth, same", [
    (r"\frac{9}{4}", r"2\frac{1}{4}", True), ("2.25", r"2\frac14", True), (r"-2\frac{1}{4}", "-2.25", True),
    ("2 1/4", r"\frac{9}{4}", True), (r"1\frac{1}{2}, 3", r"3, \frac{3}{2}", True),
    (r"\frac{1}{2}", r"2\frac{1}{4}", False),  # a mixed number is not the product 2 * 1/4
    ("2 1/4", r"\frac{21}{4}", False),  # nor 21/4 once its space is removed
    (r"2\frac{\sqrt{3}}{2}", r"\sqrt{3}", True),  # a coefficient times a non-integer fraction stays a product
])
def test_mixed_numbers_are_a_whole_plus_a_fraction(prediction, truth, same):
    assert is_equiv(prediction, truth) is same


def test_relative_tolerance_accepts_rounded_decimals_only_when_asked():
    assert not is_equiv("4.359", r"\sqrt{19}")
    assert is_equiv("4.359", r"\sqrt{19}", rel_tol=1e-3)


@pytest.mark.parametrize("hostile", [
    "9^9^9^9", r"10^{10^{100}}", r"(2^{1000})^{1000}", "9" * 5000, "(" * 300 + "1" + ")" * 300,
    "__import__('os').system('echo hi')", "().__class__.__bases__[0]", r"\exp(10^{50})", "2^" * 150 + "2",
    "x^{10^{20}}", "lambda: 1", "[x for x in range(10**9)]", ",".join(["1"] * 5000), "\\frac{" * 3000,
    "1" + " " * 20000 + "x", ",".join([" " * 3000] * 10),  # whitespace runs: 50 s and 9 s while normalising was quadratic
])
def test_hostile_answers_are_graded_quickly_and_never_raise(hostile, warm_worker):
    start = time.monotonic()
    assert not is_equiv(hostile, "1")
    assert grade(rf"\boxed{{{hostile}}}", "1").correct is False
    assert time.monotonic() - start < 2 * GRADE_TIMEOUT_S + 1.0


def test_a_reply_of_unclosed_boxes_is_read_in_one_pass():
    start = time.monotonic()  # each unclosed box was scanned to the end of the reply: 47 s for this one
    assert grade(r"\boxed{1} " + r"\boxed{" * 20000, "1").correct
    assert time.monotonic() - start < 2 * GRADE_TIMEOUT_S + 1.0


@pytest.mark.parametrize("slow", [
    "(abs(((2^9)-(3-x)))^((floor(2^{60})/log(i))/sqrt(asin(3))))", r"(\sqrt{2} \cdot 99)^{y-10^{64}}",
])
def test_expensive_sympy_evaluation_is_cut_off_by_the_deadline(slow, warm_worker, monkeypatch):
    monkeypatch.setattr(grading, "GRADE_TIMEOUT_S", 0.5)
    assert not is_cheap(slow)
    start = time.monotonic()
    assert is_equiv(slow, "2") is False  # in process, this one runs for minutes
    assert time.monotonic() - start < 0.5 + 1.5


def test_transcendental_answers_are_still_graded_through_the_worker(warm_worker):
    assert is_equiv(r"\sin(\pi/6)", r"\frac{1}{2}")
    assert is_equiv(r"\log(e^2)", "2")
    assert not is_equiv(r"\cos(0)", "0")


def test_parse_expression_rejects_exponent_towers_with_a_reason():
    with pytest.raises(ExpressionError, match="bits"):
        parse_expression("9^9^9^9")
    assert try_parse("9^9^9^9") is None
    assert str(parse_expression(r"\frac{\sqrt{8}}{2}")) == "sqrt(2)"


def test_grade_reports_the_parsed_answer():
    verdict = grade(r"I think it's $\boxed{\dfrac{1}{2}}$.", "0.5")
    assert verdict.correct and verdict.parsed == r"\dfrac{1}{2}"
    assert grade("no box, just 0.5", "0.5") == grade("", "0.5")
    assert not grade("no box, just 0.5", "0.5").has_answer


def test_grade_answer_accepts_bare_or_boxed_answers():
    assert grade_answer("x = 3", "3").correct
    assert grade_answer(r"\boxed{3}", "3").correct
    assert not grade_answer("   ", "3").has_answer


def test_think_then_boxed_format():
    assert has_think_then_boxed(r"<think>add them</think> so \boxed{8}")
    assert not has_think_then_boxed(r"\boxed{8} <think>late</think>")
    assert not has_think_then_boxed(r"<think>no answer</think>")
