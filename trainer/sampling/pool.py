"""A pool of ``envhub-train sampler`` servers as one client sees them: rotation, requests with fail-over, pushes.

Both clients of sampler servers stand on it: the trainer's :class:`~trainer.sampling.remote.RemoteSampler`
(one policy: its full weights or one adapter) and the training service (one adapter per sampler a tenant
saved, ``trainer.service._remote``).

- **requests**: :meth:`SamplerPool.request` posts a ``/sample`` body to the preferred server (an
  episode's, say) or the one with the fewest requests in flight (of those, the one picked least); a server
  that fails it (connection lost, 5xx, an adapter it lost, a restart since it took its weights) leaves the
  rotation with a log line and the request goes to another; with none left, :class:`SamplerServersDownError`
  names each server's last error. A 4xx is the caller's bug: :class:`SamplerRequestError`.
  :meth:`SamplerPool.request_batch` posts many bodies to one server in one ``/sample/batch`` request and
  answers each (or says which to send again); :class:`~.server_batches.ServerBatches` gathers the bodies
  per server and re-routes those with :meth:`SamplerPool.pick`.
- **weights**: :meth:`SamplerPool.push` streams one :class:`~.remote_push.Push` (:mod:`.wire`, no checkpoint
  on disk; over the server's weight channel when ``/health`` names one, else as an HTTP body) to every
  server in rotation at once; a server out of rotation that answers ``/health`` is sent everything
  it must hold first (``catch_up``: the current weights, every adapter) and joins only once it took all of
  it. A server whose push fails leaves the rotation. :meth:`SamplerPool.rejoin` does the catching up
  without a new push (the service calls it periodically: servers that start late or restart get their
  weights before they take work).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from trainer.sampling.remote_push import Push, put_as_body, put_through_channel
from trainer.sampling.weight_group import BACKENDS, TrainerGroup, WeightGroupError, unavailable

RETRY_FULL_QUEUE_S = 0.05

#: the server the current episode's turns go to (an episode runs in one asyncio task)
EPISODE_SERVER: contextvars.ContextVar[str | None] = contextvars.ContextVar("envhub_sampler_server", default=None)


class SamplerServersDownError(RuntimeError):
    """No sampler server can take work; the message names each server and its last error."""


class SamplerRequestError(ValueError):
    """A server refused a request as malformed (a 4xx): a bug on this side, not a server fault."""


@dataclass
class ServerSlot:
    """One server as the client sees it."""

    url: str
    in_rotation: bool = False
    version: int | None = None  # the version it took last (None: none yet)
    in_flight: int = 0  # requests (a batching client: turns queued for it) in flight
    picked: int = 0  # requests routed to it as the least loaded server
    instance: str | None = None  # the server process that took the weights (a restarted one has another)
    last_error: str = "never reached"
    weight_port: int | None = None  # its weight channel (from /health); None: weights go as HTTP bodies
    group: TrainerGroup | None = None  # the torch.distributed group pushes go through (weight_group on)
    group_failed: bool = False  # the group failed once: the channel or HTTP bodies from then on
    group_kinds: list[str] | None = None  # the groups it joins (/health's weight_group; None: not asked yet)


class SamplerPool:
    """Sampler servers at ``urls`` (see the module docstring); ``token`` defaults to ``ENVHUB_SAMPLER_TOKEN``."""

    def __init__(self, urls: Sequence[str], *, token: str | None = None, request_timeout_s: float = 600.0,
                 log: Callable[[str], None] = print, weight_group: str = "off", group_timeout_s: float = 60.0,
                 base_fingerprint: str | None = None):
        if weight_group not in BACKENDS:
            raise ValueError(f"Expected weight_group in {BACKENDS}, got {weight_group!r}.")
        why = unavailable(weight_group)
        if why is not None:
            raise ValueError(f"Expected a CUDA device and NCCL for weight_group='{weight_group}', got {why}; use "
                             "'gloo' (CPU tensors, any host) or 'off' (the weight channel).")
        self.weight_group, self.group_timeout_s = weight_group, group_timeout_s
        # LoRA adapters go onto the servers' base: one that names another base (/health) never joins
        self.base_fingerprint = base_fingerprint
        if not urls or any(not u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"Expected sampler server URLs like http://host:8100, got {list(urls)!r}.")
        self.log = log
        self.servers = {u.rstrip("/"): ServerSlot(u.rstrip("/")) for u in urls}
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(request_timeout_s, connect=10.0, pool=None)
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._http = httpx.Client(headers=self._headers, timeout=self._timeout)

    # -- requests ---------------------------------------------------------------------------------
    async def request(self, body: dict[str, Any], prefer: str | None = None) -> tuple[ServerSlot, dict[str, Any]]:
        """``POST /sample`` on ``prefer`` (when in rotation) or the least loaded server; re-sent elsewhere if it fails."""
        client = self._client()
        tried: set[str] = set()
        retried: set[str] = set()
        while True:
            server = self.pick(tried, prefer)
            server.in_flight += 1
            try:
                resp = await client.post(f"{server.url}/sample", json=body)
            except httpx.TransportError as exc:
                # a kept-alive connection the server closed meanwhile fails once; a live server gets a retry
                if server.url not in retried and await self._alive(client, server):
                    retried.add(server.url)
                    continue
                self.drop(server, f"{type(exc).__name__}: {exc}", tried)
                continue
            finally:
                server.in_flight -= 1
            data = self._answer(server, resp, tried, adapter="adapter" in body)
            if data is not None:
                return server, data
            if resp.status_code == 503:
                await asyncio.sleep(RETRY_FULL_QUEUE_S)

    def _answer(self, server: ServerSlot, resp: httpx.Response, tried: set[str], *,
                adapter: bool) -> dict[str, Any] | None:
        """The answer's JSON; None to try again (the server failed, or its queue is full)."""
        if resp.status_code == 503:
            return None
        if (resp.status_code == 404 and adapter) or resp.status_code >= 500:
            self.drop(server, f"HTTP {resp.status_code}: {reason(resp)}", tried)
            return None
        if resp.status_code >= 400:
            raise SamplerRequestError(f"Sampler server {server.url} refused a request: HTTP {resp.status_code}: "
                                      f"{reason(resp)}")
        data: dict[str, Any] = resp.json()
        if data.get("instance") != server.instance:  # restarted since it took the weights: they are gone
            self.drop(server, "it restarted since it took the weights", tried)
            return None
        return data

    async def _alive(self, client: httpx.AsyncClient, server: ServerSlot) -> bool:
        """Whether ``server`` answers ``/health`` within a couple of seconds."""
        try:
            return (await client.get(f"{server.url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def request_batch(self, server: ServerSlot,
                            bodies: list[dict[str, Any]]) -> list[dict[str, Any] | SamplerRequestError | None]:
        """``POST /sample/batch`` of ``bodies`` on ``server``: per body its answer, its refusal (a 4xx), or None
        to send it again (the server failed it and left the rotation, or its queue was full: a short wait). A 404
        for a body naming an adapter means the server lost it: a server failure, as in :meth:`request`."""
        client = self._client()
        for attempt in (1, 2):
            try:
                resp = await client.post(f"{server.url}/sample/batch", json={"requests": bodies})
                break
            except httpx.TransportError as exc:  # a kept-alive connection closed meanwhile: a live server gets a retry
                if attempt == 2 or not await self._alive(client, server):
                    self.drop(server, f"{type(exc).__name__}: {exc}", set())
                    return [None] * len(bodies)
        if resp.status_code == 404:  # no /sample/batch route: not a sampler server
            self.drop(server, f"HTTP 404: {reason(resp)}", set())
            return [None] * len(bodies)
        try:
            data = self._answer(server, resp, set(), adapter=False)  # a 404 of the whole request was handled above
        except SamplerRequestError as exc:
            return [exc] * len(bodies)
        if data is None:
            await asyncio.sleep(RETRY_FULL_QUEUE_S if resp.status_code == 503 else 0)
            return [None] * len(bodies)
        out = [self._entry(server, entry, adapter="adapter" in body) for body, entry in zip(bodies, data["results"])]
        if any(e is None for e in out) and server.in_rotation:  # some found its queue full
            await asyncio.sleep(RETRY_FULL_QUEUE_S)
        return out

    def _entry(self, server: ServerSlot, entry: dict[str, Any], *,
               adapter: bool) -> dict[str, Any] | SamplerRequestError | None:
        """One result of a batch: the answer, a refusal, or None (sent again; a server failure drops the server)."""
        error = entry.get("error")
        if error is None:
            return entry
        code, why = error.get("code", 500), f"HTTP {error.get('code')}: {error.get('message')}"
        if code == 503:
            return None
        if (code == 404 and adapter) or code >= 500:
            self.drop(server, why, set())
            return None
        return SamplerRequestError(f"Sampler server {server.url} refused a request: {why}")

    def pick(self, tried: set[str], prefer: str | None = None) -> ServerSlot:
        """``prefer`` if it is in rotation and not in ``tried``, else the least loaded server in rotation."""
        slot = self.servers.get(prefer) if prefer else None
        if slot is not None and slot.in_rotation and slot.url not in tried:
            return slot
        live = [s for s in self.servers.values() if s.in_rotation and s.url not in tried]
        if not live:
            raise SamplerServersDownError(self.down_message())
        chosen = min(live, key=lambda s: (s.in_flight, s.picked))  # ties: the one picked least, so all share work
        chosen.picked += 1
        return chosen

    def drop(self, server: ServerSlot, why: str, tried: set[str]) -> None:
        """Take ``server`` out of rotation (logged once) and out of this request's candidates."""
        tried.add(server.url)
        EPISODE_SERVER.set(None)
        server.last_error = why
        if server.in_rotation:
            server.in_rotation = False
            self.log(f"sampler server {server.url} failed ({why}); out of rotation, its requests are re-sent "
                     "to the others; it rejoins after taking the weights again")

    def down_message(self) -> str:
        lines = [f"  {s.url}: {s.last_error}" for s in self.servers.values()]
        return "No sampler server can take work (all down or out of rotation):\n" + "\n".join(lines)

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
            client = self._clients[loop] = httpx.AsyncClient(headers=self._headers, timeout=self._timeout,
                                                             limits=limits)
        return client

    async def close_loop_client(self) -> None:
        """Close the current event loop's connections (call before a loop made by ``asyncio.run`` ends)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    # -- weights ----------------------------------------------------------------------------------
    def add_server(self, url: str) -> None:
        """Take ``url`` into the pool: it joins the rotation once it took the weights (next push or rejoin)."""
        url = url.rstrip("/")
        if url not in self.servers:  # a new dict: other threads may be iterating the old one
            self.servers = {**self.servers, url: ServerSlot(url)}

    def remove_server(self, url: str) -> bool:
        """Take ``url`` out of the pool: no request goes to it from now on (those it was answering are answered, or
        re-sent to the others if it fails them) and its weight group is closed; False if it is not in the pool."""
        server = self.servers.get(url.rstrip("/"))
        if server is None:
            return False
        server.in_rotation, server.last_error = False, "removed from the pool"
        self.servers = {u: s for u, s in self.servers.items() if s is not server}  # a new dict, as in add_server
        if server.group is not None:
            server.group.close()
            server.group = None
        return True

    def push(self, push: Push, catch_up: Sequence[Push] | None = None) -> None:
        """Send ``push`` to every server in rotation, ``catch_up`` (default: ``[push]``) to every other one that
        answers; ``SamplerServersDownError`` when none is in rotation after it."""
        everything = list(catch_up) if catch_up is not None else [push]
        servers = list(self.servers.values())
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            outcomes = list(pool.map(lambda s: self._bring_up_to_date(s, push, everything), servers))
        for server, error in zip(servers, outcomes):
            self._settle(server, error, push.version)
        if not any(s.in_rotation for s in servers):
            raise SamplerServersDownError(self.down_message())

    def rejoin(self, catch_up: Sequence[Push]) -> None:
        """Servers out of rotation that answer ``/health`` take ``catch_up`` and join the rotation."""
        for server in [s for s in self.servers.values() if not s.in_rotation]:
            error = self._catch_up(server, catch_up)
            if error is None:
                self.log(f"sampler server {server.url} joined" + (f" after taking {len(catch_up)} weight update(s)"
                                                                   if catch_up else ""))
                server.in_rotation = True
            else:
                server.last_error = error

    def delete(self, path: str) -> None:
        """``DELETE path`` (an adapter) on every server in rotation; a server that fails it is left as it is."""
        for server in [s for s in self.servers.values() if s.in_rotation]:
            try:
                self._http.delete(f"{server.url}{path}", timeout=10.0)
            except httpx.HTTPError:
                pass  # it keeps an adapter nobody asks for; a later failure takes it out of rotation

    def _bring_up_to_date(self, server: ServerSlot, push: Push, everything: list[Push]) -> str | None:
        if not server.in_rotation:
            return self._catch_up(server, everything)
        known = server.instance
        error = self.send(server, push)
        if error is None and known is not None and server.instance != known:  # restarted: it lost the rest
            return self._catch_up(server, [p for p in everything if p is not push])
        return error

    def _catch_up(self, server: ServerSlot, everything: Sequence[Push]) -> str | None:
        """Send every update a joining server must hold; None when it took them all (in one server process)."""
        try:
            health = self._health(server)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        theirs = health.get("base_fingerprint")
        if self.base_fingerprint and theirs and theirs != self.base_fingerprint:
            mismatch = (f"it serves another base model (weights fingerprint {theirs}, this side's "
                        f"{self.base_fingerprint}): LoRA adapters need the same base; start it with the same --model "
                        "and overrides")
            if server.last_error != mismatch:
                self.log(f"sampler server {server.url}: {mismatch}; not taken into rotation")
            return mismatch
        server.instance = first = health.get("instance")
        for push in everything:
            error = self.send(server, push)
            if error is not None:
                return error
            if server.instance != first:
                return "it restarted while taking the weights"
        return None

    def _settle(self, server: ServerSlot, error: str | None, version: int) -> None:
        if error is None:
            if not server.in_rotation and server.version is not None:
                self.log(f"sampler server {server.url} took version {version}; back in rotation")
            elif not server.in_rotation and version > 0:
                self.log(f"sampler server {server.url} joined with version {version}")
            server.in_rotation, server.version = True, version
            return
        if server.in_rotation:
            self.log(f"sampler server {server.url} could not take the weights of version {version} ({error}); "
                     "out of rotation until it takes an update")
        server.in_rotation, server.last_error = False, error

    def send(self, server: ServerSlot, push: Push) -> str | None:
        """Stream ``push`` to ``server``; None when it took it, else the reason it did not.

        It goes over the server's weight channel when its ``/health`` named one, else as the HTTP body. A
        transport error is tried once more if the server still answers ``/health`` (a kept-alive connection
        it closed meanwhile); the server applies a body only once it arrived whole."""
        for attempt in (1, 2):
            try:
                if attempt == 2:
                    self._health(server)
                resp = self._put(server, push)
                break
            except httpx.TransportError as exc:
                if attempt == 2:
                    return f"{type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}: {reason(resp)}"
        server.instance = resp.json().get("instance")
        return None

    def _put(self, server: ServerSlot, push: Push) -> httpx.Response:
        if self.weight_group != "off" and not server.group_failed:
            resp = self._put_through_group(server, push)
            if resp is not None:
                return resp
        if server.weight_port is not None:
            resp = put_through_channel(self._http, server.url, server.weight_port, push)
            if resp is not None:
                return resp
            server.weight_port = None  # not reachable: HTTP bodies until the next /health names it again
        return put_as_body(self._http, server.url, push)

    def _put_through_group(self, server: ServerSlot, push: Push) -> httpx.Response | None:
        """Push through the server's weight group (formed on first use); None when the group failed (logged once:
        that server takes the channel or HTTP bodies from then on)."""
        try:
            if self.weight_group == "nccl" and server.group_kinds is not None and "nccl" not in server.group_kinds:
                # never asked to join: an NCCL peer that never comes leaves ours waiting on NCCL's watchdog
                raise WeightGroupError(f"it joins no NCCL group (/health weight_group: {server.group_kinds}: a "
                                       "server on a CPU, without NCCL, or started with --no-weight-group)")
            if server.group is None or server.group.broken:
                server.group = TrainerGroup(self._http, server.url, timeout_s=self.group_timeout_s,
                                            backend="nccl" if self.weight_group == "nccl" else "gloo", push=push)
            resp = server.group.put(self._http, push)
            if resp.status_code == 200:
                return resp
            why = f"HTTP {resp.status_code}: {reason(resp)}"
        except (WeightGroupError, httpx.HTTPError, OSError, RuntimeError) as exc:  # any failure: the proven paths
            why = f"{type(exc).__name__}: {exc}"
        if server.group is not None:
            server.group.close()
        server.group, server.group_failed = None, True
        self.log(f"sampler server {server.url}: weight group failed ({why}); its weights go over the weight "
                 "channel or as HTTP bodies from now on")
        return None

    def _health(self, server: ServerSlot) -> dict[str, Any]:
        """The server's ``/health`` (raises if it does not answer); notes its weight channel."""
        resp = self._http.get(f"{server.url}/health", timeout=2.0)
        resp.raise_for_status()
        health: dict[str, Any] = resp.json()
        server.weight_port = health.get("weight_port")
        server.group_kinds = list(health.get("weight_group") or [])
        return health

    def wait_for_any(self, timeout_s: float) -> None:
        """Block until one server answers ``/health`` (servers load their model first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for server in self.servers.values():
                try:
                    self._http.get(f"{server.url}/health", timeout=2.0).raise_for_status()
                    return
                except httpx.HTTPError as exc:
                    server.last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise SamplerServersDownError(f"No sampler server answered /health within {timeout_s:.0f} s:\n"
                                              + "\n".join(f"  {s.url}: {s.last_error}" for s in self.servers.values()))
            time.sleep(0.5)

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()
        for loop, client in list(self._clients.items()):
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(client.aclose())
        self._clients.clear()


def reason(resp: httpx.Response) -> str:
    """The error message of a sampler server's answer (its OpenAI-shaped error body, else the text)."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


__all__ = ["EPISODE_SERVER", "Push", "SamplerPool", "SamplerRequestError", "SamplerServersDownError", "ServerSlot",
           "reason"]
