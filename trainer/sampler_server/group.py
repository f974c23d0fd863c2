"""The server's side of weight groups (:mod:`trainer.sampling.weight_group`): joining and receiving through them.

``POST /weight-group`` (``{"host", "port", "group", "timeout_s", "backend"}``) joins the trainer's store as rank
1 of a 2-rank gloo or NCCL group named ``group``; a push with ``X-Envhub-Weight-Group: <group>`` then carries
only the safetensors header in its body, and the tensors' bytes arrive through the group straight into the
tensors the backend planned (NCCL: into buffers on the server's CUDA device, copied into the planned tensors
that live elsewhere). NCCL is joined only by a server on a CUDA device (refused otherwise, with the reason: the
trainer then pushes over the weight channel). A server keeps a few groups (one per trainer); the oldest goes first.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field
from torch._C import _distributed_c10d as dist  # the c10d classes, typed (torch.distributed re-exports them)

from trainer.sampler_server.protocol import BadRequestError
from trainer.sampling.weight_group import handshake, local_address_towards, make_group, unavailable, wait_device
from trainer.sampling.wire import TensorStreamReader

MAX_GROUPS = 8


class JoinBody(BaseModel):
    """Where the trainer's store listens and the group's id (32 hex digits)."""

    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    group: str = Field(pattern=r"^[0-9a-f]{32}$")
    timeout_s: float = Field(default=60.0, gt=0, le=3600)
    backend: Literal["gloo", "nccl"] = "gloo"


@dataclass
class _Group:
    pg: Any
    timeout_s: float
    device: torch.device  # where its tensors must be: the CPU (gloo) or the server's CUDA device (NCCL)


class WeightGroups:
    """The groups this server joined, by id; NCCL ones on ``device`` (the server's, when it is a CUDA device)."""

    def __init__(self, enabled: bool = True, device: torch.device | str = "cpu") -> None:
        self.enabled = enabled  # off: joins are refused (envhub-train sampler --no-weight-group)
        self.device = torch.device(device)
        self._groups: OrderedDict[str, _Group] = OrderedDict()
        self._lock = threading.Lock()

    def backends(self) -> list[str]:
        """The kinds of group this server joins (for ``/health``)."""
        if not self.enabled:
            return []
        return ["gloo"] + (["nccl"] if self._nccl_refusal() is None else [])

    def _nccl_refusal(self) -> str | None:
        if self.device.type != "cuda":
            return (f"this server runs on {self.device.type} (start it on a GPU, --device cuda, to take tensors "
                    "through NCCL)")
        why = unavailable("nccl")
        return f"{why} on this server" if why is not None else None

    def join(self, body: JoinBody) -> None:
        """Join ``body.group`` as rank 1 (blocks until the trainer's side is up or the timeout)."""
        if not self.enabled:
            raise BadRequestError("This server joins no weight groups (started with --no-weight-group); push over "
                                  "the weight channel or as an HTTP body.")
        refusal = self._nccl_refusal() if body.backend == "nccl" else None
        if refusal is not None:
            raise BadRequestError(f"This server joins no NCCL weight group: {refusal}; push over gloo, the weight "
                                  "channel or as an HTTP body.")
        device = self.device if body.backend == "nccl" else torch.device("cpu")
        if device == torch.device("cuda"):  # no index: the current one
            device = torch.device("cuda", torch.cuda.current_device())
        timeout = datetime.timedelta(seconds=body.timeout_s)
        try:
            store = dist.TCPStore(body.host, body.port, 2, False, timeout=timeout)
            pg = make_group(store, body.group, 1, local_address_towards(body.host), body.timeout_s,
                            backend=body.backend)
            if body.backend == "nccl":
                handshake(pg, 1, device, body.timeout_s)
        except Exception as exc:
            raise BadRequestError(f"Could not join {body.backend} weight group {body.group} at {body.host}:{body.port} "
                                  f"({type(exc).__name__}: {exc}).") from exc
        with self._lock:
            self._groups[body.group] = _Group(pg, body.timeout_s, device)
            while len(self._groups) > MAX_GROUPS:
                _, old = self._groups.popitem(last=False)
                _abort(old.pg)

    def receive(self, group: str, reader: TensorStreamReader) -> int:
        """Receive the tensors ``reader`` planned (its header fed) through ``group``; their size in bytes.

        A group that fails is forgotten (the trainer forms a new one or falls back)."""
        with self._lock:
            found = self._groups.get(group)
        if found is None:
            raise BadRequestError(f"This server is in no weight group {group}; join it with POST /weight-group.")
        timeout = datetime.timedelta(seconds=found.timeout_s)
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device buffer, planned tensor elsewhere)

        def recv(dest: torch.Tensor) -> None:
            into = dest if dest.device == found.device else torch.empty_like(dest, device=found.device)
            found.pg.recv([into], 0, 0).wait(timeout)
            if into is not dest:
                staged.append((into, dest))

        try:  # in a worker thread: NCCL's device made current for it
            with torch.cuda.device(found.device) if found.device.type == "cuda" else contextlib.nullcontext():
                reader.fill_each(recv)
                wait_device(found.device, time.monotonic() + found.timeout_s)
            for buffer, dest in staged:
                dest.copy_(buffer)
        except RuntimeError as exc:  # WeightGroupError is one
            self.forget(group)
            raise BadRequestError(f"The weight group broke off ({type(exc).__name__}: {exc}).") from exc
        header = reader.header
        return header.data_bytes if header is not None else 0

    def forget(self, group: str) -> None:
        with self._lock:
            found = self._groups.pop(group, None)
        if found is not None:
            _abort(found.pg)


def _abort(pg: Any) -> None:
    try:
        pg.abort()
    except Exception:  # torn down already
        pass


__all__ = ["JoinBody", "WeightGroups"]
