"""Reward, length and failure statistics of one step's rollouts, as every RL recipe logs them."""

from __future__ import annotations

from trainer.rollout import GroupedBatch, Trajectory


def rollout_metrics(trajs: list[Trajectory], grouped: GroupedBatch) -> dict[str, float]:
    """Reward, length and failure statistics of one step's rollouts (means over those without an infra failure)."""
    ok = [t for t in trajs if not t.infra_failed]
    n = max(len(ok), 1)
    return {"train/reward_mean": sum(t.reward for t in ok) / n,
            "train/policy_tokens_mean": sum(t.num_policy_tokens for t in ok) / n,
            "train/turns_mean": sum(t.num_turns for t in ok) / n,
            "train/parse_errors": float(sum(t.parse_errors for t in ok)),
            # turns the env penalised (invalid moves, malformed answers...) among all turns
            "train/penalised_turn_frac": sum(r < 0 for t in ok for r in t.turn_rewards)
            / max(sum(len(t.turn_rewards) for t in ok), 1),
            **{f"rollout/{k}": v for k, v in grouped.metrics().items()}}


__all__ = ["rollout_metrics"]
