"""One policy update over the training core: ``forward_backward`` (the core's ``ppo`` loss) + ``optim_step``
over minibatches of a packed batch, with every setting an explicit parameter.

How the loss maps onto the core's ``ppo`` loss (a weighted per-token sum): each policy token's weight is
its :func:`~trainer.core.losses.aggregation_weights` share divided by the minibatch's units (policy
tokens, or sequences for the ``seq_mean_*`` aggregations), so the sum is that aggregation's mean; the
clip range is ``[1 - clip_eps, 1 + clip_eps_high]``; log-probs are of ``logits / temperature``; with one
pass over the batch no ``logprobs`` input is sent, so the ratio is exactly 1 (``pi_old`` is the policy
before this step's update); with several, ``pi_old`` comes from a forward-only pass first. When the
batch was sampled by an older policy (asynchronous rollouts), ``pi_old`` is that behaviour policy: the
sampler's own log-probs, sent as ``logprobs``.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from trainer.config import AlgoConfig, OptimConfig
from trainer.core import AdamParams, TrainingClient, aggregation_units, aggregation_weights
from trainer.distributed import all_reduce_mean, world_size
from trainer.update.batch import PackedBatch
from trainer.update.datums import datums, forward_values

#: the logged names of the core's metrics
METRIC_NAMES = {"clip_frac:mean": "clip_frac", "approx_kl:mean": "approx_kl", "ratio:mean": "ratio_mean",
                "kl:mean": "kl", "value_loss:mean": "value_loss", "vf_clip_frac:mean": "vf_clip_frac",
                "value:mean": "value_mean"}


def adam_params(optim: OptimConfig, step: int, total_steps: int) -> AdamParams:
    """This step's AdamW settings: ``optim.lr`` times the schedule's factor for ``step`` of ``total_steps``."""
    return AdamParams(learning_rate=optim.lr * optim.lr_factor(step, total_steps), beta1=optim.betas[0],
                      beta2=optim.betas[1], eps=optim.eps, weight_decay=optim.weight_decay, grad_clip_norm=optim.grad_clip)


def loss_config(algo: AlgoConfig, temperature: float, *, kl: bool, value: bool) -> dict[str, float]:
    """The core ``ppo`` loss's settings for ``algo``: the clip range, plus the KL and value terms when on."""
    high = algo.clip_eps if algo.clip_eps_high is None else algo.clip_eps_high
    config = {"clip_low_threshold": 1.0 - algo.clip_eps, "clip_high_threshold": 1.0 + high,
              "temperature": temperature}
    if kl:
        config["kl_coef"] = algo.kl_coef
    if algo.entropy_coef:
        config["entropy_coef"] = algo.entropy_coef
    if value:
        config.update(value_coef=algo.value_coef, value_clip_eps=algo.value_clip_eps)
    return config


def policy_update(client: TrainingClient, batch: PackedBatch, adam: AdamParams, algo: AlgoConfig, *,
                  temperature: float, seed: int, off_policy: bool = False,
                  reference: TrainingClient | None = None, old_values_BS: Tensor | None = None) -> dict[str, float]:
    """``algo.epochs`` x ``algo.minibatches`` rounds of ``forward_backward`` and ``optim_step`` over ``batch``;
    returns the step's metrics (``train/...``).

    ``temperature``: the sampler's (log-probs are of ``logits / temperature``). ``seed``: the minibatch
    shuffle's. ``off_policy``: the batch was sampled by an older policy, whose log-probs (the sampler's)
    are ``pi_old``. ``reference``: the frozen KL reference (``algo.kl_coef``). ``old_values_BS``: PPO's
    value estimates from :func:`~trainer.update.advantages.gae_advantages` (returns in ``rewards_BS``).

    Loss metrics are token means over all policy tokens (a torchrun rank's loss-free padding rows count for
    nothing); ``loss`` is the minibatch objective (its aggregation's mean); grad_norm the mean over steps.
    """
    config = loss_config(algo, temperature, kl=reference is not None, value=old_values_BS is not None)
    if off_policy:
        behaviour_BS: Tensor | None = batch.sampler_logprobs_BS
    elif algo.epochs > 1 or algo.minibatches > 1:
        behaviour_BS = forward_values(client, batch, "logprobs", temperature)
    else:
        behaviour_BS = None
    extra = {"logprobs": behaviour_BS,
             "ref_logprobs": forward_values(reference, batch, "logprobs", temperature) if reference else None,
             "returns": batch.rewards_BS if old_values_BS is not None else None, "old_values": old_values_BS}
    shares_BS = aggregation_weights(batch.mask_BS, algo.aggregation)
    sums: dict[str, float] = {}
    tokens, drop = 0.0, 0.0
    grad_norms: list[float] = []
    rng = random.Random(seed)
    stopped = False
    for _ in range(algo.epochs):
        for rows in _split(list(range(len(batch))), algo.minibatches, rng):
            units_t = aggregation_units(batch.mask_BS[rows], algo.aggregation).double()
            # DDP averages the ranks' gradients: dividing by the mean units over ranks makes that average
            # the aggregation's mean over every rank's minibatch together
            units = float(all_reduce_mean(units_t)) if world_size() > 1 else float(units_t)
            out = client.forward_backward(datums(batch, rows, shares_BS / max(units, 1e-6), **extra), "ppo", config)
            stopped = bool(grad_norms) and _past_target_kl(out.metrics, algo.target_kl, units_t.device)
            if stopped:  # this update has moved the policy far enough: drop this minibatch's gradients
                client.zero_grad()
            else:
                grad_norms.append(client.optim_step(adam)["grad_norm"])
            n = out.metrics["tokens:sum"]
            if n:  # padding rows only: their metrics are zeros of nothing, not data
                tokens += n
                _add(sums, "loss", out.metrics["loss:sum"], n)
                _add(sums, "logprob_mismatch", _mismatch(batch, rows, out.loss_fn_outputs), n)
                if behaviour_BS is not None:
                    drop = max(drop, _max_drop(behaviour_BS, batch, rows, out.loss_fn_outputs))
                for key, name in METRIC_NAMES.items():
                    if key in out.metrics or name == "kl":  # kl is logged (as 0) without a reference too
                        _add(sums, name, out.metrics.get(key, 0.0), n)
            if stopped:
                break
        if stopped:
            break
    metrics = {f"train/{k}": v / tokens for k, v in sums.items()} if tokens else {}
    if algo.target_kl:
        metrics["train/update_steps"] = float(len(grad_norms))
    if behaviour_BS is not None and tokens:
        metrics["train/max_logprob_drop"] = drop
    return {**metrics, "train/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "train/lr": adam.learning_rate}


def _past_target_kl(metrics: dict[str, float], target_kl: float, device: torch.device) -> bool:
    """Whether the minibatch's approx KL to ``pi_old`` (its token mean over every rank's rows under DDP, so
    that the ranks stop at the same minibatch) is past ``target_kl`` (never when it is 0: no early stop)."""
    if not target_kl:
        return False
    n = float(metrics.get("tokens:sum", 0.0))
    kl_n = torch.tensor([float(metrics.get("approx_kl:mean", 0.0)) * n, n], dtype=torch.float64, device=device)
    if world_size() > 1:
        all_reduce_mean(kl_n)
    return float(kl_n[0]) > target_kl * float(kl_n[1])


def _add(sums: dict[str, float], key: str, value: float, weight: float) -> None:
    sums[key] = sums.get(key, 0.0) + value * weight


def _mismatch(batch: PackedBatch, rows: list[int], outputs: list[dict[str, Tensor]]) -> float:
    """Token mean of |trainer log-prob - sampler log-prob| over the policy tokens of ``rows``."""
    total = count = 0.0
    for i, out in zip(rows, outputs):
        lp = out["logprobs"]
        mask, sampler = batch.mask_BS[i, :len(lp)], batch.sampler_logprobs_BS[i, :len(lp)]
        total += float(((lp - sampler).abs() * mask).sum())
        count += float(mask.sum())
    return total / max(count, 1.0)


def _max_drop(old_BS: Tensor, batch: PackedBatch, rows: list[int], outputs: list[dict[str, Tensor]]) -> float:
    """The largest fall of a policy token's log-prob from ``pi_old`` (``old_BS``) to the policy that scored ``rows``."""
    drop = 0.0
    for i, out in zip(rows, outputs):
        lp = out["logprobs"]
        mask = (batch.mask_BS[i, :len(lp)] > 0).to(lp.device)
        if bool(mask.any()):
            drop = max(drop, float((old_BS[i, :len(lp)].to(lp.device) - lp)[mask].max()))
    return drop


def _split(rows: list[int], parts: int, rng: random.Random) -> list[list[int]]:
    order = rng.sample(rows, len(rows)) if parts > 1 else rows
    size = -(-len(order) // parts)
    return [order[i:i + size] for i in range(0, len(order), size)]


__all__ = ["METRIC_NAMES", "adam_params", "loss_config", "policy_update"]
