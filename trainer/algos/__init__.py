"""trainer.algos: advantages and losses as pure torch functions (rollouts in, scalar loss out)."""

from trainer.algos.advantages import (
    gae,
    grpo_advantages,
    grpo_per_turn_advantages,
    masked_mean,
    reinforce_pp_advantages,
    rloo_advantages,
    weight_negatives,
)
from trainer.algos.losses import aggregate, k3_kl, policy_loss, sft_loss, token_logprobs, value_loss
from trainer.algos.value_head import ValueHead

__all__ = [
    "ValueHead",
    "aggregate",
    "gae",
    "grpo_advantages",
    "grpo_per_turn_advantages",
    "k3_kl",
    "masked_mean",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sft_loss",
    "token_logprobs",
    "value_loss",
    "weight_negatives",
]
