"""``envhub view``'s HTTP API in process: listing, filtering, paging, one episode, tokens, metrics, bad input."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from view_fixtures import run_record, write_eval_dir, write_run_dir

from envhub.cli import main
from envhub.view import create_view_app


@pytest.fixture
def eval_client(tmp_path):
    write_eval_dir(tmp_path / "ev", n=12)
    with TestClient(create_view_app(tmp_path / "ev")) as client:
        yield client


@pytest.fixture
def run_dir(tmp_path):
    write_run_dir(tmp_path / "run", steps=5, per_step=4)
    return tmp_path / "run"


def test_eval_dir_lists_filters_and_pages_episodes(eval_client) -> None:
    info = eval_client.get("/api/info").json()
    assert info["kind"] == "eval" and info["summary"] == {"episodes": 12, "pass@1": 0.7}
    assert info["facets"]["failure"] == {"env_error": 1, "none": 11} and info["facets"]["bad_lines"] == 0
    page = eval_client.get("/api/episodes", params={"limit": 5}).json()
    assert page["total"] == 12 and [r["index"] for r in page["rows"]] == [0, 1, 2, 3, 4]
    assert eval_client.get("/api/episodes", params={"limit": 5, "offset": 10}).json()["rows"][-1]["index"] == 11
    wrong = eval_client.get("/api/episodes", params={"reward_max": 0.5}).json()
    assert [r["index"] for r in wrong["rows"]] == [3, 7]
    failed = eval_client.get("/api/episodes", params={"failure": "env_error"}).json()
    assert [(r["index"], r["reward"], r["stop_reason"]) for r in failed["rows"]] == [(11, None, "env_error")]
    both = eval_client.get("/api/episodes", params=[("stop_reason", "done"), ("stop_reason", "env_error")]).json()
    assert both["total"] == 12


def test_one_eval_episode_is_a_conversation_with_a_tool_call_and_an_image(eval_client) -> None:
    ep = eval_client.get("/api/episodes/0").json()
    assert ep["rewards"] == {"correct": 1.0, "format": 0.1} and ep["has_tokens"] is False
    roles = [m["role"] for m in ep["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert ep["messages"][2]["tool_calls"][0]["name"] == "run_python"
    assert ep["messages"][1]["parts"][1]["src"].startswith("data:image/png;base64,iVBOR")
    assert ep["details"]["tokens"] == {"prompt": 40, "completion": 12} and "messages" not in ep["details"]
    assert eval_client.get("/api/episodes/0/tokens").json()["available"] is False
    assert eval_client.get("/api/episodes/12").status_code == 404


def test_run_dir_serves_tokens_metrics_and_sees_new_lines(run_dir) -> None:
    with TestClient(create_view_app(run_dir)) as client:
        info = client.get("/api/info").json()
        assert info["kind"] == "run" and info["facets"]["episodes"] == 20 and info["facets"]["steps"] == [1, 5]
        assert info["metric_keys"] == ["train/reward_mean", "train/loss"]
        curve = client.get("/api/metrics", params={"key": "train/reward_mean"}).json()["series"]
        assert curve == {"train/reward_mean": [[s, s / 5] for s in range(1, 6)]}
        assert client.get("/api/episodes", params={"step_min": 5}).json()["total"] == 4
        tokens = client.get("/api/episodes/0/tokens").json()
        assert tokens["available"] and [s["mask"] for s in tokens["segments"]] == [0, 1, 0, 1]
        with open(run_dir / "trajectories.jsonl", "a") as handle:
            handle.write(json.dumps(run_record(6, 1.0)) + "\n" + "{broken\n" + json.dumps(run_record(7, 1.0))[:30])
        info = client.get("/api/info").json()
        assert info["facets"]["episodes"] == 21 and info["facets"]["bad_lines"] == 1
        assert info["facets"]["bad_examples"][0]["line"] == 22
        assert client.get("/api/episodes", params={"step_min": 6}).json()["rows"][0]["index"] == 20


def test_failures_are_the_newest_complete_records(run_dir) -> None:
    with TestClient(create_view_app(run_dir)) as client:
        assert [r["reason"] for r in client.get("/api/failures").json()["records"]] == ["parse_error"]
        with open(run_dir / "failures.jsonl", "a") as handle:
            handle.write(json.dumps({"step": 3, "failed": 4, "episodes": 4, "reason": "env_error"}) + "\n{\"step\": 4")
        data = client.get("/api/failures", params={"limit": 1}).json()
        assert data == {"records": [{"step": 3, "failed": 4, "episodes": 4, "reason": "env_error"}], "bad_lines": 0}
        assert client.get("/api/failures", params={"limit": 201}).status_code == 422


@pytest.mark.parametrize("params", [{"limit": 0}, {"limit": 201}, {"offset": -1}, {"reward_min": "nan"},
                                    {"step_min": 10**13}, {"stop_reason": "x" * 65},
                                    [("failure", str(i)) for i in range(33)], {"phase": "p" * 65}])
def test_every_query_parameter_is_bounded(eval_client, params) -> None:
    assert eval_client.get("/api/episodes", params=params).status_code == 422


def test_nothing_outside_the_directory_is_served(eval_client, tmp_path) -> None:
    (tmp_path / "secret.txt").write_text("secret")
    for url in ["/../secret.txt", "/%2e%2e/secret.txt", "/api/episodes/..%2f..%2fsecret.txt", "/results.jsonl",
                "/summary.json", "/api/episodes/-1", "/docs", "/openapi.json"]:
        response = eval_client.get(url)
        assert response.status_code in (404, 422) and "secret" not in response.text, url
    page = eval_client.get("/")
    assert page.status_code == 200 and "<title>envhub view</title>" in page.text
    assert "img-src data:" in page.headers["content-security-policy"]
    assert eval_client.get("/api/metrics", params={"max_points": 1}).status_code == 422


def test_a_directory_that_is_neither_a_run_nor_an_eval_is_refused(tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="Expected a training run directory"):
        create_view_app(tmp_path)
    assert main(["view", str(tmp_path / "missing")]) == 2
    assert "envhub view: error: Expected a run or eval directory" in capsys.readouterr().err
    write_eval_dir(tmp_path / "seed1", n=1)
    with pytest.raises(ValueError, match="Its subdirectories seed1 hold runs: envhub view .*seed1$"):
        create_view_app(tmp_path)


def test_a_port_in_use_or_out_of_range_is_one_line_and_status_2(tmp_path, capsys) -> None:
    import socket

    write_eval_dir(tmp_path / "ev", n=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["view", str(tmp_path / "ev"), "--port", str(port)]) == 2
    assert main(["view", str(tmp_path / "ev"), "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 2, err
    assert f"got 127.0.0.1:{port}: Address already in use." in err and "got 127.0.0.1:70000: " in err


@pytest.mark.live
def test_the_cli_serves_on_loopback_and_prints_the_real_port(tmp_path) -> None:
    import re
    import subprocess
    import sys

    import httpx

    write_eval_dir(tmp_path / "ev", n=3)
    proc = subprocess.Popen([sys.executable, "-m", "envhub", "view", str(tmp_path / "ev"), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"at http://127\.0\.0\.1:(\d+)/", line)
        assert match and int(match.group(1)) > 0, line
        info = httpx.get(f"http://127.0.0.1:{match.group(1)}/api/info", timeout=30).json()
        assert info["kind"] == "eval" and info["facets"]["episodes"] == 3
        # a loopback viewer answers only loopback names (a page elsewhere cannot rebind a DNS name to it)
        url = f"http://127.0.0.1:{match.group(1)}/api/info"
        assert httpx.get(url, headers={"Host": "evil.example"}, timeout=30).status_code == 400
        assert httpx.get(url, headers={"Host": f"localhost:{match.group(1)}"}, timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(15)
        if proc.stdout is not None:
            proc.stdout.close()
