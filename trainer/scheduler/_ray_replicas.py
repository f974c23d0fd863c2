"""Service replicas on a Ray cluster: R copies of one command, each on its own port, kept alive.

Each replica is one bundle of the service's placement group and one :class:`NodeSupervisor`. Its
command gets its port through ``{port}`` and ``ENVHUB_JOB_PORTS``; the job's record lists every
replica's node, GPUs and port, so ``endpoints`` are the replicas' URLs. A replica whose process
exits or whose node dies is started again in the same bundle (Ray places a bundle of a lost node
again elsewhere when resources allow); while it is down its port is cleared, so the URL list never
names a dead replica. A replica that keeps dying fails the service.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from trainer.scheduler._core import JobLostError, SchedulerConfig
from trainer.scheduler._jobs import Job, with_port
from trainer.scheduler._ray_node import ref_result

MAX_RESTARTS = 5  # per replica: past this the service fails instead of crash-looping
_POLL_S = 0.3
STOP_SLACK_S = 10.0  # beyond the grace: how long a supervisor may take to report its tree ended


class ReplicaHost(Protocol):
    """What a :class:`ReplicaSet` needs of its scheduler (the Ray backend's ``RayScheduler``)."""

    config: SchedulerConfig
    _ending: dict[str, tuple[str, str]]  # jobs being ended
    _actors: dict[str, list[Any]]  # job id -> its supervisors
    _held: dict[str, dict[str, int]]  # job id -> node id -> GPUs booked there

    def rank_env(self, job: Job, rank: int) -> dict[str, str]: ...

    def new_supervisor(self, job: Job, bundle_index: int) -> Any: ...

    async def _save(self, job: Job) -> None: ...


class ReplicaSet:
    """The replicas of one service job, from first start until the job is ended."""

    def __init__(self, scheduler: ReplicaHost, job: Job, supervisors: list[Any], resume: bool = False):
        """``resume``: the replicas run already (found again after a scheduler restart); a None in
        ``supervisors`` is one whose actor is gone, placed and started again."""
        self.scheduler, self.job, self.supervisors, self.resume = scheduler, job, supervisors, resume
        if resume:
            self.restarts = [int(share.get("restarts", 0)) for share in job.placement]
        else:
            self.restarts = [0] * len(supervisors)
            job.placement = [{"node_id": "", "node_ip": "", "gpus": [], "port": None, "restarts": 0}
                             for _ in supervisors]

    async def run(self) -> int | None:
        """Start every replica and keep them up; returns None once the job is being ended."""
        if self.resume:
            down = [i for i, sup in enumerate(self.supervisors) if sup is None or not self.job.placement[i]["port"]]
            await asyncio.gather(*(self._replace(i) for i in down))
        else:
            await asyncio.gather(*(self._start(i) for i in range(len(self.supervisors))))
        await self.scheduler._save(self.job)
        await asyncio.gather(*(self._keep(i) for i in range(len(self.supervisors))))
        return None

    async def _start(self, i: int) -> None:
        sup = self.supervisors[i]
        where = await ref_result(sup.where.remote())
        port = (await ref_result(sup.free_ports.remote(1)))[0]
        env = self.scheduler.rank_env(self.job, i)
        env.update({"ENVHUB_JOB_PORTS": str(port), "ENVHUB_REPLICA": str(i)})
        await ref_result(sup.start.remote(with_port(self.job.command, port), env, self.job.cwd))
        self.job.placement[i] = {**where, "port": port, "restarts": self.restarts[i]}
        self._rebook()

    async def _keep(self, i: int) -> None:
        with open(self.job.log_path, "ab", buffering=0) as log:
            while self.job.id not in self.scheduler._ending:
                why = await self._poll(i, log)
                if why is None:
                    await asyncio.sleep(_POLL_S)
                    continue
                if self.job.id in self.scheduler._ending:
                    return
                await self._restart(i, why, log)

    async def _poll(self, i: int, log: Any) -> str | None:
        """None while replica ``i`` runs, else why it stopped."""
        try:
            chunk, code = await ref_result(self.supervisors[i].poll.remote())
        except ActorUnavailableError:
            return None  # unreachable for now (e.g. while the cluster handles a lost node): ask again
        except RayActorError as exc:
            return f"its node {self.job.placement[i]['node_id'][:12]} was lost ({type(exc).__name__})"
        log.write(chunk)
        return None if code is None else f"it exited with code {code}"

    async def _restart(self, i: int, why: str, log: Any) -> None:
        self.job.placement[i] = {**self.job.placement[i], "port": None}  # down: no URL for it
        self.restarts[i] += 1
        if self.restarts[i] > MAX_RESTARTS:
            raise JobLostError(f"replica {i} stopped {self.restarts[i]} times (last: {why})")
        log.write(f"\n[envhub-sched: replica {i} stopped: {why}; starting it again]\n".encode())
        await self._replace(i)
        await self.scheduler._save(self.job)

    async def _replace(self, i: int) -> None:
        """End replica ``i``'s actor (if any) and start the replica again in a new one, in the same bundle."""
        old = self.supervisors[i]
        self.job.placement[i] = {**self.job.placement[i], "port": None}
        if old is not None:
            try:
                await asyncio.wait_for(ref_result(old.stop.remote(self.scheduler.config.grace_s)),
                                       self.scheduler.config.grace_s + STOP_SLACK_S)
            except (RayActorError, asyncio.TimeoutError):
                pass  # its node is gone, and its processes with it (PR_SET_PDEATHSIG and the reaper)
            ray.kill(old)
        self.supervisors[i] = self.scheduler.new_supervisor(self.job, i)
        self.scheduler._actors[self.job.id][i] = self.supervisors[i]
        await self._start(i)

    def _rebook(self) -> None:
        booked: dict[str, int] = {}
        for share in self.job.placement:
            if share["node_id"]:
                booked[share["node_id"]] = booked.get(share["node_id"], 0) + self.job.gpus_requested
        self.scheduler._held[self.job.id] = booked
        self.job.gpus = [g for share in self.job.placement for g in share["gpus"]]
