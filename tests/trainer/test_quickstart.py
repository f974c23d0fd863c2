"""The quick start end to end, much shortened: server up, SFT warm-up, GRPO over WebSocket, summary, plot,
and the server stopped afterwards."""

from __future__ import annotations

import json
import urllib.request

import pytest

from trainer import quickstart


@pytest.mark.slow
@pytest.mark.live
def test_quickstart_plumbing_end_to_end(tmp_path, monkeypatch) -> None:
    ports: list[int] = []
    real_free_port = quickstart.free_port
    monkeypatch.setattr(quickstart, "free_port", lambda: ports.append(real_free_port()) or ports[-1])
    summary = quickstart.main(["--steps", "2", "--sft-steps", "10", "--sft-demos", "32", "--batch", "4",
                               "--group", "4", "--eval-problems", "8", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == summary
    assert {"val_reward_before", "val_reward_after", "steps", "seconds"} <= set(written)
    assert written["steps"] == 2 and written["eval_episodes"] == 8
    assert 0.0 <= written["val_reward_before"] <= 1.0 and 0.0 <= written["val_reward_after"] <= 1.0
    assert (tmp_path / "reward.png").stat().st_size > 1000
    records = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert records and all(t["stop_reason"] == "done" for t in records)
    train = [t for t in records if t.get("phase") != "eval"]
    evals = [t for t in records if t.get("phase") == "eval"]
    assert train[0]["task"]["split"] == "train" and "What is" in train[0]["text"]
    assert evals and all(t["task"]["split"] == "validation" for t in evals)
    # The server is gone once the quick start returns.
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/health", timeout=1)
