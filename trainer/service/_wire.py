"""Training-core results → the Tinker wire: ``ForwardBackwardOutput`` and ``SampleResponse`` protobuf bodies.

(Requests go the other way through :mod:`trainer.service._requests` and :mod:`trainer.service._limits`,
which check them before they reach the core.)
"""

from __future__ import annotations

from trainer.core import ForwardBackwardOutput, SampleResponse
from trainer.service import _proto


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
