"""The Ray backend against a real multi-node Ray cluster on this machine, started with ``ray start``
(a head and a worker node, two fake GPUs each; see ``ray_cluster.py``): placement by node and GPU,
multi-node jobs, cancel across nodes, services with replicas, a worker node killed mid-job.
Skipped where ray is not installed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray_cluster import RayStartCluster, processes_with_marker
from sched_helpers import PY, make_config

from trainer.scheduler._jobs import Job, JobRequest
from trainer.scheduler._store import JobStore, Principal

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ENVHUB = str(Path(sys.executable).with_name("envhub"))
ME = Principal(user="alice", admin=False)
# each share leaves two orphaned grandchildren, one in a session of its own: only the job's marker finds them
_WITH_GRANDCHILDREN = ("import os, subprocess, time; "
                       "subprocess.run(['sh', '-c', 'setsid sleep 600 & sleep 600 &']); "
                       "print('rank', os.environ['ENVHUB_NODE_RANK'], flush=True); time.sleep(600)")


@pytest.fixture
async def rsched(ray_cluster: RayStartCluster, tmp_path: Path):
    from trainer.scheduler._ray import RayScheduler

    scheduler = RayScheduler(make_config(tmp_path), address=ray_cluster.address)
    await scheduler.start()
    yield scheduler
    if scheduler.started:
        await scheduler.stop()


def _req(code: str, gpus: int, nodes: int = 1) -> JobRequest:
    return JobRequest(command=[PY, "-c", code], gpus=gpus, nodes=nodes)


async def _running(sched: Any, job_id: str, timeout_s: float = 60) -> None:
    for _ in range(int(timeout_s / 0.1)):
        job = sched.jobs[job_id]
        log = Path(job.log_path)
        if job.state == "running" and job.placement and log.exists() and log.stat().st_size:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} never printed: {sched.jobs[job_id]}")


async def test_inventory_is_the_clusters_gpus_per_node(rsched: Any, ray_cluster: RayStartCluster) -> None:
    view = rsched.gpu_view()
    assert len(view) == 4 and {g["node_id"] for g in view} == {n.node_id for n in ray_cluster.alive_nodes}
    nodes = rsched.node_view()
    assert sorted((n["node_id"], n["node_ip"], n["gpus"], n["gpus_free"], n["jobs"]) for n in nodes) == sorted(
        (n.node_id, n.ip, 2, 2, []) for n in ray_cluster.alive_nodes)


async def test_single_node_job_gets_its_gpus_on_one_node(rsched: Any) -> None:
    code = "import os; print('CVD', os.environ['CUDA_VISIBLE_DEVICES'])"
    job = await rsched.submit(ME, _req(code, gpus=2))
    job = await rsched.wait(job.id, 120)
    assert job.state == "succeeded", job.reason
    assert len(job.placement) == 1 and sorted(job.placement[0]["gpus"]) == [0, 1]
    assert "CVD 0,1" in Path(job.log_path).read_text() or "CVD 1,0" in Path(job.log_path).read_text()


async def test_multi_node_job_spreads_and_cancel_ends_every_node(rsched: Any) -> None:
    job = await rsched.submit(ME, _req(_WITH_GRANDCHILDREN, gpus=2, nodes=2))
    await _running(rsched, job.id)
    await _until(lambda: "rank 0" in _log(job) and "rank 1" in _log(job), "both ranks up")
    assert len({p["node_id"] for p in job.placement}) == 2
    assert all(len(p["gpus"]) == 1 for p in job.placement)
    assert sorted(n["gpus_free"] for n in rsched.node_view()) == [1, 1]
    assert all(n["jobs"] == [job.id] for n in rsched.node_view())
    for share in (0, 1):  # python, sh's two orphans (and sleep's own) on each node
        assert len(processes_with_marker(f"{job.id}.{share}.")) >= 3
    pg_before = _groups_created()
    assert len(_reapers_of(job.id)) == 2  # one per node share
    await rsched.cancel(ME, job.id)
    assert job.state == "cancelled"
    assert not processes_with_marker(job.id + "."), "a process of the job outlived cancel"
    assert _groups_created() == pg_before - 1
    await _until(lambda: not _reapers_of(job.id), "the shares' reapers to exit once their actors are gone", 30)
    assert sorted(n["gpus_free"] for n in rsched.node_view()) == [2, 2]


def _reapers_of(job_id: str) -> list[int]:
    """Pids of the reapers watching the job's shares (their command line names the share)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"trainer.scheduler._node_reaper" in argv and any(a.startswith(f"{job_id}.".encode()) for a in argv):
            pids.append(int(proc.name))
    return pids


def _log(job: Job) -> str:
    return Path(job.log_path).read_text() if Path(job.log_path).exists() else ""


async def _until(predicate: Any, what: str, timeout_s: float = 60) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _groups_created() -> int:
    return len([g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"])


async def test_a_request_larger_than_any_node_is_refused(rsched: Any) -> None:
    from trainer.scheduler.errors import JobRequestError

    with pytest.raises(JobRequestError):
        await rsched.submit(ME, _req("pass", gpus=4))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def _live_endpoints(sched: Any, job_id: str, count: int, timeout_s: float = 90) -> list[str]:
    for _ in range(int(timeout_s / 0.3)):
        urls = sched.jobs[job_id].public()["endpoints"]
        if len(urls) == count and all(await asyncio.gather(*(asyncio.to_thread(_healthy, u) for u in urls))):
            return list(urls)
        await asyncio.sleep(0.3)
    job = sched.jobs[job_id]
    raise AssertionError(f"no {count} healthy replicas: {job.placement}\n{Path(job.log_path).read_text()[-3000:]}")


async def test_env_server_replicas_report_their_urls_and_a_dead_one_is_restarted(rsched: Any) -> None:
    cmd = [ENVHUB, "serve", "envhub.testing:EchoEnv", "--host", "0.0.0.0", "--port", "{port}"]
    job = await rsched.submit(ME, JobRequest(command=cmd, kind="service", replicas=2, gpus=1))
    urls = await _live_endpoints(rsched, job.id, 2)
    assert len(set(urls)) == 2
    assert len(job.gpus) == 2
    victim = job.placement[0]
    killed = _servers_on(victim["port"])
    assert killed, "the replica's server process was not found"
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    for _ in range(300):  # the restart shows in the record before the new server is up
        if job.placement[0]["restarts"] == 1:
            break
        await asyncio.sleep(0.1)
    urls_after = await _live_endpoints(rsched, job.id, 2)
    assert job.placement[0]["restarts"] == 1 and urls[1] in urls_after
    await rsched.cancel(ME, job.id)
    assert job.state == "cancelled"
    assert not any(_servers_on(int(u.rsplit(":", 1)[1])) for u in urls + urls_after)
    assert not any(await asyncio.gather(*(asyncio.to_thread(_healthy, u) for u in urls_after)))


def _servers_on(port: int) -> list[int]:
    """Pids of EchoEnv servers started on ``port`` (their command line names it)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"envhub.testing:EchoEnv" in argv and str(port).encode() in argv:
            pids.append(int(proc.name))
    return pids


_DDP_STEP = '''
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())  # different data per rank, same initial weights (DDP broadcasts them)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(8, 4)).pow(2).mean()
loss.backward()
opt.step()
weights = model.module.weight.detach().clone()
gathered = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, weights)
same = all(torch.equal(g, gathered[0]) for g in gathered)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} node_rank {os.environ['GROUP_RANK']} "
      f"step done, weights equal across ranks: {same}", flush=True)
# DDP keeps gloo's threads alive past destroy_process_group; a plain exit can abort in interpreter finalization
# (SIGABRT after a correct step): end the rank as envhub-train does
from trainer.distributed import exit_rank
exit_rank(0)
'''


async def test_two_node_gloo_torchrun_job_runs_a_training_step(rsched: Any, tmp_path: Path) -> None:
    script = tmp_path / "ddp_step.py"
    script.write_text(_DDP_STEP)
    request = JobRequest(command=[PY, str(script)], gpus=2, nodes=2, kind="sft", torchrun=True)
    job = await rsched.submit(ME, request)
    job = await rsched.wait(job.id, 300)
    log = Path(job.log_path).read_text()
    assert job.state == "succeeded", f"{job.reason}\n{log}"
    assert len({p["node_id"] for p in job.placement}) == 2
    assert "rank 0/2 node_rank 0 step done, weights equal across ranks: True" in log
    assert "rank 1/2 node_rank 1 step done, weights equal across ranks: True" in log


async def test_a_restarted_ray_scheduler_keeps_records_and_marks_jobs_it_cannot_find_lost(
        ray_cluster: RayStartCluster, tmp_path: Path) -> None:
    from trainer.scheduler._ray import RayScheduler

    store = JobStore(str(tmp_path / "sched.db"))
    store.save(Job(id="jrunning", user="alice", command=["sleep", "600"], gpus_requested=2, state="running",
                   placement=[{"node_id": "gone", "node_ip": "127.0.0.1", "gpus": [0, 1], "actor": "envhub-sched-x"}]))
    store.save(Job(id="jqueued", user="alice", command=["true"], gpus_requested=0, seq=2,
                   log_path=str(tmp_path / "jqueued.log")))
    store.close()
    sched = RayScheduler(make_config(tmp_path), address=ray_cluster.address)
    notes = await sched.start()
    try:
        assert any("jrunning" in n and "lost" in n for n in notes), notes
        lost = sched.jobs["jrunning"]
        assert lost.state == "failed" and lost.reason.startswith("lost: the scheduler restarted"), lost.reason
        queued = await sched.wait("jqueued", 120)  # the queue carries on with what was queued
        assert queued.state == "succeeded", queued.reason
    finally:
        await sched.stop()


async def test_worker_node_killed_fails_its_job_moves_its_replica_and_the_queue_goes_on(
        rsched: Any, ray_cluster: RayStartCluster) -> None:
    """Adds a third node and kills its raylet, so the other tests keep their two nodes."""
    victim = ray_cluster.add_worker()
    await _until(lambda: len(rsched.node_view()) == 3, "the third node", 60)
    job = await rsched.submit(ME, _req(_WITH_GRANDCHILDREN, gpus=3, nodes=3))  # one share on every node
    await _running(rsched, job.id)
    cmd = [ENVHUB, "serve", "envhub.testing:EchoEnv", "--host", "0.0.0.0", "--port", "{port}"]
    service = await rsched.submit(ME, JobRequest(command=cmd, kind="service", replicas=3, gpus=0))
    await _live_endpoints(rsched, service.id, 3)
    share = next(i for i, p in enumerate(job.placement) if p["node_id"] == victim.node_id)
    await _until(lambda: len(processes_with_marker(f"{job.id}.{share}.")) >= 3, "the victim share's tree")
    on_victim = [i for i, p in enumerate(service.placement) if p["node_id"] == victim.node_id]
    ray_cluster.kill_raylet(victim)
    job = await rsched.wait(job.id, 120)
    assert job.state == "failed" and "lost" in job.reason and victim.node_id[:12] in job.reason, job.reason
    await _until(lambda: not processes_with_marker(job.id + "."), "the lost job's processes (grandchildren too) "
                 "to be gone on every node", 30)
    # the lost node's replica processes run on this same machine and may still answer until the scheduler
    # has placed their replicas again: wait for the move itself, then for three healthy replicas
    await _until(lambda: all(p["node_id"] != victim.node_id for p in rsched.jobs[service.id].placement),
                 "the lost node's replicas to be placed on the others", 120)
    await _live_endpoints(rsched, service.id, 3, timeout_s=120)
    assert all(p["node_id"] != victim.node_id for p in service.placement)
    assert all(service.placement[i]["restarts"] == 1 for i in on_victim)
    assert victim.node_id not in {n["node_id"] for n in rsched.node_view()}
    after = await rsched.submit(ME, _req("print('next')", gpus=2))
    after = await rsched.wait(after.id, 120)
    assert after.state == "succeeded", after.reason
    await rsched.cancel(ME, service.id)
    assert not processes_with_marker(service.id + ".")
