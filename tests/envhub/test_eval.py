"""``envhub eval`` against an OpenAI-compatible endpoint: real envs, the real episode loop, real files.

The "model" is a small chat-completions server that returns scripted assistant messages (the
transport is all it stands in for); which script it plays is the request's ``model`` field
(``--model-name``). Everything else is real: env servers, the episode loop, results.jsonl and
summary.json, resume after a kill.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from envhub import Env, EnvRunner, Observation
from envhub.eval.runner import EvalConfig, run_eval
from envhub.eval.summary import pass_at_k, pass_at_ks
from envhub.server import ServerThread
from examples.guess_env import GuessEnv

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


def _call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _bisect(messages: list[dict[str, Any]]) -> dict[str, Any]:
    low, high, last = 1, 100, None
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            last = json.loads(m["tool_calls"][0]["function"]["arguments"])["number"]
        elif m["role"] == "tool" and last is not None:
            low, high = (last + 1, high) if m["content"] == "Higher." else (low, last - 1)
    return {"role": "assistant", "content": None,
            "tool_calls": [_call("guess", json.dumps({"number": (low + high) // 2}), f"c{len(messages)}")]}


def scripted_model(delay_s: float = 0.0, outage: dict[str, bool] | None = None,
                   hold: Callable[[], bool] | None = None) -> FastAPI:
    """Scripts by request ``model``: bisect (solves the guess env), malformed (arguments that are not JSON),
    text (answers in prose), count (says how many messages it was shown), broken (HTTP 500), context (bisects,
    then its context is full: HTTP 400), tiny (the first prompt does not fit its context: HTTP 400),
    flaky (HTTP 500 while ``outage["down"]``, else bisect), throttled (every other request: HTTP 429, else bisect).
    A request waits while ``hold()`` is true."""
    app = FastAPI()
    outage = outage if outage is not None else {"down": False}
    requests = [0]

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        await asyncio.sleep(delay_s)
        while hold is not None and hold():
            await asyncio.sleep(0.02)
        script, messages = body["model"], body["messages"]
        requests[0] += 1
        if script == "throttled" and requests[0] % 2:
            return JSONResponse({"error": "slow down"}, status_code=429, headers={"Retry-After": "0"})
        if script == "broken" or (script == "flaky" and outage["down"]):
            return JSONResponse({"error": "the GPU caught fire"}, status_code=500)
        if (script == "context" and len(messages) > 3) or script == "tiny":
            return JSONResponse({"error": {"message": "This model's maximum context length is 64 tokens"}},
                                status_code=400)
        if script == "malformed":
            message = {"role": "assistant", "content": None, "tool_calls": [_call("guess", "{number: fifty", "c1")]}
        elif script == "text":
            message = {"role": "assistant", "content": "I think it is 42."}
        elif script == "count":
            message = {"role": "assistant", "content": f"I was shown {len(messages)} messages."}
        else:
            message = _bisect(messages)
        return {"object": "chat.completion", "model": script,
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 10 * len(messages), "completion_tokens": 7}}

    return app


class ChatterEnv(Env):
    """Answers every text with the turn's number; never ends."""

    def reset(self, seed: int | None = None) -> Observation:
        self.turn = 0
        return Observation(text="Say anything.")

    def on_text(self, text: str) -> str:
        self.turn += 1
        return f"Turn {self.turn} is over."


class SlowEnv(Env):
    """Every step takes half a second."""

    def reset(self, seed: int | None = None) -> Observation:
        return Observation(text="Say anything.")

    def on_text(self, text: str) -> str:
        time.sleep(0.5)
        return "ok"


class CrashEnv(Env):
    """Raises on every step."""

    def reset(self, seed: int | None = None) -> Observation:
        return Observation(text="Say anything.")

    def on_text(self, text: str) -> str:
        raise RuntimeError("the env has a bug")


class PictureEnv(Env):
    """Shows a picture, then ends on any answer."""

    def reset(self, seed: int | None = None) -> Observation:
        return Observation(text="What is in the picture?", images=[PNG])

    def on_text(self, text: str) -> Observation:
        self.done = True
        return Observation(text="Thanks.", images=[PNG])


@pytest.fixture
def model_url():
    with ServerThread(scripted_model(), log_level="warning") as server:
        yield server.url + "/v1"


@pytest.fixture
def guess_url(serve_env) -> str:
    return serve_env(GuessEnv).url


def evaluate(tmp_path: Path, env: str, model: str, **kwargs: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config = EvalConfig(env=env, model=model, out=str(tmp_path / "out"), **kwargs)
    summary = run_eval(config)
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert summary == json.loads((tmp_path / "out" / "summary.json").read_text())
    return summary, records


def secret_of(seed: int) -> int:
    async def reset() -> int:
        runner = EnvRunner(GuessEnv())
        await runner.reset(seed=seed)
        return int(runner.env.secret)

    return asyncio.run(reset())


def test_an_endpoint_that_solves_the_env_passes_every_task(tmp_path: Path, model_url: str, guess_url: str) -> None:
    summary, records = evaluate(tmp_path, guess_url, model_url, model_name="bisect", episodes=3, samples=2,
                                concurrency=4, seed=10, api_key="sk-do-not-write-me")
    assert sorted((r["task_index"], r["sample"]) for r in records) == [(t, s) for t in range(3) for s in range(2)]
    for rec in records:
        assert rec["seed"] == 10 + rec["task_index"] and rec["reward"] == 1.0 and rec["stop_reason"] == "done"
        assert rec["rewards"] == {"solved": 1.0} and rec["failure"] is None
        assert rec["tool_calls"] == rec["turns"] >= 1
        assert rec["tokens"]["completion"] == 7 * rec["turns"]
        roles = [m["role"] for m in rec["messages"]]
        assert roles[:2] == ["system", "user"] and roles[2:] == ["assistant", "tool"] * rec["turns"]
        last_call = json.loads(rec["messages"][-2]["tool_calls"][0]["function"]["arguments"])["number"]
        assert last_call == secret_of(rec["seed"]) and rec["messages"][-1]["content"] == "Correct!"
        assert rec["messages"][-1]["tool_call_id"] == rec["messages"][-2]["tool_calls"][0]["id"]
    assert summary["mean_reward"] == 1.0 and summary["pass_at_k"] == {"1": 1.0, "2": 1.0}
    assert summary["episodes_done"] == 6 and summary["episodes_failed"] == 0 and summary["complete"]
    assert summary["reward_components"] == {"solved": 1.0}
    assert summary["args"]["model_name"] == "bisect" and summary["args"]["api_key"] == "***"
    assert not any("sk-do-not-write-me" in p.read_text() for p in (tmp_path / "out").iterdir())


def test_eval_serves_a_module_class_itself_with_reset_arguments(tmp_path: Path, model_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the served module is imported from the working directory, as `envhub serve` does
    summary, records = evaluate(tmp_path, "examples.guess_env:GuessEnv", model_url, model_name="bisect", episodes=3,
                                reset_kwargs={"high": 4})
    for rec in records:
        assert rec["messages"][1]["content"].startswith("I picked a number between 1 and 4.")
        assert rec["reward"] == 1.0 and rec["stop_reason"] == "done"
    assert summary["args"]["reset_kwargs"] == {"high": 4} and summary["env"] == "examples.guess_env:GuessEnv"


def test_the_turn_limit_stops_unsolved_episodes_with_reward_0(tmp_path: Path, model_url: str, guess_url: str) -> None:
    # bisection finds the secret in two guesses only when it is 50, 25 or 75
    summary, records = evaluate(tmp_path, guess_url, model_url, model_name="bisect", episodes=4, max_turns=2)
    for rec in records:
        solved = secret_of(rec["seed"]) in (50, 25, 75)
        assert rec["reward"] == (1.0 if solved else 0.0)
        assert rec["stop_reason"] == ("done" if solved else "max_turns") and rec["turns"] <= 2
    assert summary["pass_at_k"]["1"] == sum(r["reward"] for r in records) / 4


def test_model_mistakes_go_back_to_the_model_and_are_counted(tmp_path: Path, model_url: str, guess_url: str) -> None:
    summary, records = evaluate(tmp_path, guess_url, model_url, model_name="malformed", episodes=1, max_turns=3)
    (rec,) = records
    assert rec["malformed_tool_calls"] == 3 and rec["reward"] == 0.0 and rec["failure"] is None
    assert rec["messages"][3]["role"] == "tool" and "not a JSON object" in rec["messages"][3]["content"]
    summary_text, text_records = evaluate(tmp_path / "text", guess_url, model_url, model_name="text", episodes=1,
                                          max_turns=2)
    assert text_records[0]["invalid_actions"] == 2 and text_records[0]["messages"][3]["role"] == "user"
    assert "expects a tool call" in text_records[0]["messages"][3]["content"]
    assert summary["failures"] == {} and summary["episodes_done"] == 1
    assert summary["policy_errors"] == {"malformed_tool_calls": 3, "invalid_actions": 0, "episodes": 1}
    assert summary_text["policy_errors"]["invalid_actions"] == 2 and summary_text["failures"] == {}


def test_failures_of_the_model_and_the_env_are_counted_by_kind_and_never_scored(
        tmp_path: Path, model_url: str, guess_url: str, serve_env) -> None:
    summary, records = evaluate(tmp_path, guess_url, model_url, model_name="broken", episodes=2)
    assert all(r["reward"] is None and r["stop_reason"] == "model_error" for r in records)
    assert all(r["failure"]["kind"] == "model" and "HTTP 200" in r["failure"]["message"] for r in records)
    assert summary["mean_reward"] is None and summary["pass_at_k"] == {"1": None}
    assert summary["failures"] == {"model": 2} and summary["episodes_failed"] == 2
    from envhub.eval.serve import free_port

    down, env_records = evaluate(tmp_path / "down", f"ws://127.0.0.1:{free_port()}", model_url,
                                 model_name="bisect", episodes=1)
    assert env_records[0]["failure"]["kind"] == "infrastructure" and env_records[0]["reward"] is None
    assert env_records[0]["stop_reason"] == "env_error" and "EnvConnectionError" in env_records[0]["failure"]["message"]
    assert down["failures"] == {"infrastructure": 1}
    crashed, crash_records = evaluate(tmp_path / "crash", serve_env(CrashEnv).url, model_url, model_name="text",
                                      episodes=2)
    assert all(r["failure"]["kind"] == "env" and r["stop_reason"] == "env_error" for r in crash_records)
    assert "the env has a bug" in crash_records[0]["failure"]["message"] and crashed["failures"] == {"env": 2}
    assert crashed["mean_reward"] is None and crashed["pass_at_k"] == {"1": None}


def test_a_full_context_ends_the_episode_as_max_tokens_and_is_scored(tmp_path: Path, model_url: str,
                                                                     guess_url: str) -> None:
    summary, (rec,) = evaluate(tmp_path, guess_url, model_url, model_name="context", episodes=1, seed=1)
    assert secret_of(1) != 50, "the first guess must not solve it for this test"
    assert rec["stop_reason"] == "max_tokens" and rec["turns"] == 1 and rec["reward"] == 0.0
    assert rec["failure"] is None and summary["failures"] == {}
    assert summary["pass_at_k"] == {"1": 0.0}
    # a first prompt that does not fit: the policy never acted, so it is the model's failure, not a 0
    summary, (rec,) = evaluate(tmp_path / "tiny", guess_url, model_url, model_name="tiny", episodes=1, seed=1)
    assert rec["stop_reason"] == "model_error" and rec["turns"] == 0 and rec["reward"] is None
    assert rec["failure"]["message"].startswith("the first prompt does not fit the model's context: ")
    assert summary["failures"] == {"model": 1} and summary["pass_at_k"] == {"1": None}


def test_the_episode_deadline_and_the_env_step_timeout_are_told_apart(tmp_path: Path, model_url: str,
                                                                       serve_env) -> None:
    slow = serve_env(SlowEnv).url
    summary, (rec,) = evaluate(tmp_path, slow, model_url, model_name="text", episodes=1, episode_timeout_s=1.2)
    assert rec["failure"]["kind"] == "infrastructure" and rec["stop_reason"] == "timeout" and rec["reward"] is None
    assert rec["failure"]["message"] == "the episode ran past --episode-timeout 1.2 s"
    assert 1 <= rec["turns"] <= 3 and summary["failures"] == {"infrastructure": 1}
    strict = serve_env(SlowEnv, step_timeout_s=0.1).url
    _, (rec,) = evaluate(tmp_path / "strict", strict, model_url, model_name="text", episodes=1, episode_timeout_s=30)
    assert rec["failure"]["kind"] == "infrastructure" and rec["stop_reason"] == "timeout"
    assert rec["failure"]["message"].startswith("StepTimeoutError")


def test_image_observations_are_image_url_parts(tmp_path: Path, model_url: str, serve_env) -> None:
    _, (rec,) = evaluate(tmp_path, serve_env(PictureEnv).url, model_url, model_name="text", episodes=1)
    first, last = rec["messages"][1], rec["messages"][-1]
    for message in (first, last):
        image, text = message["content"]
        assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
        assert text["type"] == "text"
    assert rec["stop_reason"] == "done"


def _run_cli(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # `python -m envhub eval ...` with Ctrl-C as at a terminal, even when the suite runs as a background job
    # (which starts its children with SIGINT ignored: Python then raises no KeyboardInterrupt)
    main = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "runpy.run_module('envhub', run_name='__main__', alter_sys=True)")
    return subprocess.Popen([sys.executable, "-c", main, "eval", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_a_killed_run_resumes_without_duplicates_and_ctrl_c_keeps_the_finished(tmp_path: Path, guess_url: str) -> None:
    results = tmp_path / "out" / "results.jsonl"
    # the model stops answering once results.jsonl holds `at` episodes, until the signal: it lands mid-run however slow the machine
    gate: dict[str, int | None] = {"at": None}
    hold = lambda: gate["at"] is not None and _lines(results) >= gate["at"]  # noqa: E731
    with ServerThread(scripted_model(delay_s=0.05, hold=hold), log_level="warning") as slow_model:
        args = ["--env", guess_url, "--model", slow_model.url + "/v1", "--model-name", "bisect", "--episodes", "4",
                "--samples", "2", "--concurrency", "1", "--out", "out", "--seed", "3"]
        for sig in (signal.SIGKILL, signal.SIGINT):
            gate["at"] = _lines(results) + 2
            proc = _run_cli(tmp_path, *args, *(["--resume"] if sig == signal.SIGINT else []))
            deadline = time.monotonic() + 120
            while _lines(results) < gate["at"] and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.poll() is None, "the run ended before its signal"
            proc.send_signal(sig)
            gate["at"] = None  # the held request may finish now: Ctrl-C needs no answer to stop
            _, err = proc.communicate(timeout=60)
            if sig == signal.SIGINT:
                assert proc.returncode == 130, err
                summary = json.loads((tmp_path / "out" / "summary.json").read_text())
                assert summary["interrupted"] and summary["episodes_recorded"] == _lines(results) and 4 <= _lines(results) < 8
        changed = _run_cli(tmp_path, *args, "--resume", "--max-turns", "3")
        _, err = changed.communicate(timeout=60)
        assert changed.returncode == 2 and "max_turns: 10 in run.json, 3 now" in err
        final = _run_cli(tmp_path, *args, "--resume")
        out, err = final.communicate(timeout=120)
        assert final.returncode == 0, err
    pairs = [(r["task_index"], r["sample"]) for r in map(json.loads, results.read_text().splitlines())]
    assert sorted(pairs) == [(t, s) for t in range(4) for s in range(2)], "every pair once: none lost, none twice"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["complete"] and not summary["interrupted"] and summary["pass_at_k"] == {"1": 1.0, "2": 1.0}
    assert json.loads(out)["episodes_done"] == 8


def test_resume_with_retry_failed_plays_the_failed_episodes_again(tmp_path: Path, model_url: str,
                                                                   guess_url: str) -> None:
    outage = {"down": True}
    with ServerThread(scripted_model(outage=outage), log_level="warning") as flaky:
        config = dict(env=guess_url, model=flaky.url + "/v1", model_name="flaky", episodes=2, samples=2,
                      out=str(tmp_path / "out"))
        assert run_eval(EvalConfig(**config))["failures"] == {"model": 4}
        outage["down"] = False  # the endpoint is back
        unchanged = run_eval(EvalConfig(**config, resume=True))
        assert unchanged["failures"] == {"model": 4}, "a plain --resume keeps the failed episodes"
        again = run_eval(EvalConfig(**config, resume=True, retry_failed=True))
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4, "each failed line is replaced, none duplicated"
    assert again["failures"] == {} and again["pass_at_k"] == {"1": 1.0, "2": 1.0}
    with pytest.raises(ValueError, match="use it with --resume"):
        EvalConfig(env=guess_url, model=model_url, retry_failed=True)


def test_a_throttled_endpoint_is_retried(tmp_path: Path, model_url: str, guess_url: str) -> None:
    summary, records = evaluate(tmp_path, guess_url, model_url, model_name="throttled", episodes=2, concurrency=1)
    assert summary["failures"] == {} and all(r["reward"] == 1.0 for r in records)


def test_a_new_run_refuses_to_overwrite_results(tmp_path: Path, model_url: str, guess_url: str) -> None:
    evaluate(tmp_path, guess_url, model_url, model_name="bisect", episodes=1)
    with pytest.raises(ValueError, match="already holds results; pass --resume"):
        evaluate(tmp_path, guess_url, model_url, model_name="bisect", episodes=1)


# -- pass@k ------------------------------------------------------------------------------------------


def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (c passing) that hold at least one pass."""
    from itertools import combinations

    subsets = list(combinations([i < c for i in range(n)], k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_is_the_unbiased_estimator(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k))
    assert pass_at_k(n, 1, 1) == pytest.approx(1 / n)


def test_pass_at_k_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="Expected 0 <= c <= n and 1 <= k <= n"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_pass_at_ks_uses_the_threshold_and_leaves_failed_samples_out() -> None:
    records = [{"task_index": 0, "reward": 1.0}, {"task_index": 0, "reward": 0.5},
               {"task_index": 1, "reward": 0.5}, {"task_index": 1, "reward": None}]
    strict = pass_at_ks(records, 2, threshold=1.0)
    assert strict["pass_at_k"] == {"1": 0.25, "2": 1.0} and strict["pass_at_k_tasks"] == {"1": 2, "2": 1}
    assert pass_at_ks(records, 2, threshold=0.5)["pass_at_k"] == {"1": 1.0, "2": 1.0}


def test_an_episode_sums_the_envs_reward_components_and_stats_and_the_summary_averages_them() -> None:
    from envhub.eval.episode import EpisodeRecord
    from envhub.eval.summary import summarize
    from envhub.types import StepResult

    rec = EpisodeRecord(task_index=0, seed=0, sample=0)
    for info in ({"rewards": {"valid": 1.0}, "stats": {"win_chances": 1, "wins_missed": 1}},
                 {"rewards": {"valid": 1.0, "bad": "x"}, "stats": {"win_chances": 1, "wins_missed": 0}}):
        rec.add_step(StepResult(observation=Observation(text=""), reward=1.0, info=info))
    assert rec.rewards == {"valid": 2.0} and rec.stats == {"win_chances": 2.0, "wins_missed": 1.0}
    other = {**rec.to_json(), "stats": {"win_chances": 0.0, "wins_missed": 0.0}}
    summary = summarize([rec.to_json(), other], episodes=2, samples=1, threshold=1.0, wall_s=1.0, args={})
    assert summary["stats"] == {"win_chances": 1.0, "wins_missed": 0.5}


def test_picture_env_is_a_valid_env() -> None:
    from envhub.testing import check_env

    check_env(PictureEnv)



def test_without_tqdm_progress_is_one_line_rewritten_on_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from envhub.eval.episode import EpisodeRecord
    from envhub.eval.runner import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` raises ImportError, as where it is not installed
    stream = io.StringIO()
    progress = Progress(total=3, done=1, stream=stream)
    progress.update(EpisodeRecord(task_index=0, seed=0, sample=1, reward=1.0))
    progress.update(EpisodeRecord(task_index=1, seed=1, sample=0, reward=None))
    progress.close()
    assert stream.getvalue() == "\reval 2/3 failed=0 reward=1.000\reval 3/3 failed=1 reward=1.000\n"


def test_a_local_model_that_is_not_there_is_one_clear_line_and_status_2(tmp_path: Path, guess_url: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from envhub.cli import main

    assert main(["eval", "--env", guess_url, "--model", "no-such-org/no-such-model", "--episodes", "1",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("envhub eval: error: Could not load the tokenizer of 'no-such-org/no-such-model' offline")


def test_a_run_where_every_episode_failed_says_why_in_one_line_and_exits_1(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from envhub.cli import main
    from envhub.eval.serve import free_port

    dead = f"ws://127.0.0.1:{free_port()}"
    assert main(["eval", "--env", dead, "--model", "tiny", "--episodes", "2", "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("envhub eval: error: no episode completed (2 failed: 2 infrastructure); the first: ")
    assert "Is the server running?" in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["episodes_done"] == 0


def test_ctrl_c_while_the_env_server_starts_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from envhub.eval import serve

    server = serve.LocalEnvServer("examples.guess_env:GuessEnv")
    started: list[subprocess.Popen[bytes]] = []

    def interrupted(*args: Any, **kwargs: Any) -> bool:
        assert server.proc is not None
        started.append(server.proc)
        raise KeyboardInterrupt  # Ctrl-C during the wait for /health

    monkeypatch.setattr(serve, "_healthy", interrupted)
    monkeypatch.chdir(ROOT)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert started and started[0].poll() is not None, "the child `envhub serve` (its own session) is stopped"
    assert server.proc is None and not Path(server._log.name).exists()


def test_set_with_a_server_url_is_refused_not_ignored() -> None:
    with pytest.raises(ValueError, match="Expected --set only with an env eval serves itself"):
        EvalConfig(env="ws://127.0.0.1:8001", model="tiny", env_config={"size": 9})
    assert EvalConfig(env="math", model="tiny", env_config={"size": 9}).env_config == {"size": 9}


def test_an_out_that_is_a_file_is_refused_in_one_line(tmp_path: Path) -> None:
    from envhub.eval.runner import EvalRun

    (tmp_path / "out").write_text("not a directory")
    with pytest.raises(ValueError, match="Expected --out to be a directory .*which is a file"):
        EvalRun(EvalConfig(env="ws://127.0.0.1:1", model="tiny", out=str(tmp_path / "out"))).prepare()


def test_resume_refuses_fewer_episodes_and_a_broken_run_json_in_one_line(tmp_path: Path) -> None:
    from envhub.eval.runner import EvalRun

    out = tmp_path / "out"
    config: dict[str, Any] = dict(env="ws://127.0.0.1:1", model="tiny", out=str(out), episodes=2, samples=2)
    EvalRun(EvalConfig(**config)).prepare()
    pairs = {(t, s) for t in range(2) for s in range(2)}
    lines = "".join(json.dumps({"task_index": t, "sample": s, "reward": 0.0}) + "\n" for t, s in sorted(pairs))
    (out / "results.jsonl").write_text(lines)
    for fewer in ({"episodes": 1}, {"samples": 1}):
        with pytest.raises(ValueError, match="may only grow on resume"):
            EvalRun(EvalConfig(**{**config, **fewer}, resume=True)).prepare()
    assert (out / "results.jsonl").read_text() == lines, "a refused resume changes nothing"
    assert EvalRun(EvalConfig(**{**config, "episodes": 3}, resume=True)).prepare() == (pairs, 0.0)
    (out / "run.json").write_text("{broken")
    with pytest.raises(ValueError, match="run.json to hold a JSON object, got unreadable JSON"):
        EvalRun(EvalConfig(**config, resume=True)).prepare()


def test_a_model_path_that_is_not_a_directory_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Expected --model to be a Hugging Face model directory.*not a directory"):
        EvalConfig(env="math", model=str(tmp_path / "missing"), out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert EvalConfig(env="math", model=str(tmp_path)).model == str(tmp_path), "an existing directory is taken"


def test_a_transcript_with_unicode_line_separators_is_one_record(tmp_path: Path) -> None:
    from envhub.eval.runner import EvalRun

    out = tmp_path / "out"
    config: dict[str, Any] = dict(env="ws://127.0.0.1:1", model="tiny", out=str(out), episodes=1, samples=2)
    EvalRun(EvalConfig(**config)).prepare()
    text = "a\u2028b\x85c\u2029d\x1ce\x0bf"  # str.splitlines() splits on each of these; JSON lines do not
    recs = [{"task_index": 0, "sample": s, "reward": 1.0, "messages": [{"role": "assistant", "content": text}]}
            for s in range(2)]
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
    (out / "results.jsonl").write_text(lines + '{"task_index": 0, "sam', encoding="utf-8")  # + a line cut by a kill
    run = EvalRun(EvalConfig(**config, resume=True))
    assert run.prepare() == ({(0, 0), (0, 1)}, 0.0), "every episode is recorded: none is played again"
    assert (out / "results.jsonl").read_text(encoding="utf-8") == lines, "only the cut line is removed"
    summary = run.write_summary(1.0, interrupted=False)
    assert summary["episodes_recorded"] == 2 and summary["complete"] and summary["pass_at_k"] == {"1": 1.0, "2": 1.0}


def test_a_history_window_shows_the_model_its_newest_observation_and_keeps_the_whole_record(
        tmp_path: Path, model_url: str, serve_env) -> None:
    env = serve_env(ChatterEnv).url
    _, [whole] = evaluate(tmp_path / "whole", env, model_url, model_name="count", episodes=1, max_turns=3)
    _, [windowed] = evaluate(tmp_path / "window", env, model_url, model_name="count", episodes=1, max_turns=3,
                             history_turns=0)
    shown = [[m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in (whole, windowed)]
    assert shown[0] == [f"I was shown {n} messages." for n in (2, 4, 6)]  # system, observations and replies
    assert shown[1] == ["I was shown 2 messages."] * 3  # the system prompt and the newest observation
    assert len(windowed["messages"]) == len(whole["messages"]) == 8  # the record holds the whole conversation
    with pytest.raises(ValueError, match="--history-turns >= 0"):
        EvalConfig(env=env, model=model_url, history_turns=-1)
