"""Geometry domain code: problem generator, diagram rendering, safe calculator, geometry3k loader."""

import base64
import io
import json
import random
import time

import pytest
from PIL import Image

from env_servers.datasets import SPLITS, split_of
from env_servers.geometry_env import calculator, loaders
from env_servers.geometry_env.calculator import CALCULATE_TIMEOUT_S, CalculatorError
from env_servers.geometry_env.problems import FAMILIES, KINDS, generate, problem_at
from env_servers.geometry_env.render import render_png
from env_servers.math_grading import bounded
from env_servers.math_grading.expressions import numeric_value, parse_expression
from env_servers.math_grading.grading import is_equiv


@pytest.fixture
def warm_worker():
    """An idle deadline worker, so timings measure evaluation, not interpreter start-up."""
    assert bounded.call("env_servers.math_grading.expressions:is_cheap", "1", timeout_s=30) is True


@pytest.mark.parametrize("kind", KINDS)
def test_each_family_renders_and_has_a_parsable_answer(kind):
    problem = generate(random.Random(11), kind=kind, split="validation")
    assert split_of(problem.statement) == "validation" and problem.difficulty == FAMILIES[kind][0]
    assert is_equiv(problem.answer, problem.answer)
    image = Image.open(io.BytesIO(render_png(problem.diagram, 256)))
    assert image.format == "PNG" and image.size == (256, 256)
    assert len(set(image.convert("L").getdata())) > 2, "the diagram should have drawn something"


def test_answers_agree_with_the_geometry():
    rng = random.Random(5)
    for _ in range(20):
        p = generate(rng, kind="triangle_area")
        a, b, c = [int(s.split(" = ")[1]) for s in p.statement.split(". ")[0].split("sides ")[1]
                   .replace(" and ", ", ").split(", ")]
        s = (a + b + c) / 2
        heron = (s * (s - a) * (s - b) * (s - c)) ** 0.5
        assert numeric_value(parse_expression(p.answer)).real == pytest.approx(heron)
    for _ in range(20):
        p = generate(rng, kind="triangle_angle")
        angles = [int(w) for w in p.statement.replace(",", " ").split() if w.isdigit()]
        assert int(p.answer) == 180 - sum(angles)


def test_problem_at_is_deterministic_and_difficulty_filters_kinds():
    assert problem_at(3, split="test") == problem_at(3, split="test")
    levels = {problem_at(i, difficulty=1).kind for i in range(30)}
    assert levels <= {k for k, (level, _) in FAMILIES.items() if level == 1}
    with pytest.raises(ValueError, match="difficulty 3"):
        generate(random.Random(0), kind="law_of_sines", difficulty=1)


def test_splits_do_not_share_statements():
    seen = {s: {generate(random.Random(i), split=s).statement for i in range(150)} for s in SPLITS}
    assert not (seen["train"] & seen["validation"]) and not (seen["train"] & seen["test"])


@pytest.mark.parametrize("expression, expected", [
    ("sqrt(3**2 + 4**2)", "5"), ("2*sqrt(50)", "10*sqrt(2) ≈ 14.14213562"), ("8*sind(30)", "4"),
    ("acosd(1/2)", "60"), (r"\frac{180(7-2)}{7}", "900/7 ≈ 128.5714286"), ("pi*3^2", "9*pi ≈ 28.27433388"),
])
def test_calculate_is_exact_with_a_decimal(expression, expected):
    assert calculator.calculate(expression) == expected


@pytest.mark.parametrize("hostile", [
    "__import__('os').system('id')", "open('/etc/passwd').read()", "().__class__.__mro__", "9^9^9^9",
    "2^2^2^2^2^2", "10^(10^10)", "x" * 1000, "exp(10^6)", "lambda: 0", "__builtins__", "1/0", "",
    "sqrt(" * 100 + "2" + ")" * 100, "globals()", "a.b",
])
def test_calculate_rejects_malicious_or_huge_input_fast(hostile, warm_worker):
    start = time.monotonic()
    with pytest.raises(CalculatorError):
        calculator.calculate(hostile)
    assert time.monotonic() - start < CALCULATE_TIMEOUT_S + 1.5


def test_slow_evaluations_hit_the_deadline(warm_worker):
    with pytest.raises(CalculatorError, match="longer than"):
        calculator.calculate("(abs(2^9 - (3 - y)))^((floor(2^60)/log(i))/sqrt(asin(3)))", timeout_s=0.2)
    assert calculator.calculate("cosd(60) + asin(1)") == "1/2 + pi/2 ≈ 2.070796327"


def test_geometry_helpers_are_exact_and_validate_input():
    fmt = calculator.format_value
    assert fmt(calculator.law_of_cosines(5, 8, 60)) == "7"
    assert fmt(calculator.law_of_sines(8, 120, 30)) == "8*sqrt(3)/3 ≈ 4.618802154"
    assert fmt(calculator.triangle_area(3, 4, 5)) == "6"
    assert fmt(calculator.polygon_interior_angle(6)) == "120"
    assert fmt(calculator.arc_length(3, 60)) == "pi ≈ 3.141592654"
    with pytest.raises(CalculatorError, match="triangle inequality"):
        calculator.triangle_area(1, 2, 10)
    with pytest.raises(CalculatorError, match="180"):
        calculator.law_of_cosines(1, 1, 200)


def _png():
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(buf, format="PNG")
    return buf.getvalue()


def test_geometry3k_exported_table(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"problem": "<image>Find x.", "answer": "7.8",
                                "images": [base64.b64encode(_png()).decode()]}) + "\n")
    (problem,) = loaders.load(str(path), "test")
    assert problem.statement == "Find x." and problem.answer == "7.8" and problem.image_png == _png()


def test_geometry3k_original_layout_maps_the_choice_letter(tmp_path):
    item = tmp_path / "val" / "2101"
    item.mkdir(parents=True)
    (item / "data.json").write_text(json.dumps({"problem_text": "Find y.", "choices": ["3", "4", "5", "6"],
                                                "answer": "C"}))
    (item / "img_diagram.png").write_bytes(_png())
    (problem,) = loaders.load(str(tmp_path), "validation")
    assert problem.answer == "5" and problem.image_png == _png()
    with pytest.raises(FileNotFoundError, match="train"):
        loaders.load(str(tmp_path), "train")
