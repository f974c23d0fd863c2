"""A run that trains on nothing says so: failure summaries per step and the stop after all-failed steps."""

from __future__ import annotations

import json

import pytest

from trainer.rollout.failures import FailureWatch, RolloutFailureError, failure_summary
from trainer.rollout.types import StopReason, Task, Trajectory


def traj(kind: str | None, message: str = "", turns: int = 1, stop: StopReason = StopReason.DONE) -> Trajectory:
    t = Trajectory(task=Task({}), stop_reason=stop, num_turns=turns)
    if kind is not None:
        t.note_failure(kind, message)
    return t


def test_failed_means_stopped_on_an_error_or_every_turn_refused() -> None:
    assert traj("validation_error", "x", stop=StopReason.PARSE_ERROR).failed
    assert traj(None, stop=StopReason.ENV_ERROR).failed and traj(None, stop=StopReason.TIMEOUT).failed
    assert traj("parse_error", "bad call", turns=1).failed  # its only turn was malformed
    assert not traj("parse_error", "bad call", turns=2).failed  # it recovered in the next turn
    assert not traj(None, turns=3).failed


def test_summary_names_the_commonest_reason_with_an_example_and_a_fix() -> None:
    trajs = [traj("validation_error", "message: Field required", stop=StopReason.PARSE_ERROR)] * 3 + \
            [traj("env_error", "EnvConnectionError: refused", stop=StopReason.ENV_ERROR), traj(None)]
    s = failure_summary(trajs)
    assert (s.failed, s.episodes, s.top_kind) == (4, 5, "validation_error")
    assert s.metrics()["rollout/failed_frac"] == 0.8 and s.metrics()["rollout/failed_validation_error"] == 3.0
    text = s.describe()
    assert text.startswith("4/5 episodes failed (3 with validation_error, 1 with env_error)")
    assert "message: Field required" in text and "env.action_mapper" in text


def test_watch_logs_majorities_records_them_and_stops_after_consecutive_all_failed_steps(tmp_path) -> None:
    messages: list[str] = []
    watch = FailureWatch(2, messages.append, tmp_path / "failures.jsonl")
    parse = traj("parse_error", "invalid JSON in tool call", stop=StopReason.PARSE_ERROR)
    watch.check(1, [parse, parse, traj(None)])            # most failed: said, not all: no streak
    watch.check(2, [parse, traj(None), traj(None)])       # a minority: recorded, not said
    watch.check(3, [parse, parse])                        # all failed: streak 1
    with pytest.raises(RolloutFailureError, match=r"last 2 steps.*Step 4: 2/2 episodes failed.*rollout.tool_parser"):
        watch.check(4, [parse, parse])
    assert [m.split(":")[0] for m in messages] == ["step 1", "step 3", "step 4"]
    records = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[0]["reason"] == "parse_error"


def test_a_good_step_resets_the_streak_and_zero_never_stops() -> None:
    bad = traj(None, stop=StopReason.ENV_ERROR)
    watch = FailureWatch(2, lambda m: None)
    watch.check(1, [bad])
    watch.check(2, [traj(None)])
    watch.check(3, [bad])
    never = FailureWatch(0, lambda m: None)
    for step in range(10):
        never.check(step, [bad])
    # under torchrun the verdict is every rank's: a rank with good episodes keeps everyone going
    ranks = FailureWatch(1, lambda m: None)
    assert ranks.check(1, [bad], all_ranks=lambda all_failed: False)["rollout/failed_frac"] == 1.0
