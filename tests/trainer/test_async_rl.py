"""Asynchronous rollouts in the RL loop (HF sampler): staleness bounded and reported, resume from a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from test_recipes import config

from trainer.model import load_policy
from trainer.recipes.rl import train


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_version_of_staleness_trains_on_batches_sampled_during_the_previous_step(tmp_path) -> None:
    cfg = config(tmp_path, "run.steps=3", "rollout.max_staleness=1", "algo.filter_zero_variance=false")
    model, tok = load_policy(cfg.model)
    before = [p.detach().clone() for p in model.parameters()]
    summary = train(cfg, model=model, tokenizer=tok, log=lambda s: None)
    assert summary["steps"] == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    steps = [r for r in read(tmp_path / "metrics.jsonl") if "train/loss" in r]
    # batch 0 is sampled by version 0 for step 0; batch 1 starts at once (version 0) and trains at version 1
    assert [r["rollout/staleness_max"] for r in steps][:2] == [0.0, 1.0]
    assert all(r["rollout/staleness_max"] <= 1 for r in steps)
    assert steps[0]["train/logprob_mismatch"] < 1e-4  # on-policy: the sampler's copy equals the trainer
    records = read(tmp_path / "trajectories.jsonl")
    assert all(len(r["turn_versions"]) == r["num_turns"] and r["turn_versions"] for r in records)


def test_a_resumed_asynchronous_run_regenerates_what_was_in_flight_from_the_checkpoint(tmp_path) -> None:
    common = ["rollout.max_staleness=1", "algo.filter_zero_variance=false", "run.save_every=1"]
    train(config(tmp_path, "run.steps=2", *common), log=lambda s: None)
    lines = len((tmp_path / "trajectories.jsonl").read_text().splitlines())
    resumed = train(config(tmp_path, "run.steps=3", "run.resume=true", *common), log=lambda s: None)
    assert resumed["steps"] == 1
    steps = [r for r in read(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # the batch of step 2 was in flight at the checkpoint: it is sampled again, by the checkpoint's weights
    assert steps[-1]["rollout/staleness_max"] == 0.0
    new = read(tmp_path / "trajectories.jsonl")[lines:]
    assert new and all(r["turn_versions"] == [2] for r in new if "phase" not in r)


def test_max_staleness_is_validated() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        config("/tmp", "rollout.max_staleness=-1")
