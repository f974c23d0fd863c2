"""The numbers of an eval: unbiased pass@k, mean reward, per-component means, failures by kind, throughput.

Every number is computed from the records of ``results.jsonl`` (one per episode), so an
interrupted or resumed run is summarised the same way as one that ran straight through.
An episode that failed for a reason that is not the policy's (``reward`` null: the env, the model
endpoint, the infrastructure) counts under ``failures`` and is left out of every reward statistic:
never scored as reward 0. The policy's own mistakes count apart, under ``policy_errors``.

>>> pass_at_k(n=4, c=1, k=1), pass_at_k(n=4, c=1, k=4), pass_at_k(n=4, c=0, k=2)
(0.25, 1.0, 0.0)
"""

from __future__ import annotations

from collections import Counter, defaultdict
from math import comb
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate for one task: ``1 - C(n-c, k) / C(n, k)`` (n samples, c passed).

    The probability that at least one of k samples drawn without replacement from the n passes.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"Expected 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_at_ks(records: list[dict[str, Any]], k_max: int, threshold: float) -> dict[str, Any]:
    """pass@k for k = 1..k_max, the mean over tasks with at least k scored samples (and how many there were)."""
    by_task: dict[int, list[float]] = defaultdict(list)
    for rec in records:
        if rec.get("reward") is not None:
            by_task[int(rec["task_index"])].append(float(rec["reward"]))
    values: dict[str, float | None] = {}
    tasks: dict[str, int] = {}
    for k in range(1, k_max + 1):
        scores = [pass_at_k(len(r), sum(x >= threshold for x in r), k) for r in by_task.values() if len(r) >= k]
        values[str(k)] = sum(scores) / len(scores) if scores else None
        tasks[str(k)] = len(scores)
    return {"pass_at_k": values, "pass_at_k_tasks": tasks}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def component_means(scored: list[dict[str, Any]], key: str = "rewards") -> dict[str, float]:
    """Mean of each named reward component (``key="stats"``: each env statistic) over the scored episodes
    that report it."""
    sums: dict[str, list[float]] = defaultdict(list)
    for rec in scored:
        for name, value in (rec.get(key) or {}).items():
            sums[name].append(float(value))
    return {name: sum(v) / len(v) for name, v in sorted(sums.items())}


def failure_counts(records: list[dict[str, Any]]) -> dict[str, int]:
    """Episodes that failed for a reason that is not the policy's, by kind (``env``, ``model``,
    ``infrastructure``): they have no reward and count in no reward statistic."""
    kinds: Counter[str] = Counter(str(r["failure"].get("kind")) for r in records if r.get("failure"))
    return dict(sorted(kinds.items()))


def policy_errors(records: list[dict[str, Any]]) -> dict[str, int]:
    """The policy's own mistakes: turns whose tool call did not parse or whose action the env refused (the
    episodes go on and are scored), and how many episodes had any."""
    keys = ("malformed_tool_calls", "invalid_actions")
    counts = {key: sum(int(r.get(key) or 0) for r in records) for key in keys}
    counts["episodes"] = sum(1 for r in records if any(r.get(key) for key in keys))
    return counts


def summarize(records: list[dict[str, Any]], *, episodes: int, samples: int, threshold: float,
              wall_s: float, args: dict[str, Any]) -> dict[str, Any]:
    """``summary.json`` for the records of one run (see ``docs/eval.md`` for every field)."""
    scored = [r for r in records if r.get("reward") is not None]
    tokens = {key: sum(int((r.get("tokens") or {}).get(key, 0)) for r in records) for key in ("prompt", "completion")}
    return {
        "env": args.get("env"), "model": args.get("model_name") or args.get("model"),
        "episodes": episodes, "samples": samples, "episodes_planned": episodes * samples,
        "episodes_recorded": len(records), "episodes_done": len(scored), "episodes_failed": len(records) - len(scored),
        "complete": len(records) >= episodes * samples,
        "mean_reward": _mean([float(r["reward"]) for r in scored]),
        "pass_threshold": threshold,
        "pass_rule": f"an episode passes when its reward >= {threshold:g}; pass@k is the unbiased estimate "
                     "1 - C(n-c, k)/C(n, k) per task (n scored samples, c passing), averaged over the tasks "
                     "with at least k scored samples",
        **pass_at_ks(records, samples, threshold),
        "reward_components": component_means(scored),
        "stats": component_means(scored, "stats"),
        "failures": failure_counts(records),
        "policy_errors": policy_errors(records),
        "stop_reasons": dict(sorted(Counter(str(r.get("stop_reason")) for r in records).items())),
        "mean_turns": _mean([float(r.get("turns", 0)) for r in scored]),
        "mean_tool_calls": _mean([float(r.get("tool_calls", 0)) for r in scored]),
        "tokens": tokens,
        "wall_s": round(wall_s, 3),
        "completion_tokens_per_s": round(tokens["completion"] / wall_s, 3) if wall_s > 0 else None,
        "args": args,
    }


__all__ = ["pass_at_k", "pass_at_ks", "component_means", "failure_counts", "policy_errors", "summarize"]
