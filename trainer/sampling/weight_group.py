"""Weight pushes through a ``torch.distributed`` group: one 2-rank gloo group per (trainer, server) pair.

Opt-in beside the weight channel (:mod:`.remote_push`): ``SamplerPool(weight_group="gloo")``. No
``init_process_group``: the trainer talks to several servers and may itself be a torchrun rank, so each
pair gets a group of its own. The trainer hosts a ``TCPStore`` on a free port, asks the server to join
(``POST /weight-group`` with the store's host and port and a fresh group id, under the bearer token) and
builds its side of a ``ProcessGroupGloo`` (rank 0) while the server builds rank 1 on the same store.

A push then goes as ``PUT /weights`` (or ``/adapters/<name>``) with ``X-Envhub-Weight-Group: <group id>``
and the safetensors header alone as the body: the plan (names, shapes, dtypes, version, LoRA config). The
server plans its tensors from it as for any body and receives each tensor's bytes with ``recv`` straight
into them, then applies them under its update lock; the trainer sends the bytes with ``send`` meanwhile.
Every wait is bounded (``timeout_s``): a group that fails is closed and the caller falls back to the
channel or an HTTP body. Tensors travel as raw bytes (any dtype), from CPU memory.
"""

from __future__ import annotations

import datetime
import secrets
import socket
import threading
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
BACKENDS = ("off", "gloo", "auto")


class WeightGroupError(RuntimeError):
    """The group could not be formed or broke off (peer gone, timeout, refused)."""


def local_address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (what the server can reach the trainer's store at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: connect on UDP only picks the route
        addr: str = probe.getsockname()[0]
        return addr


def wire_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat contiguous uint8 CPU tensor (what travels through the group)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


class TrainerGroup:
    """The trainer's side (rank 0) of the group with the server at ``url``."""

    def __init__(self, http: httpx.Client, url: str, *, timeout_s: float = 60.0):
        host = urlsplit(url).hostname
        if host is None:
            raise WeightGroupError(f"Expected a server URL with a host, got {url!r}.")
        self.url, self.timeout_s = url, timeout_s
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
        body = {"host": addr, "port": self._store.port, "group": self.group_id, "timeout_s": timeout_s}
        built: Future[Any] = Future()

        def build() -> None:  # blocks until the server's side connects (or the timeout)
            try:
                built.set_result(make_group(self._store, self.group_id, 0, addr, timeout_s))
            except BaseException as exc:  # handed to the waiting side
                built.set_exception(exc)

        threading.Thread(target=build, name="envhub-weight-group-join", daemon=True).start()
        try:  # the server answers once its side is built; a refusal comes at once (ours then times out alone)
            resp = http.post(f"{url}/weight-group", json=body, timeout=timeout_s + 10)
        except httpx.HTTPError as exc:
            raise WeightGroupError(f"the join request failed ({type(exc).__name__}: {exc})") from exc
        if resp.status_code != 200:
            raise WeightGroupError(f"the server refused to join: HTTP {resp.status_code}: {_message(resp)}")
        try:
            self.pg = built.result(timeout=timeout_s)
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
            timeout = datetime.timedelta(seconds=self.timeout_s)
            for tensor in push.tensors.values():
                if tensor.numel():
                    self.pg.send([wire_bytes(tensor)], 1, 0).wait(timeout)
            sent.set_result(None)
        except BaseException as exc:  # handed to put()
            sent.set_exception(exc)

    def close(self) -> None:
        """Give the group up (the pool then pushes to that server over its channel or as HTTP bodies)."""
        self.broken = True
        pg = getattr(self, "pg", None)
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # already torn down by the failure
                pass


def make_group(store: dist.Store, group_id: str, rank: int, addr: str, timeout_s: float) -> Any:
    """Rank ``rank`` of the 2-rank gloo group ``group_id`` on ``store``, its device bound to ``addr``."""
    # gloo's own options (its devices: bound to the address the peer reaches); torch's type hints call them Options
    opts: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addr)]
    return dist.ProcessGroupGloo(dist.PrefixStore(group_id, store), rank, 2, opts)


def _plan_bytes(push: Push) -> bytes:
    """The push's safetensors header (names, shapes, dtypes, metadata): the first chunk :func:`encode` yields."""
    return bytes(next(iter(encode(push.tensors, push.meta))))


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


__all__ = ["BACKENDS", "GROUP_HEADER", "TrainerGroup", "WeightGroupError", "make_group", "wire_bytes"]
