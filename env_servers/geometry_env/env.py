r"""``GeometryEnv``: geometry problems with a rendered diagram, calculator tools and a verifier.

Two modes (config ``mode``):

* ``"tools"`` (default, multi-turn): the model may call ``calculate`` and the geometry helpers,
  then ``submit_answer(answer)`` (or writes ``\boxed{}`` in a text turn). Each submission gets
  the feedback ``Current parsed answer=… reward=…``; a wrong non-final attempt costs
  ``wrong_attempt_reward`` (−0.05), the final attempt's reward is its correctness (1 or 0), and
  the episode ends when an answer is right or ``max_attempts`` (3) are used. Episode returns:
  1.0, 0.95, 0.9 or −0.1. On the ``measure`` kind the final answer also reports ``closeness`` (how
  near the answered length is) and ``closeness_weight`` (0) of it is added to the reward, a shaping signal.
  ``measure_reward`` (0) is the reward of the turn that first reads the asked side with the ruler (the
  ``measured`` component), a shaping signal for the call that per-turn credit can give to that turn alone.
  ``answer_format = "number"`` also takes a text turn that is a number alone (``7``) as the answer, and the
  ``measure`` statement asks for that instead of ``\boxed{}``: an answer turn of one or two tokens.
* ``"single"``: one text turn, reward ``0.9 × accuracy + 0.1 × format`` where the format is
  ``<think>…</think>`` followed by ``\boxed{}`` (for a multiple-choice problem, such as the
  ``figure`` kind: a first word naming one of its choices).

Diagram-only kinds (:mod:`env_servers.geometry_env.figures`): ``figure`` (which figure is drawn)
and ``measure`` (a side only the ``measure`` tool, a ruler on the diagram, reads); their statements
never give the answer. ``instruction=""`` drops the mode's instruction after the statement.

The first observation carries the statement and instruction (``text``), the diagram as PNG
(``images[0]``) and the system prompt (``metadata["system_prompt"]``). Grading is
:mod:`env_servers.math_grading.grading`, the same code as the math env.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any

from env_servers.geometry_env import calculator, figures, loaders, problems
from env_servers.geometry_env.calculator import CalculatorError
from env_servers.geometry_env.problems import GeometryProblem
from env_servers.geometry_env.render import render_png_cached
from env_servers.math_grading.grading import GradeResult, extract_boxed, grade, grade_answer, has_think_then_boxed
from envhub import Env, Observation, StepResult, tool
from envhub.config import from_kwargs
from envhub.errors import ActionValidationError, EpisodeStateError

SINGLE_INSTRUCTION = ("You FIRST think about the reasoning process as an internal monologue and then provide the "
                      "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. "
                      "The final answer MUST BE put in \\boxed{}.")
TOOLS_INSTRUCTION = "Use the tools if they help, then submit your final answer with submit_answer."
SINGLE_SYSTEM_PROMPT = "You are a geometry expert. You are given a geometry problem with a diagram. Solve it."
TOOLS_SYSTEM_PROMPT = (
    "You are a geometry expert. You are given a geometry problem with a diagram. Solve it step by step. "
    "You can use the calculate tool and the geometry helpers (law_of_cosines, law_of_sines, triangle_area, "
    "polygon_interior_angle, arc_length). Submit your answer with submit_answer (or write it in \\boxed{}). "
    "If it is incorrect you will see the parsed answer and the reward, and you can try again.")
MODES = ("tools", "single")
ANSWER_FORMATS = ("boxed", "number")
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")


@dataclass
class GeometryConfig:
    """Settings of :class:`GeometryEnv` (constructor keyword arguments)."""

    mode: str = "tools"
    max_attempts: int = 3
    wrong_attempt_reward: float = -0.05
    max_turns: int = 12
    accuracy_weight: float = 0.9
    format_weight: float = 0.1
    # tools mode, the ``measure`` kind: the final reward adds closeness_weight x closeness (how near the
    # answered length is; a shaping signal for training, reported as a component; accuracy stays the score)
    closeness_weight: float = 0.0
    # the ``measure`` kind: the reward of the turn that first reads the asked side (a shaping signal for tool use)
    measure_reward: float = 0.0
    measure_side: str | None = None  # the side every ``measure`` problem asks for ("AB", "BC", "CA"); None: random
    # tools mode: "boxed" (a text turn answers in \boxed{}) or "number" (a number alone answers too)
    answer_format: str = "boxed"
    image_size: int = 384
    include_image: bool = True
    data_files: dict[str, str] = field(default_factory=dict)  # split -> exported geometry3k file
    data_dir: str | None = None  # the original geometry3k layout
    dataset_rel_tol: float | None = 0.01  # geometry3k answers are rounded decimals
    system_prompt: str | None = None  # None: the mode's default
    instruction: str | None = None  # after the statement; None: the mode's default, "" none

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Expected mode to be 'tools' or 'single', got {self.mode!r}.")
        if self.max_attempts < 1 or self.max_turns < self.max_attempts:
            raise ValueError(f"Expected 1 <= max_attempts <= max_turns, got {self.max_attempts} and {self.max_turns}.")
        if self.closeness_weight < 0 or self.measure_reward < 0:
            raise ValueError(f"Expected closeness_weight and measure_reward >= 0, got {self.closeness_weight} and "
                             f"{self.measure_reward}.")
        if self.answer_format not in ANSWER_FORMATS or (self.answer_format == "number" and self.mode != "tools"):
            raise ValueError(f"Expected answer_format in {ANSWER_FORMATS} ('number' with mode='tools'), got "
                             f"{self.answer_format!r} with mode={self.mode!r}.")
        if self.measure_side not in (None, *figures.MEASURE_SIDES):
            raise ValueError(f"Expected measure_side to be None or one of {figures.MEASURE_SIDES}, "
                             f"got {self.measure_side!r}.")
        if not 64 <= self.image_size <= 2048:
            raise ValueError(f"Expected 64 <= image_size <= 2048 pixels, got {self.image_size}.")

    @classmethod
    def build(cls, config: dict[str, Any]) -> GeometryConfig:
        return from_kwargs(cls, config)


def number_alone(text: str) -> str | None:
    """The number a reply consists of, surrounding whitespace aside; None for anything else.

    >>> number_alone(" 7 "), number_alone("-2.5"), number_alone("7 cm"), number_alone("")
    ('7', '-2.5', None, None)
    """
    reply = text.strip()
    return reply if _NUMBER.fullmatch(reply) else None


class GeometryEnv(Env):
    """Geometry problems with a diagram: calculator tools and up to 3 verified attempts (or single-turn).

    ``reset(seed, split="train", kind=None, difficulty=None, index=None, problem=None, answer=None)``:
    ``kind`` is a generator family (``triangle_angle``, ``law_of_cosines``, ``circle_arc``, ...; see
    :mod:`env_servers.geometry_env.problems`) or a diagram-only kind (``figure``, ``measure``; see
    :mod:`env_servers.geometry_env.figures`), ``difficulty`` 1-3 picks among the families of that
    level, ``index`` a deterministic problem of the split, ``problem`` + ``answer`` a custom one.
    Without a generator ``kind``, configured geometry3k data (``data_files``/``data_dir``) is used.
    """

    env_name = "geometry"

    def __init__(self, **config: Any):
        self.config = GeometryConfig.build(config)
        self.problem: GeometryProblem | None = None
        self.attempts, self.turns, self.measured = 0, 0, False

    # -- reset -------------------------------------------------------------------------------
    def reset(self, seed: int | None = None, split: str = "train", kind: str | None = None,
              difficulty: int | None = None, index: int | None = None, problem: str | None = None,
              answer: str | None = None) -> Observation:
        try:
            self.problem = self._pick(split, kind, difficulty, index, problem, answer)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            raise ActionValidationError(f"reset(): {exc}") from None
        self.attempts, self.turns, self.measured = 0, 0, False
        p, single = self.problem, self.config.mode == "single"
        instruction = self.config.instruction
        if instruction is None:
            instruction = SINGLE_INSTRUCTION if single else TOOLS_INSTRUCTION
        text = f"{p.statement} {instruction}".strip()
        images = []
        if self.config.include_image:
            png = p.image_png or (render_png_cached(p.problem_id, p.diagram, self.config.image_size)
                                  if p.diagram else None)
            images = [png] if png else []
        system = self.config.system_prompt or (SINGLE_SYSTEM_PROMPT if single else TOOLS_SYSTEM_PROMPT)
        return Observation(text=text, images=images, metadata={
            "system_prompt": system, "task_id": p.problem_id, "split": p.split, "kind": p.kind,
            "difficulty": p.difficulty, "mode": self.config.mode})

    def _pick(self, split: str, kind: str | None, difficulty: int | None, index: int | None,
              statement: str | None, answer: str | None) -> GeometryProblem:
        if statement is not None or answer is not None:
            if not (isinstance(statement, str) and statement.strip() and isinstance(answer, str) and answer.strip()):
                raise ValueError("Expected both 'problem' and 'answer' as non-empty strings for a custom problem.")
            return GeometryProblem("custom", statement, answer, kind or "custom", difficulty, split)
        if kind in figures.KINDS:
            reply = self.config.answer_format
            if index is not None:
                return figures.problem_at(index, split=split, kind=kind, side=self._side(kind), reply=reply)
            return figures.generate(self.rng, split=split, kind=kind, side=self._side(kind), reply=reply)
        source = self.config.data_dir or self.config.data_files.get(split)
        if kind in problems.KINDS or not (self.config.data_dir or self.config.data_files):
            if index is not None:
                return problems.problem_at(index, split=split, kind=kind, difficulty=difficulty)
            return problems.generate(self.rng, split=split, kind=kind, difficulty=difficulty)
        if source is None:
            raise ValueError(f"Expected split to be one of {sorted(self.config.data_files)} (from data_files), "
                             f"got {split!r}.")
        pool = loaders.load(str(source), split)
        if index is None:
            return self.rng.choice(pool)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(pool):
            raise ValueError(f"Expected index in [0, {len(pool)}) for this split, got {index!r}.")
        return pool[index]

    def _side(self, kind: str) -> str | None:
        return self.config.measure_side if kind == "measure" else None

    def current_problem(self) -> GeometryProblem:
        """The episode's problem; :class:`EpisodeStateError` before the first ``reset``."""
        if self.problem is None:
            raise EpisodeStateError(f"{type(self).__name__} has no problem yet: call reset() before stepping.")
        return self.problem

    @property
    def _rel_tol(self) -> float | None:
        return self.config.dataset_rel_tol if self.current_problem().kind == "geometry3k" else None

    # -- single mode and text turns -------------------------------------------------------------
    def on_text(self, text: str) -> StepResult:
        if self.config.mode == "single":
            problem = self.current_problem()
            answer = problem.answer
            if problem.choices:  # multiple choice: the reply's first word names a choice, or the format fails
                choice = figures.choice_of(text, problem.choices)
                verdict = GradeResult(choice, choice == answer)
                fmt = float(choice is not None)
            else:
                verdict = grade(text, answer, rel_tol=self._rel_tol)
                fmt = float(has_think_then_boxed(text))
            accuracy = float(verdict.correct)
            reward = self.config.accuracy_weight * accuracy + self.config.format_weight * fmt
            self.done = True
            return StepResult(observation=Observation(text=f"Current parsed answer={verdict.parsed} reward={reward:g}"),
                              reward=reward, done=True,
                              info={"parsed_answer": verdict.parsed, "correct": verdict.correct,
                                    "ground_truth": answer,
                                    "rewards": {"accuracy": accuracy, "format": fmt}})
        submitted = extract_boxed(text)
        if submitted is None and self.config.answer_format == "number":
            submitted = number_alone(text)
        if submitted is not None:
            return self.submit_answer(submitted)
        return self._tool_turn("No answer found. Call a tool, or submit_answer(answer) / write \\boxed{answer}.")

    # -- tools -----------------------------------------------------------------------------------
    def _require_tools_mode(self) -> None:
        if self.config.mode != "tools":
            raise ActionValidationError("GeometryEnv(mode='single') takes one text answer; tools need mode='tools'.")

    def _tool_turn(self, text: str) -> StepResult:
        """A non-final turn; the turn limit truncates the episode (reward 0, no answer)."""
        self.turns += 1
        result = StepResult(observation=Observation(text=text))
        if self.turns >= self.config.max_turns:
            result.truncated = True
            result.observation.text += "\n[Maximum turns reached.]"
            result.info.update(correct=False, ground_truth=self.current_problem().answer, attempts=self.attempts)
        return result

    def _helper(self, fn: Any, *args: Any) -> StepResult:
        self._require_tools_mode()
        try:
            text = calculator.format_value(fn(*args))
        except CalculatorError as exc:
            text = f"Error: {exc}"
        return self._tool_turn(text)

    @tool
    def calculate(self, expression: Annotated[str, "e.g. sqrt(5^2 + 12^2), 180*(7-2)/7, 8*sind(30)"]) -> StepResult:
        """Evaluate a math expression exactly (+ - * / ^, sqrt, pi, sin/cos/tan in radians, sind/cosd/tand in degrees)."""
        self._require_tools_mode()
        try:
            text = calculator.calculate(expression)
        except CalculatorError as exc:
            text = f"Error: {exc}"
        return self._tool_turn(text)

    @tool
    def law_of_cosines(self, a: float, b: float, angle_deg: float) -> StepResult:
        """Third side of a triangle from two sides and the included angle (degrees).

        Args:
            a: first side
            b: second side
            angle_deg: the angle between a and b, in degrees
        """
        return self._helper(calculator.law_of_cosines, a, b, angle_deg)

    @tool
    def law_of_sines(self, side_a: float, angle_a_deg: float, angle_b_deg: float) -> StepResult:
        """Side b opposite angle B, from side a and its opposite angle A (degrees).

        Args:
            side_a: the known side
            angle_a_deg: the angle opposite side_a, in degrees
            angle_b_deg: the angle opposite the wanted side, in degrees
        """
        return self._helper(calculator.law_of_sines, side_a, angle_a_deg, angle_b_deg)

    @tool
    def triangle_area(self, a: float, b: float, c: float) -> StepResult:
        """Area of a triangle from its three sides (Heron's formula).

        Args:
            a: first side
            b: second side
            c: third side
        """
        return self._helper(calculator.triangle_area, a, b, c)

    @tool
    def polygon_interior_angle(self, n: Annotated[int, "number of sides (>= 3)"]) -> StepResult:
        """Each interior angle of a regular polygon with n sides, in degrees."""
        return self._helper(calculator.polygon_interior_angle, n)

    @tool
    def arc_length(self, radius: float, angle_deg: float) -> StepResult:
        """Length of a circular arc from the radius and the central angle (degrees).

        Args:
            radius: the circle's radius
            angle_deg: the central angle, in degrees
        """
        return self._helper(calculator.arc_length, radius, angle_deg)

    @tool
    def measure(self, segment: Annotated[str, "two point names of the diagram, e.g. AB"]) -> StepResult:
        """Measure a segment of the diagram with a ruler: its length, to two decimals."""
        self._require_tools_mode()
        diagram = self.current_problem().diagram
        if diagram is None:
            return self._tool_turn("Error: this problem has no diagram to measure.")
        try:
            text = f"{round(figures.segment_length(diagram, segment), 2):g}"
        except ValueError as exc:
            return self._tool_turn(f"Error: {exc}")
        result = self._tool_turn(text)
        problem = self.current_problem()
        if problem.kind == "measure" and not self.measured and figures.asks_for(problem.statement, segment):
            self.measured = True
            result.reward = self.config.measure_reward
        return result

    @tool
    def submit_answer(self, answer: Annotated[str, "your final answer, e.g. 2\\sqrt{13} or 65"]) -> StepResult:
        """Submit an answer to the verifier; you get the parsed answer and its reward, and may retry if wrong."""
        self._require_tools_mode()
        truth = self.current_problem().answer
        self.attempts += 1
        self.turns += 1
        verdict = grade_answer(answer, truth, rel_tol=self._rel_tol)
        correctness = float(verdict.correct)
        done = verdict.correct or self.attempts >= self.config.max_attempts
        info: dict[str, Any] = {"parsed_answer": verdict.parsed, "correct": verdict.correct, "attempts": self.attempts}
        reward = self.config.wrong_attempt_reward
        if done:
            info["ground_truth"] = truth
            info["rewards"] = self._final_rewards(verdict.parsed, correctness)
            reward = correctness + self.config.closeness_weight * info["rewards"].get("closeness", 0.0)
            self.done = True
        text = f"Current parsed answer={verdict.parsed} reward={correctness:g}"
        if not done:
            text += f" ({self.config.max_attempts - self.attempts} attempt(s) left)"
        truncated = not done and self.turns >= self.config.max_turns
        if truncated:
            info["ground_truth"] = truth
        return StepResult(observation=Observation(text=text), reward=reward, done=done, truncated=truncated, info=info)

    def _final_rewards(self, parsed: str | None, correctness: float) -> dict[str, float]:
        """The final answer's named components: ``accuracy``, and for the ``measure`` kind ``closeness``."""
        rewards = {"accuracy": correctness}
        if self.current_problem().kind == "measure":
            rewards["closeness"] = figures.closeness(parsed, self.current_problem().answer)
            rewards["measured"] = float(self.measured)
        return rewards

    def state(self) -> dict[str, Any]:
        if self.problem is None:
            return {}
        return {"task_id": self.problem.problem_id, "attempts": self.attempts, "turns": self.turns,
                "mode": self.config.mode}


__all__ = ["GeometryEnv", "GeometryConfig"]
