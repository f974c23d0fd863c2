"""Recovery from the job store in-process: what a fresh scheduler does with the records it finds."""

from __future__ import annotations

import os
import subprocess

import pytest
from sched_helpers import alive, make_config

from trainer.scheduler._core import Scheduler
from trainer.scheduler._jobs import Job, JobRequest
from trainer.scheduler._procs import JOB_MARKER_ENV, start_ticks
from trainer.scheduler._store import JobStore, Principal


def _record(tmp_path, *jobs: Job) -> None:
    store = JobStore(tmp_path / "sched.db")
    for job in jobs:
        store.save(job)
    store.close()


async def test_running_records_are_killed_or_marked_gone_and_queued_ones_run(tmp_path):
    leftover = subprocess.Popen(["sleep", "60"], start_new_session=True, env={**os.environ, JOB_MARKER_ENV: "jold"})
    dead = subprocess.Popen(["true"])
    dead.wait()
    _record(tmp_path,
            Job(id="jold", user="u", command=["sleep", "60"], gpus_requested=2, state="running", gpus=[0, 1],
                pid=leftover.pid, pid_start_ticks=start_ticks(leftover.pid), seq=1),
            Job(id="jgone", user="u", command=["true"], gpus_requested=2, state="running", gpus=[2, 3],
                pid=dead.pid, pid_start_ticks=12345, seq=2),
            Job(id="jnext", user="u", command=["sleep", "0"], gpus_requested=4, seq=3,
                log_path=str(tmp_path / "jnext.log")),
            Job(id="jdone", user="u", command=["true"], gpus_requested=1, state="succeeded", exit_code=0, seq=4))
    scheduler = Scheduler(make_config(tmp_path))
    notes = await scheduler.start()
    try:
        jobs = scheduler.jobs
        assert (jobs["jold"].state, jobs["jold"].reason) == ("failed", "scheduler restarted; process killed")
        assert leftover.wait(timeout=5) is not None and not alive(leftover.pid)
        assert (jobs["jgone"].state, jobs["jgone"].reason) == ("failed", "scheduler restarted; process gone")
        assert jobs["jdone"].state == "succeeded" and len(notes) == 2
        assert (await scheduler.wait("jnext", timeout_s=10)).state == "succeeded"
        nxt = await scheduler.submit(Principal("u"), JobRequest(command=["true"]))
        assert nxt.seq == 5  # numbering carries on after the restored records
    finally:
        await scheduler.stop()


async def test_a_queued_job_too_big_for_the_new_inventory_fails_instead_of_blocking(tmp_path):
    _record(tmp_path, Job(id="jbig", user="u", command=["true"], gpus_requested=4, seq=1),
            Job(id="jsmall", user="u", command=["true"], gpus_requested=1, seq=2, log_path=str(tmp_path / "s.log")))
    scheduler = Scheduler(make_config(tmp_path, n_gpus=2))
    await scheduler.start()
    try:
        assert scheduler.jobs["jbig"].state == "failed" and "restarted with 2" in scheduler.jobs["jbig"].reason
        assert (await scheduler.wait("jsmall", timeout_s=10)).state == "succeeded"
    finally:
        await scheduler.stop()


async def test_a_command_with_a_nul_byte_is_refused_before_it_takes_gpus(sched):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="without NUL"):  # the OS would cut the argument at it
        await sched.submit(Principal("u"), JobRequest(command=["sh", "-c", "echo a\0b"], gpus=4))
    assert sched.gpus.free_count() == 4
