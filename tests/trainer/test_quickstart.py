"""The quick start end to end, much shortened: server up, SFT warm-up, GRPO over WebSocket, summary, plot,
and the server stopped afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trainer import quickstart, while_parent

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_env_server_ends_with_the_script_that_started_it_even_when_killed(tmp_path) -> None:
    # A SIGKILL skips env_server's `finally`: the server must still not outlive the script.
    script = ("import sys, time\nfrom pathlib import Path\n"
              "from trainer.local_server import free_port\nfrom trainer.quickstart import math_server\n"
              "with math_server(free_port(), Path(sys.argv[1])) as url:\n    print(url, flush=True)\n    time.sleep(600)\n")
    script_proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "server.log")],
                                   stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        url = script_proc.stdout.readline().strip()
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            assert resp.status == 200  # it serves ...
        script_proc.kill()
        script_proc.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
            except OSError:
                break  # ... and it is gone with the script
            time.sleep(0.2)
        else:
            pytest.fail(f"The env server at {url} outlived the script that started it.")
    finally:
        script_proc.kill()
        script_proc.wait()


def test_while_parent_runs_a_script_as_python_would(tmp_path) -> None:
    # The benchmarks that are scripts start their servers from their own file, and import their siblings.
    (tmp_path / "sibling.py").write_text("NAME = 'sibling'\n")
    (tmp_path / "script.py").write_text("import sys\nfrom sibling import NAME\n"
                                        "print(__name__, NAME, sys.argv[1:], flush=True)\n")
    done = subprocess.run(while_parent.argv(str(tmp_path / "script.py"), "--serve", "x"), capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "__main__ sibling ['--serve', 'x']\n"


def test_while_parent_refuses_bad_arguments_and_a_parent_already_gone() -> None:
    run = [sys.executable, "-m", "trainer.while_parent"]
    usage = subprocess.run([*run, "json.tool"], capture_output=True, text=True, cwd=ROOT)
    assert usage.returncode == 1 and "usage: python -m trainer.while_parent PID MODULE|SCRIPT.py" in usage.stderr
    missing = subprocess.run(while_parent.argv("no/such/script.py"), capture_output=True, text=True, cwd=ROOT)
    assert missing.returncode == 1 and "No script no/such/script.py to run." in missing.stderr
    if sys.platform.startswith("linux"):  # pid 1 did not start it: its real parent is taken to have ended
        gone = subprocess.run([*run, "1", "json.tool"], capture_output=True, text=True, cwd=ROOT)
        assert gone.returncode == 1 and "Process 1, which started json.tool, has already ended." in gone.stderr
