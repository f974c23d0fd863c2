"""The Ray backend through the command line, as a user drives it: ``envhub-sched serve --backend ray``
on a real ``ray start`` cluster, ``submit --nodes`` / ``--replicas``, ``nodes``/``gpus``/``list --json``,
a scheduler killed and started again on the same store (it reconnects to what still runs), ``cancel``
leaving nothing on any node, and ``envhub-train --scheduler URL --nodes 2 --torchrun``."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray_cluster import RayStartCluster, processes_with_marker
from sched_helpers import PY, wait_for_sync

from trainer.scheduler.client import SchedulerClient, submit_self

pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ENVHUB = str(Path(sys.executable).with_name("envhub"))
ENVHUB_TRAIN = str(Path(sys.executable).with_name("envhub-train"))
SCHED = str(Path(sys.executable).with_name("envhub-sched"))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")  # the page is checked where it is
# a tick a second, after leaving two orphaned grandchildren (one in its own session) on its node
_TICKING = ("import os, subprocess, time; subprocess.run(['sh', '-c', 'setsid sleep 600 & sleep 600 &']); "
            "[print('rank', os.environ['ENVHUB_NODE_RANK'], 'tick', i, flush=True) or time.sleep(1) "
            "for i in range(600)]")


class RaySchedulerProcess:
    """``envhub-sched serve --backend ray`` in its own session, on a free loopback port."""

    def __init__(self, db: Path, address: str, port: int = 0):
        self.proc = subprocess.Popen(
            [SCHED, "serve", "--backend", "ray", "--ray-address", address, "--port", str(port), "--db", str(db),
             "--grace-s", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        while True:
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            self.lines.append(line)
            if "serving on" in line:
                self.url = line.rsplit(" ", 1)[1].strip()
                break
            if not line:
                raise AssertionError(f"envhub-sched serve exited: {''.join(self.lines)}")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            self.lines.append(line)

    def printed(self, text: str, timeout_s: float = 60) -> str:
        """All it printed, once that holds ``text`` (the recovered jobs' lines come after 'serving on')."""
        wait_for_sync(lambda: text in "".join(self.lines), timeout_s, f"{text!r} from envhub-sched serve")
        return "".join(self.lines)

    def kill(self) -> None:
        """SIGKILL: a crash; nothing of it runs its shutdown."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.reader.join(10)


@pytest.fixture
def servers(ray_cluster: RayStartCluster) -> Iterator[list[RaySchedulerProcess]]:
    """Schedulers a test starts (appended to the list); each is stopped at the end."""
    started: list[RaySchedulerProcess] = []
    yield started
    for server in started:
        server.stop()


def sched_cli(url: str, *args: str) -> str:
    """Run ``envhub-sched ARGS`` against ``url`` as a user would; its stdout (it must succeed)."""
    done = subprocess.run([SCHED, *args], env={**os.environ, "ENVHUB_SCHEDULER_URL": url}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"envhub-sched {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _page_dom(url: str) -> str:
    """The scheduler's page after its scripts ran, from headless Chromium."""
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
             "--disable-background-networking", "--disable-component-update", f"--user-data-dir={profile}",
             "--virtual-time-budget=5000", "--dump-dom", url + "/"], capture_output=True, text=True, timeout=90).stdout


def _supervisor_of(pids: list[int]) -> int:
    """The parent of the share's first process (the one whose parent is not in the share): its Ray actor."""
    parents = {pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in pids}
    return next(ppid for ppid in parents.values() if ppid not in parents and ppid != 1)


def _job(url: str, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = json.loads(sched_cli(url, "status", job_id))
    return job


def test_cli_places_by_node_survives_a_scheduler_crash_and_cancels_on_every_node(
        ray_cluster: RayStartCluster, servers: list[RaySchedulerProcess], tmp_path: Path) -> None:
    db = tmp_path / "sched.db"
    servers.append(first := RaySchedulerProcess(db, ray_cluster.address))
    nodes = json.loads(sched_cli(first.url, "nodes", "--json"))
    alive = {n.node_id: n.ip for n in ray_cluster.alive_nodes}
    assert {(n["node_id"], n["node_ip"], n["gpus"], n["gpus_free"]) for n in nodes} == {
        (node, ip, 2, 2) for node, ip in alive.items()}

    # the job is followed as `envhub-train --scheduler` follows its run: submit_self, heartbeats and all
    out, result = io.StringIO(), {}
    follower = threading.Thread(target=lambda: result.setdefault("code", submit_self(
        first.url, [PY, "-c", _TICKING], gpus=2, kind="cmd", name="two-nodes", nodes=2, out=out, reconnect_s=120)),
        daemon=True)
    follower.start()
    wait_for_sync(lambda: json.loads(sched_cli(first.url, "list", "--json")), 30, "the job submitted")
    job_id = json.loads(sched_cli(first.url, "list", "--json"))[0]["id"]
    echo = [ENVHUB, "serve", "envhub.testing:EchoEnv", "--host", "0.0.0.0", "--port", "{port}"]
    service_id = sched_cli(first.url, "submit", "--kind", "service", "--replicas", "2", "--", *echo).strip()
    wait_for_sync(lambda: "rank 1 tick" in sched_cli(first.url, "logs", job_id)
                  and "rank 0 tick" in sched_cli(first.url, "logs", job_id), 90, "both ranks ticking")
    with SchedulerClient(first.url) as client:
        wait_for_sync(lambda: len(client.endpoints(service_id)) == 2
                      and all(_healthy(u) for u in client.endpoints(service_id)), 90, "two healthy replicas")
        urls = client.endpoints(service_id)

    listed = {j["id"]: j for j in json.loads(sched_cli(first.url, "list", "--json"))}
    placement = listed[job_id]["placement"]
    assert {p["node_id"] for p in placement} == set(alive) and [len(p["gpus"]) for p in placement] == [1, 1]
    assert {(n["node_id"], n["gpus_free"], tuple(n["jobs"])) for n in json.loads(sched_cli(first.url, "nodes", "--json"))
            } == {(node, 1, (job_id,)) for node in alive}
    gpus = json.loads(sched_cli(first.url, "gpus", "--json"))
    assert sorted((g["node_id"], g["job"] or "free") for g in gpus) == sorted(
        [(node, job_id) for node in alive] + [(node, "free") for node in alive])
    assert "two-nodes" in sched_cli(first.url, "list")  # the table names the job's node addresses too

    first.kill()  # a crash: the job's and the service's processes go on running on the cluster
    time.sleep(2)
    assert all(processes_with_marker(f"{job_id}.{share}.") for share in (0, 1))
    old_replica = processes_with_marker(f"{service_id}.1.")
    os.kill(_supervisor_of(old_replica), signal.SIGKILL)  # while no scheduler watches, replica 1's actor dies
    servers.append(second := RaySchedulerProcess(db, ray_cluster.address, port=int(first.url.rsplit(":", 1)[1])))
    second.printed(f"job {job_id}: reconnected to its 2 running share(s)")
    second.printed(f"job {service_id}: reconnected to its 1 running share(s) on the Ray cluster; "
                   "1 replica(s) gone, placed again")
    assert _job(second.url, job_id)["state"] == "running" and _job(second.url, job_id)["placement"] == placement
    with SchedulerClient(second.url) as client:
        wait_for_sync(lambda: len(client.endpoints(service_id)) == 2
                      and all(_healthy(u) for u in client.endpoints(service_id)), 90, "replica 1 placed again")
        assert urls[0] in client.endpoints(service_id)  # replica 0 kept running through the restart
        urls = client.endpoints(service_id)
    # the old replica's processes go (killed with their dead actor's process group; a zombie does not count)
    wait_for_sync(lambda: not set(old_replica) & set(processes_with_marker(f"{service_id}.1.")), 30,
                  "the old replica's processes to be gone")
    ticks = sched_cli(second.url, "logs", job_id).count("tick")
    wait_for_sync(lambda: sched_cli(second.url, "logs", job_id).count("tick") > ticks + 2, 30, "the log to go on")
    assert {n["gpus_free"] for n in json.loads(sched_cli(second.url, "nodes", "--json"))} == {1}

    if CHROMIUM:  # the page: a row per node (GPUs, free, jobs) and where each job went
        dom = _page_dom(second.url)
        for node, ip in alive.items():
            assert f'<tr data-id="{node}"><td>{node[:12]}</td><td>{ip}</td><td>2</td><td>1</td><td>{job_id}</td></tr>' \
                in dom, dom[-3000:]
        row = dom.split(f'<tr data-id="{job_id}">', 1)[1].split("</tr>", 1)[0]
        assert " ".join(f"{p['node_ip']}[{p['gpus'][0]}]" for p in placement) in row, row

    assert sched_cli(second.url, "cancel", job_id).strip() == "cancelled"
    assert not processes_with_marker(job_id + "."), "a process of the job outlived cancel"
    follower.join(30)
    assert result.get("code") == 130  # it followed the job through the restart to its end
    for rank in (0, 1):  # every tick of each rank printed once, in order, across the restart
        ticks = [line for line in out.getvalue().splitlines() if line.startswith(f"rank {rank} tick")]
        assert len(ticks) > 5 and ticks == [f"rank {rank} tick {i}" for i in range(len(ticks))], ticks
    assert sched_cli(second.url, "cancel", service_id).strip() == "cancelled"
    assert not processes_with_marker(service_id + ".") and not any(_healthy(u) for u in urls)
    assert {n["gpus_free"] for n in json.loads(sched_cli(second.url, "nodes", "--json"))} == {2}


def test_envhub_train_runs_a_two_node_torchrun_job_through_the_ray_scheduler(
        ray_cluster: RayStartCluster, servers: list[RaySchedulerProcess], tmp_path: Path) -> None:
    servers.append(server := RaySchedulerProcess(tmp_path / "sched.db", ray_cluster.address))
    done = subprocess.run([ENVHUB_TRAIN, "rl", "--scheduler", server.url, "--gpus", "2", "--nodes", "2", "--torchrun",
                           "--print-config", "model.name=tiny", "run.steps=3"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    # one resolved config from each node's rank, streamed back to this terminal
    assert done.stdout.count('"name": "tiny"') == 2 and done.stdout.count('"steps": 3,') == 2, done.stdout[-3000:]
    jobs = json.loads(sched_cli(server.url, "list", "--json"))
    assert len(jobs) == 1 and jobs[0]["state"] == "succeeded" and jobs[0]["kind"] == "rl" and jobs[0]["torchrun"]
    assert len({p["node_id"] for p in jobs[0]["placement"]}) == 2
