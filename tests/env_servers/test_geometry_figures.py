"""Diagram-only geometry problems (``figure``, ``measure``): the answer is in the picture or a tool, never the text."""

from __future__ import annotations

import asyncio
import io
import random

import pytest
from PIL import Image

from env_servers.geometry_env import GeometryEnv, figures
from env_servers.geometry_env.render import render_png
from envhub import Action
from envhub.env import EnvRunner


@pytest.mark.parametrize("kind", figures.KINDS)
def test_validation_is_balanced_over_the_answers_and_the_statement_never_gives_them(kind: str) -> None:
    answers = figures.ANSWERS[kind]
    problems = [figures.problem_at(i, split="validation", kind=kind) for i in range(3 * len(answers))]
    assert [p.answer for p in problems] == [answers[i % len(answers)] for i in range(len(problems))]
    assert all(p.split == "validation" for p in problems)
    assert len({p.problem_id for p in problems}) == len(problems)
    if kind == "figure":
        assert {p.statement for p in problems} == {figures.FIGURE_STATEMENT}
    assert not any(p.answer in p.statement.split() for p in problems)


@pytest.mark.parametrize(("kind", "reply"), [("figure", "boxed"), ("measure", "boxed"), ("measure", "number")])
def test_train_and_validation_figures_never_share_a_problem(kind: str, reply: str) -> None:
    rng = random.Random(0)
    train = {figures.generate(rng, split="train", kind=kind, reply=reply).problem_id for _ in range(200)}
    validation = {figures.problem_at(i, split="validation", kind=kind, reply=reply).problem_id for i in range(60)}
    assert not train & validation


def test_a_triangle_keeps_its_split_and_id_whichever_reply_format_its_statement_asks_for() -> None:
    for split in ("train", "validation"):
        boxed, number = (figures.problem_at(7, split=split, kind="measure", side="BC", reply=r) for r in ("boxed", "number"))
        assert (number.problem_id, number.split, number.answer) == (boxed.problem_id, split, boxed.answer)
        assert number.diagram == boxed.diagram
        assert (boxed.statement, number.statement) == ("How long is BC? Reply \\boxed{length}.",
                                                       "How long is BC? Reply with the length alone.")
    with pytest.raises(ValueError, match="reply"):
        figures.problem_at(0, kind="measure", reply="words")


def test_the_three_figures_shade_different_parts_of_the_picture() -> None:
    def ink(answer: str) -> float:
        _, diagram = figures.BUILDERS["figure"](random.Random(1), answer)
        grey = Image.open(io.BytesIO(render_png(diagram, 168))).convert("L")
        return sum(grey.histogram()[:200]) / (168 * 168)

    # polygons are shaded (a quadrilateral covers more than a triangle), circles only outlined
    assert ink("c") < ink("t") < ink("q")


def test_a_reply_names_a_choice_with_its_first_word() -> None:
    choices = ("t", "q", "c")
    assert figures.choice_of("t", choices) == "t"
    assert figures.choice_of(" Quadrilateral!", choices) == "q"
    assert figures.choice_of("x t", choices) is None and figures.choice_of("", choices) is None


def test_the_ruler_reads_the_asked_side_and_refuses_a_segment_the_diagram_lacks() -> None:
    problem = figures.problem_at(5, split="validation", kind="measure")
    side = problem.statement.split()[3].rstrip("?")
    assert f"{figures.segment_length(problem.diagram, side):.6f}" == f"{float(problem.answer):.6f}"
    with pytest.raises(ValueError, match="two point names"):
        figures.segment_length(problem.diagram, "AZ")


def test_single_mode_grades_a_figure_answer_by_its_letter_with_named_components() -> None:
    async def answer(text: str) -> dict:
        runner = EnvRunner(GeometryEnv(mode="single", instruction="", image_size=168))
        first = await runner.reset(split="validation", kind="figure", index=1)
        assert first.observation.text == figures.FIGURE_STATEMENT and first.observation.images
        return (await runner.step(Action(text=text).model_dump(exclude_none=True))).info

    right, wrong, garbled = (asyncio.run(answer(t)) for t in ("q", "circle", "hmm"))
    assert right["rewards"] == {"accuracy": 1.0, "format": 1.0}
    assert wrong["rewards"] == {"accuracy": 0.0, "format": 1.0}
    assert garbled["rewards"] == {"accuracy": 0.0, "format": 0.0}


def test_tools_mode_measure_then_answer_scores_the_reading() -> None:
    async def episode() -> tuple[str, float, dict]:
        runner = EnvRunner(GeometryEnv(mode="tools", instruction="", max_attempts=1, max_turns=2))
        first = await runner.reset(split="validation", kind="measure", index=2)
        side = first.observation.text.split()[3].rstrip("?")
        reading = await runner.step({"tool_name": "measure", "arguments": {"segment": side}})
        final = await runner.step({"text": f"\\boxed{{{reading.observation.text}}}"})
        return reading.observation.text, final.reward, final.info

    reading, reward, info = asyncio.run(episode())
    assert reading == figures.ANSWERS["measure"][2] and reward == 1.0
    assert info["rewards"] == {"accuracy": 1.0, "closeness": 1.0, "measured": 1.0}


def test_the_number_format_takes_a_number_alone_as_the_answer_and_the_statement_asks_for_it() -> None:
    async def answer(text: str) -> tuple[str, dict]:
        runner = EnvRunner(GeometryEnv(mode="tools", instruction="", max_attempts=1, max_turns=2,
                                       answer_format="number"))
        first = await runner.reset(split="validation", kind="measure", index=4)  # index 4: length 6
        final = await runner.step({"text": text})
        return first.observation.text, final.info

    statement, right = asyncio.run(answer(" 6\n"))
    assert statement.endswith("Reply with the length alone.") and right["correct"] is True
    assert asyncio.run(answer("\\boxed{6}"))[1]["correct"] is True
    assert "correct" not in asyncio.run(answer("6 cm"))[1]  # not an answer: the turn asks again
    with pytest.raises(ValueError, match="answer_format"):
        GeometryEnv(mode="single", answer_format="number")


def test_measure_reward_goes_to_the_first_turn_that_reads_the_asked_side() -> None:
    env = GeometryEnv(mode="tools", instruction="", max_attempts=1, max_turns=4, measure_side="BC", measure_reward=0.5)
    env.reset(split="validation", kind="measure", index=3)
    rewards = [env.measure(segment).reward for segment in ("AB", "cb", "BC")]
    assert rewards == [0.0, 0.5, 0.0]  # another side earns nothing, the asked one once (in either direction)
    final = env.submit_answer("1")
    assert final.reward == 0.0 and final.info["rewards"]["measured"] == 1.0
    env.reset(split="validation", kind="measure", index=3)
    assert env.submit_answer(env.current_problem().answer).info["rewards"]["measured"] == 0.0
    with pytest.raises(ValueError, match="measure_reward"):
        GeometryEnv(measure_reward=-0.1)


@pytest.mark.parametrize(("weight", "answer", "reward"), [(0.0, "5", 0.0), (1.0, "5", 6 / 7), (1.0, "x", 0.0),
                                                          (0.5, "6", 1.5)])
def test_closeness_shapes_the_reward_by_its_weight_and_accuracy_stays_exact(weight: float, answer: str,
                                                                            reward: float) -> None:
    async def episode() -> tuple[float, dict]:
        runner = EnvRunner(GeometryEnv(mode="tools", instruction="", max_attempts=1, max_turns=2,
                                       closeness_weight=weight))
        await runner.reset(split="validation", kind="measure", index=4)  # index 4: length 6
        final = await runner.step({"text": f"\\boxed{{{answer}}}"})
        return final.reward, final.info["rewards"]

    got, rewards = asyncio.run(episode())
    assert got == pytest.approx(reward)
    assert rewards["accuracy"] == float(answer == "6")
    assert rewards["closeness"] == pytest.approx(figures.closeness(answer, "6"))


def test_closeness_is_one_minus_the_distance_over_the_spread_of_lengths() -> None:
    assert figures.closeness("6", "6") == 1.0 and figures.closeness("2", "9") == 0.0
    assert figures.closeness("8", "6") == pytest.approx(5 / 7)
    assert figures.closeness(None, "6") == 0.0 and figures.closeness("nan", "6") == 0.0
    with pytest.raises(ValueError, match="closeness_weight"):
        GeometryEnv(closeness_weight=-1.0)


def test_measure_side_fixes_the_asked_side_and_the_ruler_still_reads_it() -> None:
    env = GeometryEnv(mode="tools", instruction="", max_attempts=1, max_turns=2, measure_side="CA")
    statements = {env.reset(split="validation", kind="measure", index=i).text for i in range(8)}
    env.rng = random.Random(0)  # what a runner's reset(seed=...) sets
    statements |= {env.reset(split="train", kind="measure").text for _ in range(8)}
    assert statements == {"How long is CA? Reply \\boxed{length}."}
    assert env.measure("CA").observation.text == env.current_problem().answer
    assert figures.problem_at(3, split="validation", kind="measure", side="CA").answer == figures.ANSWERS["measure"][3]
    with pytest.raises(ValueError, match="measure_side"):
        GeometryEnv(measure_side="AC")
    with pytest.raises(ValueError, match="for the measure kind"):
        figures.problem_at(0, kind="figure", side="AB")
