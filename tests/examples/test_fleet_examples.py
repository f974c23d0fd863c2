"""The ecosystem examples run as documented: a new env in one file, the fleet, the OpenAI agent loop, the TRL recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.live


def test_envhub_serve_runs_the_one_file_env(serve_process) -> None:
    from envhub import EnvTool, OpenEnv

    server = serve_process([sys.executable, "-m", "envhub", "serve", "examples.guess_env:GuessEnv",
                            "--log-level", "warning"], cwd=ROOT)
    with OpenEnv(f"ws://127.0.0.1:{server.port}") as env:
        env.reset(seed=1, low=1, high=4)
        (guess,) = EnvTool.from_env(env)
        replies = [guess(number=n) for n in (1, 2, 3, 4) if not guess.done]
    assert replies[-1] == "Correct!" and guess.episode_reward == 1.0


def test_openai_agent_example_solves_every_episode() -> None:
    from examples import openai_agent

    summaries = openai_agent.main(["--episodes", "2"])
    assert [s["reward"] for s in summaries] == [1.0, 1.0]
    assert all(s["stop"] == "done" and s["turns"] <= 7 for s in summaries)


@pytest.mark.slow
def test_connect_fleet_example_starts_and_visits_every_service() -> None:
    env = {**os.environ, "SANDBOX_SLOTS": "1"}
    out = subprocess.run([sys.executable, "examples/connect_fleet.py", "--start"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {row["service"]: row for row in map(json.loads, out.stdout.splitlines())}
    assert set(rows) == {"math", "gomoku", "geometry", "code"}
    assert all(r["health"] == "healthy" and r["prompt"] for r in rows.values())
    assert "place_stone" in rows["gomoku"]["tools"] and "submit_answer" in rows["geometry"]["tools"]
    assert rows["math"]["done"] is True
    assert rows["code"]["step"].endswith("42")  # print(6 * 7) ran in the sandbox


@pytest.mark.slow
def test_trl_grpo_example_trains_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trl")
    from examples import trl_grpo

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    logs = trl_grpo.main(["--steps", "1", "--max-completion-length", "8", "--output-dir", str(tmp_path)])
    assert len(logs) == 1 and logs[0]["step"] == 1 and isinstance(logs[0]["reward"], float)


@pytest.mark.slow
def test_gomoku_example_warms_up_to_legal_replies_and_trains(tmp_path) -> None:
    # Shortened: the default warm-up, two per-turn GRPO steps. After the warm-up the policy must
    # already write parseable moves often enough that some turns are not penalised.
    out = tmp_path / "gomoku"
    proc = subprocess.run([sys.executable, "examples/gomoku_train.py", "--steps", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and (out / "invalid_rate.png").exists()
    assert summary["invalid_rate_first_steps"] < 1.0, "the warm-up did not teach the <move>r,c</move> format"
