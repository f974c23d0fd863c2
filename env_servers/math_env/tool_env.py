r"""``MathToolEnv``: multi-turn math with a Python interpreter tool.

The model may call ``run_python(code)`` (executed in the code sandbox, see
:mod:`.code_runner`) as often as the turn limit allows, and ends the episode with a
``\boxed{}`` answer in a text turn or a ``submit_answer(answer)`` call. Text turns that carry
```` ```python ```` blocks instead of an answer have those blocks run, so text-only agents work
too. Rewards are :class:`MathEnv`'s; a turn limit without an answer ends the episode as
truncated with ``turn_limit_reward``.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Annotated, Any

from env_servers.math_env.code_runner import RUNNER_KINDS, PythonRunner, make_runner
from env_servers.math_env.env import MathConfig, MathEnv
from env_servers.math_grading.expressions import sympy_module
from env_servers.math_grading.grading import extract_boxed, grade_answer
from envhub import Observation, StepResult, tool

TOOL_SYSTEM_PROMPT = (
    "You are a helpful assistant that solves math problems. You can call the run_python tool to run "
    "Python code (print what you need to see) and read its output. When you know the answer, write it "
    "in \\boxed{} or call submit_answer.")
_CODE_BLOCK = re.compile(r"```(?:python|py)\s*\n(.*?)```", re.DOTALL)
NO_ACTION_HINT = ("Call run_python to run code, or give your final answer in \\boxed{} "
                  "(or call submit_answer).")


@dataclass
class MathToolConfig(MathConfig):
    """:class:`MathConfig` plus the tool loop: turn limit, code timeout, which Python runner."""

    system_prompt: str = TOOL_SYSTEM_PROMPT
    max_turns: int = 5
    python_timeout_s: float = 10.0
    python_runner: str = "auto"
    max_output_chars: int = 2000
    turn_limit_reward: float = 0.0
    run_code_blocks: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_turns < 1:
            raise ValueError(f"Expected max_turns >= 1, got {self.max_turns}.")
        if not 0 < self.python_timeout_s <= 600:
            raise ValueError(f"Expected 0 < python_timeout_s <= 600, got {self.python_timeout_s}.")
        if self.python_runner not in RUNNER_KINDS:
            raise ValueError(f"Expected python_runner to be one of {RUNNER_KINDS}, got {self.python_runner!r}.")


class MathToolEnv(MathEnv):
    """Multi-turn math with ``run_python`` and ``submit_answer`` tools; answer in ``\\boxed{}`` or by tool."""

    env_name = "math_tool"
    config_class = MathToolConfig
    config: MathToolConfig

    def __init__(self, **config: Any):
        super().__init__(**config)
        self._runner: PythonRunner | None = None
        sympy_module()  # import now (in the server's worker thread), not on the event loop at the first answer

    def reset(self, seed: int | None = None, split: str = "train", kind: str | None = None,
              difficulty: int | None = None, index: int | None = None, problem: str | None = None,
              answer: str | None = None) -> Observation:
        self.turns = 0
        return super().reset(seed=seed, split=split, kind=kind, difficulty=difficulty, index=index,
                             problem=problem, answer=answer)

    async def python_runner(self) -> PythonRunner:
        """The process-wide runner (built off the event loop: the sandbox probe blocks)."""
        if self._runner is None:
            self._runner = await asyncio.to_thread(make_runner, self.config.python_runner)
        return self._runner

    # -- tools ---------------------------------------------------------------------------------
    @tool
    async def run_python(self, code: Annotated[str, "Python source; print() what you want to see"]) -> StepResult:
        """Run Python code and return what it printed (stdout, then stderr)."""
        output = await self._execute([code])
        return self._turn(StepResult(observation=Observation(text=output)))

    @tool
    def submit_answer(self, answer: Annotated[str, "the final answer, e.g. 3/4 or \\frac{3}{4}"]) -> StepResult:
        """Submit the final answer; this ends the episode."""
        self.turns += 1
        verdict = grade_answer(answer, self.current_task().answer, rel_tol=self.config.rel_tol)
        return self.final_result(verdict, turns=self.turns)

    # -- text turns ----------------------------------------------------------------------------
    async def on_text(self, text: str) -> StepResult:
        if extract_boxed(text) is not None:
            verdict = await asyncio.to_thread(self.grade_response, text)
            self.turns += 1
            return self.final_result(verdict, turns=self.turns)
        blocks = _CODE_BLOCK.findall(text) if self.config.run_code_blocks else []
        if blocks:
            output = await self._execute(blocks)
            return self._turn(StepResult(observation=Observation(text=output)))
        return self._turn(StepResult(observation=Observation(text=NO_ACTION_HINT)))

    async def _execute(self, blocks: list[str]) -> str:
        runner, outputs = await self.python_runner(), []
        for code in blocks:
            result = await runner.run(code, self.config.python_timeout_s)
            outputs.append(result.as_observation(self.config.max_output_chars))
        return "\n\n".join(outputs)

    def _turn(self, result: StepResult) -> StepResult:
        """Count a non-final turn; at the limit the episode is truncated with ``turn_limit_reward``."""
        self.turns += 1
        if self.turns >= self.config.max_turns:
            result.truncated = True
            result.reward = self.config.turn_limit_reward
            result.observation.text += "\n[Maximum turns reached without a final answer.]"
            result.info.update(parsed_answer=None, correct=False, ground_truth=self.current_task().answer, turns=self.turns)
        return result

    def state(self) -> dict[str, Any]:
        return {**super().state(), "turns": getattr(self, "turns", 0)}


__all__ = ["MathToolEnv", "MathToolConfig", "TOOL_SYSTEM_PROMPT"]
