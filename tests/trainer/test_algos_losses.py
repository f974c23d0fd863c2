"""The core's value and cross-entropy losses, log-probs and the value head against values worked out by hand.

(The policy losses' hand-worked values are in test_core.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algos import ValueHead
from trainer.core.losses import token_logprobs, weighted_loss

LN = math.log


def close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32),
                          torch.tensor(expected, dtype=torch.float32), atol=tol), (actual, expected)


def test_value_loss_is_clipped_around_the_old_values():
    values_BT = torch.tensor([[1.0, 0.0]])
    old_BT = torch.tensor([[0.5, 0.1]])
    returns_BT = torch.tensor([[2.0, 0.5]])
    inputs = {"advantages": torch.zeros(1, 2), "returns": returns_BT, "old_values": old_BT,
              "weights": torch.full((1, 2), 0.5)}
    # zero advantages: only the value term (value_coef 1) is left of the ppo loss
    loss, _, metrics = weighted_loss("ppo", torch.zeros(1, 2), inputs, {"value_coef": 1.0, "value_clip_eps": 0.2},
                                     values_BT=values_BT)
    # token 0: v - old = 0.5 -> clipped to 0.2 -> v_clip = 0.7; (1-2)^2 = 1 vs (0.7-2)^2 = 1.69 -> 1.69
    # token 1: v - old = -0.1 is inside the clip; (0 - 0.5)^2 = 0.25
    # 0.5 * (1.69 + 0.25) / 2 = 0.485
    close(loss, 0.485)
    assert float(metrics["vf_clip_frac:mean"]) == pytest.approx(0.5)
    assert float(metrics["value:mean"]) == pytest.approx(0.5)


def test_entropy_bonus_on_sampled_tokens_raises_the_entropy_and_only_when_asked():
    torch.manual_seed(0)
    logits_V = torch.tensor([3.0, 0.0, -1.0, -2.0], requires_grad=True)

    def entropy() -> float:
        p = torch.softmax(logits_V.detach(), -1)
        return float(-(p * p.log()).sum())

    start = entropy()
    optimizer = torch.optim.SGD([logits_V], lr=0.5)
    for _ in range(20):  # sampled tokens, zero advantages: only the bonus moves the logits
        tokens_BT = torch.multinomial(torch.softmax(logits_V.detach(), -1), 4096, replacement=True).view(1, -1)
        lp_BT = token_logprobs(logits_V.expand(1, tokens_BT.shape[1], 4), tokens_BT)
        inputs = {"target_tokens": tokens_BT, "advantages": torch.zeros_like(lp_BT),
                  "weights": torch.full_like(lp_BT, 1 / tokens_BT.shape[1])}
        loss, _, _ = weighted_loss("ppo", lp_BT, inputs, {"entropy_coef": 1.0})
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert entropy() > start + 0.3  # 0.48 nats -> toward ln 4 = 1.39
    lp_BT = torch.tensor([[-0.5, -1.0]])
    inputs = {"target_tokens": torch.zeros(1, 2), "advantages": torch.zeros(1, 2)}
    assert float(weighted_loss("ppo", lp_BT, inputs, {})[0]) == 0.0  # off unless asked
    assert float(weighted_loss("ppo", lp_BT, inputs, {"entropy_coef": 0.5})[0]) == pytest.approx(0.5 * (0.25 + 1.0))


def test_sft_loss_is_token_mean_cross_entropy_on_demonstration_tokens():
    logits_BTV = torch.tensor([[[0.0, LN(3)], [LN(3), 0.0], [50.0, -50.0]]])
    labels_BT = torch.tensor([[0, 0, 1]])
    weights_BT = torch.tensor([[0.5, 0.5, 0.0]])  # the last token (a wildly wrong prediction) is a prompt token
    inputs = {"target_tokens": labels_BT, "weights": weights_BT}
    loss, _, metrics = weighted_loss("cross_entropy", token_logprobs(logits_BTV, labels_BT), inputs, {},
                                     logits_BTV=logits_BTV)
    # token 0: p(0) = 1/(1+3) -> -ln 0.25 = 1.386294 ; token 1: p(0) = 3/4 -> -ln 0.75 = 0.287682
    close(loss, (1.386294 + 0.287682) / 2)
    assert float(metrics["token_acc:mean"]) == pytest.approx(0.5)  # argmax is right on token 1 only


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
