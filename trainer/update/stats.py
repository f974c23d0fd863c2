"""Reward, length, failure and outcome statistics of rollouts, as every RL recipe logs them."""

from __future__ import annotations

import re

from envhub.types import Outcome
from trainer.rollout import GroupedBatch, Trajectory

#: the game results :func:`episode_metrics` reports as ``<prefix>/<result>_rate``
RESULTS = (Outcome.WIN, Outcome.LOSS, Outcome.DRAW)
#: end reasons reported per step at most (an env naming every episode's end differently cannot flood the logs)
MAX_END_REASONS = 16
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def rollout_metrics(trajs: list[Trajectory], grouped: GroupedBatch,
                    episodes: list[Trajectory] | None = None) -> dict[str, float]:
    """Reward, length and failure statistics of one step's rollouts (means over those without an infra failure),
    with :func:`episode_metrics` under ``train/`` of ``episodes`` (default: ``trajs``; a two-agent step
    reports its head-to-head games there, not those against a reference player).

    ``train/sampled_nll``: the mean negative log-probability of the sampled policy tokens under the
    temperature-scaled distribution they were sampled from, an estimate of its entropy per token; near 0 the
    policy has become deterministic (the same reply to the same context), which no reward metric shows."""
    ok = [t for t in trajs if not t.infra_failed]
    n = max(len(ok), 1)
    shown = ok if episodes is None else [t for t in episodes if not t.infra_failed]
    tokens = sum(t.num_policy_tokens for t in ok)
    nll = -sum(lp for t in ok for lp, m in zip(t.logprobs, t.mask) if m)
    return {"train/reward_mean": sum(t.reward for t in ok) / n,
            "train/policy_tokens_mean": tokens / n,
            "train/sampled_nll": nll / max(tokens, 1),
            "train/turns_mean": sum(t.num_turns for t in ok) / n,
            "train/parse_errors": float(sum(t.parse_errors for t in ok)),
            **episode_metrics(shown, "train"),
            **{f"rollout/{k}": v for k, v in grouped.metrics().items()}}


def episode_metrics(episodes: list[Trajectory], prefix: str) -> dict[str, float]:
    """What the env reported about how ``episodes`` went, the same rule for every env:

    - ``<prefix>/penalised_turn_frac``: turns the env rewarded below zero (invalid moves, malformed
      answers...) among all turns;
    - ``<prefix>/tool_call_rate``: episodes with at least one tool call; ``<prefix>/tool_calls_mean`` per episode;
    - ``<prefix>/win_rate``, ``loss_rate``, ``draw_rate``: final ``info["outcome"]``
      (:class:`envhub.types.Outcome`) over all episodes, reported when any episode carries one (a game env);
    - ``<prefix>/end/<reason>_rate``: the env's own ``info["end_reason"]`` over all episodes (gomoku's
      ``too_many_invalid``: games lost on invalid moves, which ``penalised_turn_frac`` cannot tell apart
      from a legal move answered by the opponent's winning line, rewarded below zero too);
    - ``<prefix>/rewards/<name>_mean``: each named reward component (an env's ``@reward``, its
      ``info["rewards"]``), summed over the episode, mean over episodes (0 for one that never reported it);
    - ``<prefix>/stats/<name>_mean``: each statistic the env reports in ``info["stats"]`` (gomoku's
      ``win_chances`` and ``wins_missed``...), summed over the episode, mean over episodes (0 likewise).

    Pass the episodes to count: those without an infrastructure failure.
    """
    n = max(len(episodes), 1)
    turns = max(sum(len(t.turn_rewards) for t in episodes), 1)
    metrics = {f"{prefix}/penalised_turn_frac": sum(r < 0 for t in episodes for r in t.turn_rewards) / turns,
               f"{prefix}/tool_call_rate": sum(t.tool_calls > 0 for t in episodes) / n,
               f"{prefix}/tool_calls_mean": sum(t.tool_calls for t in episodes) / n}
    outcomes = [Outcome.of(t.info) for t in episodes]
    if any(o is not None for o in outcomes):
        metrics.update({f"{prefix}/{o.value}_rate": outcomes.count(o) / n for o in RESULTS})
    metrics.update(end_reason_rates(episodes, prefix))
    names = sorted({name for t in episodes for name in t.reward_components})
    metrics.update({f"{prefix}/rewards/{name}_mean": sum(t.reward_components.get(name, 0.0) for t in episodes) / n
                    for name in names})
    stats = sorted({name for t in episodes for name in t.stats})
    metrics.update({f"{prefix}/stats/{_UNSAFE.sub('_', name)}_mean": sum(t.stats.get(name, 0.0) for t in episodes) / n
                    for name in stats})
    return metrics


def end_reason_rates(episodes: list[Trajectory], prefix: str) -> dict[str, float]:
    """``<prefix>/end/<reason>_rate`` for each end reason the episodes report (the commonest
    :data:`MAX_END_REASONS`, names reduced to letters, digits, ``_``, ``.`` and ``-``)."""
    counts: dict[str, int] = {}
    for t in episodes:
        reason = t.info.get("end_reason")
        if isinstance(reason, str) and reason:
            key = _UNSAFE.sub("_", reason)
            counts[key] = counts.get(key, 0) + 1
    kept = sorted(counts, key=lambda r: (-counts[r], r))[:MAX_END_REASONS]
    return {f"{prefix}/end/{r}_rate": counts[r] / max(len(episodes), 1) for r in sorted(kept)}


__all__ = ["end_reason_rates", "episode_metrics", "rollout_metrics"]
