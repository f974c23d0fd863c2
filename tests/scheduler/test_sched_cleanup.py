"""Cleanup: cancel, exit and lost heartbeats end the whole process tree and free the GPUs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from sched_helpers import PY, alive, wait_for

from trainer.scheduler._jobs import JobRequest
from trainer.scheduler._store import Principal

ME = Principal("alice")

# a grandchild that leaves the job's session and process group, then records its pid
_GRANDCHILD = "import os, sys, time; os.setsid(); open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"


def tree_job(pidfile: Path, main_sleeps_s: float, gpus: int = 2) -> JobRequest:
    main = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {_GRANDCHILD!r}, {str(pidfile)!r}]);"
            f" time.sleep({main_sleeps_s})")
    return JobRequest(command=[PY, "-c", main], gpus=gpus)


async def test_cancel_ends_the_whole_tree_including_a_setsid_grandchild(sched, tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    job = await sched.submit(ME, tree_job(pidfile, 60))
    await wait_for(lambda: pidfile.exists() and pidfile.read_text(), what="the grandchild to start")
    grandchild = int(pidfile.read_text())
    assert alive(job.pid) and alive(grandchild)
    waiting = await sched.submit(ME, JobRequest(command=["sleep", "0"], gpus=4))
    assert waiting.state == "queued"

    await sched.cancel(ME, job.id)

    assert job.state == "cancelled" and job.reason == "cancelled by alice"
    assert not alive(job.pid) and not alive(grandchild)
    assert waiting.state in ("running", "succeeded")  # the queue moved on at once


async def test_processes_left_behind_by_a_finished_job_are_ended(sched, tmp_path):
    pidfile = tmp_path / "orphan.pid"
    job = await sched.submit(ME, tree_job(pidfile, 0.5))
    await sched.wait(job.id, timeout_s=15)
    assert job.state == "succeeded"
    grandchild = int(pidfile.read_text())
    assert not alive(grandchild)


async def test_a_process_ignoring_sigterm_is_killed_after_the_grace(sched, tmp_path):
    ready = tmp_path / "ready"
    code = f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w'); time.sleep(60)"
    job = await sched.submit(ME, JobRequest(command=[PY, "-c", code], gpus=1))
    await wait_for(ready.exists, what="the job to ignore SIGTERM")
    t0 = time.monotonic()
    await sched.cancel(ME, job.id)
    elapsed = time.monotonic() - t0
    assert job.state == "cancelled" and not alive(job.pid)
    assert sched.config.grace_s <= elapsed < sched.config.grace_s + 5


async def test_lost_heartbeats_end_a_running_job(sched, tmp_path):
    job = await sched.submit(ME, JobRequest(command=["sleep", "60"], gpus=2, heartbeat_timeout_s=0.8))
    await wait_for(lambda: job.pid is not None, what="the job to start")
    for _ in range(7):  # heartbeats keep it alive past its timeout
        await sched.heartbeat(ME, job.id)
        await asyncio.sleep(0.15)
    assert job.state == "running"
    await sched.wait(job.id, timeout_s=5)
    assert job.state == "failed" and job.reason == "heartbeat lost: no heartbeat for 0.8 s"
    assert not alive(job.pid) and sched.gpus.free_count() == 4


async def test_lost_heartbeats_drop_a_queued_job(sched):
    blocker = await sched.submit(ME, JobRequest(command=["sleep", "60"], gpus=4))
    queued = await sched.submit(ME, JobRequest(command=["sleep", "0"], gpus=4, heartbeat_timeout_s=0.2))
    await sched.wait(queued.id, timeout_s=5)
    assert queued.state == "failed" and queued.started_at is None and "heartbeat" in queued.reason
    await sched.cancel(ME, blocker.id)


async def test_stop_ends_running_jobs_and_keeps_queued_ones(sched):
    running = await sched.submit(ME, JobRequest(command=["sleep", "60"], gpus=4))
    queued = await sched.submit(ME, JobRequest(command=["sleep", "0"], gpus=4))
    await wait_for(lambda: running.pid is not None, what="the job to start")
    await sched.stop()
    assert (running.state, running.reason) == ("failed", "scheduler stopped")
    assert not alive(running.pid) and queued.state == "queued"
