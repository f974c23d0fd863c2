"""Rows that share a token prefix under one adapter compute that prefix once: a prefix pass, then the suffixes.

A GRPO step's rows are a group's samples: each row is the group's prompt plus its own completion, so most of
its tokens are the shared prompt. :func:`shared_prefix_logits` runs each distinct prefix once (a pass whose
batch is the number of prefixes, keeping every layer's keys and values), then every row's suffix attending to
its prefix's keys and values (selected per row from the prefix pass, under autograd) plus its own. The logits
at prefix positions, the last one included (it predicts each row's first suffix token), come from the prefix
pass, so a row's logits, and the gradients through the shared prefix (summed over its rows), are those of
the row's own full pass up to float rounding (``tests/trainer/test_core_prefix.py``).

Rotary positions of a suffix start at its prefix's length; prefixes are right-padded to the longest one and
the padding is masked out, so causal attention over the cache index stays exact per row. Only used where it
pays (:func:`plan_groups`): otherwise the caller runs today's one full pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor

from trainer.core.forward import PassLogits
from trainer.sampling.row_adapters import RowAdapters

#: a group's shared prefix must be at least this many tokens
MIN_PREFIX = 8
#: the prefix path runs only when its token cost (prefix pass + suffix pass, padded) is at most this share of
#: the full pass's
MAX_COST_SHARE = 0.75


@dataclass
class PrefixPlan:
    """Row ``b`` belongs to group ``group_B[b]``, whose shared prefix is ``prefix_G[g]`` tokens long."""

    group_B: list[int]
    prefix_G: list[int]
    first_row_G: list[int]

    def cost(self, lengths: Sequence[int]) -> int:
        """Padded tokens of the two passes: groups x the longest prefix, rows x the longest suffix."""
        return len(self.prefix_G) * max(self.prefix_G) + len(lengths) * self.suffix(lengths)

    def suffix(self, lengths: Sequence[int]) -> int:
        return max(n - self.prefix_G[g] for n, g in zip(lengths, self.group_B))


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two id lists, by bisection over slice comparisons (each one C loop)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_groups(tokens_BT: Tensor, lengths: Sequence[int], adapters: Sequence[str | None], *,
                min_prefix: int = MIN_PREFIX, max_cost_share: float = MAX_COST_SHARE) -> PrefixPlan | None:
    """Groups of rows (same adapter) sharing a token prefix, or None where sharing would not pay.

    Rows ordered by adapter and tokens are cut into runs wherever the common prefix of two neighbours falls
    below a threshold; the threshold (at least ``min_prefix``) is the one whose runs cost fewest padded
    tokens, so prompts sharing only a system prompt stay apart when their own prompts pay more. A run's
    prefix is its rows' common prefix; a row alone is a group whose prefix is the whole row.
    """
    ids = tokens_BT.cpu().tolist()  # one conversion: per-row tensor ops would cost more than the comparisons
    rows = [ids[b][:n] for b, n in enumerate(lengths)]
    order = sorted(range(len(rows)), key=lambda b: (adapters[b] or "", rows[b]))
    # common prefix with the previous row in that order (none across adapters)
    shared = [0] + [_common(rows[a], rows[b]) if adapters[a] == adapters[b] else 0 for a, b in pairwise(order)]
    best: PrefixPlan | None = None
    best_cost = 0
    for threshold in sorted({n for n in shared if n >= min_prefix}):
        plan = _runs(order, shared, threshold, lengths)
        cost = plan.cost(lengths) if plan.suffix(lengths) else None
        if cost is not None and (best is None or cost < best_cost):
            best, best_cost = plan, cost
    if best is None or best_cost > max_cost_share * len(rows) * max(lengths):
        return None
    return best


def _runs(order: list[int], shared: list[int], threshold: int, lengths: Sequence[int]) -> PrefixPlan:
    group_B = [0] * len(order)
    prefix_G: list[int] = []
    first_row_G: list[int] = []
    for b, common in zip(order, shared):
        if prefix_G and common >= threshold:
            prefix_G[-1] = min(prefix_G[-1], common)
        else:
            prefix_G.append(lengths[b])
            first_row_G.append(b)
        group_B[b] = len(prefix_G) - 1
    return PrefixPlan(group_B, prefix_G, first_row_G)


def prefix_plan(model: Any, tokens_BT: Tensor, lengths: Sequence[int], adapters: Sequence[str | None] | None,
                images_B: Sequence[Sequence[Any]] | None = None) -> PrefixPlan | None:
    """:func:`plan_groups` for a pass of ``model``, or None where the prefix path does not apply: a
    vision-language model (its rotary positions are not one index per token), a DDP wrapper (its gradient
    hooks expect one forward per backward) or gradient checkpointing (which drops the prefix pass's keys
    and values)."""
    from trainer.model import unwrap

    if (images_B and any(images_B)) or hasattr(getattr(unwrap(model), "config", None), "vision_config"):
        return None
    hf = unwrap(model)
    checkpointing = "is_activation_checkpointing"  # transformers 5's name; older ones say gradient
    if not hasattr(type(hf), checkpointing):
        checkpointing = "is_gradient_checkpointing"
    if unwrap(model, peft=False) is not model or getattr(hf, checkpointing, False):
        return None
    return plan_groups(tokens_BT, lengths, adapters if adapters is not None else [None] * len(lengths))


def shared_prefix_logits(model: Any, tokens_BT: Tensor, lengths: Sequence[int], adapters: list[str] | None,
                         plan: PrefixPlan) -> PassLogits:
    """Logits of right-padded rows ``tokens_BT`` (``lengths`` real tokens each, row ``b`` under ``adapters[b]``)
    by a prefix pass and a suffix pass, as :func:`~trainer.core.forward.run_model` gives them in one pass (its
    padding positions hold other finite logits): a :class:`~trainer.core.forward.PassLogits` over the two
    passes' logits, each group's prefix positions once."""
    from trainer.model import cache_keyword, output_cache

    device = tokens_BT.device
    B, T = tokens_BT.shape
    G, P = len(plan.prefix_G), max(plan.prefix_G)
    S = plan.suffix(lengths)
    group_B = torch.tensor(plan.group_B, device=device)
    prefix_G = torch.tensor(plan.prefix_G, device=device)
    length_B = torch.tensor(list(lengths), device=device)
    start_B = prefix_G[group_B]
    # the prefix pass: each group's prefix (from its first row), right-padded to P
    cols_P = torch.arange(P, device=device)
    prefix_tokens = tokens_BT[torch.tensor(plan.first_row_G, device=device), :P]  # P <= T: a prefix is in its row
    prefix_attn = (cols_P.unsqueeze(0) < prefix_G.unsqueeze(1)).long()
    with _row_adapters(model, None if adapters is None else [adapters[b] for b in plan.first_row_G]):
        out = model(input_ids=prefix_tokens * prefix_attn, attention_mask=prefix_attn, use_cache=True)
    prefix_logits_GPV, cache = out.logits, output_cache(out)
    # the suffix pass: row b's tokens from its prefix's length on, at rotary positions from there
    cols_S = torch.arange(S, device=device)
    pos_BS = start_B.unsqueeze(1) + cols_S.unsqueeze(0)
    suffix_attn = (pos_BS < length_B.unsqueeze(1)).long()
    suffix_tokens = tokens_BT.gather(1, pos_BS.clamp(max=T - 1)) * suffix_attn
    attn = torch.cat([prefix_attn[group_B], suffix_attn], dim=1)
    rows_cache = _rows_cache(cache, group_B)
    with _row_adapters(model, adapters):
        suffix_logits_BSV = model(input_ids=suffix_tokens, attention_mask=attn, position_ids=pos_BS,
                                  use_cache=True, **{cache_keyword(model): rows_cache}).logits
    # row b, position t: its group's prefix logits before its prefix's length, its suffix logits after
    V = prefix_logits_GPV.shape[-1]
    flat = torch.cat([prefix_logits_GPV.reshape(G * P, V), suffix_logits_BSV.reshape(B * S, V)])
    cols_T = torch.arange(T, device=device).unsqueeze(0)
    in_prefix = cols_T < start_B.unsqueeze(1)
    from_prefix = group_B.unsqueeze(1) * P + cols_T.clamp(max=P - 1)
    from_suffix = G * P + torch.arange(B, device=device).unsqueeze(1) * S + (cols_T - start_B.unsqueeze(1)).clamp(0, S - 1)
    return PassLogits(flat, torch.where(in_prefix, from_prefix, from_suffix))


def _row_adapters(model: Any, adapters: list[str] | None) -> AbstractContextManager[Any]:
    return nullcontext() if adapters is None else RowAdapters(model, adapters)


def _rows_cache(cache: Any, group_B: Tensor) -> Any:
    """A cache holding, for each row, its group's prefix keys and values (selected, so gradients flow back)."""
    from transformers import DynamicCache

    layers = [(layer.keys.index_select(0, group_B), layer.values.index_select(0, group_B)) for layer in cache.layers]
    return DynamicCache(ddp_cache_data=layers)


__all__ = ["PrefixPlan", "plan_groups", "prefix_plan", "shared_prefix_logits", "MIN_PREFIX", "MAX_COST_SHARE"]
