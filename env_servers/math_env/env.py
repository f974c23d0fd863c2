r"""``MathEnv``: single-turn math problems graded by :mod:`.grading`, served as an envhub env.

The first observation *is* the prompt: ``text`` is the user message (the problem plus the
``\boxed{}`` instruction) and ``metadata["system_prompt"]`` the system message, so a client
never builds its own prompt. The action is the whole assistant turn as free text
(``{"text": ...}``); the episode ends after it::

    from envhub import EnvRunner
    runner = EnvRunner(MathEnv())
    first = await runner.reset(seed=0, kind="add", difficulty=1)   # "What is 3 + 5? Put ..."
    result = await runner.step({"text": r"\boxed{8}"})             # reward 1.0, done
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from env_servers.math_env import loaders, tasks
from env_servers.math_env.tasks import MathTask
from env_servers.math_grading.grading import GradeResult, grade
from envhub import Env, Observation, StepResult
from envhub.config import from_kwargs
from envhub.env import MaybeAwaitable
from envhub.errors import ActionValidationError, EpisodeStateError

DEFAULT_SYSTEM_PROMPT = ("You are a helpful assistant that solves math problems step by step. "
                         "Think through the problem carefully and put your final answer in \\boxed{}.")
DEFAULT_INSTRUCTION = "Put the final answer in \\boxed{}."


@dataclass
class MathConfig:
    """Settings of a math env (pass them as constructor keyword arguments: ``MathEnv(format_reward=0.1)``).

    Rewards: ``correct_reward`` or ``incorrect_reward`` when a ``\\boxed{}`` answer is present,
    ``no_answer_reward`` when it is missing; ``format_reward`` is added whenever it is present.
    ``data_files`` maps split names to local MATH- or GSM8K-style files; ``hf_dataset`` reads a
    ``datasets`` cache already on disk (offline). Without either, problems come from the built-in
    generator (see :mod:`.tasks` for the kinds).
    """

    correct_reward: float = 1.0
    incorrect_reward: float = 0.0
    no_answer_reward: float = 0.0
    format_reward: float = 0.0
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    instruction: str = DEFAULT_INSTRUCTION
    data_files: dict[str, str] = field(default_factory=dict)
    dataset_format: str = "auto"
    hf_dataset: str | None = None
    hf_config: str | None = None
    rel_tol: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.data_files, dict):
            raise ValueError(f"Expected data_files to map split names to paths, got {self.data_files!r}.")
        if self.dataset_format not in loaders.FORMATS:
            raise ValueError(f"Expected dataset_format to be one of {loaders.FORMATS}, got {self.dataset_format!r}.")
        if self.rel_tol is not None and not 0 <= self.rel_tol < 1:
            raise ValueError(f"Expected rel_tol to be None or in [0, 1), got {self.rel_tol!r}.")

    @classmethod
    def build(cls, config: dict[str, Any]) -> MathConfig:
        """The config from keyword arguments, naming the accepted keys when one is unknown."""
        return from_kwargs(cls, config)


class MathEnv(Env):
    """Single-turn math: one problem, one answer in ``\\boxed{}``, reward 1 if it is right.

    ``reset(seed, split="train", kind=None, difficulty=None, index=None, problem=None, answer=None)``:
    ``kind``/``difficulty`` choose the generator family and level (``kind="add", difficulty=1`` is
    single-digit addition for tiny models); ``index`` picks a deterministic task of the split;
    ``problem`` + ``answer`` pose a custom task. Kinds: ``add``, ``arithmetic``, ``fraction``,
    ``power``, ``linear``, ``quadratic``, ``word`` (difficulty 1-3 each; see
    :mod:`env_servers.math_env.tasks`, whose ``add_tasks(split, difficulty)`` lists a whole split).
    With ``data_files``/``hf_dataset`` configured, ``kind``/``difficulty`` filter the records'
    ``type``/``level`` instead.

    The observation's metadata carries ``split_size`` when the split is a fixed list (``add`` at
    difficulty 1-2, or a configured dataset): ``index`` 0..split_size-1 then visits each problem once.
    """

    split_size: int | None = None

    env_name = "math"
    config_class: type[MathConfig] = MathConfig

    def __init__(self, **config: Any):
        self.config = self.config_class.build(config)
        self.task: MathTask | None = None

    # -- task selection ------------------------------------------------------------------------
    def reset(self, seed: int | None = None, split: str = "train", kind: str | None = None,
              difficulty: int | None = None, index: int | None = None, problem: str | None = None,
              answer: str | None = None) -> Observation:
        try:
            self.task = self._pick(split, kind, difficulty, index, problem, answer)
        except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
            raise ActionValidationError(f"reset(): {exc}") from None
        self.last_grade: GradeResult | None = None
        return Observation(text=self.user_prompt(self.task), metadata=self.task_metadata())

    def _pick(self, split: str, kind: str | None, difficulty: int | None, index: int | None,
              problem: str | None, answer: str | None) -> MathTask:
        self.split_size = None
        if problem is not None or answer is not None:
            if not (isinstance(problem, str) and problem.strip() and isinstance(answer, str) and answer.strip()):
                raise ValueError("Expected both 'problem' and 'answer' as non-empty strings for a custom task.")
            digest = hashlib.sha256(f"{problem}\n{answer}".encode()).hexdigest()[:10]
            return MathTask(f"custom-{digest}", problem, answer, kind or "custom", difficulty, split)
        if kind in tasks.KINDS or not self._has_dataset():
            self.split_size = tasks.listed_size(split, kind, difficulty)
            if index is not None:
                return tasks.task_at(index, split=split, kind=kind, difficulty=difficulty)
            return tasks.generate(self.rng, split=split, kind=kind, difficulty=difficulty)
        return self._from_dataset(split, kind, difficulty, index)

    def _has_dataset(self) -> bool:
        return bool(self.config.data_files or self.config.hf_dataset)

    def _from_dataset(self, split: str, kind: str | None, difficulty: int | None, index: int | None) -> MathTask:
        cfg = self.config
        if cfg.data_files:
            if split not in cfg.data_files:
                raise ValueError(f"Expected split to be one of {sorted(cfg.data_files)} (from data_files), got {split!r}.")
            pool = loaders.load_file(str(cfg.data_files[split]), split, cfg.dataset_format)
        else:
            pool = loaders.load_cached_dataset(cfg.hf_dataset, split, cfg.hf_config, cfg.dataset_format)
        pool = tuple(t for t in pool if (kind is None or t.kind == kind)
                     and (difficulty is None or t.difficulty == difficulty))
        if not pool:
            raise ValueError(f"No {split} task has kind={kind!r} and difficulty={difficulty!r}.")
        self.split_size = len(pool)
        if index is not None:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(pool):
                raise ValueError(f"Expected index in [0, {len(pool)}) for this split, got {index!r}.")
            return pool[index]
        return self.rng.choice(pool)

    def current_task(self) -> MathTask:
        """The episode's task; :class:`EpisodeStateError` before the first ``reset``."""
        if self.task is None:
            raise EpisodeStateError(f"{type(self).__name__} has no task yet: call reset() before stepping.")
        return self.task

    # -- prompt ------------------------------------------------------------------------------
    def user_prompt(self, task: MathTask) -> str:
        """The user message: the problem, then the answer-format instruction."""
        return f"{task.problem} {self.config.instruction}".strip()

    def task_metadata(self) -> dict[str, Any]:
        task = self.current_task()
        meta = {"system_prompt": self.config.system_prompt, "task_id": task.task_id, "split": task.split,
                "kind": task.kind, "difficulty": task.difficulty}
        if self.split_size is not None:  # the split is a fixed list: index 0..split_size-1 walks it once
            meta["split_size"] = self.split_size
        return meta

    # -- acting ------------------------------------------------------------------------------
    def on_text(self, text: str) -> MaybeAwaitable[StepResult]:  # MathToolEnv's is async
        """Grade the whole response; the episode ends here."""
        verdict = self.grade_response(text)
        return self.final_result(verdict)

    def grade_response(self, text: str) -> GradeResult:
        self.last_grade = grade(text, self.current_task().answer, rel_tol=self.config.rel_tol)
        return self.last_grade

    def final_result(self, verdict: GradeResult, **info: Any) -> StepResult:
        """The terminal step for a verdict: reward, feedback text, and the answer info."""
        cfg, answer = self.config, self.current_task().answer
        if not verdict.has_answer:
            correctness, fmt = cfg.no_answer_reward, 0.0
            text = "No \\boxed{} answer found."
        else:
            correctness = cfg.correct_reward if verdict.correct else cfg.incorrect_reward
            fmt = cfg.format_reward
            text = "Correct." if verdict.correct else f"Incorrect. The expected answer was {answer}."
        self.done = True
        return StepResult(observation=Observation(text=text), reward=correctness + fmt, done=True,
                          info={"parsed_answer": verdict.parsed, "correct": verdict.correct,
                                "ground_truth": answer,
                                "rewards": {"correctness": correctness, "format": fmt}, **info})

    def state(self) -> dict[str, Any]:
        if self.task is None:
            return {}
        return {"task_id": self.task.task_id, "split": self.task.split, "kind": self.task.kind}


__all__ = ["MathEnv", "MathConfig", "DEFAULT_SYSTEM_PROMPT", "DEFAULT_INSTRUCTION"]
