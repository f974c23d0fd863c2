"""Wire values ⇄ training-core types: the only translation the service does.

JSON bodies arrive as the SDK's ``model_dump(exclude_none=True)`` dicts; forward_backward arrives
as decoded protobuf (:mod:`trainer.service._proto`). Every check here raises ``ValueError`` with the
fix in the message, which the work queue answers as a ``user`` error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.core import AdamParams, Datum, ForwardBackwardOutput, SampleResponse, SamplingParams
from trainer.service import _proto


def datums(wire: list[_proto.WireDatum], *, vocab_size: int, max_tokens: int) -> list[Datum]:
    """Core datums from the request's; token ids are checked against the model's vocabulary."""
    if not wire:
        raise ValueError("Expected at least one Datum in forward_backward, got none.")
    total = sum(len(d.tokens) for d in wire)
    if total > max_tokens:
        raise ValueError(f"Expected at most {max_tokens} tokens in one forward_backward (--max-batch-tokens), got "
                         f"{total} in {len(wire)} datums; send the batch in smaller calls and optim_step once.")
    out = []
    for i, d in enumerate(wire):
        _check_ids(d.tokens, vocab_size, f"datum {i} model_input")
        if "target_tokens" in d.loss_fn_inputs:
            _check_ids(d.loss_fn_inputs["target_tokens"].reshape(-1).tolist(), vocab_size, f"datum {i} target_tokens")
        try:
            out.append(Datum(d.tokens, {k: np.array(v).reshape(-1) for k, v in d.loss_fn_inputs.items()}))
        except ValueError as exc:
            raise ValueError(f"datum {i}: {exc}") from None
    return out


def _check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    bad = [t for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"Expected {what} token ids in [0, {vocab_size}), got {bad[:5]}.")


def prompt_tokens(prompt: dict[str, Any], vocab_size: int) -> list[int]:
    """A ``ModelInput`` dict (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``) as token ids."""
    tokens: list[int] = []
    for chunk in (prompt or {}).get("chunks", []):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise ValueError(f"Expected encoded_text prompt chunks (this service is text-only), got {kind!r}.")
        tokens += [int(t) for t in chunk.get("tokens", [])]
    if not tokens:
        raise ValueError("Expected a prompt with at least one token, got none.")
    _check_ids(tokens, vocab_size, "prompt")
    return tokens


def adam_params(body: dict[str, Any]) -> AdamParams:
    if "adam_params" not in body:
        raise ValueError("Expected adam_params in optim_step (this service trains with AdamW only), got "
                         f"{sorted(body)}.")
    params = body["adam_params"]
    return AdamParams(**{k: float(params[k]) for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay",
                                                        "grad_clip_norm") if k in params})


def sampling_params(params: dict[str, Any]) -> SamplingParams:
    if params.get("max_tokens") is None:
        raise ValueError("Expected sampling_params.max_tokens (a positive integer), got none.")
    keys = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed")
    return SamplingParams(**{k: params[k] for k in keys if params.get(k) is not None})


def forward_backward_proto(out: ForwardBackwardOutput) -> bytes:
    rows = [{k: v.detach().cpu().numpy() for k, v in row.items()} for row in out.loss_fn_outputs]
    metrics = {k: float(v) for k, v in out.metrics.items() if k.count(":") == 1}
    return _proto.encode_forward_backward_output(rows, metrics)


def sample_proto(responses: list[SampleResponse]) -> bytes:
    """One ``SampleResponse`` proto from one or more core responses (their sequences in order)."""
    sequences = [_proto.WireSequence(s.tokens, s.logprobs, s.stop_reason) for r in responses for s in r.sequences]
    for seq in sequences:
        if not seq.tokens:  # the SDK maps empty log-prob bytes to None, which loops then assert on
            raise RuntimeError("the sampler returned an empty sequence")
    prompt = responses[0].prompt_logprobs if responses else None
    prompt_f = None if prompt is None else [float("nan") if p is None else float(p) for p in prompt]
    return _proto.encode_sample_response(sequences, prompt_f)
