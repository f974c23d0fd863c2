"""Training against an unmodified openenv-core server whose action and observation are typed models without `text`.

The server is the example ``examples/openenv_shout_server.py``: openenv-core's own ``create_app``
under uvicorn on a loopback port, nothing of envhub on the server side; the config is the
example ``examples/configs/openenv_shout_grpo.toml``. Importing openenv-core takes seconds, hence ``slow``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.interop, pytest.mark.live, pytest.mark.slow]

openenv_server = pytest.importorskip("openenv.core.env_server.http_server")
uvicorn = pytest.importorskip("uvicorn")

from trainer.config import load_config  # noqa: E402
from trainer.model import load_policy  # noqa: E402
from trainer.recipes.rl import train  # noqa: E402
from trainer.rollout.failures import RolloutFailureError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples.openenv_shout_server import build_app  # noqa: E402

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64"]


@pytest.fixture(scope="module")
def openenv_url():
    app = build_app(max_concurrent_envs=32)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not (server.started and server.servers):
        assert time.monotonic() < deadline, "openenv-core server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(5)


def config(tmp_path, url, *extra: str):
    """The example config (examples/configs/openenv_shout_grpo.toml), shrunk to a few seconds."""
    return load_config(ROOT / "examples/configs/openenv_shout_grpo.toml",
                       [f"env.url='{url}'", *TINY, "rollout.max_tokens_per_turn=6", "rollout.max_total_tokens=6",
                        "run.batch_size=3", "run.group_size=4", "run.eval_problems=2",
                        "algo.filter_zero_variance=false", f"run.output_dir='{tmp_path}'", *extra])


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_steps_train_against_an_unmodified_openenv_server(tmp_path, openenv_url) -> None:
    cfg = config(tmp_path, openenv_url, "run.steps=2")  # env.action_mapper "auto": read from /schema
    model, tok = load_policy(cfg.model)
    before = [p.detach().clone() for p in model.parameters()]
    summary = train(cfg, model=model, tokenizer=tok, log=lambda s: None)
    assert summary["steps"] == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    steps = [r for r in records(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 2 and all(r["rollout/groups_kept"] == 3 and r["rollout/failed_frac"] == 0 for r in steps)
    trajs = [r for r in records(tmp_path / "trajectories.jsonl") if r.get("phase") != "eval"]
    # the typed observation reached the prompt; every reply went to the env as {"message": ...}
    assert all('"echoed_message": "SHOUT SOMETHING"' in t["text"] for t in trajs)
    assert all(t["stop_reason"] == "done" and t["failure"] is None for t in trajs)


def test_a_run_whose_actions_never_fit_says_why_and_stops(tmp_path, openenv_url, capsys) -> None:
    cfg = config(tmp_path, openenv_url, "run.steps=5", "env.action_mapper='identity'", "run.max_failed_steps=2")
    messages: list[str] = []
    with pytest.raises(RolloutFailureError, match=r"last 2 steps.*12/12 episodes failed \(12 with validation_error\)"
                                                  r".*env.action_mapper"):
        train(cfg, log=messages.append)
    assert sum("episodes failed" in m for m in messages) == 2 and "message" in messages[0]
    failures = records(tmp_path / "failures.jsonl")
    assert [f["reason"] for f in failures] == ["validation_error"] * 2 and "message" in failures[0]["example"]
    step = next(r for r in records(tmp_path / "metrics.jsonl") if "rollout/failed_frac" in r)
    assert step["rollout/failed_frac"] == 1.0 and step["rollout/failed_validation_error"] == 12
