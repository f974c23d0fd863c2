"""``CodeEnv``: solve a programming task with a sandboxed Python tool, then submit for hidden tests.

The first observation is the problem statement (the system prompt is in
``metadata["system_prompt"]``). Tools: ``run_python(code)`` runs code in the sandbox and shows
stdout, stderr, exit status, time and whether it was killed; ``submit(code)`` runs the hidden
tests and ends the episode with reward = fraction of tests passed (or 1/0 with
``reward_mode="all_or_nothing"``). Rewards are computed on the host from the program's
serialized outputs (see :mod:`.grading`), never from its exit code. All sessions of a server
share one sandbox backend, so at most ``slots`` programs run at a time, off the event loop.

    envhub serve env_servers.code_env:CodeEnv --port 8004
    python -m env_servers.code_env --port 8004 --stateful true
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from env_servers.code_env import grading
from env_servers.code_env.tasks import CodeTask, TaskSet, builtin_tasks, load_jsonl
from env_servers.sandbox import ExecResult, Limits, get_default_backend
from envhub import Env, Observation, StepResult, tool
from envhub.config import from_kwargs
from envhub.errors import ActionValidationError

DEFAULT_SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the task. You can test code with the run_python tool "
    "(a fresh sandboxed Python 3 process with numpy; no network). When you are confident, call submit with "
    "your final solution; it is graded on hidden tests and ends the episode.")


@dataclass
class CodeEnvConfig:
    """Settings of a code env (constructor keyword arguments: ``CodeEnv(reward_mode="all_or_nothing")``).

    ``stateful``: variables persist across ``run_python`` calls of a session (earlier successful
    cells are replayed silently before each new one). ``tasks_path``: a JSONL task file instead of
    the built-in set; ``split_seed`` shuffles the train/validation/test split.
    """

    reward_mode: str = "fraction"
    stateful: bool = False
    max_submissions: int = 1
    run_timeout_s: float = 5.0
    test_timeout_s: float = 2.0
    submit_timeout_s: float = 10.0
    mem_mb: int = 512
    max_output_chars: int = 4000
    max_cells: int = 50
    tasks_path: str | None = None
    split_seed: int = 0
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        if self.reward_mode not in ("fraction", "all_or_nothing"):
            raise ValueError(f"Expected reward_mode 'fraction' or 'all_or_nothing', got {self.reward_mode!r}.")
        if self.max_submissions < 1:
            raise ValueError(f"Expected max_submissions >= 1, got {self.max_submissions}.")
        Limits(timeout_s=self.run_timeout_s, mem_mb=self.mem_mb)
        Limits(timeout_s=self.submit_timeout_s)
        Limits(timeout_s=self.test_timeout_s)

    @classmethod
    def build(cls, config: dict[str, Any]) -> CodeEnvConfig:
        return from_kwargs(cls, config, what="CodeEnv")


@functools.lru_cache(maxsize=8)
def _task_set(path: str | None, seed: int) -> TaskSet:
    return TaskSet(list(load_jsonl(path)) if path else list(builtin_tasks()), seed=seed)


def format_exec(result: ExecResult, max_chars: int) -> str:
    """What the model sees after ``run_python``: status line, then stdout and stderr (capped)."""
    parts = [f"[{result.summary()}]"]
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            if len(text) > max_chars:
                text = text[:max_chars] + f"\n[... {len(text) - max_chars} more characters cut]"
            parts.append(f"--- {name} ---\n{text.rstrip()}")
    if len(parts) == 1:
        parts.append("(no output)")
    return "\n".join(parts)


def stateful_program(history: list[str], code: str) -> str:
    """Replay earlier cells with their output discarded, then run ``code``, all in one namespace."""
    lines = ["import contextlib as _envhub_c, io as _envhub_io"]
    for i, cell in enumerate(history):
        lines.append(f"with _envhub_c.redirect_stdout(_envhub_io.StringIO()), "
                     f"_envhub_c.redirect_stderr(_envhub_io.StringIO()):\n"
                     f"    exec(compile({cell!r}, '<cell {i}>', 'exec'), globals())")
    lines.append(f"exec(compile({code!r}, '<cell {len(history)}>', 'exec'), globals())")
    return "\n".join(lines)


class CodeEnv(Env):
    """Solve a Python programming task: test code with run_python, then submit for hidden tests."""

    env_name = "code"
    max_steps = 30
    config_class: ClassVar[type[CodeEnvConfig]] = CodeEnvConfig
    #: the sandbox backend; None means the process-wide default (``ENVHUB_SANDBOX_*``)
    sandbox: ClassVar[Any] = None

    def __init__(self, **config: Any):
        self.config = self.config_class.build(config)
        self.tasks = _task_set(self.config.tasks_path, self.config.split_seed)
        self.task: CodeTask | None = None
        self.split = "train"
        self.history: list[str] = []
        self.submissions = 0
        self.best_score = 0.0

    @classmethod
    def backend(cls) -> Any:
        return cls.sandbox if cls.sandbox is not None else get_default_backend()

    @classmethod
    def metadata(cls) -> dict[str, Any]:
        """The usual metadata plus the sandbox backend that was probed at start-up."""
        return {**super().metadata(), "sandbox": cls.backend().info()}

    def reset(self, seed: int | None = None, split: str = "train", index: int | None = None,
              task_id: str | None = None) -> Observation:
        try:
            self.task = self.tasks.pick(self.rng, split, index, task_id)
        except (ValueError, TypeError, IndexError, KeyError) as exc:  # the task arguments: the client's to fix
            raise ActionValidationError(f"reset(): {exc}") from None
        self.split, self.history, self.submissions, self.best_score = split, [], 0, 0.0
        return Observation(text=self.task.statement(), metadata={
            "system_prompt": self.config.system_prompt, "task_id": self.task.task_id, "split": split,
            "kind": self.task.kind, "entry_point": self.task.entry_point, "num_tests": len(self.task.tests)})

    def state(self) -> dict[str, Any]:
        return {"task_id": self.task.task_id if self.task else None, "submissions": self.submissions,
                "best_score": self.best_score, "cells": len(self.history)}

    @tool
    async def run_python(self, code: Annotated[str, "Python 3 source to run"]) -> StepResult:
        """Run Python code in a sandbox and see its stdout, stderr, exit status and run time.

        Each call is a fresh process unless the server runs in stateful mode. No network access.
        """
        program = stateful_program(self.history, code) if self.config.stateful else code
        limits = Limits(timeout_s=self.config.run_timeout_s, mem_mb=self.config.mem_mb)
        result = await self.backend().run(program, limits=limits)
        if self.config.stateful and result.ok and len(self.history) < self.config.max_cells:
            self.history.append(code)
        return StepResult(observation=Observation(text=format_exec(result, self.config.max_output_chars)),
                          info={"exec": result.to_dict()})

    @tool
    async def submit(self, code: Annotated[str, "the complete solution: the function definition, or the program"]
                     ) -> StepResult:
        """Submit your final solution; it runs against hidden tests and the score is your reward."""
        assert self.task is not None
        passed, details = await self.grade(code)
        total = len(self.task.tests)
        reward = grading.score(passed, total, self.config.reward_mode)
        self.submissions += 1
        self.best_score = max(self.best_score, reward)
        if self.submissions >= self.config.max_submissions or passed == total:
            self.done = True
        text = f"Passed {passed}/{total} hidden tests."
        if not self.done:
            text += f" You have {self.config.max_submissions - self.submissions} submission(s) left."
        return StepResult(observation=Observation(text=text), reward=reward,
                          info={"tests_passed": passed, "tests_total": total, "tests": details})

    async def grade(self, code: str) -> tuple[int, list[str]]:
        """(tests passed, one status per test: ``pass``/``wrong``/``error: X``/``missing``)."""
        assert self.task is not None
        if self.task.kind == "call":
            return await self._grade_call(code)
        return await self._grade_io(code)

    async def _grade_call(self, code: str) -> tuple[int, list[str]]:
        task = self.task
        assert task is not None and task.entry_point is not None
        harness, nonce = grading.call_harness(code, task.entry_point, [t.input for t in task.tests])
        limits = Limits(timeout_s=self.config.submit_timeout_s, mem_mb=self.config.mem_mb)
        result = await self.backend().run(harness, limits=limits)
        reports = grading.parse_call_output(result.stdout, nonce, len(task.tests))
        details = []
        for report, test in zip(reports, task.tests):
            if report is None:
                details.append("missing")
            elif report[0] == "error":
                details.append(f"error: {report[1]}")
            else:
                details.append("pass" if grading.values_match(report[1], test.output) else "wrong")
        return details.count("pass"), details

    async def _grade_io(self, code: str) -> tuple[int, list[str]]:
        task = self.task
        assert task is not None
        limits = Limits(timeout_s=self.config.test_timeout_s, mem_mb=self.config.mem_mb)
        results = await asyncio.gather(*(self.backend().run(code, stdin=t.input.encode(), limits=limits)
                                         for t in task.tests))
        details = []
        for result, test in zip(results, task.tests):
            if result.killed:
                details.append("error: " + result.summary())
            else:
                details.append("pass" if grading.stdout_matches(result.stdout, test.output) else "wrong")
        return details.count("pass"), details
