"""Job records: what a user asks for (:class:`JobRequest`) and what the scheduler keeps (:class:`Job`).

States::

    queued ──▶ running ──▶ succeeded   (exit code 0)
       │          ├──────▶ failed      (non-zero exit, heartbeat lost, scheduler restarted/stopped)
       │          └──────▶ cancelled   (a user cancelled it)
       ├──────────────────▶ cancelled
       └──────────────────▶ failed      (heartbeat lost while queued, launch error)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

JobKind = Literal["rl", "sft", "inference", "service", "sampler", "cmd"]
JOB_KINDS: tuple[str, ...] = ("rl", "sft", "inference", "service", "sampler", "cmd")
SERVICE_KINDS = frozenset({"service", "sampler"})  # long-running servers: may have replicas
STATES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")
ACTIVE_STATES = frozenset({"queued", "running"})


class JobRequest(BaseModel):
    """The body of ``POST /jobs``."""

    model_config = {"extra": "forbid"}

    command: list[str] = Field(min_length=1, description="argv of the job, run as given")
    gpus: int = Field(default=0, ge=0)
    kind: JobKind = "cmd"
    name: str | None = Field(default=None, max_length=200)
    priority: int = Field(default=0, description="higher runs first; FIFO within a priority")
    heartbeat_timeout_s: float | None = Field(default=None, gt=0)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")
    cwd: str | None = None
    torchrun: bool = Field(default=False, description="rl/sft only: wrap in torchrun --nproc_per_node=<gpus>")
    ports: int = Field(default=1, ge=0, le=64, description="TCP ports to reserve for the job")
    nodes: int = Field(default=1, ge=1, le=256, description="nodes to spread the GPUs over (Ray backend)")
    replicas: int = Field(default=1, ge=1, le=256,
                          description="service only (Ray backend): copies of the command, each with --gpus GPUs and "
                                      "its own port ({port} in the command); one that dies is restarted")

    @field_validator("command")
    @classmethod
    def _command_not_blank(cls, command: list[str]) -> list[str]:
        if not command[0].strip():
            raise ValueError("Expected a command such as ['python', 'train.py'], got an empty program name")
        if any("\0" in arg for arg in command):  # the OS would cut the argument at it
            raise ValueError("Expected command arguments without NUL characters")
        return command

    @field_validator("cwd")
    @classmethod
    def _cwd_without_nul(cls, cwd: str | None) -> str | None:
        if cwd is not None and "\0" in cwd:
            raise ValueError("Expected a working directory without NUL characters")
        return cwd

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [k for k in env if not k or "=" in k or "\0" in k]
        if bad:
            raise ValueError(f"Expected environment variable names without '=' or NUL, got {bad}")
        if any("\0" in v for v in env.values()):
            raise ValueError("Expected environment variable values without NUL characters")
        return env


@dataclass
class Job:
    """One job as the scheduler keeps it (and as the job store persists it)."""

    id: str
    user: str
    command: list[str]
    gpus_requested: int
    kind: str = "cmd"
    name: str = ""
    priority: int = 0
    heartbeat_timeout_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    torchrun: bool = False
    n_ports: int = 1
    nodes: int = 1
    replicas: int = 1
    placement: list[dict[str, Any]] = field(default_factory=list)  # Ray: [{node_id, node_ip, gpus}] per node
    state: str = "queued"
    reason: str = ""
    gpus: list[int] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    pid: int | None = None
    pid_start_ticks: int | None = None
    exit_code: int | None = None
    log_path: str = ""
    seq: int = 0  # submission order, for FIFO within a priority
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    heartbeat_at: float | None = None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def launch_argv(self, master_port: int | None) -> list[str]:
        """The argv actually started: the command, wrapped in torchrun when asked for.

        ``python train.py ...`` and ``python -m pkg ...`` become ``python -m torch.distributed.run
        <opts> train.py ...`` with the job's own interpreter, so workers run in the job's
        environment; any other program runs under ``torchrun --no-python``.
        """
        if not (self.torchrun and self.kind in ("rl", "sft")):
            return with_port(self.command, master_port)
        opts = [f"--nproc_per_node={max(self.gpus_requested, 1)}"]
        if master_port is not None:
            opts.append(f"--master_port={master_port}")
        program, *args = self.command
        if Path(program).name.startswith("python"):
            return [program, "-m", "torch.distributed.run", *opts, *args]
        return ["torchrun", *opts, "--no-python", program, *args]

    def public(self, advertise_host: str = "127.0.0.1") -> dict[str, Any]:
        """The job as the API shows it: no environment values (they may hold secrets)."""
        data = asdict(self)
        data["env"] = sorted(self.env)  # names only
        replicas = [f"http://{p['node_ip']}:{p['port']}" for p in self.placement if p.get("port")]
        # where the job serves, while it runs (a queued or ended job serves nowhere)
        data["endpoints"] = (replicas or [f"http://{advertise_host}:{p}" for p in self.ports]) \
            if self.state == "running" else []
        data.pop("pid_start_ticks")
        return data


def with_port(command: list[str], port: int | None) -> list[str]:
    """``command`` with ``{port}`` replaced by the job's (or replica's) port, so a server can bind it."""
    return [arg.replace("{port}", str(port)) for arg in command] if port is not None else list(command)
