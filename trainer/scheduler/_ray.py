"""The Ray backend: the same queue, API and records, placed on a Ray cluster's nodes and GPUs.

Placement is Ray's: a job of N GPUs on K nodes gets a placement group of K bundles of N/K GPUs
(STRICT_PACK for one node, STRICT_SPREAD for several), and one :class:`NodeSupervisor` actor per
bundle runs the job's share on its node. The queue decides *whether* a job starts (strict order, as
locally) from a per-node count of free GPUs kept beside Ray's; Ray decides *where*, and the record
says where it went (``job.placement``). A multi-node torchrun job runs
``torch.distributed.run --nnodes K --node_rank r`` on each node, rendezvous at rank 0's node.

A node that dies takes its actor with it: the next log pull raises, the job fails with the node in
its reason, the other nodes' shares are ended and the placement group is removed; on the lost node
the share's reaper ends what is left of its tree (see :mod:`trainer.scheduler._node_reaper`).

Actors and placement groups are detached and named after the job (the actor's name is in its
share's record), so they outlive a scheduler that crashed or was killed: a scheduler restarted on the
same job store finds them again by name, books their GPUs and carries on pulling logs (the job keeps
running). A job whose actors are gone (their node died meanwhile) is ended on every node and marked
failed, lost, with that reason; a service replica that is gone is placed and started again. A
scheduler that is *stopped* (SIGINT/SIGTERM) ends its running jobs, as the local backend does.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainer.scheduler._core import _SECRET_ENV_PREFIXES, JobLostError, Scheduler, SchedulerConfig
from trainer.scheduler._jobs import Job, with_port
from trainer.scheduler._ray_node import NodeSupervisor, ref_result
from trainer.scheduler._ray_replicas import ReplicaSet

_BUNDLE_CPU = 0.01  # a bundle needs some resource; a 0-GPU share holds almost no CPU
_POLL_S = 0.3
_PLACE_TIMEOUT_S = 120.0
_PING_TIMEOUT_S = 30.0  # a restarted scheduler asks each found actor this long whether it still answers


class RayScheduler(Scheduler):
    """A :class:`Scheduler` whose inventory is a Ray cluster's GPUs, per node."""

    def __init__(self, config: SchedulerConfig, address: str | None = None):
        super().__init__(config)
        if not ray.is_initialized():
            ray.init(address=address or "auto", namespace="envhub-sched", log_to_driver=False,
                     include_dashboard=False)
        self._node_gpus: dict[str, int] = {}  # alive node id -> GPUs it declares
        self._node_ip: dict[str, str] = {}
        self._held: dict[str, dict[str, int]] = {}  # job id -> node id -> GPUs booked there
        self._groups: dict[str, PlacementGroup] = {}
        self._actors: dict[str, list[Any]] = {}
        self._adopted: dict[str, list[Any]] = {}  # running jobs found again after a restart -> their actors
        self._refresh_nodes()

    # -- inventory ----------------------------------------------------------------------------
    def _refresh_nodes(self) -> None:
        alive = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
        self._node_gpus = {n["NodeID"]: int(n.get("Resources", {}).get("GPU", 0)) for n in alive}
        self._node_ip = {n["NodeID"]: str(n.get("NodeManagerAddress", "")) for n in alive}

    def _free_by_node(self) -> dict[str, int]:
        free = dict(self._node_gpus)
        for booked in self._held.values():
            for node, n in booked.items():
                if node in free:
                    free[node] -= n
        return free

    def gpu_nodes(self) -> list[str]:
        """Ids of the alive nodes that declare GPUs."""
        return [node for node, n in self._node_gpus.items() if n > 0]

    def gpus_total(self) -> int:
        return sum(self._node_gpus.values())

    def _never_fits(self, gpus: int, nodes: int, replicas: int = 1) -> bool:
        if replicas > 1:
            return gpus > 0 and sum(n // gpus for n in self._node_gpus.values()) < replicas
        per_node = gpus // nodes
        return sum(1 for n in self._node_gpus.values() if n >= per_node) < nodes

    def gpu_view(self) -> list[dict[str, Any]]:
        """One entry per GPU of each alive node: its node, its index there and the job holding it."""
        self._refresh_nodes()
        view = []
        for node, count in sorted(self._node_gpus.items(), key=lambda kv: self._node_ip[kv[0]] + kv[0]):
            holders = [job for job, booked in self._held.items() for _ in range(booked.get(node, 0))]
            for i in range(count):
                view.append({"index": i, "node_id": node, "node_ip": self._node_ip[node], "name": "ray",
                             "memory_mib": None, "job": holders[i] if i < len(holders) else None})
        return view

    def node_view(self) -> list[dict[str, Any]]:
        """One entry per alive node: its id and address, GPUs it declares and has free, jobs holding some."""
        self._refresh_nodes()
        free = self._free_by_node()
        return [{"node_id": node, "node_ip": self._node_ip[node], "gpus": count, "gpus_free": free[node],
                 "jobs": sorted(job for job, booked in self._held.items() if booked.get(node))}
                for node, count in sorted(self._node_gpus.items(), key=lambda kv: self._node_ip[kv[0]] + kv[0])]

    # -- placement ----------------------------------------------------------------------------
    def _place(self, job: Job) -> bool:
        self._refresh_nodes()
        if job.replicas > 1:
            return self._place_replicas(job)
        per_node = job.gpus_requested // job.nodes
        free = self._free_by_node()
        fitting = sorted((n for n, f in free.items() if f >= per_node), key=lambda n: free[n])
        if len(fitting) < job.nodes:
            return False
        self._held[job.id] = dict.fromkeys(fitting[:job.nodes], per_node)  # rebooked once Ray has placed it
        return True

    def _place_replicas(self, job: Job) -> bool:
        free, booked = self._free_by_node(), {}
        need = job.replicas
        for node, n in sorted(free.items(), key=lambda kv: -kv[1]):
            fit = need if job.gpus_requested == 0 else min(need, n // job.gpus_requested)
            if fit > 0:
                booked[node], need = fit * job.gpus_requested, need - fit
        if need:
            return False
        self._held[job.id] = booked
        return True

    def _release(self, job: Job) -> None:
        self._held.pop(job.id, None)

    async def _launch_and_wait(self, job: Job) -> int | None:
        adopted = self._adopted.pop(job.id, None)
        if adopted is not None:  # found again after a scheduler restart: it runs already
            if job.replicas > 1:
                return await ReplicaSet(self, job, adopted, resume=True).run()
            return await self._pump(job, adopted)
        supervisors = await self._place_group(job)
        if job.replicas > 1:
            return await ReplicaSet(self, job, supervisors).run()
        where = await asyncio.gather(*(ref_result(s.where.remote()) for s in supervisors))
        job.placement = list(where)
        self._held[job.id] = {w["node_id"]: job.gpus_requested // job.nodes for w in where}
        job.gpus = [g for w in where for g in w["gpus"]]
        job.ports = await ref_result(supervisors[0].free_ports.remote(max(job.n_ports, 1 if job.nodes > 1 else 0)))
        for rank, sup in enumerate(supervisors):
            await ref_result(sup.start.remote(self._rank_argv(job, rank), self.rank_env(job, rank), job.cwd))
        await self._save(job)
        return await self._pump(job, supervisors)

    async def _place_group(self, job: Job) -> list[Any]:
        await self._end_leftovers(job)
        per_node = job.gpus_requested // job.nodes
        shares = max(job.nodes, job.replicas)
        bundle: dict[str, float] = {"CPU": _BUNDLE_CPU, **({"GPU": float(per_node)} if per_node else {})}
        # replicas spread where they can (a node's loss takes fewer of them); a multi-node job must
        strategy = "SPREAD" if job.replicas > 1 else "STRICT_PACK" if job.nodes == 1 else "STRICT_SPREAD"
        group = placement_group([dict(bundle) for _ in range(shares)], name=_group_name(job.id),
                                strategy=strategy, lifetime="detached")
        self._groups[job.id] = group
        try:
            await asyncio.wait_for(ref_result(group.ready()), _PLACE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise JobLostError(f"placement failed: Ray placed no group of {job.nodes} x {bundle} "
                               f"within {_PLACE_TIMEOUT_S:g} s") from None
        supervisors = [self.new_supervisor(job, i) for i in range(shares)]
        self._actors[job.id] = supervisors
        return supervisors

    def new_supervisor(self, job: Job, bundle_index: int) -> Any:
        """A supervisor actor in bundle ``bundle_index`` of the job's placement group.

        Detached and named (``envhub-sched-<job>-<share>-<random>``, the name in its ``where()``), so a
        restarted scheduler can find it; the random part keeps a replacement's name apart from the
        name of the actor it replaces, which Ray may not have released yet.
        """
        name = f"{_group_name(job.id)}-{bundle_index}-{secrets.token_hex(3)}"
        return ray.remote(NodeSupervisor).options(
            name=name, lifetime="detached", num_cpus=_BUNDLE_CPU, num_gpus=job.gpus_requested // job.nodes,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._groups[job.id], placement_group_bundle_index=bundle_index),
        ).remote(job.id, bundle_index, self.config.grace_s, name)

    def _rank_argv(self, job: Job, rank: int) -> list[str]:
        if not (job.torchrun and job.kind in ("rl", "sft")):
            return with_port(job.command, job.ports[0] if job.ports else None)
        opts = [f"--nnodes={job.nodes}", f"--nproc_per_node={max(job.gpus_requested // job.nodes, 1)}",
                f"--node_rank={rank}", f"--master_addr={job.placement[0]['node_ip']}",
                f"--master_port={job.ports[0]}"]
        program, *args = job.command
        if os.path.basename(program).startswith("python"):
            return [program, "-m", "torch.distributed.run", *opts, *args]
        return ["torchrun", *opts, "--no-python", program, *args]

    def rank_env(self, job: Job, rank: int) -> dict[str, str]:
        """The environment of share ``rank`` of the job (the scheduler's own secrets left out)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SECRET_ENV_PREFIXES)}
        env.update(job.env)
        env.update({"ENVHUB_JOB_ID": job.id, "ENVHUB_JOB_PORTS": ",".join(map(str, job.ports)),
                    "ENVHUB_NODE_RANK": str(rank), "ENVHUB_NNODES": str(job.nodes)})
        if job.ports and job.replicas == 1:
            env.update({"MASTER_ADDR": job.placement[0]["node_ip"], "MASTER_PORT": str(job.ports[0])})
        return env

    async def _pump(self, job: Job, supervisors: list[Any]) -> int | None:
        """Pull every node's output into the job's log until all exit, one fails, or it is ended."""
        codes: dict[int, int] = {}
        with open(job.log_path, "ab", buffering=0) as log:
            while True:
                for rank, sup in enumerate(supervisors):
                    try:
                        chunk, code = await ref_result(sup.poll.remote())
                    except ActorUnavailableError:
                        continue  # unreachable for now (the cluster is handling a lost node): ask again
                    except RayActorError as exc:
                        node = job.placement[rank]
                        raise JobLostError(f"node {node['node_id'][:12]} ({node['node_ip']}) lost: "
                                           f"{type(exc).__name__}") from None
                    log.write(chunk)
                    if code is not None:
                        codes[rank] = code
                if len(codes) == len(supervisors) or any(codes.values()):
                    return next((c for c in codes.values() if c), 0)
                if job.id in self._ending:
                    return None
                await asyncio.sleep(_POLL_S)

    # -- ending -------------------------------------------------------------------------------
    async def _end_processes(self, job: Job) -> None:
        supervisors = [s for s in self._actors.pop(job.id, []) if s is not None]
        stops = [asyncio.wait_for(ref_result(s.stop.remote(self.config.grace_s)), self.config.grace_s + 10)
                 for s in supervisors]
        await asyncio.gather(*stops, return_exceptions=True)  # a lost node's share died with it
        for sup in supervisors:
            ray.kill(sup)
        group = self._groups.pop(job.id, None)
        if group is not None:
            remove_placement_group(group)

    def _kill_soon(self, job: Job) -> None:
        pass  # the pump sees job.id in self._ending on its next turn; _end_processes then ends every node

    async def _recover_running(self, job: Job) -> str:
        """Find a job that ran under the previous scheduler: adopt it if all of it still runs, else end it."""
        actors = await asyncio.gather(*(_answering_actor(p.get("actor")) for p in job.placement))
        group = _find_group(job.id)
        whole = bool(actors) and (any(actors) if job.replicas > 1 else all(actors))
        if group is None or not whole:
            return await self._end_lost(job, [i for i, a in enumerate(actors) if a is None] or None)
        self._groups[job.id], self._actors[job.id], self._adopted[job.id] = group, list(actors), list(actors)
        booked: dict[str, int] = {}
        per_share = job.gpus_requested if job.replicas > 1 else job.gpus_requested // job.nodes
        for share, actor in zip(job.placement, actors):
            if actor is not None:
                booked[share["node_id"]] = booked.get(share["node_id"], 0) + per_share
        self._held[job.id] = booked
        self._arm_heartbeat(job)
        self._runners[job.id] = asyncio.get_running_loop().create_task(self._run(job), name=f"job-{job.id}")
        gone = sum(a is None for a in actors)
        return (f"job {job.id}: reconnected to its {len(actors) - gone} running share(s) on the Ray cluster"
                + (f"; {gone} replica(s) gone, placed again" if gone else ""))

    async def _end_lost(self, job: Job, gone: list[int] | None) -> str:
        """End whatever is left of a job found broken after a restart, and mark it failed (lost)."""
        what = f"share(s) {gone} no longer ran" if gone else "its Ray actors were gone"
        reason = f"lost: the scheduler restarted and {what} (node lost?); the rest of it was ended"
        await self._end_leftovers(job)
        job.state, job.reason, job.ended_at = "failed", reason, time.time()
        await self._save(job)
        return f"job {job.id}: {reason}"

    async def _end_leftovers(self, job: Job) -> None:
        """End every actor and the placement group named after ``job``: what a broken run of it left on
        the cluster (a scheduler that died between placing a job and saving where it went, say)."""
        prefix = _group_name(job.id) + "-"
        found = [_actor_named(n) for n in ray.util.list_named_actors() if n.startswith(prefix)]
        self._actors[job.id] = [a for a in found if a is not None]
        group = _find_group(job.id)
        if group is not None:
            self._groups[job.id] = group
        await self._end_processes(job)


def _group_name(job_id: str) -> str:
    return f"envhub-sched-{job_id}"


def _find_group(job_id: str) -> PlacementGroup | None:
    try:
        group: PlacementGroup = get_placement_group(_group_name(job_id))
    except ValueError:
        return None
    return group


def _actor_named(name: str) -> Any:
    """The actor ``name``, or None when it is gone (between listing and lookup)."""
    try:
        return ray.get_actor(name)
    except ValueError:
        return None


async def _answering_actor(name: str | None) -> Any:
    """The detached actor ``name`` if it exists and answers, else None."""
    if not name:
        return None
    actor = _actor_named(name)
    if actor is None:
        return None
    try:
        await asyncio.wait_for(ref_result(actor.where.remote()), _PING_TIMEOUT_S)
    except (RayActorError, ActorUnavailableError, asyncio.TimeoutError):
        return None
    return actor
