"""The trainer's side of sampler servers: a rollout sampler whose turns run on N servers, and the weight pushes.

:class:`RemoteSampler` has what the rollout engine asks of its in-process sampler (``version``,
``await generate(GenRequest) -> SampledSequence``, ``update_weights(model, version)``, ``close()``):

- **routing**: every turn of an episode goes to the server that sampled its first turn (its prompt
  prefix is cached there), a new episode to the server with the fewest turns queued or in flight;
- **batching**: the turns are gathered as the in-process samplers gather theirs (a
  :class:`~trainer.sampling.batching.TurnQueue`: until every live episode asked, :meth:`set_demand`)
  and each server gets them in ONE ``POST /sample/batch`` request, which it decodes as one batch;
  a server answering a batch gets the next one once it answered, the others meanwhile go on;
- **weights**: ``update_weights`` streams the new weights (:mod:`.wire`; a LoRA run sends only its
  adapter) to every server at once, straight from the parameters, no checkpoint on disk; each sample
  reports the version that drew it;
- **faults**: a server that fails a request (connection lost, 5xx, lost its weights) leaves the
  rotation with a log line and its turns are sampled again on the others, so the episodes go on
  (a turn the server refused alone fails alone: a 4xx is the caller's bug, a 503 is retried);
  a server that cannot take an update leaves the rotation; a server that is down, late or back from
  a restart is probed at every update and joins only once it took the current weights; with no
  server left, :class:`SamplerServersDownError` stops the run, naming each server's last error.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from trainer.sampling.batching import TurnQueue
from trainer.sampling.remote_push import ServerSlot, payload, push, reason
from trainer.sampling.types import GenRequest, SampledSequence, SamplingConfig

#: the server the current episode's turns go to (an episode runs in one asyncio task)
_EPISODE_SERVER: contextvars.ContextVar[str | None] = contextvars.ContextVar("envhub_sampler_server", default=None)
RETRY_FULL_QUEUE_S = 0.05


class SamplerServersDownError(RuntimeError):
    """No sampler server can take work; the message names each server and its last error."""


class SamplerRequestError(ValueError):
    """A server refused a request as malformed (a 4xx): a bug on this side, not a server fault."""


@dataclass(eq=False)
class _Turn:
    """One episode's turn, queued for ``server`` or in its batch; ``tried``: servers that failed it."""

    body: dict[str, Any]
    server: ServerSlot
    future: asyncio.Future[tuple[SampledSequence, str]]
    tried: set[str] = field(default_factory=set)


class _Lane:
    """The turns of one event loop: its HTTP client, its queue and the batch each server is answering."""

    def __init__(self, config: SamplingConfig, demand: Callable[[], int], client: httpx.AsyncClient):
        self.client = client
        self.queue: TurnQueue[_Turn] = TurnQueue(config)
        self.queue.demand = demand
        self.running: dict[str, list[_Turn]] = {}  # server url -> its batch in flight
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.worker: asyncio.Task[None] | None = None

    def busy(self) -> int:
        return sum(len(turns) for turns in self.running.values())


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
        self._lanes: dict[asyncio.AbstractEventLoop, _Lane] = {}
        self._demand: Callable[[], int] = lambda: 1
        self._http = httpx.Client(headers=self._headers, timeout=self._timeout)
        self._wait_for_any(connect_timeout_s)
        self.update_weights(model, 0)

    def set_demand(self, live_episodes: Callable[[], int]) -> None:
        """Tell the sampler how many episodes are live: a batch waits (up to ``batch_wait_s``) until they all ask."""
        self._demand = live_episodes

    def _live(self) -> int:
        return self._demand()

    # -- rollouts ---------------------------------------------------------------------------------
    async def generate(self, request: GenRequest) -> SampledSequence:
        """One turn, on the episode's server (or the least loaded one), re-sampled elsewhere if that one fails."""
        if request.images:
            raise ValueError("Expected text-only requests: sampler servers do not take images yet.")
        if request.max_new_tokens < 1:
            raise ValueError(f"Expected max_new_tokens >= 1, got {request.max_new_tokens}.")
        body = {"prompt_ids": request.prompt_ids, "max_tokens": request.max_new_tokens,
                "temperature": 0.0 if request.greedy else self.config.temperature, "top_p": self.config.top_p,
                **({"adapter": self.adapter_name} if self.lora else {})}
        lane = self._lane()
        turn = _Turn(body, self._pick(), asyncio.get_running_loop().create_future())
        turn.server.in_flight += 1
        lane.queue.items.append(turn)
        self._wake(lane)
        sample, url = await turn.future
        _EPISODE_SERVER.set(url)  # the episode's next turns go where this one was sampled
        return sample

    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]:
        """Answer ``requests`` at once (a blocking call: each one is an episode of its own, routed as such)."""
        async def run() -> list[SampledSequence]:
            try:
                return list(await asyncio.gather(*(_fresh_episode(self.generate(r)) for r in requests)))
            finally:
                lane = self._lanes.pop(asyncio.get_running_loop())
                if lane.worker is not None:
                    lane.worker.cancel()
                await lane.client.aclose()
        return asyncio.run(run())

    def _lane(self) -> _Lane:
        loop = asyncio.get_running_loop()
        lane = self._lanes.get(loop)
        if lane is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            client = httpx.AsyncClient(headers=self._headers, timeout=self._timeout, limits=limits)
            lane = self._lanes[loop] = _Lane(self.config, self._live, client)
        return lane

    def _wake(self, lane: _Lane) -> None:
        if lane.worker is None or lane.worker.done():
            lane.worker = asyncio.create_task(self._drain(lane))

    async def _drain(self, lane: _Lane) -> None:
        """Gather the waiting turns, send each free server its own in one request; wait while all are busy."""
        while lane.queue.items:
            await lane.queue.gather(busy=lane.busy)
            if not self._dispatch(lane) and lane.tasks:
                await asyncio.wait(list(lane.tasks.values()), return_when=asyncio.FIRST_COMPLETED)

    def _dispatch(self, lane: _Lane) -> bool:
        """Start one request per server that has turns waiting and no batch in flight; whether any started."""
        ready: dict[str, list[_Turn]] = {}
        waiting = []
        for turn in lane.queue.items:
            if turn.future.done():  # its episode was cancelled
                turn.server.in_flight -= 1
                continue
            if not turn.server.in_rotation and not self._reroute(turn):
                continue
            url = turn.server.url
            if url in lane.running or len(ready.get(url, ())) >= self.config.max_batch_size:
                waiting.append(turn)
            else:
                ready.setdefault(url, []).append(turn)
        lane.queue.items = waiting
        for url, turns in ready.items():
            lane.running[url] = turns
            lane.tasks[url] = asyncio.create_task(self._post(lane, self.servers[url], turns))
        return bool(ready)

    async def _post(self, lane: _Lane, server: ServerSlot, turns: list[_Turn]) -> None:
        try:
            await self._answer(lane.client, server, turns, lane.queue.items)
        except Exception as exc:  # a bug on this side: the episodes waiting on this batch see it
            for turn in turns:
                self._settle_turn(turn, exc=exc)
        finally:
            del lane.running[server.url]
            del lane.tasks[server.url]
            if lane.queue.items:
                self._wake(lane)

    async def _answer(self, client: httpx.AsyncClient, server: ServerSlot, turns: list[_Turn],
                      requeue: list[_Turn]) -> None:
        """Send ``turns`` to ``server`` in one request and settle each; the ones to sample again go to ``requeue``."""
        retried = False
        while True:
            try:
                resp = await client.post(f"{server.url}/sample/batch", json={"requests": [t.body for t in turns]})
                break
            except httpx.TransportError as exc:
                # a kept-alive connection the server closed meanwhile fails once; a live server gets a retry
                if not retried and await self._alive(client, server):
                    retried = True
                    continue
                return self._fail(server, f"{type(exc).__name__}: {exc}", turns, requeue)
        if resp.status_code == 503:
            await asyncio.sleep(RETRY_FULL_QUEUE_S)
            requeue.extend(turns)
        elif resp.status_code == 404 or resp.status_code >= 500:  # 404: no /sample/batch route, not a sampler
            self._fail(server, f"HTTP {resp.status_code}: {reason(resp)}", turns, requeue)
        elif resp.status_code >= 400:
            error = SamplerRequestError(f"Sampler server {server.url} refused a request: HTTP {resp.status_code}: "
                                        f"{reason(resp)}")
            for turn in turns:
                self._settle_turn(turn, exc=error)
        else:
            await self._settle_batch(server, turns, resp.json(), requeue)

    async def _settle_batch(self, server: ServerSlot, turns: list[_Turn], data: dict[str, Any],
                      requeue: list[_Turn]) -> None:
        """Answer each turn from its result in ``data``, or queue it again (its server failed it, or was full)."""
        if data.get("instance") != server.instance:  # restarted since it took the weights: they are gone
            return self._fail(server, "it restarted since it took the weights", turns, requeue)
        full = []
        for turn, entry in zip(turns, data["results"], strict=True):
            error = entry.get("error")
            if error is None:
                s = entry["samples"][0]
                seq = SampledSequence(s["token_ids"], s["logprobs"], s["finish_reason"], version=entry["version"])
                self._settle_turn(turn, (seq, server.url))
            elif error.get("code") == 503:
                full.append(turn)
            elif (error.get("code") == 404 and self.lora) or error.get("code", 500) >= 500:
                self._fail(server, f"HTTP {error.get('code')}: {error.get('message')}", [turn], requeue)
            else:
                self._settle_turn(turn, exc=SamplerRequestError(
                    f"Sampler server {server.url} refused a request: HTTP {error.get('code')}: {error.get('message')}"))
        if full:
            await asyncio.sleep(RETRY_FULL_QUEUE_S)
            requeue.extend(full)

    def _settle_turn(self, turn: _Turn, result: tuple[SampledSequence, str] | None = None,
                     exc: Exception | None = None) -> None:
        turn.server.in_flight -= 1
        if turn.future.done():
            return
        if exc is not None:
            turn.future.set_exception(exc)
        else:
            turn.future.set_result(result)  # type: ignore[arg-type]  # one of result, exc is given

    def _fail(self, server: ServerSlot, why: str, turns: list[_Turn], requeue: list[_Turn]) -> None:
        """``server`` failed ``turns``: out of rotation, the turns go to the queue (another server takes them)."""
        self._drop(server, why)
        for turn in turns:
            turn.tried.add(server.url)
        requeue.extend(turns)

    def _reroute(self, turn: _Turn) -> bool:
        """Move ``turn`` off its server (out of rotation) to the least loaded other; False if none is left."""
        turn.server.in_flight -= 1
        try:
            turn.server = self._least_loaded(turn.tried | {turn.server.url})
        except SamplerServersDownError as exc:
            if not turn.future.done():
                turn.future.set_exception(exc)
            return False
        turn.server.in_flight += 1
        return True

    async def _alive(self, client: httpx.AsyncClient, server: ServerSlot) -> bool:
        """Whether ``server`` answers ``/health`` within a couple of seconds."""
        try:
            return (await client.get(f"{server.url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def _pick(self) -> ServerSlot:
        """The current episode's server, or the least loaded one for a new episode (or one whose server failed)."""
        sticky = _EPISODE_SERVER.get()
        slot = self.servers.get(sticky) if sticky else None
        if slot is not None and slot.in_rotation:
            return slot
        return self._least_loaded(set())

    def _least_loaded(self, exclude: set[str]) -> ServerSlot:
        live = [s for s in self.servers.values() if s.in_rotation and s.url not in exclude]
        if not live:
            raise SamplerServersDownError(self._down_message())
        return min(live, key=lambda s: s.in_flight)

    def _drop(self, server: ServerSlot, why: str) -> None:
        server.last_error = why
        if server.in_rotation:
            server.in_rotation = False
            self.log(f"sampler server {server.url} failed ({why}); out of rotation, its turns are re-sampled "
                     "on the others; it rejoins after taking a weight update")

    def _down_message(self) -> str:
        lines = [f"  {s.url}: {s.last_error}" for s in self.servers.values()]
        return "No sampler server can take work (all down or out of rotation):\n" + "\n".join(lines)

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
        path, tensors, meta = payload(model, version, lora=self.lora, adapter_name=self.adapter_name)
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

    def _push(self, server: ServerSlot, path: str, tensors: Any, meta: dict[str, str]) -> str | None:
        return push(self._http, server, path, tensors, meta)

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
        for loop, lane in list(self._lanes.items()):
            if not loop.is_closed() and not loop.is_running():
                loop.run_until_complete(lane.client.aclose())
        self._lanes.clear()


async def _fresh_episode(turn: Any) -> SampledSequence:
    """``turn`` awaited as a new episode (no server chosen yet)."""
    _EPISODE_SERVER.set(None)
    result: SampledSequence = await turn
    return result


__all__ = ["RemoteSampler", "SamplerServersDownError", "SamplerRequestError", "ServerSlot"]
