"""The trainer's side of sampler servers: a rollout sampler whose turns run on N servers, and the weight pushes.

:class:`RemoteSampler` has what the rollout engine asks of its in-process sampler (``version``,
``await generate(GenRequest) -> SampledSequence``, ``update_weights(model, version)``, ``close()``):

- **routing**: every turn of an episode goes to the server that sampled its first turn (its prompt
  prefix is cached there), a new episode to the server with the fewest turns queued or in flight;
- **batching**: the turns are gathered as the in-process samplers gather theirs (a
  :class:`~trainer.sampling.batching.TurnQueue`: until every live episode asked, :meth:`set_demand`)
  and each server gets them in ONE ``POST /sample/batch`` request, which it decodes as one batch;
  a server answering a batch gets the next one once it answered, the others meanwhile go on;
  a vision-language policy's turns carry their image patches (:mod:`.image_wire`, an HF-backend server);
- **weights**: ``update_weights`` streams the new weights (:mod:`.wire`; a LoRA run sends only its
  adapter) to every server at once, straight from the parameters, no checkpoint on disk, over each
  server's weight channel (:mod:`.remote_push`); each sample reports the version that drew it;
- **faults**: a server that fails a request (connection lost, 5xx, lost its weights) leaves the
  rotation with a log line and its turns are sampled again on the others, so the episodes go on
  (a turn the server refused alone fails alone: a 4xx is the caller's bug, a 503 is retried);
  a server that cannot take an update leaves the rotation; a server that is down, late or back from
  a restart is probed at every update and joins only once it took the current weights; with no
  server left, :class:`SamplerServersDownError` stops the run, naming each server's last error.

The pool mechanics (rotation, fail-over, pushes, catching a joiner up) are :mod:`.pool`'s, shared with the
training service's sampling on the same servers; this module gathers the turns and routes them.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.sampling.batching import TurnQueue
from trainer.sampling.image_wire import image_entry
from trainer.sampling.pool import (
    EPISODE_SERVER,
    SamplerPool,
    SamplerRequestError,
    SamplerServersDownError,
    ServerSlot,
)
from trainer.sampling.remote_push import payload
from trainer.sampling.types import GenRequest, SampledSequence, SamplingConfig


@dataclass(eq=False)
class _Turn:
    """One episode's turn, queued for ``server`` or in its batch; ``tried``: servers that failed it."""

    body: dict[str, Any]
    server: ServerSlot
    future: asyncio.Future[tuple[SampledSequence, str]]
    tried: set[str] = field(default_factory=set)


class _Lane:
    """The turns of one event loop: its queue and the batch each server is answering."""

    def __init__(self, config: SamplingConfig, demand: Callable[[], int]):
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
        self.config = config or SamplingConfig()
        self.version = 0
        self.lora, self.adapter_name, self.log = lora, adapter_name, log
        self.pool = SamplerPool(urls, token=token or os.environ.get("ENVHUB_SAMPLER_TOKEN") or None,
                                request_timeout_s=request_timeout_s, log=log, weight_group=self.config.weight_group)
        self.last_push_s = 0.0
        self.last_push_bytes = 0
        self._pushed_s, self._pushed_bytes = 0.0, 0  # since the last metrics()
        self._lanes: dict[asyncio.AbstractEventLoop, _Lane] = {}
        self._demand: Callable[[], int] = lambda: 1
        self.pool.wait_for_any(connect_timeout_s)
        self.update_weights(model, 0)

    @property
    def servers(self) -> dict[str, ServerSlot]:
        """The servers by URL, with their rotation state and last error."""
        return self.pool.servers

    def set_demand(self, live_episodes: Callable[[], int]) -> None:
        """Tell the sampler how many episodes are live: a batch waits (up to ``batch_wait_s``) until they all ask."""
        self._demand = live_episodes

    def _live(self) -> int:
        return self._demand()

    # -- rollouts ---------------------------------------------------------------------------------
    async def generate(self, request: GenRequest) -> SampledSequence:
        """One turn, on the episode's server (or the least loaded one), re-sampled elsewhere if that one fails."""
        if request.max_new_tokens < 1:
            raise ValueError(f"Expected max_new_tokens >= 1, got {request.max_new_tokens}.")
        body = {"prompt_ids": request.prompt_ids, "max_tokens": request.max_new_tokens,
                "temperature": 0.0 if request.greedy else self.config.temperature, "top_p": self.config.top_p,
                **({"adapter": self.adapter_name} if self.lora else {}),
                **({"images": [image_entry(f) for f in request.images]} if request.images else {})}
        lane = self._lane()
        turn = _Turn(body, self.pool.pick(set(), EPISODE_SERVER.get()), asyncio.get_running_loop().create_future())
        turn.server.in_flight += 1
        lane.queue.items.append(turn)
        self._wake(lane)
        sample, url = await turn.future
        EPISODE_SERVER.set(url)  # the episode's next turns go where this one was sampled
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
                await self.pool.close_loop_client()
        return asyncio.run(run())

    def _lane(self) -> _Lane:
        loop = asyncio.get_running_loop()
        lane = self._lanes.get(loop)
        if lane is None:
            lane = self._lanes[loop] = _Lane(self.config, self._live)
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
        """Send ``turns`` to ``server`` in one request and settle each; the ones to sample again are queued again."""
        try:
            results = await self.pool.request_batch(server, [t.body for t in turns], adapter=self.lora)
            for turn, result in zip(turns, results, strict=True):
                if result is None:  # sampled again: elsewhere if the server failed it, else (a full queue) there
                    if not server.in_rotation:
                        turn.tried.add(server.url)
                    lane.queue.items.append(turn)
                elif isinstance(result, SamplerRequestError):
                    self._settle_turn(turn, exc=result)
                else:
                    s = result["samples"][0]
                    seq = SampledSequence(s["token_ids"], s["logprobs"], s["finish_reason"], version=result["version"])
                    self._settle_turn(turn, (seq, server.url))
        except Exception as exc:  # a bug on this side: the episodes waiting on this batch see it
            for turn in turns:
                self._settle_turn(turn, exc=exc)
        finally:
            del lane.running[server.url]
            del lane.tasks[server.url]
            if lane.queue.items:
                self._wake(lane)

    def _settle_turn(self, turn: _Turn, result: tuple[SampledSequence, str] | None = None,
                     exc: Exception | None = None) -> None:
        turn.server.in_flight -= 1
        if turn.future.done():
            return
        if exc is not None:
            turn.future.set_exception(exc)
        else:
            turn.future.set_result(result)  # type: ignore[arg-type]  # one of result, exc is given

    def _reroute(self, turn: _Turn) -> bool:
        """Move ``turn`` off its server (out of rotation) to the least loaded other; False if none is left."""
        turn.server.in_flight -= 1
        try:
            turn.server = self.pool.pick(turn.tried | {turn.server.url})
        except SamplerServersDownError as exc:
            if not turn.future.done():
                turn.future.set_exception(exc)
            return False
        turn.server.in_flight += 1
        return True

    # -- weights ----------------------------------------------------------------------------------
    def add_server(self, url: str) -> None:
        """Take ``url`` into the pool: it joins the rotation once it took the next weight update."""
        self.pool.add_server(url)

    def update_weights(self, model: Any, version: int) -> None:
        """Push ``model``'s weights (its adapter, for LoRA) to every server that answers, as ``version``.

        Servers out of rotation are probed first and join when the push succeeds; a server whose push
        fails leaves the rotation. With none left, ``SamplerServersDownError``.
        """
        start = time.monotonic()
        push = payload(model, version, lora=self.lora, adapter_name=self.adapter_name)
        self.pool.push(push)
        self.version = version
        self.last_push_s = time.monotonic() - start
        self.last_push_bytes = push.nbytes
        self._pushed_s += self.last_push_s
        self._pushed_bytes += self.last_push_bytes

    def metrics(self) -> dict[str, float]:
        """For a step's metrics: seconds and megabytes of weight pushes since the last call, servers in rotation."""
        out = {"time/weight_push_s": self._pushed_s, "sampler/push_mb": self._pushed_bytes / 1e6,
               "sampler/servers_in_rotation": float(sum(s.in_rotation for s in self.servers.values()))}
        self._pushed_s, self._pushed_bytes = 0.0, 0
        return out

    def close(self) -> None:
        """Close the HTTP connections."""
        self.pool.close()
        self._lanes.clear()


async def _fresh_episode(turn: Any) -> SampledSequence:
    """``turn`` awaited as a new episode (no server chosen yet)."""
    EPISODE_SERVER.set(None)
    result: SampledSequence = await turn
    return result


__all__ = ["RemoteSampler", "SamplerServersDownError", "SamplerRequestError", "ServerSlot"]
