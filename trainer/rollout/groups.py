"""Group building for GRPO-style algorithms: complete groups only, zero-variance groups optionally dropped.

A group is the ``group_size`` trajectories that answered the same task. One infrastructure
failure makes its group incomplete, so the whole group leaves the batch (its baseline would
be biased otherwise); the failures are counted, never trained on as reward 0.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from trainer.rollout.types import Task, Trajectory


def make_tasks(reset_kwargs: list[dict[str, Any]], group_size: int, urls: list[str] | None = None) -> list[Task]:
    """``group_size`` copies of each task's reset arguments, group ids 0..n-1, spread over ``urls``."""
    tasks = []
    for gid, kw in enumerate(reset_kwargs):
        url = urls[gid % len(urls)] if urls else None
        tasks += [Task(reset_kwargs=dict(kw), group_id=gid, env_url=url) for _ in range(group_size)]
    return tasks


@dataclass
class GroupedBatch:
    """The groups to train on, plus what was left out and why."""

    groups: list[list[Trajectory]] = field(default_factory=list)
    incomplete_groups: int = 0
    zero_variance_groups: int = 0
    infra_failures: int = 0
    stop_reasons: Counter[str] = field(default_factory=Counter)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]

    def metrics(self) -> dict[str, float]:
        total = sum(self.stop_reasons.values()) or 1
        out = {"groups_kept": float(len(self.groups)), "groups_incomplete": float(self.incomplete_groups),
               "groups_zero_variance": float(self.zero_variance_groups),
               "infra_failures": float(self.infra_failures)}
        out.update({f"stop/{k}": v / total for k, v in sorted(self.stop_reasons.items())})
        return out


def build_groups(trajectories: list[Trajectory], group_size: int, *, filter_zero_variance: bool = False,
                 eps: float = 1e-8) -> GroupedBatch:
    """Gather trajectories by group id; keep groups with exactly ``group_size`` trajectories and no infra failure."""
    by_group: dict[int, list[Trajectory]] = defaultdict(list)
    batch = GroupedBatch()
    for t in trajectories:
        batch.stop_reasons[t.stop_reason.value if t.stop_reason else "none"] += 1
        if t.infra_failed:
            batch.infra_failures += 1
        by_group[t.group_id].append(t)
    for gid in sorted(by_group):
        group = by_group[gid]
        if len(group) != group_size or any(t.infra_failed for t in group):
            batch.incomplete_groups += 1
            continue
        rewards = [t.reward for t in group]
        if filter_zero_variance and max(rewards) - min(rewards) <= eps:
            batch.zero_variance_groups += 1
            continue
        batch.groups.append(group)
    return batch


__all__ = ["make_tasks", "GroupedBatch", "build_groups"]
