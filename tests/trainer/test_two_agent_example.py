"""examples/two_agent_gomoku.py end to end, shrunk: its own match server, warm-up, one RL step, per-agent plots."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.live
def test_the_two_agent_example_runs_with_its_own_server(tmp_path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("two_agent_gomoku", ROOT / "examples" / "two_agent_gomoku.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    small = [f"agents.{a}.model.{kv}" for a in ("alice", "bob") for kv in ("hidden_size=32", "num_layers=1")]
    summary = example.main(["--warmup-steps", "2", "--warmup-games", "2", "run.steps=1", "run.batch_size=2",
                            "run.group_size=2", "run.eval_problems=2", "run.eval_every=0",
                            f"run.output_dir='{tmp_path}'", *small])
    assert set(summary["agents"]) == {"alice", "bob"} and summary["steps"] == 1
    for name in ("alice", "bob"):
        assert (tmp_path / name / "reward.png").stat().st_size > 0
        assert (tmp_path / name / "metrics.jsonl").exists()
    out = capsys.readouterr().out
    assert "imitation warm-up" in out and "validation reward after" in out
