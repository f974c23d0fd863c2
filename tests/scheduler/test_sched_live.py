"""Live tests: uvicorn on a loopback port, the real client and CLI, a killed client, a headless page."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import pytest
from sched_helpers import PY, alive, wait_for_sync

from trainer.scheduler import JobNotFoundError, JobRequestError, SchedulerClient
from trainer.scheduler.cli import main as cli

pytestmark = pytest.mark.live


def test_client_follows_logs_until_the_job_ends(live):
    with SchedulerClient(live.url) as client:
        job = client.submit([PY, "-u", "-c", "import time\nfor i in range(3): print('line', i); time.sleep(0.2)"])
        text = "".join(client.logs(job["id"], follow=True))
        assert text == "line 0\nline 1\nline 2\n"
        assert client.status(job["id"])["state"] == "succeeded"
        with pytest.raises(JobRequestError, match="at most 4 GPUs"):
            client.submit(["true"], gpus=8)
        with pytest.raises(JobNotFoundError):
            client.cancel("j00000000")


def test_followed_logs_decode_a_character_split_across_chunks(live):
    script = ("import sys, time\nsys.stdout.buffer.write(b'caf\\xc3'); sys.stdout.flush(); time.sleep(0.5)\n"
              "sys.stdout.buffer.write(b'\\xa9\\n'); sys.stdout.flush()")
    with SchedulerClient(live.url) as client:
        job = client.submit([PY, "-u", "-c", script])
        assert "".join(client.logs(job["id"], follow=True)) == "caf\u00e9\n"  # not two replacement characters
        assert b"".join(client.follow_bytes(job["id"])) == "caf\u00e9\n".encode()


def test_job_context_cancels_on_keyboard_interrupt(live):
    with SchedulerClient(live.url) as client:
        with pytest.raises(KeyboardInterrupt):
            with client.job(["sleep", "60"], gpus=2, heartbeat_timeout_s=1.5) as job:
                wait_for_sync(lambda: job.status()["state"] == "running", what="the job to run")
                time.sleep(1.8)  # longer than the timeout: only the heartbeat thread keeps it alive
                assert job.status()["state"] == "running"
                pid = job.status()["pid"]
                raise KeyboardInterrupt
        final = client.status(job.id)
    assert final["state"] == "cancelled" and not alive(pid)


@pytest.mark.slow
def test_a_killed_client_stops_heartbeats_and_its_job_is_cleaned_up(live):
    script = (f"from trainer.scheduler import SchedulerClient\n"
              f"c = SchedulerClient({live.url!r})\n"
              f"with c.job(['sleep', '60'], gpus=4, heartbeat_timeout_s=1.5) as job:\n"
              f"    print(job.id, flush=True)\n"
              f"    import time; time.sleep(60)\n")
    client_proc = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, text=True)
    job_id = client_proc.stdout.readline().strip()
    with SchedulerClient(live.url) as client:
        wait_for_sync(lambda: client.status(job_id)["pid"] is not None, what="the job to start")
        time.sleep(1.8)
        assert client.status(job_id)["state"] == "running"  # alive while its client beats
        pid = client.status(job_id)["pid"]
        client_proc.send_signal(signal.SIGKILL)  # no finally, no cancel: only the heartbeats stop
        client_proc.wait()
        final = client.wait(job_id, timeout_s=10)
        assert final["state"] == "failed" and final["reason"].startswith("heartbeat lost")
        assert not alive(pid) and all(g["job"] is None for g in client.gpus())
    client_proc.stdout.close()


def test_cli_submit_list_logs_status_cancel(live, monkeypatch, capsys):
    monkeypatch.setenv("ENVHUB_SCHEDULER_URL", live.url)
    assert cli(["submit", "--gpus", "2", "--name", "hi", "--kind", "sft", "--", "sh", "-c", "echo hi from $CUDA_VISIBLE_DEVICES"]) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.startswith("j") and " " not in job_id  # just the id on stdout
    assert cli(["logs", job_id, "-f"]) == 0
    assert capsys.readouterr().out == "hi from 0,1\n"
    assert cli(["submit", "--gpus", "1", "--", "sleep", "60"]) == 0
    sleeper = capsys.readouterr().out.strip()
    assert cli(["list", "--json"]) == 0
    jobs = json.loads(capsys.readouterr().out)
    assert [(j["id"], j["name"], j["state"], j["gpus"], j["kind"]) for j in jobs] == [
        (job_id, "hi", "succeeded", [0, 1], "sft"), (sleeper, "sleep", "running", [0], "cmd")]
    assert cli(["nodes"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["local", "127.0.0.1", "4", "3", sleeper]
    assert cli(["cancel", sleeper]) == 0 and capsys.readouterr().out.strip() == "cancelled"
    assert cli(["status", sleeper]) == 0 and json.loads(capsys.readouterr().out)["state"] == "cancelled"
    assert cli(["submit", "--gpus", "5", "--", "true"]) == 2
    assert "at most 4 GPUs" in capsys.readouterr().err
    assert cli(["status", "nope"]) == 2 and "No job 'nope'" in capsys.readouterr().err


def _serve(tmp_path, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([PY, "-m", "trainer.scheduler.cli", "serve", "--port", "0", "--db", str(tmp_path / "s.db"),
                             "--grace-s", "1", "--ports", "39600-39699", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    while True:
        line = proc.stdout.readline()
        lines.append(line)
        if "serving on" in line:
            return proc, line.rsplit(" ", 1)[1].strip()
        if not line:
            raise AssertionError(f"serve exited: {''.join(lines)}")


@pytest.mark.slow
def test_restart_keeps_every_record_and_ends_orphaned_processes(tmp_path):
    sched, url = _serve(tmp_path, "--gpus", "0,1,2,3")
    with SchedulerClient(url) as client:
        kept = client.submit(["sleep", "60"], gpus=2)     # its process outlives the scheduler
        gone = client.submit(["sleep", "60"], gpus=2)     # its process dies while the scheduler is down
        next_ = client.submit(["sleep", "60"], gpus=4)    # queued; runs once the two are dealt with
        last = client.submit(["sleep", "0"], gpus=4)      # queued behind it
        wait_for_sync(lambda: all(client.status(j["id"])["pid"] for j in (kept, gone)), what="two running jobs")
        kept_pid, gone_pid = client.status(kept["id"])["pid"], client.status(gone["id"])["pid"]
    os.killpg(sched.pid, signal.SIGKILL)  # a crash: no shutdown hook runs
    sched.wait()
    sched.stdout.close()
    os.kill(gone_pid, signal.SIGKILL)
    wait_for_sync(lambda: not alive(gone_pid), what="the job process to die")
    assert alive(kept_pid)

    sched, url = _serve(tmp_path, "--gpus", "0,1,2,3")
    try:
        with SchedulerClient(url) as client:
            states = {j["id"]: (j["state"], j["reason"]) for j in client.list()}
            assert states[kept["id"]] == ("failed", "scheduler restarted; process killed")
            assert states[gone["id"]] == ("failed", "scheduler restarted; process gone")
            assert states[next_["id"]][0] == "running" and states[last["id"]] == ("queued", "")
            assert not alive(kept_pid)
            client.cancel(next_["id"])
            assert client.wait(last["id"], timeout_s=10)["state"] == "succeeded"
    finally:
        sched.send_signal(signal.SIGTERM)
        sched.wait(timeout=15)
        sched.stdout.close()


def test_serve_refuses_a_public_bind_without_auth(tmp_path):
    result = subprocess.run([PY, "-m", "trainer.scheduler.cli", "serve", "--host", "0.0.0.0", "--port", "0",
                             "--db", str(tmp_path / "s.db")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Refusing to bind 0.0.0.0 without auth" in result.stderr


def test_keys_create_prints_a_key_that_the_client_uses_from_the_environment(tmp_path, monkeypatch, capsys):
    db = str(tmp_path / "sched.db")
    assert cli(["keys", "create", "--user", "carol", "--db", db]) == 0
    key = capsys.readouterr().out.strip()
    from sched_helpers import LiveScheduler, make_config

    with LiveScheduler(make_config(tmp_path), auth=True) as server:
        monkeypatch.setenv("ENVHUB_SCHEDULER_KEY", key)
        with SchedulerClient(server.url) as client:
            assert client.submit(["true"])["user"] == "carol"
        monkeypatch.delenv("ENVHUB_SCHEDULER_KEY")
        keyfile = tmp_path / "key"
        keyfile.write_text(key + "\n")
        monkeypatch.setenv("ENVHUB_SCHEDULER_KEY_FILE", str(keyfile))
        with SchedulerClient(server.url) as client:
            assert [j["user"] for j in client.list()] == ["carol"]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_web_page_renders_gpus_and_jobs_in_headless_chromium(live):
    with SchedulerClient(live.url) as client:
        job = client.submit(["sleep", "60"], gpus=2, name="page-check")
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", live.url + "/"],
            capture_output=True, text=True, timeout=90).stdout
    assert f'<tr data-id="{job["id"]}">' in dom
    row = dom.split(f'<tr data-id="{job["id"]}">', 1)[1].split("</tr>", 1)[0]
    assert "page-check" in row and '<td class="running">running</td>' in row and "<td>0,1</td>" in row
    assert "<td>0,1</td><td>local</td>" in row  # the local backend's jobs run on the node listed as local
    for index, holder in [(0, job["id"]), (1, job["id"]), (2, "free"), (3, "free")]:
        assert f'<tr data-id="{index}"><td></td><td>{index}</td><td>declared</td><td>{holder}</td></tr>' in dom
    assert f'<tr data-id="local"><td>local</td><td>127.0.0.1</td><td>4</td><td>2</td><td>{job["id"]}</td></tr>' in dom


@pytest.mark.slow
def test_sigterm_ends_log_streams_and_running_jobs_then_exits(tmp_path):
    sched, url = _serve(tmp_path, "--gpus", "0,1")
    with SchedulerClient(url) as client:
        job = client.submit(["sh", "-c", "echo started; sleep 60"], gpus=1)
        wait_for_sync(lambda: client.status(job["id"])["pid"], what="the job to start")
        pid = client.status(job["id"])["pid"]
        stream = client.logs(job["id"], follow=True)
        assert next(stream) == "started\n"  # the stream is open and waiting for more
        t0 = time.monotonic()
        sched.send_signal(signal.SIGTERM)
        rest = "".join(stream)
    assert sched.wait(timeout=15) in (0, -signal.SIGTERM) and time.monotonic() - t0 < 8  # uvicorn re-raises it
    sched.stdout.close()
    assert "the scheduler is shutting down" in rest and not alive(pid)
    sched, url = _serve(tmp_path, "--gpus", "0,1")
    try:
        with SchedulerClient(url) as client:
            assert (client.status(job["id"])["state"], client.status(job["id"])["reason"]) == (
                "failed", "scheduler stopped")
    finally:
        sched.send_signal(signal.SIGTERM)
        sched.wait(timeout=15)
        sched.stdout.close()


def test_submit_self_streams_the_log_and_returns_the_exit_code(live, tmp_path, monkeypatch):
    import io

    from trainer.scheduler import submit_self

    monkeypatch.chdir(tmp_path)  # the job runs where the caller stands
    out = io.StringIO()
    code = "import os; print('rank env', os.environ['CUDA_VISIBLE_DEVICES'], os.getcwd()); raise SystemExit(3)"
    assert submit_self(live.url, [PY, "-c", code], gpus=2, kind="rl", out=out) == 3
    assert out.getvalue() == f"rank env 0,1 {tmp_path}\n"
    with SchedulerClient(live.url) as client:
        assert [(j["state"], j["kind"], j["cwd"]) for j in client.list()] == [("failed", "rl", str(tmp_path))]


@pytest.mark.slow
def test_submit_self_waits_for_a_restarted_scheduler_and_prints_each_line_once(tmp_path):
    import io

    from trainer.scheduler import submit_self

    sched, url = _serve(tmp_path, "--gpus", "0,1")
    code = "import time\nfor i in range(600): print('line', i, flush=True); time.sleep(0.05)"
    out, result = io.StringIO(), {}
    runner = threading.Thread(target=lambda: result.setdefault("code", submit_self(
        url, [PY, "-c", code], gpus=1, kind="cmd", out=out, reconnect_s=60)), daemon=True)
    runner.start()
    wait_for_sync(lambda: "line 5\n" in out.getvalue(), 30, "the first lines")
    sched.kill()  # a crash; the job's process goes on writing its log meanwhile
    sched.wait(10)
    sched.stdout.close()
    time.sleep(1.5)
    sched, _ = _serve(tmp_path, "--gpus", "0,1", "--port", url.rsplit(":", 1)[1])  # same store, same URL
    try:
        runner.join(60)
        assert not runner.is_alive() and result["code"] == 1  # the local backend ends what ran before a restart
        lines = out.getvalue().splitlines()
        assert len(lines) > 6 and lines == [f"line {i}" for i in range(len(lines))]  # no gap, nothing twice
    finally:
        sched.send_signal(signal.SIGTERM)
        sched.wait(timeout=15)
        sched.stdout.close()


def test_serve_on_a_port_in_use_is_one_line_and_status_2(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli(["serve", "--gpus", "0", "--port", str(port), "--db", str(tmp_path / "s.db")]) == 2
    assert capsys.readouterr().err.endswith(f"envhub-sched: Could not listen on 127.0.0.1:{port}: Address already in "
                                            "use (another process listens there: stop it or pick another --port).\n")
