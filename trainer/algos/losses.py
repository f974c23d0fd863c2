"""Losses: clipped policy gradient (with optional KL to a reference), clipped value loss, SFT cross-entropy.

Alignment convention: ``logits_BTV[:, t]`` scores ``tokens_BT[:, t]`` (and ``labels_BT[:, t]``). A causal
LM's logits at position t predict token t+1, so callers shift first:
``token_logprobs(logits[:, :-1], input_ids[:, 1:])``. Nothing in this module shifts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.algos.advantages import masked_mean

AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def token_logprobs(logits_BTV: Tensor, tokens_BT: Tensor) -> Tensor:
    """log p(tokens) under ``logits``: gathered logit minus logsumexp, never a full [B, T, V] log-softmax.

    Low-precision logits are upcast to float32 one sequence at a time to keep peak memory at one row.
    Returns float32 [B, T].
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


def aggregate(loss_BT: Tensor, mask_BT: Tensor, aggregation: str = "token_mean") -> Tensor:
    """Reduce a per-token loss to a scalar.

    token_mean: mean over all mask-1 tokens of the batch (long answers weigh more).
    seq_mean_token_mean: per-sequence token mean, then mean over sequences with at least one token.
    seq_mean_token_sum: per-sequence token sum, then mean over sequences with at least one token.
    """
    mask_BT = mask_BT.to(loss_BT.dtype)
    if aggregation == "token_mean":
        return masked_mean(loss_BT, mask_BT)
    has_tokens_B = (mask_BT.sum(dim=1) > 0).to(loss_BT.dtype)
    if aggregation == "seq_mean_token_mean":
        per_seq_B = masked_mean(loss_BT, mask_BT, dim=1)
    elif aggregation == "seq_mean_token_sum":
        per_seq_B = (loss_BT * mask_BT).sum(dim=1)
    else:
        raise ValueError(f"Expected aggregation in {AGGREGATIONS}, got {aggregation!r}.")
    return masked_mean(per_seq_B, has_tokens_B)


def k3_kl(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(ref - lp) - (ref - lp) - 1 (>= 0, unbiased)."""
    log_ratio_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1.0


def policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logprobs_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token_mean",
) -> tuple[Tensor, dict[str, float]]:
    """Clipped importance-ratio policy-gradient loss (PPO surrogate), plus ``kl_coef`` * k3 KL to a reference.

    per token: max(-A * r, -A * clip(r, 1 - clip_eps, 1 + clip_eps_high)) with r = exp(lp - old_lp);
    ``clip_eps_high`` defaults to ``clip_eps`` (symmetric clip). ``advantages_BT`` may be [B] (one
    advantage per sequence, broadcast over tokens) or [B, T]. Metrics (floats): clip_frac (share of
    tokens whose clipped term was chosen), approx_kl (k3 KL between old and current policy), ratio_mean,
    kl (k3 KL to the reference, 0 without one).
    """
    if advantages_BT.dim() == 1:
        advantages_BT = advantages_BT[:, None].expand_as(logprobs_BT)
    old_logprobs_BT = old_logprobs_BT.detach()
    advantages_BT = advantages_BT.detach().to(logprobs_BT.dtype)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_eps, 1.0 + high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    kl_value = 0.0
    if ref_logprobs_BT is not None:
        kl_BT = k3_kl(logprobs_BT, ref_logprobs_BT.detach())
        loss_BT = loss_BT + kl_coef * kl_BT
        kl_value = masked_mean(kl_BT.detach(), mask_BT).item()
    loss = aggregate(loss_BT, mask_BT, aggregation)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped_BT > unclipped_BT).float(), mask_BT).item(),
            "approx_kl": masked_mean(k3_kl(logprobs_BT, old_logprobs_BT), mask_BT).item(),
            "ratio_mean": masked_mean(ratio_BT, mask_BT).item(),
            "kl": kl_value,
        }
    return loss, metrics


def value_loss(
    values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, *, clip_eps: float = 0.2
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: token mean of 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clip(v - old, ±eps).

    Metrics: vf_clip_frac (share of tokens where the clipped error was larger), value_mean.
    """
    old_values_BT, returns_BT = old_values_BT.detach(), returns_BT.detach()
    clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_eps, clip_eps)
    err_BT = (values_BT - returns_BT) ** 2
    err_clipped_BT = (clipped_values_BT - returns_BT) ** 2
    loss = 0.5 * masked_mean(torch.maximum(err_BT, err_clipped_BT), mask_BT)
    with torch.no_grad():
        metrics = {
            "vf_clip_frac": masked_mean((err_clipped_BT > err_BT).float(), mask_BT).item(),
            "value_mean": masked_mean(values_BT, mask_BT).item(),
        }
    return loss, metrics


def sft_loss(logits_BTV: Tensor, labels_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Supervised fine-tuning: token-mean cross-entropy over mask-1 tokens (demonstration tokens).

    Metrics: sft_loss, token_acc (argmax accuracy on mask-1 tokens), num_tokens.
    """
    nll_BT = -token_logprobs(logits_BTV, labels_BT)
    loss = masked_mean(nll_BT, mask_BT)
    with torch.no_grad():
        correct_BT = (logits_BTV.argmax(dim=-1) == labels_BT).float()
        metrics = {
            "sft_loss": loss.item(),
            "token_acc": masked_mean(correct_BT, mask_BT).item(),
            "num_tokens": float(mask_BT.sum().item()),
        }
    return loss, metrics

