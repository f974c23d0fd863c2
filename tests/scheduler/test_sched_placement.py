"""Queueing and placement: GPUs are never shared, the queue moves on when a job ends."""

from __future__ import annotations

from pathlib import Path

import pytest
from sched_helpers import PY, wait_for

from trainer.scheduler._jobs import Job, JobRequest
from trainer.scheduler._store import Principal

ME = Principal("alice")


def gpu_job(out: Path, name: str, seconds: float, gpus: int = 2, **kw) -> JobRequest:
    script = f'echo "$CUDA_VISIBLE_DEVICES $MASTER_PORT $ENVHUB_JOB_PORTS" > {out / name}; sleep {seconds}'
    return JobRequest(command=["sh", "-c", script], gpus=gpus, name=name, **kw)


async def test_three_two_gpu_jobs_on_four_gpus_two_run_one_waits(sched, tmp_path):
    a = await sched.submit(ME, gpu_job(tmp_path, "a", 0.3))
    b = await sched.submit(ME, gpu_job(tmp_path, "b", 3))
    c = await sched.submit(ME, gpu_job(tmp_path, "c", 0.5))
    assert [a.state, b.state, c.state] == ["running", "running", "queued"]
    assert set(a.gpus).isdisjoint(b.gpus) and len(a.gpus) == len(b.gpus) == 2
    await sched.wait(a.id, timeout_s=10)
    assert a.state == "succeeded" and a.exit_code == 0
    # the moment a's tree is gone its GPUs go to c, while b still holds its own
    assert c.state == "running" and c.gpus == a.gpus
    await sched.wait(c.id, timeout_s=10)
    seen = {n: (tmp_path / n).read_text().split() for n in "abc"}
    assert seen["a"][0] == ",".join(map(str, a.gpus)) and seen["c"][0] == seen["a"][0]
    assert set(seen["b"][0].split(",")).isdisjoint(seen["a"][0].split(","))
    assert seen["a"][1] == str(a.ports[0]) and seen["a"][2] == ",".join(map(str, a.ports))
    assert a.ports != b.ports


async def test_higher_priority_first_and_fifo_within_a_priority(sched, tmp_path):
    blocker = await sched.submit(ME, gpu_job(tmp_path, "blocker", 0.3, gpus=4))
    low = await sched.submit(ME, gpu_job(tmp_path, "low", 0, gpus=4, priority=0))
    high1 = await sched.submit(ME, gpu_job(tmp_path, "high1", 0.2, gpus=4, priority=5))
    high2 = await sched.submit(ME, gpu_job(tmp_path, "high2", 0.5, gpus=4, priority=5))
    await sched.wait(blocker.id, timeout_s=10)
    assert (high1.state, high2.state, low.state) == ("running", "queued", "queued")
    await sched.wait(high1.id, timeout_s=10)
    assert high2.state == "running" and low.state == "queued"
    await sched.wait(low.id, timeout_s=10)
    assert high2.started_at <= low.started_at


async def test_a_big_job_at_the_head_is_not_overtaken_by_small_ones(sched, tmp_path):
    two = await sched.submit(ME, gpu_job(tmp_path, "two", 0.3, gpus=2))
    four = await sched.submit(ME, gpu_job(tmp_path, "four", 0, gpus=4))
    one = await sched.submit(ME, gpu_job(tmp_path, "one", 0, gpus=1))
    assert (two.state, four.state, one.state) == ("running", "queued", "queued")  # 2 GPUs idle, on purpose
    await sched.wait(four.id, timeout_s=10)
    assert four.started_at <= one.started_at


async def test_zero_gpu_job_gets_no_devices_and_exit_code_is_kept(sched, tmp_path):
    job = await sched.submit(ME, JobRequest(command=["sh", "-c", 'echo "[$CUDA_VISIBLE_DEVICES]"; exit 3']))
    await sched.wait(job.id, timeout_s=10)
    assert (job.state, job.exit_code, job.reason) == ("failed", 3, "exit code 3")
    assert Path(job.log_path).read_text() == "[]\n"


async def test_a_command_that_cannot_start_fails_and_frees_its_gpus(sched, tmp_path):
    job = await sched.submit(ME, JobRequest(command=["/nonexistent/program"], gpus=4))
    await sched.wait(job.id, timeout_s=10)
    assert job.state == "failed" and job.reason == "launch failed: No such file or directory: program '/nonexistent/program'"
    nxt = await sched.submit(ME, gpu_job(tmp_path, "next", 0, gpus=4))
    await wait_for(lambda: nxt.state != "queued", what="the next job to start")
    await sched.wait(nxt.id, timeout_s=30)
    # a working directory that is not there is named as such, not as a missing program
    lost = await sched.submit(ME, JobRequest(command=["true"], cwd=str(tmp_path / "no" / "such")))
    await sched.wait(lost.id, timeout_s=10)
    assert lost.reason == f"launch failed: No such file or directory: working directory '{tmp_path / 'no' / 'such'}'"


def test_nul_characters_in_a_job_request_are_refused() -> None:
    import pytest
    from pydantic import ValidationError

    for bad in ({"command": ["echo", "a\0b"]}, {"command": ["true"], "cwd": "/tmp\0x"},
                {"command": ["true"], "env": {"A": "b\0c"}}):
        with pytest.raises(ValidationError, match="NUL"):
            JobRequest(**bad)


def test_torchrun_wrapping_only_for_training_kinds():
    job = Job(id="j1", user="u", command=["/venv/bin/python", "train.py", "--lr", "1"], gpus_requested=2,
              kind="rl", torchrun=True)
    assert job.launch_argv(29500) == ["/venv/bin/python", "-m", "torch.distributed.run", "--nproc_per_node=2",
                                      "--master_port=29500", "train.py", "--lr", "1"]
    job.command = ["./train.sh"]
    assert job.launch_argv(29500) == ["torchrun", "--nproc_per_node=2", "--master_port=29500", "--no-python",
                                      "./train.sh"]
    job.kind = "inference"
    assert job.launch_argv(29500) == ["./train.sh"]


@pytest.mark.slow
async def test_torchrun_job_starts_one_worker_per_gpu(sched, tmp_path):
    script = tmp_path / "worker.py"
    # one write(2) per worker: the two ranks share the log (O_APPEND), and print's pieces could interleave
    script.write_text("import os\nos.write(1, ' '.join(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'MASTER_PORT',"
                      " 'CUDA_VISIBLE_DEVICES')).encode() + b'\\n')\n")
    job = await sched.submit(ME, JobRequest(command=[PY, str(script)], gpus=2, kind="sft", torchrun=True))
    await sched.wait(job.id, timeout_s=60)
    assert job.state == "succeeded", Path(job.log_path).read_text()
    lines = sorted(line for line in Path(job.log_path).read_text().splitlines() if line[:1].isdigit())
    assert lines == [f"{rank} 2 {job.ports[0]} {','.join(map(str, job.gpus))}" for rank in (0, 1)]


async def test_public_record_hides_environment_values(sched, tmp_path):
    job = await sched.submit(ME, JobRequest(command=["sleep", "30"], env={"WANDB_API_KEY": "s3cret"}, ports=2))
    public = job.public("node7")
    assert public["env"] == ["WANDB_API_KEY"] and "s3cret" not in repr(public)
    assert public["endpoints"] == [f"http://node7:{p}" for p in job.ports] and len(job.ports) == 2
    await sched.cancel(ME, job.id)
    await sched.wait(job.id, timeout_s=30)
    assert job.public("node7")["endpoints"] == []  # an ended job serves nowhere
