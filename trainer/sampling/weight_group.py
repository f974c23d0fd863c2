"""Weight pushes through a ``torch.distributed`` group: one 2-rank group (gloo or NCCL) per (trainer, server) pair.

Opt-in beside the weight channel (:mod:`.remote_push`): ``SamplerPool(weight_group="gloo")`` (CPU tensors, any
host) or ``"nccl"`` (GPU to GPU: the tensors on the trainer's current CUDA device, received on the server's;
chosen explicitly, never by ``"auto"``, and refused with the reason where this process has no CUDA device or
torch no NCCL: :func:`unavailable`). No ``init_process_group``: the trainer talks to several servers and may
itself be a torchrun rank, so each pair gets a group of its own. The trainer hosts a ``TCPStore`` on a free
port, asks the server to join (``POST /weight-group`` with the store's host and port, the backend and a fresh
group id, under the bearer token) and builds its side (rank 0) while the server builds rank 1 on the same
store. An NCCL pair then sends one byte from rank 0 to rank 1 while the server still answers the join, so a
pair NCCL cannot form (both ranks on one GPU, no path between them) fails the join instead of a push.

A push then goes as ``PUT /weights`` (or ``/adapters/<name>``) with ``X-Envhub-Weight-Group: <group id>``
and the safetensors header alone as the body: the plan (names, shapes, dtypes, version, LoRA config). The
server plans its tensors from it as for any body and receives each tensor's bytes with ``recv`` straight
into them (NCCL: into device buffers, copied into host tensors the plan keeps on the CPU), then applies
them under its update lock; the trainer sends the bytes with ``send`` meanwhile. Every wait is bounded
(``timeout_s``; NCCL's own watchdog gets a longer one, so the pair is aborted here first): a group that
fails is closed and the caller falls back to the channel or an HTTP body. Tensors travel as raw bytes.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch
from torch._C import _distributed_c10d as dist  # the c10d classes, typed (torch.distributed re-exports them)

from trainer.sampling.remote_push import Push
from trainer.sampling.wire import encode

#: the HTTP header of a push whose tensors come through the server's weight group
GROUP_HEADER = "X-Envhub-Weight-Group"
BACKENDS = ("off", "gloo", "nccl", "auto")
#: how much longer NCCL's watchdog waits than a pair's own bounded waits (its timeout may end the process)
NCCL_WATCHDOG_MARGIN_S = 60.0


class WeightGroupError(RuntimeError):
    """The group could not be formed or broke off (peer gone, timeout, refused)."""


def local_address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (what the server can reach the trainer's store at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: connect on UDP only picks the route
        addr: str = probe.getsockname()[0]
        return addr


def wire_bytes(tensor: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """``tensor``'s bytes as a flat contiguous uint8 tensor on ``device`` (what travels through the group)."""
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def unavailable(backend: str) -> str | None:
    """Why this process cannot take part in a ``backend`` group (None: it can); only NCCL needs anything."""
    if backend != "nccl":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device is visible to this process"
    if not torch.distributed.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def group_device(backend: str, push: Push | None = None) -> torch.device:
    """Where a ``backend`` group's tensors live: the CPU for gloo; for NCCL the CUDA device ``push``'s tensors are
    on (a push is made in a worker thread, whose current device is not the trainer's), else the current one."""
    if backend != "nccl":
        return torch.device("cpu")
    on_gpu = [t.device for t in (push.tensors.values() if push is not None else ()) if t.is_cuda]
    return on_gpu[0] if on_gpu else torch.device("cuda", torch.cuda.current_device())


def wait_device(device: torch.device, deadline: float) -> None:
    """Block until the work queued on ``device``'s current stream (NCCL sends and receives) is done, or raise
    ``WeightGroupError`` at ``deadline`` (monotonic seconds). Nothing to wait for on the CPU."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(torch.cuda.current_stream(device))
    while not done.query():  # type: ignore[no-untyped-call]
        if time.monotonic() > deadline:
            raise WeightGroupError("the group's transfers did not finish in time")
        time.sleep(0.001)


def handshake(pg: Any, rank: int, device: torch.device, timeout_s: float) -> None:
    """One byte from rank 0 to rank 1: forms an NCCL pair's communicator now, so a pair that cannot form fails
    at the join."""
    with torch.cuda.device(device):  # the calling thread's current device is NCCL's (threads start on device 0)
        byte = torch.ones(1, dtype=torch.uint8, device=device)
        op = pg.send if rank == 0 else pg.recv
        op([byte], 1 - rank, 0).wait(datetime.timedelta(seconds=timeout_s))
        wait_device(device, time.monotonic() + timeout_s)


class TrainerGroup:
    """The trainer's side (rank 0) of the group with the server at ``url`` (NCCL: on ``push``'s CUDA device)."""

    def __init__(self, http: httpx.Client, url: str, *, timeout_s: float = 60.0, backend: str = "gloo",
                 push: Push | None = None):
        host = urlsplit(url).hostname
        if host is None:
            raise WeightGroupError(f"Expected a server URL with a host, got {url!r}.")
        why = unavailable(backend)
        if why is not None:
            raise WeightGroupError(f"no {backend} group here: {why}")
        self.url, self.timeout_s, self.backend = url, timeout_s, backend
        self.device = group_device(backend, push)
        self.group_id = secrets.token_hex(16)
        try:
            addr = local_address_towards(host)
        except OSError as exc:  # no IPv4 route to it (an IPv6-only host, a name that does not resolve)
            raise WeightGroupError(f"no route to {host} for the group's store ({exc})") from exc
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self._store = dist.TCPStore(addr, 0, 2, True, timeout=timeout, wait_for_workers=False)
        except Exception as exc:
            raise WeightGroupError(f"could not host a store on {addr} ({type(exc).__name__}: {exc})") from exc
        self.broken = False
        body = {"host": addr, "port": self._store.port, "group": self.group_id, "timeout_s": timeout_s,
                "backend": backend}
        built: Future[Any] = Future()
        forming: list[Any] = []  # our side, once made (aborted if the join fails)

        def build() -> None:  # blocks until the server's side connects (or the timeout)
            try:
                pg = make_group(self._store, self.group_id, 0, addr, timeout_s, backend=backend)
                forming.append(pg)
                if backend == "nccl":
                    handshake(pg, 0, self.device, timeout_s)
                built.set_result(pg)
            except BaseException as exc:  # handed to the waiting side
                built.set_exception(exc)

        threading.Thread(target=build, name="envhub-weight-group-join", daemon=True).start()
        try:
            self.pg = self._join(http, body, built)
        except WeightGroupError:
            # ours may still wait for a peer that never comes: aborted, so no watchdog (NCCL's may end the process)
            # fires on it later
            for pg in forming:
                _abort(pg)
            raise

    def _join(self, http: httpx.Client, body: dict[str, Any], built: Future[Any]) -> Any:
        try:  # the server answers once its side is built; a refusal comes at once
            resp = http.post(f"{self.url}/weight-group", json=body, timeout=self.timeout_s + 10)
        except httpx.HTTPError as exc:
            raise WeightGroupError(f"the join request failed ({type(exc).__name__}: {exc})") from exc
        if resp.status_code != 200:
            raise WeightGroupError(f"the server refused to join: HTTP {resp.status_code}: {_message(resp)}")
        try:
            return built.result(timeout=self.timeout_s)
        except Exception as exc:
            raise WeightGroupError(f"the group did not form ({type(exc).__name__}: {exc})") from exc

    def put(self, http: httpx.Client, push: Push) -> httpx.Response:
        """Send ``push``: its plan over HTTP, its tensors through the group; the server's answer.

        ``WeightGroupError`` when the tensors could not go through (the group is closed then)."""
        plan = _plan_bytes(push)
        sent: Future[None] = Future()
        threading.Thread(target=self._send_all, args=(push, sent), name="envhub-weight-group-send",
                         daemon=True).start()
        try:
            resp = http.put(f"{self.url}{push.path}", content=plan,
                            headers={GROUP_HEADER: self.group_id, "Content-Type": "application/octet-stream"},
                            timeout=self.timeout_s + 30)
        except httpx.HTTPError:
            self.close()
            raise
        if resp.status_code != 200:  # refused before (or while) receiving: the group's state is unknown now
            self.close()
            return resp
        try:
            sent.result(timeout=self.timeout_s)
        except Exception as exc:
            self.close()
            raise WeightGroupError(f"sending through the group failed ({type(exc).__name__}: {exc})") from exc
        return resp

    def _send_all(self, push: Push, sent: Future[None]) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            timeout = datetime.timedelta(seconds=self.timeout_s)
            staged = []  # NCCL sends run on their own stream: their buffers live until it is done
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                for tensor in push.tensors.values():
                    if tensor.numel():
                        staged.append(wire_bytes(tensor, self.device))
                        self.pg.send([staged[-1]], 1, 0).wait(timeout)
                wait_device(self.device, deadline)
            sent.set_result(None)
        except BaseException as exc:  # handed to put()
            sent.set_exception(exc)

    def close(self) -> None:
        """Give the group up (the pool then pushes to that server over its channel or as HTTP bodies)."""
        self.broken = True
        pg = getattr(self, "pg", None)
        if pg is not None:
            _abort(pg)


def make_group(store: dist.Store, group_id: str, rank: int, addr: str, timeout_s: float, *,
               backend: str = "gloo") -> Any:
    """Rank ``rank`` of the 2-rank ``backend`` group ``group_id`` on ``store``: gloo's device bound to ``addr``
    (the address the peer reaches), or NCCL's (on the current CUDA device; it finds its own path)."""
    if backend == "nccl":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = datetime.timedelta(seconds=timeout_s + NCCL_WATCHDOG_MARGIN_S)
        return dist.ProcessGroupNCCL(dist.PrefixStore(group_id, store), rank, 2, nccl)
    # gloo's own options (its devices: bound to the address the peer reaches); torch's type hints call them Options
    opts: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    return dist.ProcessGroupGloo(dist.PrefixStore(group_id, store), rank, 2, opts)


def _abort(pg: Any) -> None:
    try:
        pg.abort()
    except Exception:  # already torn down by the failure
        pass


def _plan_bytes(push: Push) -> bytes:
    """The push's safetensors header (names, shapes, dtypes, metadata): the first chunk :func:`encode` yields."""
    return bytes(next(iter(encode(push.tensors, push.meta))))


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


__all__ = ["BACKENDS", "GROUP_HEADER", "TrainerGroup", "WeightGroupError", "group_device", "handshake", "make_group",
           "unavailable", "wait_device", "wire_bytes"]
