"""Whether each tenant learns: its validation reward before and after its GRPO steps, with the estimate's noise.

A tenant's validation reward is the mean reward of ``n`` samples (temperature 1) from its own sampler on each
held-out validation problem: an estimate of its policy's expected reward there. Its standard error comes from
the spread of the samples within each problem (the problems are fixed, so only sampling adds noise):
``sqrt(sum_i var_i / n) / P`` over the ``P`` problems. A tenant's rise counts as clear when it exceeds twice
the standard error of the difference of its two independent estimates.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from examples.tinker_rl import MathEpisodes, sample_all


@dataclass(frozen=True)
class Validation:
    """A validation reward and its standard error (sampling noise only)."""

    mean: float
    se: float

    def __str__(self) -> str:
        return f"{self.mean:.3f}±{self.se:.3f}"


def validate(sampler: Any, episodes: MathEpisodes, samples: int, max_tokens: int) -> Validation:
    """Mean reward of ``samples`` samples of ``sampler`` on every validation problem, and its standard error."""
    if samples < 2:
        raise ValueError(f"Expected at least 2 validation samples per problem (a standard error needs 2), got {samples}")
    indices = list(range(episodes.size("validation")))
    groups = sample_all(sampler, [episodes.prompt("validation", i) for i in indices], samples, 1.0, max_tokens)
    rewards = episodes.rewards([("validation", i, s.tokens) for i, g in zip(indices, groups) for s in g])
    return estimate([rewards[k * samples:(k + 1) * samples] for k in range(len(indices))])


def estimate(rewards_per_problem: list[list[float]]) -> Validation:
    """The mean over problems of each problem's mean reward, and its standard error from the spread within each."""
    if not rewards_per_problem or min(len(r) for r in rewards_per_problem) < 2:
        raise ValueError("Expected at least one problem with at least 2 rewards each")
    mean = statistics.fmean(statistics.fmean(r) for r in rewards_per_problem)
    variance = sum(statistics.variance(r) / len(r) for r in rewards_per_problem)
    return Validation(mean, math.sqrt(variance) / len(rewards_per_problem))


def clear_rise(before: Validation, after: Validation) -> bool:
    """Whether ``after`` exceeds ``before`` by more than twice the standard error of their difference."""
    return after.mean - before.mean > 2 * math.hypot(before.se, after.se)


def verdict(pairs: list[tuple[Validation, Validation]]) -> str:
    """One line: did every tenant's validation reward rise, and how many rose clearly."""
    rose = sum(after.mean > before.mean for before, after in pairs)
    clear = sum(clear_rise(before, after) for before, after in pairs)
    every = "yes" if clear == len(pairs) else "no"
    return (f"every tenant's validation rose clearly (by > 2 standard errors): {every} ({clear} of {len(pairs)}; "
            f"{rose} of {len(pairs)} rose at all)")
