"""A lean batched decode loop for causal LMs: the samplers' replacement for Hugging Face ``generate``.

RL samples many short completions from small batches, where ``generate``'s per-token bookkeeping
(generation-config checks, logits processors, stopping criteria, kept score tensors) costs as much as the
model's forward pass itself on a CPU. :func:`decode` does only what sampling needs: one prefill that
keeps the last position's logits, then one cached forward per new token, temperature / top-k / top-p
sampling from the global torch RNG, the log-prob of each sampled id under the temperature-scaled
distribution (before top-k/top-p filtering: the policy's own log-prob, as the trainer computes it),
and per-row stops (EOS or any stop id, a per-row token budget, an optional check of the row so far).
It ends as soon as every row has stopped.

Prompts are left-padded; position ids count real tokens only, so a padded row sees the same positions
as it would alone. Rows may decode under different LoRA adapters (``row_adapters``, one batch for several
tenants). Extra keyword arguments (a peft ``adapter_names`` list, say) go to every forward.

>>> out = decode(model, ids_BT, attn_BT, max_new_tokens=[16, 8], eos_ids={eos}, temperature=1.0)  # doctest: +SKIP
>>> out.token_ids[0], out.logprobs[0], out.finish_reasons[0]                                      # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.sampling.kernels import HFKernel, LlamaKernel
from trainer.sampling.row_adapters import RowAdapters


@dataclass
class Decoded:
    """Per row: the new ids (ending with the stop id when ``finish_reason == "stop"``), their log-probs."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]  # "stop" | "length"


@torch.no_grad()
def decode(model: Any, ids_BT: Tensor, attn_BT: Tensor, *, max_new_tokens: int | Sequence[int],
           eos_ids: set[int] | frozenset[int] = frozenset(), temperature: float = 1.0, greedy: bool = False,
           top_k: int = 0, top_p: float = 1.0, stop_check: Callable[[list[int]], bool] | None = None,
           row_adapters: RowAdapters | None = None, **forward_kwargs: Any) -> Decoded:
    """Continue each left-padded row of ``ids_BT`` (mask ``attn_BT``) until it stops.

    ``max_new_tokens``: one budget for all rows or one per row. ``eos_ids``: ids that end a row
    (kept as its last id, reason "stop"). ``stop_check(new_ids)`` is asked after every new id of a row
    still running (stop strings); True ends it with reason "stop". ``greedy`` takes the argmax and
    reports log-probs at temperature 1. ``row_adapters``: row ``b`` decodes under that LoRA adapter
    (:class:`~trainer.sampling.row_adapters.RowAdapters`, entered here).
    """
    if row_adapters is None:
        return _decode(model, ids_BT, attn_BT, max_new_tokens, eos_ids, temperature, greedy, top_k, top_p,
                       stop_check, None, forward_kwargs)
    with row_adapters:
        return _decode(model, ids_BT, attn_BT, max_new_tokens, eos_ids, temperature, greedy, top_k, top_p,
                       stop_check, row_adapters, forward_kwargs)


def _decode(model: Any, ids_BT: Tensor, attn_BT: Tensor, max_new_tokens: int | Sequence[int],
            eos_ids: set[int] | frozenset[int], temperature: float, greedy: bool, top_k: int, top_p: float,
            stop_check: Callable[[list[int]], bool] | None, adapters: RowAdapters | None,
            forward_kwargs: dict[str, Any]) -> Decoded:
    B = ids_BT.shape[0]
    device = ids_BT.device
    budgets = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != B or min(budgets) < 1:
        raise ValueError(f"Expected {B} token budgets >= 1, got {budgets}.")
    if not greedy and temperature <= 0:
        raise ValueError(f"Expected temperature > 0 (or greedy=True), got {temperature}.")
    temperature = 1.0 if greedy else temperature
    n_max = max(budgets)
    budget_B = torch.tensor(budgets, device=device)
    stop_ids = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)

    T = ids_BT.shape[1]
    attn_BS = torch.ones((B, T + n_max), dtype=torch.long, device=device)  # new columns: 0 once a row stopped
    attn_BS[:, :T] = attn_BT
    pos_BT = (attn_BS[:, :T].cumsum(-1) - 1).clamp_(min=0)
    kernel = (None if forward_kwargs else LlamaKernel.build(model, T + n_max)) or HFKernel(model)
    # rows with the same prompt and adapter (a GRPO group's samples) share one prefill, its cache copied to each
    # of them; the adapter's index leads the key so that the unique rows keep each adapter's rows together
    adapter_B = torch.zeros((B, 1), dtype=torch.long, device=device)
    if adapters is not None:
        names = {name: i for i, name in enumerate(dict.fromkeys(adapters.adapters_B))}
        adapter_B[:, 0] = torch.tensor([names[a] for a in adapters.adapters_B], device=device)
    unique_UT, inverse_B = torch.unique(torch.cat([adapter_B, ids_BT, attn_BS[:, :T]], dim=1), dim=0,
                                        return_inverse=True)
    if len(unique_UT) < B and not forward_kwargs:
        first_U = _first_rows(inverse_B, len(unique_UT))
        if adapters is not None:
            adapters.select(first_U)
        logits_UV = kernel.prefill(unique_UT[:, 1:T + 1], unique_UT[:, T + 1:], pos_BT[first_U])
        if adapters is not None:
            adapters.select(range(B))
        if kernel.expand(inverse_B):
            logits_BV = logits_UV[inverse_B]
        else:  # a cache type that cannot copy rows: prefill every row
            logits_BV = kernel.prefill(ids_BT, attn_BS[:, :T], pos_BT)
    else:
        logits_BV = kernel.prefill(ids_BT, attn_BS[:, :T], pos_BT, **forward_kwargs)
    next_pos_B = pos_BT[:, -1] + 1
    new_N: list[Tensor] = []        # per step: the id of each row ...
    logprobs_N: list[Tensor] = []   # ... and its log-prob (stacked once at the end)
    running_B = torch.ones(B, dtype=torch.bool, device=device)
    ended_at = [n_max] * B          # ids kept per row
    stopped = [False] * B           # reason "stop" (else "length")
    budget_ends = set(budgets)
    all_running = True
    steps = 0
    for t in range(n_max):
        logp_BV = torch.log_softmax(logits_BV.float() if temperature == 1.0 else logits_BV.float() / temperature, dim=-1)
        tok_B = logp_BV.argmax(-1) if greedy else _sample(logp_BV, top_k, top_p)
        if not all_running:
            tok_B.masked_fill_(~running_B, 0)
        new_N.append(tok_B)
        logprobs_N.append(logp_BV.gather(-1, tok_B[:, None]))
        steps = t + 1
        hit_B = tok_B == stop_ids if len(stop_ids) == 1 else torch.isin(tok_B, stop_ids)
        if not all_running:
            hit_B &= running_B
        if stop_check is not None:
            rows = torch.stack(new_N, dim=1).tolist()
            for i in running_B.nonzero().flatten().tolist():
                if not hit_B[i] and stop_check(rows[i]):
                    hit_B[i] = True
        ended_B = hit_B | (running_B & (budget_B <= steps)) if steps in budget_ends else hit_B
        if bool(ended_B.any()):
            for i in ended_B.nonzero().flatten().tolist():
                ended_at[i], stopped[i] = steps, bool(hit_B[i])
            running_B &= ~ended_B
            all_running = False
            if not bool(running_B.any()):
                break
        if not all_running:
            attn_BS[:, T + t] = running_B  # else it is still the 1 it was made with
        logits_BV = kernel.step(tok_B, attn_BS[:, :T + t + 1], next_pos_B, all_running, **forward_kwargs)
        next_pos_B += 1
    ids, lps = torch.stack(new_N, dim=1).cpu().tolist(), torch.cat(logprobs_N, dim=1).cpu().tolist()
    return Decoded([ids[i][:ended_at[i]] for i in range(B)], [lps[i][:ended_at[i]] for i in range(B)],
                   ["stop" if s else "length" for s in stopped])


def _first_rows(inverse_B: Tensor, n: int) -> Tensor:
    """For each of ``n`` unique rows, the index of one row of the batch it came from."""
    first_U = torch.empty(n, dtype=torch.long, device=inverse_B.device)
    first_U[inverse_B] = torch.arange(len(inverse_B), device=inverse_B.device)
    return first_U


def _sample(logp_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    """One id per row from ``exp(logp_BV)`` after top-k / top-p, by inverting the CDF at one uniform draw per row
    (a draw of B numbers, where ``torch.multinomial`` draws per vocabulary entry: many times slower on a CPU)."""
    cdf_BV = _filtered_probs(logp_BV, top_k, top_p).cumsum_(-1)
    u_B1 = torch.rand((logp_BV.shape[0], 1), device=logp_BV.device) * cdf_BV[:, -1:]
    # the first id whose cumulative mass exceeds u: an id of probability 0 is never picked
    return torch.searchsorted(cdf_BV, u_B1, right=True).squeeze_(-1).clamp_(max=logp_BV.shape[-1] - 1)


def _filtered_probs(logp_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    """Probabilities to sample from: top-k then top-p (nucleus) applied to the temperature-scaled log-probs."""
    if top_k <= 0 and top_p >= 1.0:
        return logp_BV.exp()
    logp_BV = logp_BV.clone()
    if 0 < top_k < logp_BV.shape[-1]:
        kth_B1 = logp_BV.topk(top_k, dim=-1).values[:, -1:]
        logp_BV.masked_fill_(logp_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = logp_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.exp()
        before_BV = probs_BV.cumsum(-1) - probs_BV       # mass of the more likely ids
        drop_BV = before_BV >= top_p * probs_BV.sum(-1, keepdim=True)
        drop_BV[:, 0] = False                            # the most likely id always stays
        logp_BV.scatter_(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    return logp_BV.exp()


def stop_string_check(stop_strings: Sequence[str], tokenizer: Any) -> Callable[[list[int]], bool] | None:
    """A :func:`decode` stop check: does the newest text of a row hold one of ``stop_strings``? None for none.

    Only the row's last few ids are decoded (a stop string ends within them: every id decodes to at least
    one byte), so a long generation costs linear time."""
    if not stop_strings:
        return None
    tail = max(len(s.encode()) for s in stop_strings) + 1

    def check(ids: list[int]) -> bool:
        text = tokenizer.decode(ids[-tail:])
        return any(s in text for s in stop_strings)

    return check


def supports_decode(model: Any) -> bool:
    """Whether :func:`decode` can drive ``model``: a text causal LM (vision-language models use ``generate``,
    whose multimodal position ids are model-specific)."""
    config = getattr(model, "config", None)
    return getattr(config, "image_token_id", None) is None and getattr(config, "vision_config", None) is None

__all__ = ["Decoded", "decode", "stop_string_check", "supports_decode"]
