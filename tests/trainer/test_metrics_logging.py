"""Metrics: JSONL records, TensorBoard event files, trajectories, reward plot PNG, non-TTY progress bar."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
import torch

from trainer.metrics import MetricsLogger, Progress, plot_rewards, read_metrics


def test_log_writes_jsonl_scalars_and_tensorboard_events(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"train/reward_mean": 0.25, "train/loss": torch.tensor(1.5), "note": "text", "hist": [1, 2]})
        logger.log(2, {"train/reward_mean": 0.75})
        has_tensorboard = importlib.util.find_spec("tensorboard") is not None
        assert logger.tensorboard_enabled == has_tensorboard  # TensorBoard "if installed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["train/reward_mean"] == 0.25 and records[0]["train/loss"] == 1.5
    assert "note" not in records[0] and "hist" not in records[0]  # non-scalars are not metrics
    events = list(tmp_path.glob("events.out.tfevents.*"))
    if has_tensorboard:
        assert events and events[0].stat().st_size > 0
    else:
        assert not events


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    with MetricsLogger(tmp_path) as logger:
        logger.log(3, {"val/reward": 0.5})
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    [event] = acc.Scalars("val/reward")
    assert (event.step, event.value) == (3, 0.5)


def test_non_main_rank_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "rank1", is_main=False)
    logger.log(1, {"train/loss": 1.0})
    logger.log_trajectories(1, [{"reward": 1.0}])
    logger.close()
    assert not (tmp_path / "rank1").exists()


def test_trajectories_jsonl(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log_trajectories(4, [{"messages": [{"role": "user", "content": "2+2?"}], "reward": 1.0,
                                     "stop_reason": "done"}, {"reward": 0.0, "path": tmp_path}])
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first["step"] == 4 and first["stop_reason"] == "done" and first["messages"][0]["content"] == "2+2?"
    assert second["path"] == str(tmp_path)  # non-JSON values are written as text, not dropped
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_plot_rewards_writes_a_png(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"train/reward_mean": step / 10, "train/loss": 1.0 / step})
        logger.log(5, {"val/reward": 0.6})
    out = plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "plots" / "rewards.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="Expected reward metrics"):
        plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "x.png", keys=["nope"])


def test_plot_axis_names_what_is_plotted(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    labels = []
    real = Axes.set_ylabel
    monkeypatch.setattr(Axes, "set_ylabel", lambda ax, label, **kw: (labels.append(label), real(ax, label, **kw))[1])
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 4):
            logger.log(step, {"train/reward_mean": step / 10, "train/penalised_turn_frac": 1.0 / step})
    plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "r.png")
    plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "i.png", keys=["train/penalised_turn_frac"])
    plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "j.png", keys=["train/penalised_turn_frac"], ylabel="invalid")
    assert labels == ["reward", "train/penalised_turn_frac", "invalid"]


def test_progress_without_tty_prints_a_line_every_few_percent():
    out = io.StringIO()
    bar = Progress(100, desc="train", file=out, every_pct=10)
    for i in range(100):
        bar.update(1, loss=1.0 / (i + 1))
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert 10 <= len(lines) <= 11  # one per 10 % (plus the first update)
    assert lines[-1].startswith("train: 100%|") and "100/100" in lines[-1] and "loss=0.01" in lines[-1]
    assert lines[0].startswith("train:   1%|") and "1/100" in lines[0]


def test_progress_on_a_tty_redraws_in_place():
    class FakeTTY(io.StringIO):
        def isatty(self):
            return True

    out = FakeTTY()
    with Progress(3, desc="sft", file=out) as bar:
        for _ in range(3):
            bar.update(reward=0.5)
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1  # one line, redrawn
    final = text.rsplit("\r", 1)[1]
    assert final.startswith("sft: 100%|") and "3/3" in final and "reward=0.5" in final
    with pytest.raises(ValueError, match="total >= 0"):
        Progress(-1)


def test_progress_with_nothing_to_do_prints_nothing():
    class FakeTTY(io.StringIO):
        def isatty(self):
            return True

    for out in (io.StringIO(), FakeTTY()):  # run.steps=0, or a resumed run already at its last step
        with Progress(0, desc="grpo", file=out) as bar:
            bar.update(1, reward=0.5)
        assert out.getvalue() == ""
