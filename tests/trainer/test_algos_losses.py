"""Losses against values worked out by hand (derivations in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algos import ValueHead, aggregate, policy_loss, sft_loss, token_logprobs, value_loss

LN = math.log


def close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32),
                          torch.tensor(expected, dtype=torch.float32), atol=tol), (actual, expected)


def _four_tokens():
    """Ratios r = 1.5, 0.5, 0.5, 1.0 with advantages +1, +1, -1, +2 (one sequence, four tokens)."""
    old_BT = torch.zeros(1, 4)
    logprobs_BT = torch.tensor([[LN(1.5), LN(0.5), LN(0.5), 0.0]], requires_grad=True)
    advantages_BT = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    return logprobs_BT, old_BT, advantages_BT, torch.ones(1, 4)


def test_policy_loss_clips_the_importance_ratio_pessimistically():
    logprobs_BT, old_BT, adv_BT, mask_BT = _four_tokens()
    loss, metrics = policy_loss(logprobs_BT, old_BT, adv_BT, mask_BT, clip_eps=0.2)
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5, A=+1: max(-1.5, -1.2) = -1.2  (clipped term chosen)
    #   r=0.5, A=+1: max(-0.5, -0.8) = -0.5
    #   r=0.5, A=-1: max( 0.5,  0.8) =  0.8  (clipped term chosen)
    #   r=1.0, A=+2: -2
    # token mean: (-1.2 - 0.5 + 0.8 - 2) / 4 = -0.725
    close(loss, -0.725)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 0.5 + 1.0) / 4)
    # approx_kl = mean of k3(old || new) = 1/r + ln r - 1: r=1.5 -> 0.072132, r=0.5 -> 0.306853, r=1 -> 0
    assert metrics["approx_kl"] == pytest.approx((0.072132 + 2 * 0.306853) / 4, abs=1e-5)
    assert metrics["kl"] == 0.0
    # clipped tokens carry no gradient; the others get d(-A r)/d lp / 4 = -A r / 4
    loss.backward()
    close(logprobs_BT.grad, [[0.0, -0.125, 0.0, -0.5]])


def test_policy_loss_asymmetric_clip_widens_only_the_upper_bound():
    logprobs_BT, old_BT, adv_BT, mask_BT = _four_tokens()
    loss, metrics = policy_loss(logprobs_BT, old_BT, adv_BT, mask_BT, clip_eps=0.2, clip_eps_high=0.6)
    # upper bound 1.6: r=1.5 is no longer clipped -> -1.5 ; the lower bound 0.8 still clips token 3
    # (-1.5 - 0.5 + 0.8 - 2) / 4 = -0.8
    close(loss, -0.8)
    assert metrics["clip_frac"] == pytest.approx(0.25)


def test_policy_loss_broadcasts_per_sequence_advantages():
    logprobs_BT = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    mask_BT = torch.tensor([[1, 1], [1, 0]])
    # ratio 1 everywhere: per-token loss = -A -> [-2, -2], [1, masked]; token mean = (-2 - 2 + 1) / 3 = -1
    loss, _ = policy_loss(logprobs_BT, logprobs_BT, torch.tensor([2.0, -1.0]), mask_BT)
    close(loss, -1.0)


def test_policy_loss_adds_k3_kl_to_the_reference():
    logprobs_BT = torch.full((1, 2), LN(0.5))
    ref_BT = torch.full((1, 2), LN(0.25))
    loss, metrics = policy_loss(logprobs_BT, logprobs_BT, torch.zeros(1, 2), torch.ones(1, 2),
                                ref_logprobs_BT=ref_BT, kl_coef=0.1)
    # A = 0 so only the KL term is left; k3 with d = ref - lp = ln 0.5: e^d - d - 1 = 0.5 + 0.693147 - 1
    assert metrics["kl"] == pytest.approx(0.193147, abs=1e-5)
    close(loss, 0.1 * 0.193147)


def test_aggregations():
    loss_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the third sequence has no policy token
    close(aggregate(loss_BT, mask_BT, "token_mean"), (1 + 2 + 3 + 4) / 4)  # 2.5
    close(aggregate(loss_BT, mask_BT, "seq_mean_token_mean"), (2.0 + 4.0) / 2)  # 3
    close(aggregate(loss_BT, mask_BT, "seq_mean_token_sum"), (6.0 + 4.0) / 2)  # 5
    with pytest.raises(ValueError, match="Expected aggregation in"):
        aggregate(loss_BT, mask_BT, "sum")


def test_value_loss_is_clipped_around_the_old_values():
    values_BT = torch.tensor([[1.0, 0.0]])
    old_BT = torch.tensor([[0.5, 0.1]])
    returns_BT = torch.tensor([[2.0, 0.5]])
    loss, metrics = value_loss(values_BT, old_BT, returns_BT, torch.ones(1, 2), clip_eps=0.2)
    # token 0: v - old = 0.5 -> clipped to 0.2 -> v_clip = 0.7; (1-2)^2 = 1 vs (0.7-2)^2 = 1.69 -> 1.69
    # token 1: v - old = -0.1 is inside the clip; (0 - 0.5)^2 = 0.25
    # 0.5 * (1.69 + 0.25) / 2 = 0.485
    close(loss, 0.485)
    assert metrics["vf_clip_frac"] == pytest.approx(0.5)
    assert metrics["value_mean"] == pytest.approx(0.5)


def test_sft_loss_is_token_mean_cross_entropy_on_demonstration_tokens():
    logits_BTV = torch.tensor([[[0.0, LN(3)], [LN(3), 0.0], [50.0, -50.0]]])
    labels_BT = torch.tensor([[0, 0, 1]])
    mask_BT = torch.tensor([[1, 1, 0]])  # the last token (a wildly wrong prediction) is a prompt token
    loss, metrics = sft_loss(logits_BTV, labels_BT, mask_BT)
    # token 0: p(0) = 1/(1+3) -> -ln 0.25 = 1.386294 ; token 1: p(0) = 3/4 -> -ln 0.75 = 0.287682
    close(loss, (1.386294 + 0.287682) / 2)
    assert metrics["token_acc"] == pytest.approx(0.5)  # argmax is right on token 1 only
    assert metrics["num_tokens"] == 2.0


def test_token_logprobs_hand_values_and_low_precision_path():
    logits_BTV = torch.tensor([[[0.0, LN(3)], [LN(3), 0.0]]])
    # softmax([0, ln3]) = [1/4, 3/4]: log p(1) = ln 0.75 ; second row: log p(1) = ln 0.25
    close(token_logprobs(logits_BTV, torch.tensor([[1, 1]])), [[LN(0.75), LN(0.25)]])
    bf16 = token_logprobs(logits_BTV.bfloat16(), torch.tensor([[1, 1]]))
    assert bf16.dtype == torch.float32
    close(bf16, [[LN(0.75), LN(0.25)]], tol=2e-2)
    with pytest.raises(ValueError, match="shift with"):
        token_logprobs(torch.zeros(1, 3, 5), torch.zeros(1, 2, dtype=torch.long))


def test_value_head_starts_at_zero_and_is_linear():
    head = ValueHead(2)
    hidden_BTH = torch.tensor([[[3.0, 4.0], [1.0, -1.0]]])
    assert head(hidden_BTH).shape == (1, 2)
    close(head(hidden_BTH), [[0.0, 0.0]])
    with torch.no_grad():
        head.proj.weight.copy_(torch.tensor([[1.0, 2.0]]))
        head.proj.bias.fill_(0.5)
    # 1*3 + 2*4 + 0.5 = 11.5 ; 1*1 + 2*(-1) + 0.5 = -0.5
    close(head(hidden_BTH.bfloat16()), [[11.5, -0.5]])
