"""The trainer's side of sampler servers: a rollout sampler whose turns run on N servers, and the weight pushes.

:class:`RemoteSampler` has what the rollout engine asks of its in-process sampler (``version``,
``await generate(GenRequest) -> SampledSequence``, ``update_weights(model, version)``, ``close()``):

- **routing**: every turn of an episode goes to the server that sampled its first turn (its prompt
  prefix is cached there), a new episode to the server with the fewest requests in flight;
- **weights**: ``update_weights`` streams the new weights (:mod:`.wire`; a LoRA run sends only its
  adapter) to every server at once, straight from the parameters, no checkpoint on disk; each sample
  reports the version that drew it;
- **faults**: a server that fails a request (connection lost, 5xx, lost its weights) leaves the
  rotation with a log line and the turn is sampled again on another server, so the episode goes on;
  a server that cannot take an update leaves the rotation; a server that is down, late or back from
  a restart is probed at every update and joins only once it took the current weights; with no
  server left, :class:`SamplerServersDownError` stops the run, naming each server's last error.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from trainer.sampling.hf import generation_model
from trainer.sampling.types import GenRequest, SampledSequence, SamplingConfig
from trainer.sampling.wire import encode

#: the server the current episode's turns go to (an episode runs in one asyncio task)
_EPISODE_SERVER: contextvars.ContextVar[str | None] = contextvars.ContextVar("envhub_sampler_server", default=None)
RETRY_FULL_QUEUE_S = 0.05


class SamplerServersDownError(RuntimeError):
    """No sampler server can take work; the message names each server and its last error."""


class SamplerRequestError(ValueError):
    """A server refused a request as malformed (a 4xx): a bug on this side, not a server fault."""


@dataclass
class ServerSlot:
    """One server as the trainer sees it."""

    url: str
    in_rotation: bool = False
    version: int | None = None  # the version it took last (None: none yet)
    in_flight: int = 0
    instance: str | None = None  # the server process that took the weights (a restarted one has another)
    last_error: str = "never reached"


class RemoteSampler:
    """A rollout sampler backed by sampler servers at ``urls`` (see the module docstring).

    ``model`` is pushed to every server at start (version 0), so the servers sample the trainer's
    weights from the first turn; ``lora`` pushes only its adapter, as ``adapter_name``.

    >>> sampler = RemoteSampler(["http://127.0.0.1:8100"], model, SamplingConfig())   # doctest: +SKIP
    >>> engine = RolloutEngine(pool, sampler, tokenizer)                              # doctest: +SKIP
    """

    def __init__(self, urls: list[str], model: Any, config: SamplingConfig | None = None, *,
                 token: str | None = None, lora: bool = False, adapter_name: str = "policy",
                 request_timeout_s: float = 600.0, connect_timeout_s: float = 60.0,
                 log: Callable[[str], None] = print):
        if not urls or any(not u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"Expected sampler server URLs like http://host:8100, got {urls!r}.")
        self.config = config or SamplingConfig()
        self.version = 0
        self.lora, self.adapter_name, self.log = lora, adapter_name, log
        self.servers = {u.rstrip("/"): ServerSlot(u.rstrip("/")) for u in urls}
        self.last_push_s = 0.0
        self.last_push_bytes = 0
        self._pushed_s, self._pushed_bytes = 0.0, 0  # since the last metrics()
        token = token or os.environ.get("ENVHUB_SAMPLER_TOKEN") or None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(request_timeout_s, connect=10.0, pool=None)
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._http = httpx.Client(headers=self._headers, timeout=self._timeout)
        self._wait_for_any(connect_timeout_s)
        self.update_weights(model, 0)

    # -- rollouts ---------------------------------------------------------------------------------
    async def generate(self, request: GenRequest) -> SampledSequence:
        """One turn, on the episode's server (or the least loaded one), re-sampled elsewhere if that one fails."""
        if request.images:
            raise ValueError("Expected text-only requests: sampler servers do not take images yet.")
        body = {"prompt_ids": request.prompt_ids, "max_tokens": request.max_new_tokens,
                "temperature": 0.0 if request.greedy else self.config.temperature, "top_p": self.config.top_p,
                **({"adapter": self.adapter_name} if self.lora else {})}
        client = self._client()
        tried: set[str] = set()
        retried: set[str] = set()
        while True:
            server = self._pick(tried)
            server.in_flight += 1
            try:
                resp = await client.post(f"{server.url}/sample", json=body)
            except httpx.TransportError as exc:
                # a kept-alive connection the server closed meanwhile fails once; a live server gets a retry
                if server.url not in retried and await self._alive(client, server):
                    retried.add(server.url)
                    continue
                self._drop(server, f"{type(exc).__name__}: {exc}", tried)
                continue
            finally:
                server.in_flight -= 1
            result = self._result(server, resp, tried)
            if result is not None:
                _EPISODE_SERVER.set(server.url)
                return result
            if resp.status_code == 503:
                await asyncio.sleep(RETRY_FULL_QUEUE_S)

    async def _alive(self, client: httpx.AsyncClient, server: ServerSlot) -> bool:
        """Whether ``server`` answers ``/health`` within a couple of seconds."""
        try:
            return (await client.get(f"{server.url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]:
        """Answer ``requests`` at once (a blocking call: each one is an episode of its own, routed as such)."""
        async def run() -> list[SampledSequence]:
            try:
                return list(await asyncio.gather(*(_fresh_episode(self.generate(r)) for r in requests)))
            finally:
                await self._clients.pop(asyncio.get_running_loop()).aclose()
        return asyncio.run(run())

    def _result(self, server: ServerSlot, resp: httpx.Response, tried: set[str]) -> SampledSequence | None:
        """The turn from ``resp``; None to try again (the server failed, or its queue is full)."""
        if resp.status_code == 503:
            return None
        if (resp.status_code == 404 and self.lora) or resp.status_code >= 500:
            self._drop(server, f"HTTP {resp.status_code}: {_reason(resp)}", tried)
            return None
        if resp.status_code >= 400:
            raise SamplerRequestError(f"Sampler server {server.url} refused a request: HTTP {resp.status_code}: "
                                      f"{_reason(resp)}")
        data = resp.json()
        if data.get("instance") != server.instance:  # restarted since it took the weights: they are gone
            self._drop(server, "it restarted since it took the weights", tried)
            return None
        sample = data["samples"][0]
        return SampledSequence(sample["token_ids"], sample["logprobs"], sample["finish_reason"], version=data["version"])

    def _pick(self, tried: set[str]) -> ServerSlot:
        sticky = _EPISODE_SERVER.get()
        slot = self.servers.get(sticky) if sticky else None
        if slot is not None and slot.in_rotation and slot.url not in tried:
            return slot
        live = [s for s in self.servers.values() if s.in_rotation and s.url not in tried]
        if not live:
            raise SamplerServersDownError(self._down_message())
        return min(live, key=lambda s: s.in_flight)

    def _drop(self, server: ServerSlot, reason: str, tried: set[str]) -> None:
        tried.add(server.url)
        _EPISODE_SERVER.set(None)
        server.last_error = reason
        if server.in_rotation:
            server.in_rotation = False
            self.log(f"sampler server {server.url} failed ({reason}); out of rotation, its turns are re-sampled "
                     "on the others; it rejoins after taking a weight update")

    def _down_message(self) -> str:
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

    # -- weights ----------------------------------------------------------------------------------
    def add_server(self, url: str) -> None:
        """Take ``url`` into the pool: it joins the rotation once it took the next weight update."""
        self.servers.setdefault(url.rstrip("/"), ServerSlot(url.rstrip("/")))

    def update_weights(self, model: Any, version: int) -> None:
        """Push ``model``'s weights (its adapter, for LoRA) to every server that answers, as ``version``.

        Servers out of rotation are probed first and join when the push succeeds; a server whose push
        fails leaves the rotation. With none left, ``SamplerServersDownError``.
        """
        start = time.monotonic()
        path, tensors, meta = self._payload(model, version)
        servers = list(self.servers.values())
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            outcomes = list(pool.map(lambda s: self._push(s, path, tensors, meta), servers))
        for server, error in zip(servers, outcomes):
            self._settle(server, error, version)
        if not any(s.in_rotation for s in servers):
            raise SamplerServersDownError(self._down_message())
        self.version = version
        self.last_push_s = time.monotonic() - start
        self.last_push_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._pushed_s += self.last_push_s
        self._pushed_bytes += self.last_push_bytes

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

    def _payload(self, model: Any, version: int) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
        peft_model = _peft_model(model)
        if self.lora:
            if peft_model is None:
                raise ValueError("Expected a peft model for a LoRA run's weight push, got a plain one.")
            from peft import get_peft_model_state_dict

            cfg = peft_model.peft_config[peft_model.active_adapter]
            lora = {"r": int(cfg.r), "lora_alpha": cfg.lora_alpha, "use_rslora": bool(cfg.use_rslora),
                    "target_modules": sorted(cfg.target_modules) if not isinstance(cfg.target_modules, str)
                    else cfg.target_modules}
            tensors = dict(get_peft_model_state_dict(peft_model))
            meta = {"version": str(version), "kind": "lora", "lora_config": json.dumps(lora)}
            return f"/adapters/{self.adapter_name}", tensors, meta
        base = generation_model(model)
        tensors = {n: p.detach() for n, p in base.named_parameters()}
        return "/weights", tensors, {"version": str(version), "kind": "full"}

    def _push(self, server: ServerSlot, path: str, tensors: dict[str, torch.Tensor],
              meta: dict[str, str]) -> str | None:
        """Stream the weights to ``server``; None when it took them, else the reason it did not.

        A transport error is tried once more if the server still answers ``/health`` (a kept-alive
        connection it closed meanwhile); the server applies a body only once it arrived whole."""
        for attempt in (1, 2):
            try:
                if not server.in_rotation or attempt == 2:
                    self._http.get(f"{server.url}/health", timeout=2.0).raise_for_status()
                chunks = encode(tensors, meta)
                first = next(chunks)
                size = len(first) + sum(t.numel() * t.element_size() for t in tensors.values())
                resp = self._http.put(f"{server.url}{path}", content=_prepend(first, chunks),
                                      headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
                break
            except httpx.TransportError as exc:
                if attempt == 2:
                    return f"{type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}: {_reason(resp)}"
        server.instance = resp.json().get("instance")
        return None

    def _wait_for_any(self, timeout_s: float) -> None:
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

    def metrics(self) -> dict[str, float]:
        """For a step's metrics: seconds and megabytes of weight pushes since the last call, servers in rotation."""
        out = {"time/weight_push_s": self._pushed_s, "sampler/push_mb": self._pushed_bytes / 1e6,
               "sampler/servers_in_rotation": float(sum(s.in_rotation for s in self.servers.values()))}
        self._pushed_s, self._pushed_bytes = 0.0, 0
        return out

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()
        for loop, client in list(self._clients.items()):
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(client.aclose())
        self._clients.clear()


async def _fresh_episode(turn: Any) -> SampledSequence:
    """``turn`` awaited as a new episode (no server chosen yet)."""
    _EPISODE_SERVER.set(None)
    result: SampledSequence = await turn
    return result


def _prepend(first: bytes | memoryview, rest: Iterator[bytes | memoryview]) -> Iterator[bytes]:
    yield bytes(first)
    yield from rest  # type: ignore[misc]  # httpx writes memoryviews as they are


def _reason(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def _peft_model(model: Any) -> Any:
    inner = generation_model(model)
    return inner if hasattr(inner, "peft_config") else None


__all__ = ["RemoteSampler", "SamplerServersDownError", "SamplerRequestError", "ServerSlot"]
