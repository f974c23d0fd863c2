"""Per-token advantages from an algorithm's own config: GRPO (outcome or per turn), RLOO, REINFORCE++ from
the groups' rewards, and PPO's GAE from the value head's estimates."""

from __future__ import annotations

import torch
from torch import Tensor

from trainer import algos
from trainer.config import AlgoConfig
from trainer.core import TrainingClient
from trainer.rollout import Trajectory
from trainer.update.batch import PackedBatch, token_advantages
from trainer.update.datums import forward_values


def compute_advantages(algo: AlgoConfig, groups: list[list[Trajectory]]) -> list[list[float]]:
    """Per-token advantages for every trajectory of ``groups`` (flattened in order); PPO's are zeros here,
    filled later by :func:`gae_advantages` (they need the value head).

    Negative advantages are scaled by ``algo.negative_weight`` (1: as estimated).
    """
    flat = [t for g in groups for t in g]
    w = algo.negative_weight
    if algo.name == "grpo_per_turn":
        # one reward per generated turn (a turn whose step failed earned 0); an episode the env ended at
        # reset has no turn, trains nothing and stays out of its group's per-turn statistics
        turn_rewards = [t.turn_rewards + [0.0] * (len(t.turn_ends) - len(t.turn_rewards)) for t in flat]
        per_turn = algos.grpo_per_turn_advantages(turn_rewards,
                                                  [t.group_id for t in flat], gamma=algo.gamma,
                                                  normalize_std=algo.normalize_std)
        return [token_advantages(t, algos.weight_negatives(torch.tensor(a), w).tolist())
                for t, a in zip(flat, per_turn)]
    if algo.name == "ppo":
        return [[0.0] * len(t.tokens) for t in flat]
    rewards_BG = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float)
    if algo.name == "grpo":
        adv_BG = algos.grpo_advantages(rewards_BG, normalize_std=algo.normalize_std)
    elif algo.name == "rloo":
        adv_BG = algos.rloo_advantages(rewards_BG)
    else:
        adv_BG = algos.reinforce_pp_advantages(rewards_BG.flatten()).view_as(rewards_BG)
    adv_BG = algos.weight_negatives(adv_BG, w)
    return [token_advantages(t, [a]) for t, a in zip(flat, adv_BG.flatten().tolist())]


def gae_advantages(algo: AlgoConfig, client: TrainingClient, batch: PackedBatch) -> Tensor:
    """PPO: GAE from the value head's forward-only estimates, whitened over the batch's policy tokens.

    Fills ``batch.advantages_BS``, moves the returns into ``batch.rewards_BS`` (the value targets travel in
    the rewards slot from here on) and returns the old values [B, S] the clipped value loss needs.
    """
    if client.value_head is None:
        raise ValueError("Expected a training client with a value head for PPO's GAE, got none.")
    values_BS = forward_values(client, batch, "values")
    adv_BS, returns_BS = algos.gae(batch.rewards_BS, values_BS, batch.mask_BS, gamma=algo.gamma, lam=algo.lam)
    valid_BS = batch.mask_BS.bool()
    mean: Tensor | float
    std: Tensor | float
    if int(valid_BS.sum()) > 1:
        mean, std = algos.masked_mean(adv_BS, batch.mask_BS), adv_BS[valid_BS].std().clamp_min(1e-6)
    else:  # nothing to whiten (a rank's padding-only batch under torchrun): no NaN from an empty std
        mean, std = 0.0, 1.0
    batch.advantages_BS = algos.weight_negatives((adv_BS - mean) / std, algo.negative_weight) * batch.mask_BS
    batch.rewards_BS = returns_BS
    return values_BS


__all__ = ["compute_advantages", "gae_advantages"]
