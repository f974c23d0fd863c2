"""Several sampling requests, from samplers on one model with different LoRA adapters, in one decode pass.

The training service merges concurrent ``sample`` requests (one tenant's many prompts, several tenants'
adapters) into one engine batch: every request's ``num_samples`` rows are left-padded into one batch,
each row decodes under its own LoRA adapter (:class:`~trainer.sampling.row_adapters.RowAdapters`: the
rows of one adapter together, each adapter's arithmetic on its own rows only), and one
:func:`~trainer.sampling.decode` call continues them all, each row with its own token budget, and gives
the log-probs of its ids. In float32 those are the trainer's up to float rounding and are returned as
they are; in lower precision they are recomputed in one trainer forward over every row, each under its
own adapter (:func:`~trainer.core.sampling.decode_logprobs_exact`), as :meth:`SamplingClient.sample` does.

Requests can share a pass when their decode settings match (:func:`batch_key`): the same model object,
temperature, top-k, top-p, stop ids and stop strings. A request with a ``seed`` never shares one: its
samples must not depend on what else was in the batch, so it runs alone and stays reproducible.

>>> outs = sample_batch([SampleRequest(alice, [1, 2], 4, params), SampleRequest(bob, [3], 2, params)])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from trainer.core.forward import BASE_ADAPTER, model_device
from trainer.core.sampling import SamplingClient, _eval_mode, decode_logprobs_exact
from trainer.sampling import (
    SampledSequence,
    SampleResponse,
    SamplingParams,
    decode,
    generation_model,
    stop_string_check,
)
from trainer.sampling.row_adapters import RowAdapters


@dataclass
class SampleRequest:
    """One ``sample`` call: ``num_samples`` completions of ``prompt`` from ``client``'s weights."""

    client: SamplingClient
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    include_prompt_logprobs: bool = False

    @property
    def rows(self) -> int:
        return self.num_samples


def decode_key(params: SamplingParams) -> Hashable | None:
    """The decode settings requests must share to run in one pass; None for a seeded request (it runs alone)."""
    if params.seed is not None:
        return None
    stop_ids = tuple(sorted(params.stop_token_ids)) if params.stop is not None else None
    return (params.temperature == 0, params.temperature, params.top_k, params.top_p, stop_ids,
            tuple(params.stop_strings))


def batch_key(client: object, params: SamplingParams) -> Hashable | None:
    """What requests must share to run in one decode pass (the model object and :func:`decode_key`); None when
    this one must run alone (seeded, or a sampler that is not a :class:`SamplingClient`, such as a vLLM view)."""
    key = decode_key(params)
    if key is None or not isinstance(client, SamplingClient):
        return None
    return (id(client.model), key)


def sample_batch(requests: Sequence[SampleRequest]) -> list[SampleResponse]:
    """Each request's :class:`SampleResponse`, all decoded in one pass (their :func:`batch_key` must be equal)."""
    if not requests:
        return []
    keys = {batch_key(r.client, r.params) for r in requests}
    if len(keys) != 1 or None in keys:
        raise ValueError(f"Expected requests with one batch key (same model and decode settings, no seed), got {keys}.")
    for r in requests:
        r.client.check_request(r.prompt, r.num_samples, r.params)
    first = requests[0].client
    # each adapter's rows together: one run per adapter in every LoRA layer (RowAdapters)
    order = sorted(range(len(requests)), key=lambda k: str(requests[k].client.adapter))
    ordered = [requests[k] for k in order]
    rows = [(r.client.adapter, r.prompt) for r in ordered for _ in range(r.num_samples)]
    budgets = [r.params.max_tokens for r in ordered for _ in range(r.num_samples)]
    completions = _generate(first, rows, budgets, requests[0].params)
    if not decode_logprobs_exact(first.model):
        completions = _recomputed(first, rows, completions, requests[0].params.temperature or 1.0)
    out: list[SampleResponse | None] = [None] * len(requests)
    row = 0
    for k, r in zip(order, ordered):
        seqs = [SampledSequence(ids, lps, reason) for ids, reason, lps in completions[row:row + r.num_samples]]
        row += r.num_samples
        prompt_lps = None
        if r.include_prompt_logprobs:
            prompt_lps = r.client.compute_logprobs(r.prompt)
        out[k] = SampleResponse(seqs, prompt_lps)
    return [o for o in out if o is not None]


def _adapter_names(client: SamplingClient, adapters: list[str | None]) -> list[str] | None:
    """peft's per-row adapter names, or None when the model carries no adapters at all."""
    if all(a is None for a in adapters) and client.adapter is None:
        return None
    return [a if a is not None else BASE_ADAPTER for a in adapters]


@torch.no_grad()
def _generate(client: SamplingClient, rows: list[tuple[str | None, list[int]]], budgets: list[int],
              params: SamplingParams) -> list[tuple[list[int], str, list[float]]]:
    """Decode every (adapter, prompt) row in one left-padded batch, each up to its own token budget."""
    model = generation_model(client.model)
    device = model_device(model)
    width = max(len(p) for _, p in rows)
    ids_BT = torch.full((len(rows), width), client.pad_id, dtype=torch.long)
    attn_BT = torch.zeros_like(ids_BT)
    for i, (_, prompt) in enumerate(rows):
        ids_BT[i, width - len(prompt):], attn_BT[i, width - len(prompt):] = torch.tensor(prompt), 1
    names = _adapter_names(client, [a for a, _ in rows])
    adapters = RowAdapters(client.model, names) if names is not None else None
    stop_ids = set(params.stop_token_ids) if params.stop is not None else {client.eos_id}
    greedy = params.temperature == 0
    with _eval_mode(client.model):
        out = decode(model, ids_BT.to(device), attn_BT.to(device), max_new_tokens=budgets, eos_ids=stop_ids,
                     temperature=1.0 if greedy else params.temperature, greedy=greedy, top_k=max(params.top_k, 0),
                     top_p=params.top_p, stop_check=stop_string_check(params.stop_strings, client.tokenizer),
                     row_adapters=adapters)
    return list(zip(out.token_ids, out.finish_reasons, out.logprobs))


def _recomputed(client: SamplingClient, rows: list[tuple[str | None, list[int]]],
                completions: list[tuple[list[int], str, list[float]]],
                temperature: float) -> list[tuple[list[int], str, list[float]]]:
    """``completions`` with the log-probs of the trainer's forward (one pass, each row under its own adapter);
    greedy ids are scored at temperature 1."""
    full = [prompt + ids for (_, prompt), (ids, _, _) in zip(rows, completions)]
    names = _adapter_names(client, [a for a, _ in rows])
    logprobs_BT = client.row_logprobs(full, temperature, names)
    return [(ids, reason, logprobs_BT[i, len(prompt) - 1:len(full[i]) - 1].tolist())
            for i, ((_, prompt), (ids, reason, _)) in enumerate(zip(rows, completions))]


__all__ = ["SampleRequest", "batch_key", "decode_key", "sample_batch"]
