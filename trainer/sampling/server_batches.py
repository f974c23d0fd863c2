"""Requests to sampler servers, gathered per server: each server gets the ones waiting for it in ONE request.

Both clients of sampler servers send their ``/sample`` bodies through :class:`ServerBatches`: the trainer's
:class:`~trainer.sampling.remote.RemoteSampler` (an episode's turns) and the training service (its tenants'
``asample`` requests, ``trainer.service._remote``).

- **gathering**: :meth:`ServerBatches.request` queues a body for its server (``prefer``, an episode's, or
  the least loaded one) in a :class:`~trainer.sampling.batching.TurnQueue`, which releases the waiting
  bodies once every live caller asked (:meth:`ServerBatches.set_demand`; at most ``batch_wait_s``);
- **one request per server**: each server with bodies waiting and no batch in flight gets them all (at most
  ``max_batch_size``) in one ``POST /sample/batch`` (:meth:`~trainer.sampling.pool.SamplerPool.request_batch`),
  which it decodes together (bodies naming different adapters too: the server groups them); a server
  answering a batch gets the next one once it answered, the others meanwhile go on (with ``overlap``,
  for callers that do not gather, at once: the server's queue merges it into its next decode);
- **faults**: a body the server failed (it died mid-batch, lost an adapter, restarted) goes back in the
  queue for another server in rotation (the failing server leaves the rotation, :mod:`.pool`); a full
  queue (503) is retried there; a body the server refused (4xx) fails alone; with no server left, the
  callers see :class:`~trainer.sampling.pool.SamplerServersDownError`.

Each event loop that sends requests has a lane of its own (a queue and the batches in flight).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.sampling.batching import TurnQueue
from trainer.sampling.pool import SamplerPool, SamplerRequestError, SamplerServersDownError, ServerSlot
from trainer.sampling.types import SamplingConfig

#: a server's answer to one body (``samples``, ``version``, maybe ``prompt_logprobs``) and the server's URL
Answer = tuple[dict[str, Any], str]


@dataclass(eq=False)
class _Queued:
    """One body, queued for ``server`` or in its batch; ``tried``: servers that failed it."""

    body: dict[str, Any]
    server: ServerSlot
    future: asyncio.Future[Answer]
    tried: set[str] = field(default_factory=set)


class _Lane:
    """The requests of one event loop: its queue and the batch each server is answering."""

    def __init__(self, config: SamplingConfig, demand: Callable[[], int]):
        self.queue: TurnQueue[_Queued] = TurnQueue(config)
        self.queue.demand = demand
        self.running: dict[int, tuple[str, list[_Queued]]] = {}  # batch number -> its server's url, its bodies
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.worker: asyncio.Task[None] | None = None
        self.numbered = 0

    def busy(self) -> int:
        return sum(len(items) for _, items in self.running.values())


class ServerBatches:
    """``/sample`` bodies to ``pool``'s servers, sent as one ``/sample/batch`` per server (see the module docstring).

    ``config`` gives ``max_batch_size`` (bodies in one request) and ``batch_wait_s`` (the longest a body
    waits for the other live callers, :meth:`set_demand`; with the default demand of 1 none waits).
    ``overlap``: a server answering a batch gets the bodies that arrive meanwhile at once, as another batch
    (its own queue merges them into its next decode), instead of once it answered; for callers that do not
    gather (no :meth:`set_demand`), whose bodies would otherwise wait out a whole decode here.
    """

    def __init__(self, pool: SamplerPool, config: SamplingConfig | None = None, *, overlap: bool = False):
        self.pool, self.config, self.overlap = pool, config or SamplingConfig(), overlap
        self.posts = 0  # /sample/batch requests sent
        self.bodies = 0  # bodies they carried (a body sent again counts again)
        self._lanes: dict[asyncio.AbstractEventLoop, _Lane] = {}
        self._demand: Callable[[], int] = lambda: 1

    def set_demand(self, live: Callable[[], int]) -> None:
        """How many callers are live: a batch waits (up to ``batch_wait_s``) until they all asked."""
        self._demand = live

    def _live(self) -> int:
        return self._demand()  # read at each gather: set_demand may come after the lane was made

    async def request(self, body: dict[str, Any], prefer: str | None = None) -> Answer:
        """``body``'s answer and the server that gave it: on ``prefer`` (when in rotation) or the least loaded
        server, batched with the bodies waiting for the same server; re-sent elsewhere if that server fails."""
        lane = self._lane()
        item = _Queued(body, self.pool.pick(set(), prefer), asyncio.get_running_loop().create_future())
        item.server.in_flight += 1
        lane.queue.items.append(item)
        self._wake(lane)
        return await item.future

    async def close_loop(self) -> None:
        """Forget the current loop's lane and close its connections (before a loop made by ``asyncio.run`` ends)."""
        lane = self._lanes.pop(asyncio.get_running_loop(), None)
        if lane is not None and lane.worker is not None:
            lane.worker.cancel()
        await self.pool.close_loop_client()

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
        """Gather the waiting bodies, send each free server its own in one request; wait while all are busy."""
        while lane.queue.items:
            await lane.queue.gather(busy=lane.busy)
            if not self._dispatch(lane) and lane.tasks:
                await asyncio.wait(list(lane.tasks.values()), return_when=asyncio.FIRST_COMPLETED)

    def _dispatch(self, lane: _Lane) -> bool:
        """Start one request per server that has bodies waiting and no batch in flight (with ``overlap``: any server
        with bodies waiting); whether any started."""
        ready: dict[str, list[_Queued]] = {}
        waiting = []
        answering = set() if self.overlap else {url for url, _ in lane.running.values()}
        for item in lane.queue.items:
            if item.future.done():  # its caller was cancelled
                item.server.in_flight -= 1
                continue
            if not item.server.in_rotation and not self._reroute(item):
                continue
            url = item.server.url
            if url in answering or len(ready.get(url, ())) >= self.config.max_batch_size:
                waiting.append(item)
            else:
                ready.setdefault(url, []).append(item)
        lane.queue.items = waiting
        for url, items in ready.items():
            lane.numbered += 1
            lane.running[lane.numbered] = (url, items)
            # the items' own slot: the pool may have dropped the server from its dict meanwhile (remove_server)
            lane.tasks[lane.numbered] = asyncio.create_task(self._post(lane, lane.numbered, items[0].server, items))
        return bool(ready)

    async def _post(self, lane: _Lane, number: int, server: ServerSlot, items: list[_Queued]) -> None:
        """Send ``items`` to ``server`` in one request and settle each; the ones to send again are queued again."""
        self.posts += 1
        self.bodies += len(items)
        try:
            results = await self.pool.request_batch(server, [t.body for t in items])
            for item, result in zip(items, results, strict=True):
                if result is None:  # sent again: elsewhere if the server failed it, else (a full queue) there
                    if not server.in_rotation:
                        item.tried.add(server.url)
                    lane.queue.items.append(item)
                elif isinstance(result, SamplerRequestError):
                    self._settle(item, exc=result)
                else:
                    self._settle(item, (result, server.url))
        except Exception as exc:  # a bug on this side: the callers waiting on this batch see it
            for item in items:
                self._settle(item, exc=exc)
        finally:
            del lane.running[number]
            del lane.tasks[number]
            if lane.queue.items:
                self._wake(lane)

    @staticmethod
    def _settle(item: _Queued, answer: Answer | None = None, exc: Exception | None = None) -> None:
        item.server.in_flight -= 1
        if item.future.done():
            return
        if exc is not None:
            item.future.set_exception(exc)
        else:
            item.future.set_result(answer)  # type: ignore[arg-type]  # one of answer, exc is given

    def _reroute(self, item: _Queued) -> bool:
        """Move ``item`` off its server (out of rotation) to the least loaded other; False if none is left."""
        item.server.in_flight -= 1
        try:
            item.server = self.pool.pick(item.tried | {item.server.url})
        except SamplerServersDownError as exc:
            if not item.future.done():
                item.future.set_exception(exc)
            return False
        item.server.in_flight += 1
        return True


__all__ = ["Answer", "ServerBatches"]
