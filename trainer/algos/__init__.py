"""trainer.algos: advantage estimators as pure torch functions, and PPO's value head (the losses live in trainer.core)."""

from trainer.algos.advantages import (
    gae,
    grpo_advantages,
    grpo_per_turn_advantages,
    masked_mean,
    reinforce_pp_advantages,
    rloo_advantages,
    weight_negatives,
)
from trainer.algos.value_head import ValueHead

__all__ = [
    "ValueHead",
    "gae",
    "grpo_advantages",
    "grpo_per_turn_advantages",
    "masked_mean",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "weight_negatives",
]
