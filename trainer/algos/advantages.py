"""Advantage estimators: pure functions from rewards (and values) to per-sample or per-token advantages.

Shapes: ``B`` groups (or sequences), ``G`` samples per group, ``N`` flat samples, ``T`` tokens.
Standard deviations are the unbiased (Bessel-corrected) sample std, the usual choice for GRPO;
a group of one sample has no spread, so its advantage is 0.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 where nothing is masked in.

    >>> masked_mean(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0]))
    tensor(1.5000)
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def _std(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Unbiased std, 0 (instead of NaN) when there is a single element."""
    n = x.numel() if dim is None else x.shape[dim]
    if n < 2:
        return torch.zeros_like(x.mean() if dim is None else x.mean(dim, keepdim=keepdim))
    return x.std() if dim is None else x.std(dim, keepdim=keepdim)


def grpo_advantages(rewards_BG: Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Outcome GRPO: each reward minus its group mean, divided by the group std (+eps) if ``normalize_std``.

    rewards_BG: [B, G] — B groups of G samples answering the same prompt. Returns [B, G].
    """
    _check_2d(rewards_BG, "rewards_BG")
    rewards_BG = rewards_BG.float()
    centred_BG = rewards_BG - rewards_BG.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred_BG
    return centred_BG / (_std(rewards_BG, dim=1, keepdim=True) + eps)


def grpo_per_turn_advantages(
    turn_rewards: list[list[float]],
    group_ids: list[int],
    *,
    gamma: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Multi-turn GRPO: per-turn returns-to-go, centred (and std-normalised) within each group per turn index.

    ``turn_rewards[i][t]`` is the reward trajectory ``i`` received after its turn ``t``; ``group_ids[i]``
    names its group. The return of turn t is ``sum_k gamma**k * r[t+k]``. Turn t of a trajectory is
    compared only with turn t of the other trajectories in its group that reached turn t (a trajectory
    alone at a turn index gets advantage 0 there). Returns one list of advantages per trajectory,
    with the same lengths as ``turn_rewards``.
    """
    if len(turn_rewards) != len(group_ids):
        raise ValueError(
            f"Expected one group id per trajectory, got {len(group_ids)} ids for {len(turn_rewards)} "
            "trajectories; pass group_ids with the same length as turn_rewards."
        )
    returns = [_returns_to_go(rewards, gamma) for rewards in turn_rewards]
    # (group, turn index) -> indices of the trajectories that reached that turn
    cells: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (gid, rets) in enumerate(zip(group_ids, returns)):
        for t in range(len(rets)):
            cells[(gid, t)].append(i)
    advantages = [[0.0] * len(rets) for rets in returns]
    for (_, t), members in cells.items():
        values_M = torch.tensor([returns[i][t] for i in members], dtype=torch.float64)
        centred_M = values_M - values_M.mean()
        if normalize_std:
            centred_M = centred_M / (_std(values_M) + eps)
        for i, adv in zip(members, centred_M.tolist()):
            advantages[i][t] = adv
    return advantages


def _returns_to_go(rewards: list[float], gamma: float) -> list[float]:
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def rloo_advantages(rewards_BG: Tensor) -> Tensor:
    """RLOO: each reward minus the mean of the *other* G-1 rewards of its group. [B, G] -> [B, G]."""
    _check_2d(rewards_BG, "rewards_BG")
    G = rewards_BG.shape[1]
    if G < 2:
        raise ValueError(f"Expected at least 2 samples per group for a leave-one-out baseline, got G={G}.")
    rewards_BG = rewards_BG.float()
    baseline_BG = (rewards_BG.sum(dim=1, keepdim=True) - rewards_BG) / (G - 1)
    return rewards_BG - baseline_BG


def reinforce_pp_advantages(rewards_N: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: rewards normalised with the mean and std of the whole batch (no per-group baseline). [N] -> [N]."""
    if rewards_N.dim() != 1:
        raise ValueError(f"Expected rewards_N of shape [N], got {tuple(rewards_N.shape)}; flatten the batch first.")
    rewards_N = rewards_N.float()
    return (rewards_N - rewards_N.mean()) / (_std(rewards_N) + eps)


def gae(
    rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the mask-1 (policy) tokens of each sequence.

    Tokens with mask 0 (prompt, observations, padding) are skipped: the next *policy* token's value
    bootstraps the current one, and the value after the last policy token is 0 (the episode ends).
    Rewards must sit on mask-1 tokens (usually the last token of a turn); rewards on mask-0 tokens
    are ignored. Returns (advantages_BT, returns_BT), both 0 where mask is 0.
    """
    if not rewards_BT.shape == values_BT.shape == mask_BT.shape:
        raise ValueError(
            f"Expected rewards, values and mask of one shape [B, T], got {tuple(rewards_BT.shape)}, "
            f"{tuple(values_BT.shape)}, {tuple(mask_BT.shape)}."
        )
    rewards_BT, values_BT = rewards_BT.float(), values_BT.detach().float()
    valid_BT = mask_BT.bool()
    B, T = rewards_BT.shape
    zeros_B = torch.zeros(B, device=rewards_BT.device)
    advantages_BT = torch.zeros(B, T, device=rewards_BT.device)
    next_value_B, running_B = zeros_B, zeros_B
    # A backward scan: GAE is a recurrence in t, so it cannot be vectorised over T.
    for t in reversed(range(T)):
        valid_B = valid_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        new_running_B = delta_B + gamma * lam * running_B
        running_B = torch.where(valid_B, new_running_B, running_B)
        next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
        advantages_BT[:, t] = torch.where(valid_B, new_running_B, zeros_B)
    returns_BT = (advantages_BT + values_BT) * valid_BT
    return advantages_BT, returns_BT


def weight_negatives(advantages: Tensor, weight: float) -> Tensor:
    """Advantages with the negative ones scaled by ``weight`` (any shape; ``weight=1`` returns them as they are).

    ``weight=1`` is the unbiased policy gradient. Smaller weights push less on samples that did
    worse than their baseline and keep the full push towards those that did better; ``0`` trains
    on better-than-baseline samples only. With few, rarely-correct samples per prompt (tiny models,
    a weak start) the negative pushes are mostly noise for the optimizer, and a small weight learns
    several times faster; with capable models the full estimator keeps more exploration.

    >>> weight_negatives(torch.tensor([1.5, -0.5, 0.0]), 0.2)
    tensor([ 1.5000, -0.1000,  0.0000])
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"Expected a negative-advantage weight in [0, 1], got {weight}.")
    if weight == 1.0:
        return advantages
    return torch.where(advantages < 0, advantages * weight, advantages)


def _check_2d(x: Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"Expected {name} of shape [B, G], got {tuple(x.shape)}; reshape to (groups, group_size).")
