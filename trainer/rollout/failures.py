"""A run that trains on nothing says so: why a step's episodes failed, and a stop when they all keep failing.

An episode *failed* (:attr:`Trajectory.failed`) when it stopped on a parse, validation or env
error, or every turn it played was malformed or refused. Per step, :func:`failure_summary` counts
failures by kind — ``parse_error`` (a reply the tool-call parser could not read),
``validation_error`` (the env refused the action: ``VALIDATION_ERROR``, a typed action that did not
fit), ``env_error`` and ``timeout`` (infrastructure) — and names the most common one with an
example. :class:`FailureWatch` logs that when most episodes of a step failed for one reason and
raises :class:`RolloutFailureError` once every episode failed for ``max_failed_steps`` steps in a row.
The metrics carry ``rollout/failed_frac`` and a count per kind (``rollout/failed_validation_error``...);
with ``record_path`` each step with failures also appends ``{"step", "failed", "episodes", "by_kind",
"reason", "example"}`` to that JSONL file (``failures.jsonl`` in the run directory).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.rollout.types import Trajectory

KINDS = ("parse_error", "validation_error", "env_error", "timeout")
_HINTS = {
    "parse_error": "The replies are not tool calls the parser reads: check rollout.tool_parser (or "
                   "rollout.agent) against the model's format",
    "validation_error": "The env refuses the actions: set env.action_mapper to the env's action shape "
                        "(see docs/training.md, 'Any OpenEnv server')",
    "env_error": "The env server fails or is unreachable: check env.url and the server's log",
    "timeout": "Episodes run past rollout.episode_timeout_s: raise it or check the env's speed",
}


class RolloutFailureError(RuntimeError):
    """Every episode failed for several steps in a row: the run would train on nothing."""


@dataclass
class FailureSummary:
    """One step's failures: how many of ``episodes`` failed, by kind, and the commonest kind with an example."""

    episodes: int
    failed: int
    by_kind: dict[str, int]
    top_kind: str | None = None
    example: str | None = None

    @property
    def failed_frac(self) -> float:
        return self.failed / max(self.episodes, 1)

    def metrics(self) -> dict[str, float]:
        return {"rollout/failed_frac": self.failed_frac,
                **{f"rollout/failed_{k}": float(self.by_kind.get(k, 0)) for k in KINDS}}

    def describe(self) -> str:
        """``"6/8 episodes failed, 6 with validation_error, e.g. '...': <what to do>"``."""
        kinds = ", ".join(f"{n} with {k}" for k, n in sorted(self.by_kind.items(), key=lambda kv: -kv[1]))
        example = (self.example or "")[:300]
        return (f"{self.failed}/{self.episodes} episodes failed ({kinds}); e.g. {example!r}. "
                f"{_HINTS.get(self.top_kind or '', '')}").strip()


def failure_summary(trajs: list[Trajectory]) -> FailureSummary:
    failed = [t for t in trajs if t.failed]
    kinds = Counter(t.failure or (t.stop_reason.value if t.stop_reason else "unknown") for t in failed)
    if not failed:
        return FailureSummary(len(trajs), 0, {})
    top = kinds.most_common(1)[0][0]
    example = next((t.failure_message or t.error for t in failed if (t.failure or "") == top), None)
    return FailureSummary(len(trajs), len(failed), dict(kinds), top, example)


class FailureWatch:
    """Checks every step's rollouts: reports a step where most episodes failed for the same reason,
    and stops the run when all failed for ``max_failed_steps`` consecutive steps (0: never stops)."""

    def __init__(self, max_failed_steps: int = 3, log: Callable[[str], None] = print,
                 record_path: str | Path | None = None):
        self.max_failed_steps = max_failed_steps
        self.log = log
        self.record_path = Path(record_path) if record_path is not None else None
        self.streak = 0

    def check(self, step: int, trajs: list[Trajectory],
              all_ranks: Callable[[bool], bool] | None = None) -> dict[str, float]:
        """Metrics for the step; logs and may raise :class:`RolloutFailureError`. ``all_ranks`` turns
        this process's "every episode failed" into the verdict of all ranks (under torchrun), so
        that every rank stops at the same step."""
        summary = failure_summary(trajs)
        top_count = summary.by_kind.get(summary.top_kind or "", 0)
        if summary.episodes and top_count * 2 > summary.episodes:
            self.log(f"step {step}: {summary.describe()}")
        if summary.failed and self.record_path is not None:
            with self.record_path.open("a") as fh:
                fh.write(json.dumps({"step": step, "failed": summary.failed, "episodes": summary.episodes,
                                     "by_kind": summary.by_kind, "reason": summary.top_kind,
                                     "example": summary.example}) + "\n")
        all_failed = summary.failed == summary.episodes
        if all_ranks is not None:
            all_failed = all_ranks(all_failed)
        self.streak = self.streak + 1 if all_failed else 0
        if self.max_failed_steps and self.streak >= self.max_failed_steps:
            raise RolloutFailureError(f"Every episode failed in the last {self.streak} steps, so the run "
                                      f"would train on nothing (run.max_failed_steps={self.max_failed_steps}). "
                                      f"Step {step}: {summary.describe()}")
        return summary.metrics()


__all__ = ["FailureSummary", "FailureWatch", "RolloutFailureError", "failure_summary", "KINDS"]
