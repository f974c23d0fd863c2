"""Advantage estimators against values worked out by hand (derivations in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algos import (
    gae,
    grpo_advantages,
    grpo_per_turn_advantages,
    masked_mean,
    reinforce_pp_advantages,
    rloo_advantages,
    weight_negatives,
)

EPS = 1e-6


def close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32),
                          torch.tensor(expected, dtype=torch.float32), atol=tol), (actual, expected)


def test_masked_mean_ignores_masked_out_values_and_is_zero_when_empty():
    # (1 + 2) / 2 = 1.5 ; the 100 is masked out
    close(masked_mean(torch.tensor([1.0, 2.0, 100.0]), torch.tensor([1, 1, 0])), 1.5)
    # per row: row 0 (4 + 6) / 2 = 5 ; row 1 has no token -> 0, not NaN
    close(masked_mean(torch.tensor([[4.0, 6.0], [3.0, 3.0]]), torch.tensor([[1, 1], [0, 0]]), dim=1), [5.0, 0.0])


def test_grpo_outcome_advantages_are_group_centred_and_std_normalised():
    rewards_BG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    # group 0: mean 0.5, deviations ±0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735
    #          -> ±0.5 / 0.57735 = ±0.866025
    # group 1: mean 5, deviations -3 -1 1 3, var = (9+1+1+9)/3 = 20/3, std = 2.581989
    #          -> -1.161895, -0.387298, 0.387298, 1.161895
    close(grpo_advantages(rewards_BG),
          [[0.866025, -0.866025, -0.866025, 0.866025], [-1.161895, -0.387298, 0.387298, 1.161895]])
    # without std normalisation, only the centring remains
    close(grpo_advantages(rewards_BG, normalize_std=False), [[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0]])


def test_grpo_group_with_equal_rewards_has_zero_advantage():
    # no spread: deviations are 0, and 0 / (0 + eps) = 0 — no NaN to poison the loss
    close(grpo_advantages(torch.tensor([[3.0, 3.0, 3.0]])), [[0.0, 0.0, 0.0]])


def test_grpo_per_turn_returns_are_compared_per_group_and_turn_index():
    turn_rewards = [[0.0, 1.0], [0.0, 0.0], [1.0], [5.0, 5.0]]
    group_ids = [0, 0, 0, 1]
    adv = grpo_per_turn_advantages(turn_rewards, group_ids, gamma=0.5, normalize_std=False)
    # returns-to-go with gamma 0.5: traj0 [0 + 0.5*1, 1] = [0.5, 1]; traj1 [0, 0]; traj2 [1]
    # group 0, turn 0: returns 0.5, 0, 1 -> mean 0.5 -> 0, -0.5, 0.5
    # group 0, turn 1: returns 1 (traj0), 0 (traj1) -> mean 0.5 -> 0.5, -0.5
    # group 1 has a single trajectory: alone at each turn -> 0
    assert [[round(a, 6) for a in row] for row in adv] == [[0.0, 0.5], [-0.5, -0.5], [0.5], [0.0, 0.0]]


def test_grpo_per_turn_std_normalisation():
    adv = grpo_per_turn_advantages([[0.0, 1.0], [0.0, 0.0], [1.0]], [7, 7, 7], gamma=1.0)
    # returns: [1, 1], [0, 0], [1]
    # turn 0: 1, 0, 1 -> mean 2/3, deviations 1/3, -2/3, 1/3, var = (1/9 + 4/9 + 1/9)/2 = 1/3,
    #         std = 0.577350 -> 0.577350, -1.154700, 0.577350
    # turn 1: 1, 0 -> deviations ±0.5, var = 0.5, std = 0.707107 -> ±0.707107
    expected = [[0.577350, 0.707107], [-1.154700, -0.707107], [0.577350]]
    for row, exp_row in zip(adv, expected):
        assert row == pytest.approx(exp_row, abs=1e-5)


def test_grpo_per_turn_rejects_mismatched_group_ids():
    with pytest.raises(ValueError, match="one group id per trajectory"):
        grpo_per_turn_advantages([[1.0], [0.0]], [0])


def test_rloo_uses_the_mean_of_the_other_samples_as_baseline():
    # r = [1, 2, 6]: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5 -> -3, -1.5, 4.5
    close(rloo_advantages(torch.tensor([[1.0, 2.0, 6.0]])), [[-3.0, -1.5, 4.5]])
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages(torch.tensor([[1.0], [2.0]]))


def test_reinforce_pp_normalises_over_the_whole_batch():
    # r = [0, 1, 2, 5]: mean 2, deviations -2 -1 0 3, var = (4+1+0+9)/3 = 14/3, std = 2.160247
    # -> -0.925820, -0.462910, 0, 1.388730
    close(reinforce_pp_advantages(torch.tensor([0.0, 1.0, 2.0, 5.0])), [-0.925820, -0.462910, 0.0, 1.388730])


def test_gae_matches_a_hand_unrolled_recursion():
    gamma, lam = 0.9, 0.8
    rewards_BT = torch.tensor([[0.0, 0.0, 1.0]])
    values_BT = torch.tensor([[0.5, 0.6, 0.7]])
    mask_BT = torch.ones(1, 3)
    # delta2 = 1 + 0.9*0 - 0.7 = 0.3                      A2 = 0.3
    # delta1 = 0 + 0.9*0.7 - 0.6 = 0.03                   A1 = 0.03 + 0.72*0.3 = 0.246
    # delta0 = 0 + 0.9*0.6 - 0.5 = 0.04                   A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = 0.71712, 0.846, 1.0
    adv, ret = gae(rewards_BT, values_BT, mask_BT, gamma=gamma, lam=lam)
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_skips_observation_tokens_and_padding():
    # tokens: policy, observation (mask 0), policy, padding (mask 0); gamma 1, lam 0.5
    rewards_BT = torch.tensor([[0.0, 9.0, 1.0, 9.0]])  # 9s sit on mask-0 tokens and must be ignored
    values_BT = torch.tensor([[0.5, 3.0, 0.5, 3.0]])
    mask_BT = torch.tensor([[1, 0, 1, 0]])
    # t2: delta = 1 + 0 - 0.5 = 0.5 -> A = 0.5 (the padding after it is not a successor)
    # t0: next policy value is V2 = 0.5: delta = 0 + 0.5 - 0.5 = 0 -> A = 0 + 0.5*0.5 = 0.25
    adv, ret = gae(rewards_BT, values_BT, mask_BT, gamma=1.0, lam=0.5)
    close(adv, [[0.25, 0.0, 0.5, 0.0]])
    close(ret, [[0.75, 0.0, 1.0, 0.0]])


def test_gae_with_lambda_one_and_zero_values_gives_discounted_returns():
    # V = 0, lam = 1: A_t = sum_k gamma^k r_{t+k}; r = [1, 0, 2], gamma 0.5 -> [1 + 0.5, 0 + 1, 2] = [1.5, 1, 2]
    adv, _ = gae(torch.tensor([[1.0, 0.0, 2.0]]), torch.zeros(1, 3), torch.ones(1, 3), gamma=0.5, lam=1.0)
    close(adv, [[1.5, 1.0, 2.0]])
    assert not math.isnan(adv.sum().item())


def test_weight_negatives_scales_only_negative_advantages():
    # GRPO group [1, 0, 0, 0]: mean 0.25, std sqrt(0.75 / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5]
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    close(weight_negatives(adv, 0.2), [[1.5, -0.1, -0.1, -0.1]])
    close(weight_negatives(adv, 0.0), [[1.5, 0.0, 0.0, 0.0]])
    assert weight_negatives(adv, 1.0) is adv  # the unbiased estimate, untouched
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="negative-advantage weight"):
            weight_negatives(adv, bad)
