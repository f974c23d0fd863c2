"""``envhub view`` over what the trainer really writes: a two-step GRPO run of the tiny policy against the
math env with its Python tool (three turns, tool schemas in the system prompt), then the API and the page
in headless Chromium over that directory."""

from __future__ import annotations

import json

import pytest
from cdp_browser import CHROMIUM, Browser
from fastapi.testclient import TestClient

from envhub.server.run import ServerThread
from envhub.view import create_view_app

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from trainer.config import load_config
    from trainer.recipes.rl import train

    out = tmp_path_factory.mktemp("math_run")
    cfg = load_config(None, [
        "env.env_class='env_servers.math_env.tool_env:MathToolEnv'", "rollout.tool_mode='tools'", "rollout.max_turns=3",
        "env.train_task={ split = 'train', kind = 'add', difficulty = 1 }",
        "env.eval_task={ split = 'validation', kind = 'add', difficulty = 1 }", "env.eval_key='index'", *TINY,
        "rollout.max_tokens_per_turn=6", "rollout.max_total_tokens=4000", "run.steps=2", "run.batch_size=2",
        "run.group_size=2", "run.eval_problems=2", "algo.filter_zero_variance=false", "run.device='cpu'",
        f"run.output_dir='{out}'"])
    train(cfg, log=lambda message: None)
    return out


def test_the_api_reads_a_real_run(run_dir) -> None:
    written = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    with TestClient(create_view_app(run_dir)) as client:
        info = client.get("/api/info").json()
        assert info["kind"] == "run" and info["facets"]["episodes"] == len(written) and info["facets"]["bad_lines"] == 0
        assert info["facets"]["phase"] == {"eval": 4, "train": 8} and info["facets"]["steps"] == [0, 2]
        assert "train/reward_mean" in info["metric_keys"] and info["summary"]["steps"] == 2
        curve = client.get("/api/metrics", params={"key": "train/reward_mean"}).json()["series"]["train/reward_mean"]
        assert [step for step, _ in curve] == [1.0, 2.0]
        train_rows = client.get("/api/episodes", params={"phase": "train"}).json()["rows"]
        first = train_rows[0]["index"]
        episode = client.get(f"/api/episodes/{first}").json()
        record = written[first]
        roles = [m["role"] for m in episode["messages"]]
        assert roles[:3] == ["system", "user", "assistant"] and roles.count("assistant") == record["num_turns"]
        assert all(m["trained"] == (m["role"] == "assistant") for m in episode["messages"])
        assert "run_python" in episode["messages"][0]["parts"][0]["text"] and "tool_calls" not in episode["messages"][0]
        assert "What is" in episode["messages"][1]["parts"][0]["text"]
        tokens = client.get(f"/api/episodes/{first}/tokens").json()
        assert tokens["decoded"] and [s["mask"] for s in tokens["segments"]] == [0, 1] * record["num_turns"]
        assert "".join(s["text"] for s in tokens["segments"]) == record["text"]
        assert tokens["trained_tokens"] == sum(record["mask"])


@pytest.mark.live
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_the_page_shows_a_real_run(run_dir, tmp_path) -> None:
    with ServerThread(create_view_app(run_dir)) as server, Browser() as browser:
        browser.open(server.url + "/")
        browser.wait_for("document.querySelectorAll('#list tbody tr').length === 12", "the run's 12 episodes")
        browser.wait_for("!!document.querySelector('#curve-plot polyline')", "the reward curve")
        browser.eval("document.querySelector('#list tbody tr[data-index=\"2\"]').click()")
        browser.wait_for("document.querySelectorAll('#conv .msg.role-assistant').length >= 1", "the conversation")
        browser.eval("document.getElementById('tab-tokens').click()")
        browser.wait_for("document.querySelectorAll('#tokens .runs .tok.trained').length >= 1", "the trained tokens")
        assert browser.eval("document.querySelectorAll('#tokens .runs .tok.trained').length") == browser.eval(
            "document.querySelectorAll('#conv .msg.role-assistant').length")
        browser.screenshot(tmp_path / "real_run.png")
        assert (tmp_path / "real_run.png").stat().st_size > 20_000
