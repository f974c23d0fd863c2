"""The losses of the training core, the only copy in envhub: per-token objectives, weighted and summed.

Conventions (Tinker's): position t scores ``target_tokens[t]``; every loss is ``sum_t w_t * l_t`` over
all positions of all datums of a call, a **sum**, not a mean; a caller who wants a mean scales the
weights (the recipes pass ``mask / units``, see :func:`aggregation_weights`). ``w_t`` is the input
``weights`` (required by ``cross_entropy``, default 1 elsewhere, where a zero advantage already
silences prompt positions). ``r_t = exp(lp_t - logprobs_t)`` is the ratio to the sampler's log-prob.

===================  ========================================  ===============================================
loss_fn              per-token l_t                             loss_fn_config (defaults)
===================  ========================================  ===============================================
cross_entropy        ``-lp``                                   --
importance_sampling  ``-r * A``                                --
ppo                  ``-min(r * A, clip(r, lo, hi) * A)``      clip_low_threshold 0.8, clip_high_threshold 1.2
cispo                ``-sg(clip(r, lo, hi)) * lp * A``         clip_low_threshold 0, clip_high_threshold 4
===================  ========================================  ===============================================

Extensions every policy loss accepts (absent in Tinker's wire, so its semantics are unchanged):
``logprobs`` omitted means on-policy (``r = 1``, gradient ``-A * grad lp``); ``kl_coef`` (config) with
input ``ref_logprobs`` adds ``kl_coef * k3(lp, ref)``; ``entropy_coef`` (config) adds ``entropy_coef * sg(lp) * lp``,
whose gradient on sampled tokens is, in expectation, that of ``-entropy_coef * H`` (an entropy bonus from
the sampled tokens alone, no full-vocabulary softmax); ``temperature`` (config) scores ``logits / T``;
on a client with a value head, inputs ``returns`` and ``old_values`` add ``value_coef`` (0.5) times the
clipped value loss ``0.5 * max((v - R)^2, (v_clip - R)^2)`` (``value_clip_eps`` 0.2).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trainer.algos.advantages import masked_mean

#: a per-token loss [B, T] and its metrics (masked means, each a 0-dim tensor)
LossTerms = tuple[Tensor, dict[str, Tensor]]
#: (log-probs [B, T], the batch's inputs, the loss config, the active-token mask [B, T]) -> LossTerms
PolicyLoss = Callable[[Tensor, dict[str, Tensor], dict[str, float], Tensor], LossTerms]

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
#: loss_fn_inputs each loss needs besides target_tokens
REQUIRED_INPUTS = {"cross_entropy": ("weights",), "importance_sampling": ("advantages",),
                   "ppo": ("advantages",), "cispo": ("advantages",)}
CONFIG_KEYS = {"clip_low_threshold", "clip_high_threshold", "kl_coef", "entropy_coef", "temperature", "value_coef",
               "value_clip_eps"}
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def token_logprobs(logits_BTV: Tensor, tokens_BT: Tensor) -> Tensor:
    """log p(tokens) under ``logits``: gathered logit minus logsumexp, never a full [B, T, V] log-softmax.

    ``logits_BTV[:, t]`` scores ``tokens_BT[:, t]`` (nothing here shifts). Low-precision logits are upcast
    to float32 one sequence at a time to keep peak memory at one row. Returns float32 [B, T].
    """
    if logits_BTV.shape[:2] != tokens_BT.shape:
        raise ValueError(
            f"Expected logits [B, T, V] aligned with tokens [B, T], got {tuple(logits_BTV.shape)} and "
            f"{tuple(tokens_BT.shape)}; shift with logits[:, :-1] and tokens[:, 1:]."
        )
    if logits_BTV.dtype == torch.float32:
        return _row_logprobs(logits_BTV, tokens_BT)
    return torch.stack([_row_logprobs(row_TV.float(), row_T) for row_TV, row_T in zip(logits_BTV, tokens_BT)])


def _row_logprobs(logits_TV: Tensor, tokens_T: Tensor) -> Tensor:
    picked = logits_TV.gather(-1, tokens_T.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits_TV, dim=-1)


def k3_kl(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(ref - lp) - (ref - lp) - 1 (>= 0, unbiased)."""
    log_ratio_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1.0


def check_loss(loss_fn: str, inputs: dict[str, Tensor], config: dict[str, float]) -> None:
    """Raise ValueError (with the accepted choices) for an unknown loss, config key or a missing input."""
    if loss_fn not in LOSSES:
        raise ValueError(f"Expected loss_fn in {LOSSES}, got {loss_fn!r}.")
    unknown = sorted(set(config) - CONFIG_KEYS)
    if unknown:
        raise ValueError(f"Unknown loss_fn_config key(s) {unknown}; expected some of {sorted(CONFIG_KEYS)}.")
    for key in ("target_tokens", *REQUIRED_INPUTS[loss_fn]):
        if key not in inputs:
            raise ValueError(f"Expected loss_fn_inputs[{key!r}] for loss_fn={loss_fn!r}, got {sorted(inputs)}.")


def weighted_loss(loss_fn: str, lp_BT: Tensor, inputs: dict[str, Tensor], config: dict[str, float], *,
                  values_BT: Tensor | None = None, logits_BTV: Tensor | None = None,
                  predicted_BT: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``(sum_t w_t l_t, w_t l_t [B, T], metrics)`` for ``lp_BT`` (log-probs of the targets, with grad).

    ``inputs`` are [B, T] tensors (padding positions carry weight 0). Metrics are 0-d tensors: token means
    over the positions whose weight is non-zero, keyed ``name:mean``. ``cross_entropy`` adds the token accuracy
    of the argmax of ``logits_BTV`` (or of ``predicted_BT``, those argmax ids) when either is given.
    """
    weights_BT = inputs.get("weights", torch.ones_like(lp_BT))
    active_BT = (weights_BT != 0).to(lp_BT.dtype)
    loss_BT, metrics = _POLICY_LOSSES[loss_fn](lp_BT, inputs, config, active_BT)
    if loss_fn == "cross_entropy" and (logits_BTV is not None or predicted_BT is not None):
        with torch.no_grad():
            best_BT = predicted_BT if predicted_BT is not None else logits_BTV.argmax(dim=-1)  # type: ignore[union-attr]
            correct_BT = best_BT.eq(inputs["target_tokens"]).to(lp_BT.dtype)
            metrics["token_acc:mean"] = masked_mean(correct_BT, active_BT)
    if "ref_logprobs" in inputs and config.get("kl_coef", 0.0):
        kl_BT = k3_kl(lp_BT, inputs["ref_logprobs"])
        loss_BT = loss_BT + config["kl_coef"] * kl_BT
        metrics["kl:mean"] = masked_mean(kl_BT.detach(), active_BT)
    if config.get("entropy_coef", 0.0) and loss_fn != "cross_entropy":
        # E[sg(lp) grad lp] = -grad H over the sampled tokens: minimising it raises the policy's entropy
        loss_BT = loss_BT + config["entropy_coef"] * lp_BT.detach() * lp_BT
    if values_BT is not None and "returns" in inputs:
        vloss_BT, vmetrics = _value_loss(values_BT, inputs, config, active_BT)
        loss_BT = loss_BT + config.get("value_coef", 0.5) * vloss_BT
        metrics.update(vmetrics)
    elementwise_BT = weights_BT * loss_BT
    return elementwise_BT.sum(), elementwise_BT, metrics


def _cross_entropy(lp_BT: Tensor, inputs: dict[str, Tensor], config: dict[str, float],
                   active_BT: Tensor) -> LossTerms:
    return -lp_BT, {"nll:mean": masked_mean(-lp_BT.detach(), active_BT)}


def _ratio(lp_BT: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    # no sampler log-probs: the current policy is its own behaviour policy (r = 1, exact on-policy gradient)
    old_BT = inputs.get("logprobs", lp_BT).detach()
    return torch.exp(lp_BT - old_BT)


def _ratio_metrics(lp_BT: Tensor, ratio_BT: Tensor, inputs: dict[str, Tensor], active_BT: Tensor,
                   clipped_BT: Tensor) -> dict[str, Tensor]:
    with torch.no_grad():
        old_BT = inputs.get("logprobs", lp_BT)
        return {"clip_frac:mean": masked_mean(clipped_BT.to(lp_BT.dtype), active_BT),
                "ratio:mean": masked_mean(ratio_BT.detach(), active_BT),
                "approx_kl:mean": masked_mean(k3_kl(lp_BT.detach(), old_BT.detach()), active_BT)}


def _importance_sampling(lp_BT: Tensor, inputs: dict[str, Tensor], config: dict[str, float], active_BT: Tensor) -> LossTerms:
    ratio_BT = _ratio(lp_BT, inputs)
    loss_BT = -ratio_BT * inputs["advantages"]
    return loss_BT, _ratio_metrics(lp_BT, ratio_BT, inputs, active_BT, torch.zeros_like(lp_BT))


def _ppo(lp_BT: Tensor, inputs: dict[str, Tensor], config: dict[str, float], active_BT: Tensor) -> LossTerms:
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    adv_BT = inputs["advantages"]
    ratio_BT = _ratio(lp_BT, inputs)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(lo, hi)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)  # = -min(r A, clip(r) A): the pessimistic bound
    return loss_BT, _ratio_metrics(lp_BT, ratio_BT, inputs, active_BT, clipped_BT > unclipped_BT)


def _cispo(lp_BT: Tensor, inputs: dict[str, Tensor], config: dict[str, float], active_BT: Tensor) -> LossTerms:
    lo, hi = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
    ratio_BT = _ratio(lp_BT, inputs)
    weight_BT = ratio_BT.clamp(lo, hi).detach()
    loss_BT = -weight_BT * lp_BT * inputs["advantages"]
    clipped_BT = (ratio_BT < lo) | (ratio_BT > hi)
    return loss_BT, _ratio_metrics(lp_BT, ratio_BT, inputs, active_BT, clipped_BT)


_POLICY_LOSSES: dict[str, PolicyLoss] = {"cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling,
                                       "ppo": _ppo, "cispo": _cispo}


def _value_loss(values_BT: Tensor, inputs: dict[str, Tensor], config: dict[str, float],
                active_BT: Tensor) -> LossTerms:
    """Clipped value loss per token: 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clip(v - old, ±eps)."""
    eps = config.get("value_clip_eps", 0.2)
    returns_BT = inputs["returns"]
    old_BT = inputs.get("old_values", values_BT).detach()
    clipped_values_BT = old_BT + (values_BT - old_BT).clamp(-eps, eps)
    err_BT = (values_BT - returns_BT) ** 2
    err_clipped_BT = (clipped_values_BT - returns_BT) ** 2
    loss_BT = 0.5 * torch.maximum(err_BT, err_clipped_BT)
    with torch.no_grad():
        metrics = {"value_loss:mean": masked_mean(loss_BT, active_BT),
                   "vf_clip_frac:mean": masked_mean((err_clipped_BT > err_BT).to(values_BT.dtype), active_BT),
                   "value:mean": masked_mean(values_BT, active_BT)}
    return loss_BT, metrics


def aggregation_weights(mask_BT: Tensor, aggregation: str = "token_mean") -> Tensor:
    """Per-token weights that turn the core's weighted sum into ``aggregation`` over the mask-1 tokens,
    before dividing by :func:`aggregation_units` (left to the caller: micro-batches share one divisor).

    token_mean: 1 per token (long answers weigh more); seq_mean_token_mean: 1 / (tokens of the sequence);
    seq_mean_token_sum: 1 per token (each sequence's sum, then the mean over sequences via the units).
    """
    mask_BT = mask_BT.float()
    if aggregation in ("token_mean", "seq_mean_token_sum"):
        return mask_BT
    if aggregation == "seq_mean_token_mean":
        return mask_BT / mask_BT.sum(dim=1, keepdim=True).clamp_min(1.0)
    raise ValueError(f"Expected aggregation in {AGGREGATIONS}, got {aggregation!r}.")


def aggregation_units(mask_BT: Tensor, aggregation: str = "token_mean") -> Tensor:
    """What ``aggregation`` averages over: mask-1 tokens (``token_mean``), else sequences with one."""
    if aggregation == "token_mean":
        return mask_BT.sum()
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"Expected aggregation in {AGGREGATIONS}, got {aggregation!r}.")
    return (mask_BT.sum(dim=1) > 0).sum().to(mask_BT.dtype)


__all__ = ["LOSSES", "AGGREGATIONS", "token_logprobs", "k3_kl", "check_loss", "weighted_loss",
           "aggregation_weights", "aggregation_units"]
