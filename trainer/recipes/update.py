"""One RL update over the training core, shared by single- and two-agent training: advantages, datums, and
``forward_backward`` + ``optim_step`` over minibatches.

How the recipes' loss maps onto the core's ``ppo`` loss (a weighted per-token sum): each policy token's
weight is its :func:`~trainer.core.losses.aggregation_weights` share divided by the minibatch's units
(policy tokens, or sequences for the ``seq_mean_*`` aggregations), so the sum is that aggregation's mean;
the clip range is ``[1 - clip_eps, 1 + clip_eps_high]``; log-probs are of ``logits / temperature``; with
one pass over the batch no ``logprobs`` input is sent, so the ratio is exactly 1 (``pi_old`` is the
policy before this step's update); with several, ``pi_old`` comes from a forward-only pass first. With
asynchronous rollouts (``rollout.max_staleness > 0``) ``pi_old`` is the behaviour policy: the sampler's
own log-probs, sent as ``logprobs``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from trainer import algos
from trainer.core import AdamParams, Datum, TrainingClient, aggregation_units, aggregation_weights
from trainer.distributed import all_reduce_mean, world_size
from trainer.recipes.batch import PackedBatch, token_advantages
from trainer.rollout import Trajectory

#: the recipes' logged names of the core's metrics
METRIC_NAMES = {"clip_frac:mean": "clip_frac", "approx_kl:mean": "approx_kl", "ratio:mean": "ratio_mean",
                "kl:mean": "kl", "value_loss:mean": "value_loss", "vf_clip_frac:mean": "vf_clip_frac",
                "value:mean": "value_mean"}


def adam_params(optim: Any, step: int, total_steps: int) -> AdamParams:
    """This step's AdamW settings from an ``OptimConfig``: ``lr`` times the schedule's factor for ``step``."""
    return AdamParams(learning_rate=optim.lr * optim.lr_factor(step, total_steps), beta1=optim.betas[0],
                      beta2=optim.betas[1], eps=1e-8, weight_decay=optim.weight_decay, grad_clip_norm=optim.grad_clip)


def compute_advantages(cfg: Any, groups: list[list[Trajectory]]) -> list[list[float]]:
    """Per-token advantages for every trajectory of ``groups`` (flattened in order); PPO fills them later.

    Negative advantages are scaled by ``algo.negative_weight`` (1: as estimated).
    """
    flat = [t for g in groups for t in g]
    name, w = cfg.algo.name, cfg.algo.negative_weight
    if name == "grpo_per_turn":
        per_turn = algos.grpo_per_turn_advantages([t.turn_rewards or [0.0] for t in flat],
                                                  [t.group_id for t in flat], gamma=cfg.algo.gamma,
                                                  normalize_std=cfg.algo.normalize_std)
        return [token_advantages(t, algos.weight_negatives(torch.tensor(a), w).tolist())
                for t, a in zip(flat, per_turn)]
    if name == "ppo":
        return [[0.0] * len(t.tokens) for t in flat]
    rewards_BG = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float)
    if name == "grpo":
        adv_BG = algos.grpo_advantages(rewards_BG, normalize_std=cfg.algo.normalize_std)
    elif name == "rloo":
        adv_BG = algos.rloo_advantages(rewards_BG)
    else:
        adv_BG = algos.reinforce_pp_advantages(rewards_BG.flatten()).view_as(rewards_BG)
    adv_BG = algos.weight_negatives(adv_BG, w)
    return [token_advantages(t, [a]) for t, a in zip(flat, adv_BG.flatten().tolist())]


def datums(batch: PackedBatch, rows: list[int], weights_BS: torch.Tensor,
           **extra_BS: torch.Tensor | None) -> list[Datum]:
    """The core's datums for ``rows`` of ``batch``: inputs ``tokens[:n-1]``, targets ``tokens[1:n]``, the given
    per-token weights and advantages, plus each ``extra_BS`` tensor (sampler ``logprobs``, ``ref_logprobs``,
    ``returns``, ``old_values``) that is not None."""
    out = []
    for i in rows:
        n = int(batch.attn_BT[i].sum())
        inputs = {"target_tokens": batch.tokens_BT[i, 1:n], "weights": weights_BS[i, :n - 1],
                  "advantages": batch.advantages_BS[i, :n - 1],
                  **{k: v[i, :n - 1] for k, v in extra_BS.items() if v is not None}}
        out.append(Datum(batch.tokens_BT[i, :n - 1], inputs, images=batch.images_B[i]))
    return out


def forward_values(client: TrainingClient, batch: PackedBatch, key: str, temperature: float = 1.0) -> torch.Tensor:
    """[B, S] of a forward-only pass's per-token output ``key`` (``logprobs`` or ``values``); 0 on padding."""
    out_BS = torch.zeros_like(batch.mask_BS)
    result = client.forward(datums(batch, list(range(len(batch))), batch.mask_BS), "importance_sampling",
                            {"temperature": temperature})
    for i, row in enumerate(result.loss_fn_outputs):
        out_BS[i, :len(row[key])] = row[key]
    return out_BS


def ppo_advantages(cfg: Any, client: TrainingClient, batch: PackedBatch) -> torch.Tensor:
    """GAE from the value head's estimates; fills the batch's advantages and returns, returns the old values [B, S]."""
    values_BS = forward_values(client, batch, "values")
    adv_BS, returns_BS = algos.gae(batch.rewards_BS, values_BS, batch.mask_BS, gamma=cfg.algo.gamma, lam=cfg.algo.lam)
    valid_BS = batch.mask_BS.bool()
    if int(valid_BS.sum()) > 1:
        mean, std = algos.masked_mean(adv_BS, batch.mask_BS), adv_BS[valid_BS].std().clamp_min(1e-6)
    else:  # nothing to whiten (a rank's padding-only batch under torchrun): no NaN from an empty std
        mean, std = 0.0, 1.0
    batch.advantages_BS = algos.weight_negatives((adv_BS - mean) / std, cfg.algo.negative_weight) * batch.mask_BS
    batch.rewards_BS = returns_BS  # the value targets travel in the rewards slot from here on
    return values_BS


def policy_update(cfg: Any, client: TrainingClient, batch: PackedBatch, adam: AdamParams, *,
                  reference: TrainingClient | None = None,
                  old_values_BS: torch.Tensor | None = None) -> dict[str, float]:
    """``algo.epochs`` x ``algo.minibatches`` rounds of ``forward_backward`` (the core's ``ppo`` loss) and
    ``optim_step`` over ``batch``; returns the step's metrics (``train/...``).

    Loss metrics are token means over all policy tokens (a torchrun rank's loss-free padding rows count for
    nothing); ``loss`` is the minibatch objective (its aggregation's mean); grad_norm the mean over steps.
    """
    a, T = cfg.algo, cfg.sampling.temperature
    config = {"clip_low_threshold": 1.0 - a.clip_eps,
              "clip_high_threshold": 1.0 + (a.clip_eps if a.clip_eps_high is None else a.clip_eps_high),
              "temperature": T}
    if reference is not None:
        config["kl_coef"] = a.kl_coef
    if old_values_BS is not None:
        config.update(value_coef=a.value_coef, value_clip_eps=a.value_clip_eps)
    multi_pass = a.epochs > 1 or a.minibatches > 1
    if getattr(getattr(cfg, "rollout", None), "max_staleness", 0) > 0:
        # asynchronous rollouts were sampled by an older policy: the sampler's log-probs are the behaviour policy
        behaviour_BS = batch.sampler_logprobs_BS
    else:
        behaviour_BS = forward_values(client, batch, "logprobs", T) if multi_pass else None
    extra = {"logprobs": behaviour_BS,
             "ref_logprobs": forward_values(reference, batch, "logprobs", T) if reference is not None else None,
             "returns": batch.rewards_BS if old_values_BS is not None else None, "old_values": old_values_BS}
    shares_BS = aggregation_weights(batch.mask_BS, a.aggregation)
    sums: dict[str, float] = {}
    tokens, grad_norms = 0.0, []
    rng = random.Random(cfg.run.seed)
    for _ in range(a.epochs):
        for rows in _split(list(range(len(batch))), a.minibatches, rng):
            units = aggregation_units(batch.mask_BS[rows], a.aggregation).double()
            # DDP averages the ranks' gradients: dividing by the mean units over ranks makes that average
            # the aggregation's mean over every rank's minibatch together
            units = float(all_reduce_mean(units)) if world_size() > 1 else float(units)
            out = client.forward_backward(datums(batch, rows, shares_BS / max(units, 1e-6), **extra), "ppo", config)
            grad_norms.append(client.optim_step(adam)["grad_norm"])
            n = out.metrics["tokens:sum"]
            if not n:  # padding rows only: their metrics are zeros of nothing, not data
                continue
            tokens += n
            _add(sums, "loss", out.metrics["loss:sum"], n)
            _add(sums, "logprob_mismatch", _mismatch(batch, rows, out.loss_fn_outputs), n)
            for key, name in METRIC_NAMES.items():
                if key in out.metrics or name == "kl":  # kl is logged (as 0) without a reference too
                    _add(sums, name, out.metrics.get(key, 0.0), n)
    metrics = {f"train/{k}": v / tokens for k, v in sums.items()} if tokens else {}
    return {**metrics, "train/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "train/lr": adam.learning_rate}


def _add(sums: dict[str, float], key: str, value: float, weight: float) -> None:
    sums[key] = sums.get(key, 0.0) + value * weight


def _mismatch(batch: PackedBatch, rows: list[int], outputs: list[dict]) -> float:
    """Token mean of |trainer log-prob - sampler log-prob| over the policy tokens of ``rows``."""
    total = count = 0.0
    for i, out in zip(rows, outputs):
        lp = out["logprobs"]
        mask, sampler = batch.mask_BS[i, :len(lp)], batch.sampler_logprobs_BS[i, :len(lp)]
        total += float(((lp - sampler).abs() * mask).sum())
        count += float(mask.sum())
    return total / max(count, 1.0)


def _split(rows: list[int], parts: int, rng: random.Random) -> list[list[int]]:
    order = rng.sample(rows, len(rows)) if parts > 1 else rows
    size = -(-len(order) // parts)
    return [order[i:i + size] for i in range(0, len(order), size)]


def rollout_metrics(trajs: list[Trajectory], grouped: Any) -> dict[str, float]:
    """Reward, length and failure statistics of one step's rollouts."""
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


__all__ = ["adam_params", "compute_advantages", "datums", "forward_values", "ppo_advantages", "policy_update",
           "rollout_metrics", "METRIC_NAMES"]
