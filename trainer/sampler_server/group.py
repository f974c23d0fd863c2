"""The server's side of weight groups (:mod:`trainer.sampling.weight_group`): joining and receiving through them.

``POST /weight-group`` (``{"host", "port", "group", "timeout_s"}``) joins the trainer's store as rank 1 of a
2-rank gloo group named ``group``; a push with ``X-Envhub-Weight-Group: <group>`` then carries only the
safetensors header in its body, and the tensors' bytes arrive through the group straight into the
tensors the backend planned. A server keeps a few groups (one per trainer); the oldest goes first.
"""

from __future__ import annotations

import datetime
import threading
from collections import OrderedDict
from typing import Any

import torch
from pydantic import BaseModel, Field
from torch._C import _distributed_c10d as dist  # the c10d classes, typed (torch.distributed re-exports them)

from trainer.sampler_server.protocol import BadRequestError
from trainer.sampling.weight_group import local_address_towards, make_group
from trainer.sampling.wire import TensorStreamReader

MAX_GROUPS = 8


class JoinBody(BaseModel):
    """Where the trainer's store listens and the group's id (32 hex digits)."""

    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    group: str = Field(pattern=r"^[0-9a-f]{32}$")
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


class WeightGroups:
    """The groups this server joined, by id."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off: joins are refused (envhub-train sampler --no-weight-group)
        self._groups: OrderedDict[str, tuple[Any, float]] = OrderedDict()
        self._lock = threading.Lock()

    def join(self, body: JoinBody) -> None:
        """Join ``body.group`` as rank 1 (blocks until the trainer's side is up or the timeout)."""
        if not self.enabled:
            raise BadRequestError("This server joins no weight groups (started with --no-weight-group); push over "
                                  "the weight channel or as an HTTP body.")
        timeout = datetime.timedelta(seconds=body.timeout_s)
        try:
            store = dist.TCPStore(body.host, body.port, 2, False, timeout=timeout)
            pg = make_group(store, body.group, 1, local_address_towards(body.host), body.timeout_s)
        except Exception as exc:
            raise BadRequestError(f"Could not join weight group {body.group} at {body.host}:{body.port} "
                                  f"({type(exc).__name__}: {exc}).") from exc
        with self._lock:
            self._groups[body.group] = (pg, body.timeout_s)
            while len(self._groups) > MAX_GROUPS:
                _, (old, _) = self._groups.popitem(last=False)
                _abort(old)

    def receive(self, group: str, reader: TensorStreamReader) -> int:
        """Receive the tensors ``reader`` planned (its header fed) through ``group``; their size in bytes.

        A group that fails is forgotten (the trainer forms a new one or falls back)."""
        with self._lock:
            found = self._groups.get(group)
        if found is None:
            raise BadRequestError(f"This server is in no weight group {group}; join it with POST /weight-group.")
        pg, timeout_s = found
        timeout = datetime.timedelta(seconds=timeout_s)

        def recv(dest: torch.Tensor) -> None:
            pg.recv([dest], 0, 0).wait(timeout)

        try:
            reader.fill_each(recv)
        except RuntimeError as exc:
            self.forget(group)
            raise BadRequestError(f"The weight group broke off ({type(exc).__name__}: {exc}).") from exc
        header = reader.header
        return header.data_bytes if header is not None else 0

    def forget(self, group: str) -> None:
        with self._lock:
            found = self._groups.pop(group, None)
        if found is not None:
            _abort(found[0])


def _abort(pg: Any) -> None:
    try:
        pg.abort()
    except Exception:  # torn down already
        pass


__all__ = ["JoinBody", "WeightGroups"]
