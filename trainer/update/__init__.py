"""trainer.update: the RL update every recipe runs (single-agent RL, two-agent, PPO's value pass).

``pack`` trajectories -> ``compute_advantages`` / ``gae_advantages`` from the algorithm's config ->
``policy_update`` (``forward_backward`` + ``optim_step`` over a :class:`~trainer.core.TrainingClient`).
Every setting is an explicit, typed parameter: no recipe's whole config is needed to call it.
"""

from trainer.update.advantages import compute_advantages, gae_advantages
from trainer.update.batch import PackedBatch, pack, padding_row, token_advantages
from trainer.update.datums import datums, forward_values
from trainer.update.policy import METRIC_NAMES, adam_params, loss_config, policy_update
from trainer.update.reference import frozen_reference
from trainer.update.stats import RESULTS, episode_metrics, rollout_metrics

__all__ = ["METRIC_NAMES", "RESULTS", "PackedBatch", "adam_params", "compute_advantages", "datums", "forward_values",
           "episode_metrics", "frozen_reference", "gae_advantages", "loss_config", "pack",
           "padding_row", "policy_update", "rollout_metrics", "token_advantages"]
