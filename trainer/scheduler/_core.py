"""The scheduler proper: queue, placement, launch, heartbeats and deterministic cleanup.

Everything that decides runs on the event loop and never awaits between reading and changing the
allocation tables, so two decisions cannot interleave. Blocking work goes elsewhere: the job store
to one dedicated thread (writes stay in order), process-tree scans and kills to the default pool.

Queueing: higher ``priority`` first, FIFO within a priority, strictly in order — a job that does
not fit holds back the jobs behind it, so a large job is never starved by a stream of small ones.

Cleanup is event-driven: each running job has one task awaiting its main process; the moment it
exits (or a cancel, a lost heartbeat, or shutdown ends it) the whole tree is ended, its GPUs and
ports return to the pools and the queue is scheduled again.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.scheduler import _procs
from trainer.scheduler._jobs import SERVICE_KINDS, Job, JobRequest
from trainer.scheduler._resources import Gpu, GpuPool, PortPool
from trainer.scheduler._store import JobStore, Principal
from trainer.scheduler.errors import JobNotFoundError, JobRequestError


class JobLostError(RuntimeError):
    """A backend lost a running job's processes (their node died); the message is the job's reason."""

#: environment variables of the scheduler that never reach a job
_SECRET_ENV_PREFIXES = ("ENVHUB_SCHEDULER_KEY",)
_TAIL_WINDOW_BYTES = 1 << 20  # `logs --tail N` looks at most this far back


@dataclass
class SchedulerConfig:
    """Settings of one scheduler instance."""

    gpus: list[Gpu]
    db_path: str = "envhub-sched.db"
    log_dir: str | None = None  # default: "<db_path>.logs/"
    grace_s: float = 5.0  # SIGTERM -> SIGKILL
    port_first: int = 29500
    port_last: int = 29999
    advertise_host: str = "127.0.0.1"

    def resolved_log_dir(self) -> Path:
        if self.log_dir:
            return Path(self.log_dir)
        if self.db_path == ":memory:":
            raise ValueError("Expected log_dir to be set when db_path is ':memory:'")
        return Path(f"{self.db_path}.logs")


class Scheduler:
    """Places jobs on GPUs and runs them; see the module docstring for the guarantees."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.store = JobStore(config.db_path)
        self.log_dir = config.resolved_log_dir().resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.gpus = GpuPool(config.gpus)
        self.ports = PortPool(config.port_first, config.port_last)
        self.jobs: dict[str, Job] = {}  # every job of the store: ids and order are decided here
        self._last_seq = 0
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="envhub-sched-db")
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._ending: dict[str, tuple[str, str]] = {}  # job id -> (final state, reason) once asked to end
        self._done: dict[str, asyncio.Event] = {}
        self._heartbeat_timers: dict[str, asyncio.TimerHandle] = {}
        self.started = False
        self.closing = False  # set when shutdown begins: log streams end so connections can drain

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Load the job store and recover from a previous run; returns one line per recovered job.

        Queued jobs stay queued. A job recorded as running from before is never adopted: its
        process (checked by pid and start time, so a reused pid is left alone) and every process
        carrying its marker are killed, and it is marked failed. Its GPUs were free meanwhile, so
        carrying on with it could have shared them.
        """
        notes = []
        for job in await self._in_db(self.store.load_all):
            self.jobs[job.id] = job
            self._last_seq = max(self._last_seq, job.seq)
            self._done[job.id] = asyncio.Event()
            if job.state == "running":
                notes.append(await self._recover_running(job))
            elif job.state == "queued" and self._never_fits(job.gpus_requested, job.nodes, job.replicas):
                # it would hold the head of the queue forever
                self._mark_ended(job, "failed", f"needs {job.gpus_requested} GPUs; the scheduler restarted "
                                                f"with {self.gpus_total()}")
                await self._save(job)
            elif job.state == "queued":
                self._arm_heartbeat(job)
            if not job.active:
                self._done[job.id].set()
        self.started = True
        self._schedule()
        return notes

    async def _recover_running(self, job: Job) -> str:
        same = job.pid is not None and _procs.is_same_process(job.pid, job.pid_start_ticks)
        root = job.pid if same else None
        killed = await asyncio.get_running_loop().run_in_executor(
            None, _procs.end_job_tree, job.id, root, root, self.config.grace_s)
        reason = ("scheduler restarted; process killed" if same or killed
                  else "scheduler restarted; process gone")
        job.state, job.reason, job.ended_at = "failed", reason, time.time()
        await self._save(job)
        return f"job {job.id}: {reason}"

    async def stop(self) -> None:
        """End every running job (failed: "scheduler stopped"), keep queued ones, close the store."""
        self.started = False  # nothing new starts from here on
        self.closing = True
        for job in list(self.jobs.values()):
            if job.state == "running":
                self._ending.setdefault(job.id, ("failed", "scheduler stopped"))
        for timer in self._heartbeat_timers.values():
            timer.cancel()
        self._heartbeat_timers.clear()
        await asyncio.gather(*(self._end_running(job_id) for job_id in list(self._runners)))
        self._db.shutdown(wait=True)
        self.store.close()

    # -- requests ---------------------------------------------------------------------------
    async def submit(self, who: Principal, request: JobRequest) -> Job:
        """Queue a job for ``who``; refuses a request the inventory can never satisfy."""
        if request.nodes < 1 or request.gpus % request.nodes:
            raise JobRequestError(f"Expected --gpus to be a multiple of --nodes, got {request.gpus} GPUs "
                                  f"on {request.nodes} nodes")
        if request.replicas > 1 and (request.kind not in SERVICE_KINDS or request.nodes != 1):
            raise JobRequestError(f"Expected --replicas only for kind service on one node per replica, got kind "
                                  f"{request.kind!r} with --nodes {request.nodes}")
        if self._never_fits(request.gpus, request.nodes, request.replicas):
            raise JobRequestError(f"Expected at most {self.gpus_total()} GPUs (the scheduler's inventory), "
                                  f"got a request for {request.gpus} on {request.nodes} node(s) x "
                                  f"{request.replicas} replica(s); ask for fewer (--nodes and --replicas "
                                  "need the Ray backend)")
        if request.torchrun and request.kind not in ("rl", "sft"):
            raise JobRequestError(f"Expected torchrun only for kind rl or sft, got kind {request.kind!r}")
        self._last_seq += 1  # no await before this: concurrent submits get distinct, ordered numbers
        job = Job(id=self._new_id(), user=who.user, command=request.command,
                  gpus_requested=request.gpus, kind=request.kind, name=request.name or Path(request.command[0]).name,
                  priority=request.priority, heartbeat_timeout_s=request.heartbeat_timeout_s, env=request.env,
                  cwd=request.cwd, torchrun=request.torchrun, n_ports=request.ports,
                  nodes=request.nodes, replicas=request.replicas, seq=self._last_seq)
        job.log_path = str(self.log_dir / f"{job.id}.log")
        self.jobs[job.id] = job
        self._done[job.id] = asyncio.Event()
        await self._save(job)
        self._arm_heartbeat(job)
        self._schedule()
        return job

    def get(self, who: Principal, job_id: str) -> Job:
        """The job ``job_id`` if ``who`` may see it (its owner or an admin)."""
        job = self.jobs.get(job_id)
        if job is None or not (who.admin or job.user == who.user):
            raise JobNotFoundError(f"No job {job_id!r}; list your jobs with `envhub-sched list`")
        return job

    def list(self, who: Principal, all_users: bool = True) -> list[Job]:
        """Jobs ``who`` may see in submission order (an admin sees everyone's unless ``all_users=False``)."""
        return [j for j in sorted(self.jobs.values(), key=lambda j: j.seq)
                if j.user == who.user or (who.admin and all_users)]

    async def cancel(self, who: Principal, job_id: str) -> Job:
        """Cancel a job; returns once its whole process tree is gone. A finished job is left as is."""
        job = self.get(who, job_id)
        await self._end(job, "cancelled", f"cancelled by {who.user}")
        return job

    async def heartbeat(self, who: Principal, job_id: str) -> Job:
        """Record that the job's client is alive; re-arms its heartbeat deadline."""
        job = self.get(who, job_id)
        if job.active:
            job.heartbeat_at = time.time()
            self._arm_heartbeat(job)
        return job

    async def wait(self, job_id: str, timeout_s: float | None = None) -> Job:
        """Wait until ``job_id`` has ended and been cleaned up."""
        await asyncio.wait_for(self._done[job_id].wait(), timeout_s)
        return self.jobs[job_id]

    async def authenticate(self, key: str) -> Principal | None:
        """The owner of API key ``key``, or None (looked up off the event loop)."""
        principal: Principal | None = await self._in_db(self.store.verify_key, key)
        return principal

    # -- backend hooks: the local backend below; trainer.scheduler._ray overrides them -------------
    def gpus_total(self) -> int:
        """GPUs in the whole inventory."""
        return self.gpus.total

    def _never_fits(self, gpus: int, nodes: int, replicas: int = 1) -> bool:
        """Whether a job of ``gpus`` GPUs on ``nodes`` nodes (x ``replicas``) can never be placed here."""
        return nodes != 1 or replicas != 1 or gpus > self.gpus.total

    def _place(self, job: Job) -> bool:
        """Reserve the job's GPUs and ports; False when they are not free now (nothing reserved then).

        Raises RuntimeError when the job fits but cannot be launched (no free port): it fails.
        """
        gpus = self.gpus.take(job.id, job.gpus_requested)
        if gpus is None:
            return False
        try:
            job.ports = self.ports.take(job.id, job.n_ports)
        except RuntimeError:
            self.gpus.release(job.id)
            raise
        job.gpus = gpus
        return True

    def _release(self, job: Job) -> None:
        """Return the job's GPUs and ports to the pools."""
        self.gpus.release(job.id)
        self.ports.release(job.id)

    async def _launch_and_wait(self, job: Job) -> int | None:
        """Start the job's processes and wait for its main process; returns its exit code."""
        proc = await self._spawn(job)
        job.pid, job.pid_start_ticks = proc.pid, _procs.start_ticks(proc.pid)
        await self._save(job)
        if job.id in self._ending:  # cancelled while it was being launched
            self._kill_soon(job)
        return await proc.wait()

    async def _end_processes(self, job: Job) -> None:
        """End every process of the job that is still alive; returns once they are gone."""
        await self._in_pool(_procs.end_job_tree, job.id, job.pid, job.pid, self.config.grace_s)

    def _kill_soon(self, job: Job) -> None:
        """Start ending the job's processes without waiting (its runner task sees the exit)."""
        if job.pid is None:
            return
        asyncio.get_running_loop().run_in_executor(
            None, _procs.end_job_tree, job.id, job.pid, job.pid, self.config.grace_s)

    def gpu_view(self) -> builtins.list[dict[str, Any]]:
        """The inventory as the API shows it: one entry per GPU with the job holding it."""
        return [{"index": g.index, "name": g.name, "memory_mib": g.memory_mib, "job": self.gpus.holder(g.index)}
                for g in self.gpus.gpus]

    def node_view(self) -> builtins.list[dict[str, Any]]:
        """The inventory per node as the API shows it: this machine, its GPUs, how many are free, who holds some."""
        holders = sorted({h for g in self.gpus.gpus if (h := self.gpus.holder(g.index)) is not None})
        return [{"node_id": "local", "node_ip": self.config.advertise_host, "gpus": self.gpus.total,
                 "gpus_free": self.gpus.free_count(), "jobs": holders}]

    async def follow_log(self, job_id: str, tail_lines: int | None, follow: bool,
                         offset_bytes: int | None = None) -> AsyncIterator[bytes]:
        """The job's log: from byte ``offset_bytes`` (a follower resuming), else the last ``tail_lines``
        lines (all when None); then new output while it runs."""
        job = self.jobs[job_id]
        path = Path(job.log_path)
        size = path.stat().st_size if path.exists() else 0
        offset = 0
        if offset_bytes is not None:
            offset = min(offset_bytes, size)
        elif tail_lines is not None:
            start = max(0, size - _TAIL_WINDOW_BYTES)
            lines = _read_from(path, start, size - start).splitlines(keepends=True)
            if tail_lines > 0 and lines[-tail_lines:]:
                yield b"".join(lines[-tail_lines:])
            offset = size
        while True:
            finished = not job.active  # read before the chunk: output written before the end is kept
            chunk = _read_from(path, offset)
            offset += len(chunk)
            if chunk:
                yield chunk
            elif finished or not follow:
                return
            elif self.closing:
                yield b"\n[envhub-sched: the scheduler is shutting down]\n"
                return
            else:  # files give no readiness events; a short wait, cut short by the job's end
                try:
                    await asyncio.wait_for(self._done[job_id].wait(), 0.2)
                except asyncio.TimeoutError:
                    pass

    # -- placement and launch ---------------------------------------------------------------
    def _schedule(self) -> None:
        """Start queued jobs in order while they fit; synchronous, so no two runs interleave."""
        if not self.started:
            return
        queue = sorted((j for j in self.jobs.values() if j.state == "queued"), key=lambda j: (-j.priority, j.seq))
        for job in queue:
            try:
                if not self._place(job):
                    break
            except RuntimeError as exc:
                self._finish_queued(job, "failed", f"launch failed: {exc}")
                continue
            job.state, job.started_at = "running", time.time()
            self._runners[job.id] = asyncio.get_running_loop().create_task(self._run(job), name=f"job-{job.id}")

    async def _run(self, job: Job) -> None:
        """Launch the job, await its main process, then clean up; the job's single owner task."""
        exit_code: int | None = None
        launch_error = ""
        try:
            exit_code = await self._launch_and_wait(job)
        except JobLostError as exc:  # the backend lost the job's processes (a node died)
            launch_error = str(exc)
        except Exception as exc:  # whatever stops the launch (no program, bad cwd, NUL in argv) fails the job
            launch_error = f"launch failed: {_launch_failure(job, exc)}"
        await self._end_processes(job)
        if launch_error:
            state, reason = "failed", launch_error
        elif job.id in self._ending:
            state, reason = self._ending[job.id]
        else:
            state = "succeeded" if exit_code == 0 else "failed"
            reason = "" if exit_code == 0 else f"exit code {exit_code}"
        job.exit_code = exit_code
        self._release(job)
        self._runners.pop(job.id, None)
        self._ending.pop(job.id, None)
        self._mark_ended(job, state, reason)
        self._schedule()  # before the save: the queue moves on the moment the tree is gone
        await self._save(job)
        self._done[job.id].set()

    async def _spawn(self, job: Job) -> asyncio.subprocess.Process:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SECRET_ENV_PREFIXES)}
        env.update(job.env)
        env.update({
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, job.gpus)),
            "ENVHUB_JOB_ID": job.id,
            "ENVHUB_JOB_PORTS": ",".join(map(str, job.ports)),
            _procs.JOB_MARKER_ENV: job.id,
        })
        if job.ports:
            env["MASTER_PORT"] = str(job.ports[0])
        with open(job.log_path, "ab", buffering=0) as log:
            return await asyncio.create_subprocess_exec(
                *job.launch_argv(job.ports[0] if job.ports else None), stdin=asyncio.subprocess.DEVNULL,
                stdout=log, stderr=asyncio.subprocess.STDOUT, cwd=job.cwd or None, env=env,
                start_new_session=True)

    # -- ending -----------------------------------------------------------------------------
    async def _end(self, job: Job, state: str, reason: str) -> None:
        if job.state == "queued":
            self._finish_queued(job, state, reason)
            await self._save(job)
        elif job.state == "running":
            self._ending.setdefault(job.id, (state, reason))
            await self._end_running(job.id)

    async def _end_running(self, job_id: str) -> None:
        self._kill_soon(self.jobs[job_id])
        await self._done[job_id].wait()

    def _mark_ended(self, job: Job, state: str, reason: str) -> None:
        job.state, job.reason, job.ended_at = state, reason, time.time()
        self._drop_heartbeat(job.id)

    def _finish_queued(self, job: Job, state: str, reason: str) -> None:
        self._mark_ended(job, state, reason)
        self._done[job.id].set()
        self._db.submit(self.store.save, job)  # ordered before any later write by the single db thread

    # -- heartbeats -------------------------------------------------------------------------
    def _arm_heartbeat(self, job: Job) -> None:
        if job.heartbeat_timeout_s is None or not job.active:
            return
        self._drop_heartbeat(job.id)
        loop = asyncio.get_running_loop()
        self._heartbeat_timers[job.id] = loop.call_later(job.heartbeat_timeout_s, self._heartbeat_lost, job.id)

    def _drop_heartbeat(self, job_id: str) -> None:
        timer = self._heartbeat_timers.pop(job_id, None)
        if timer is not None:
            timer.cancel()

    def _heartbeat_lost(self, job_id: str) -> None:
        job = self.jobs[job_id]
        self._heartbeat_timers.pop(job_id, None)
        reason = f"heartbeat lost: no heartbeat for {job.heartbeat_timeout_s:g} s"
        asyncio.get_running_loop().create_task(self._end(job, "failed", reason))

    # -- helpers ----------------------------------------------------------------------------
    def _new_id(self) -> str:
        while True:
            job_id = "j" + secrets.token_hex(4)
            if job_id not in self.jobs:
                return job_id

    async def _save(self, job: Job) -> None:
        await self._in_db(self.store.save, job)

    async def _in_db(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._db, fn, *args)

    async def _in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _read_from(path: Path, offset: int, size: int = 1 << 16) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    except FileNotFoundError:
        return b""


def _launch_failure(job: Job, exc: Exception) -> str:
    """Why a job did not start, naming what was missing: its working directory or its program."""
    filename = getattr(exc, "filename", None)
    if isinstance(exc, OSError) and filename is not None:
        what = "working directory" if job.cwd is not None and str(filename) == job.cwd else "program"
        return f"{exc.strerror}: {what} {str(filename)!r}"
    return str(exc)
