"""Asynchronous, streaming rollouts: batches generated ahead of training, a bounded number of versions ahead.

A :class:`RolloutStream` runs episodes on the rollout engine's event loop in a background thread while
the trainer runs its optimizer step. Batch ``k`` (the tasks of training step ``k``) may start generating
once the trainer has published policy version ``k - max_staleness``; with ``max_staleness = 1`` the
next batch is sampled while the current step trains. Groups stream to the trainer as they complete
(:meth:`RolloutStream.groups`), at most ``max_open_groups`` in flight at once, and their episodes share the
engine's ``max_in_flight`` bound with everything else the engine runs (an evaluation, say).

No generation runs on half-updated weights: the sampler holds its ``weights_lock`` around every batched
generate call and every weight update, so a turn is sampled wholly by one version. Every turn records
that version (``Trajectory.turn_versions``); a batch's staleness is the trainer's version when it
trains on the batch minus the oldest version behind any of its turns, at most ``max_staleness``.

>>> stream = RolloutStream(engine, lambda step: train_tasks(cfg, step), max_staleness=1)  # doctest: +SKIP
>>> stream.start(step=0, version=0)                                                     # doctest: +SKIP
>>> trajs = stream.next_batch(0); ...optimizer step...; sampler.update_weights(model, 1)  # doctest: +SKIP
>>> stream.publish(1)                                                                   # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeAlias

from trainer.rollout.types import Task, Trajectory

if TYPE_CHECKING:
    from trainer.rollout.engine import RolloutEngine

#: what a batch's queue carries: its group count first, then each group, or the error that stopped it
_Item: TypeAlias = int | list[Trajectory] | BaseException


class RolloutStream:
    """Groups of episodes for training steps ``start, start + 1, ...``, produced ahead of the trainer.

    ``tasks_for(step)`` gives a step's tasks (deterministic in ``step``, so a resumed run sees the same
    ones); tasks with the same ``group_id`` form a group. Whatever is in flight when the stream closes
    is cancelled and discarded: nothing of it was trained on, and a run resumed from a checkpoint at
    step ``s`` regenerates batch ``s`` onwards from the checkpoint's weights.
    """

    def __init__(self, engine: RolloutEngine, tasks_for: Callable[[int], list[Task]], *, max_staleness: int = 1,
                 max_open_groups: int = 0):
        if max_staleness < 0:
            raise ValueError(f"Expected max_staleness >= 0, got {max_staleness}.")
        if max_open_groups < 0:
            raise ValueError(f"Expected max_open_groups >= 0 (0: no bound), got {max_open_groups}.")
        self.engine = engine
        self.tasks_for = tasks_for
        self.max_staleness = max_staleness
        self.max_open_groups = max_open_groups
        self.version = 0
        self._queues: dict[int, queue.Queue[_Item]] = defaultdict(queue.Queue)
        self._lock = threading.Lock()
        self._producer: concurrent.futures.Future[None] | None = None
        self._changed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the producer and the groups in flight

    # -- trainer side --------------------------------------------------------------------------
    def start(self, step: int, version: int) -> None:
        """Begin producing batches from ``step`` on, the sampler holding policy ``version``."""
        if self._producer is not None:
            raise RuntimeError("This RolloutStream is already running.")
        self.version = version
        self._producer = self.engine.submit(self._produce(step))

    def publish(self, version: int) -> None:
        """The sampler now holds policy ``version`` (call after ``sampler.update_weights``)."""
        self.version = version
        loop = self.engine.loop
        if self._changed is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._changed.set)

    def groups(self, step: int, timeout_s: float | None = None) -> Iterator[list[Trajectory]]:
        """Yield the groups of batch ``step`` as they complete (each a list of its trajectories)."""
        q = self._queue(step)
        expected, seen = None, 0
        while expected is None or seen < expected:
            item = self._get(q, timeout_s)
            if isinstance(item, int):
                expected = item
                continue
            seen += 1
            yield item
        with self._lock:
            self._queues.pop(step, None)

    def next_batch(self, step: int, timeout_s: float | None = None) -> list[Trajectory]:
        """Every trajectory of batch ``step`` (blocks until its last group completes), grouped in task order."""
        groups = sorted(self.groups(step, timeout_s), key=lambda g: g[0].group_id)
        return [t for g in groups for t in g]

    def staleness(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """How many versions behind the trainer's current one the batch was sampled (max and mean)."""
        lags = [self.version - t.oldest_version for t in trajectories]
        return {"rollout/staleness_max": float(max(lags, default=0)),
                "rollout/staleness_mean": sum(lags) / max(len(lags), 1)}

    def close(self) -> None:
        """Cancel what is in flight (it is discarded) and stop producing."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        loop = self.engine.loop
        if loop is not None and not loop.is_closed():
            done = self.engine.submit(self._cancel_all())
            done.result(timeout=60)

    # -- rollout side (on the engine's event loop) -----------------------------------------------
    def _queue(self, step: int) -> queue.Queue[_Item]:
        with self._lock:
            return self._queues[step]

    def _get(self, q: queue.Queue[_Item], timeout_s: float | None) -> int | list[Trajectory]:
        waited = 0.0
        while True:
            try:
                item = q.get(timeout=0.5)
            except queue.Empty:
                waited += 0.5
                if self._producer is not None and self._producer.done():
                    self._producer.result()  # the producer failed: raise its error here
                    raise RuntimeError("The rollout stream stopped producing.") from None
                if timeout_s is not None and waited >= timeout_s:
                    raise TimeoutError(f"No rollout group completed within {timeout_s} s.") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    async def _produce(self, step: int) -> None:
        self._changed = asyncio.Event()
        me = asyncio.current_task()
        if me is not None:  # always: this coroutine runs as a task (engine.submit)
            self._tasks.add(me)
        gate = asyncio.Semaphore(self.max_open_groups) if self.max_open_groups else None
        try:
            while True:
                while self.version < step - self.max_staleness:  # the staleness bound
                    self._changed.clear()
                    await self._changed.wait()
                by_group: dict[int, list[Task]] = defaultdict(list)
                for task in self.tasks_for(step):
                    by_group[task.group_id].append(task)
                out = self._queue(step)
                out.put(len(by_group))
                for group in by_group.values():
                    if gate is not None:
                        await gate.acquire()
                    runner = asyncio.create_task(self._run_group(group, out, gate))
                    self._tasks.add(runner)
                    runner.add_done_callback(self._tasks.discard)
                step += 1
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in tasks_for: the trainer waiting on a batch sees it
            for q in list(self._queues.values()):
                q.put(exc)
            raise

    async def _run_group(self, group: list[Task], out: queue.Queue[_Item], gate: asyncio.Semaphore | None) -> None:
        try:
            keys = [self.engine.new_key() for _ in group]
            try:
                trajs = await asyncio.gather(*(self.engine.run_bounded(t, key=k) for t, k in zip(group, keys)))
            finally:
                for k in keys:
                    self.engine.states.pop(k, None)
            out.put(list(trajs))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # run_episode turns env trouble into stop reasons: this is a bug
            out.put(exc)
        finally:
            if gate is not None:
                gate.release()

    async def _cancel_all(self) -> None:
        victims = [t for t in self._tasks if not t.done()]
        for t in victims:
            t.cancel()
        await asyncio.gather(*victims, return_exceptions=True)


__all__ = ["RolloutStream"]
