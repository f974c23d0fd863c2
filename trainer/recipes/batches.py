"""Where the RL loop's batches come from: sampled when the step asks (synchronous), or streamed ahead by a
:class:`~trainer.rollout.RolloutStream` while the previous step trains (``rollout.max_staleness > 0``).

Both give the loop the same four calls, so it has one body: ``next_batch(step)``, ``metrics(trajs)``,
``publish(policy, version, updated)`` (the sampler gets the new weights) and ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from trainer.core import TrainingClient
from trainer.rollout import RolloutEngine, RolloutStream, Task, Trajectory


class BatchSource(Protocol):
    """One step's episodes for the RL loop, and the weights it sends back."""

    #: the batch may come from an older policy than the one being trained (the sampler's log-probs are pi_old)
    off_policy: bool

    def next_batch(self, step: int) -> list[Trajectory]: ...

    def metrics(self, trajs: list[Trajectory]) -> dict[str, float]: ...

    def publish(self, policy: TrainingClient, version: int, *, updated: bool) -> None: ...

    def close(self) -> None: ...


class SampledBatches:
    """Each step's episodes sampled when the step asks, by the current policy."""

    off_policy = False

    def __init__(self, engine: RolloutEngine, tasks: Callable[[int], list[Task]]):
        self.engine, self.tasks = engine, tasks

    def next_batch(self, step: int) -> list[Trajectory]:
        """Run step ``step``'s tasks to the end."""
        return self.engine.run_sync(self.tasks(step))

    def metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        """Nothing beyond the rollout metrics: every episode is on-policy."""
        return {}

    def publish(self, policy: TrainingClient, version: int, *, updated: bool) -> None:
        """The sampler gets the policy's weights after an update (without one it already has them)."""
        if updated:
            policy.save_weights_for_sampler(self.engine.sampler, version=version)

    def close(self) -> None:
        """Nothing runs between steps."""


class StreamedBatches:
    """Batches sampled ahead, while the loop trains: batch ``s`` starts once version ``s - max_staleness``
    is published, so every episode is at most ``max_staleness`` versions old."""

    off_policy = True

    def __init__(self, engine: RolloutEngine, tasks: Callable[[int], list[Task]], *, first_step: int,
                 max_staleness: int, max_open_groups: int):
        self.engine = engine
        self.stream = RolloutStream(engine, tasks, max_staleness=max_staleness, max_open_groups=max_open_groups)
        self.stream.start(first_step, version=first_step)

    def next_batch(self, step: int) -> list[Trajectory]:
        """Step ``step``'s batch, waiting for it if it is still sampling."""
        return self.stream.next_batch(step)

    def metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        """``rollout/staleness_*``: how many versions behind the trained policy the batch was sampled."""
        return self.stream.staleness(trajs)

    def publish(self, policy: TrainingClient, version: int, *, updated: bool) -> None:
        """The sampler gets the weights and the version moves on, update or not, so the staleness bound does too."""
        policy.save_weights_for_sampler(self.engine.sampler, version=version)
        self.stream.publish(version)

    def close(self) -> None:
        """Discard the batches sampled ahead of the last step."""
        self.stream.close()


__all__ = ["BatchSource", "SampledBatches", "StreamedBatches"]
