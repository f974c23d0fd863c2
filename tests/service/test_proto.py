"""The hand-written protobuf codec against the SDK's own encoder and decoders (tinker 0.38)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.service import _proto

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto import request_conv, response_conv  # noqa: E402


def _request(data: list, loss_fn: str = "cross_entropy", config: dict | None = None, forward_only: bool = False,
             seq_id: int = 7) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="sess-x:train:0", seq_id=seq_id)
    msg = request_conv.forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_forward_backward_request_decodes_what_the_sdk_encodes():
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, -0.5]})
    body = _request([datum, datum], "ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}, forward_only=True)
    req = _proto.decode_forward_backward_request(body)
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("sess-x:train:0", 7, "ppo", True)
    assert req.loss_fn_config == pytest.approx({"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    assert len(req.data) == 2 and req.data[1].tokens.tolist() == [5, 6, 7]
    assert req.data[0].loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8]
    assert req.data[0].loss_fn_inputs["target_tokens"].dtype == np.int64
    assert req.data[0].loss_fn_inputs["weights"].tolist() == [0.0, 1.0, -0.5]


def test_sparse_and_multi_chunk_inputs_decode_dense():
    import torch

    chunks = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.EncodedTextChunk(tokens=[3])])
    weights = torch.tensor([[0.0, 0.0, 2.0]])  # a 2-D torch tensor: the SDK sends it as sparse CSR
    datum = types.Datum(model_input=chunks, loss_fn_inputs={"target_tokens": [2, 3, 4],
                                                            "weights": types.TensorData.from_torch(weights)})
    req = _proto.decode_forward_backward_request(_request([datum]))
    assert req.data[0].tokens.tolist() == [1, 2, 3]
    assert req.data[0].loss_fn_inputs["weights"].reshape(-1).tolist() == [0.0, 0.0, 2.0]


def test_forward_backward_output_reads_back_through_the_sdk():
    rows = [{"logprobs": np.array([-1.0, -2.5], np.float32), "elementwise_loss": np.array([0.5, 1.0], np.float32)},
            {"logprobs": np.array([-0.25], np.float32), "elementwise_loss": np.array([0.0], np.float32)}]
    out = response_conv.deserialize_forward_backward_output(
        _proto.encode_forward_backward_output(rows, {"loss:sum": 1.5, "tokens:sum": 3.0}))
    assert out.metrics == {"loss:sum": 1.5, "tokens:sum": 3.0}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.5], [-0.25]]
    assert out.loss_fn_outputs[0]["elementwise_loss"].tolist() == [0.5, 1.0]


def test_sample_response_reads_back_through_the_sdk():
    seqs = [_proto.WireSequence([3, 4, 5], [-0.5, -1.0, -2.0], "stop"), _proto.WireSequence([9], [-3.0], "length")]
    resp = response_conv.deserialize_sample_response(_proto.encode_sample_response(seqs, [math.nan, -1.5]))
    assert [s.tokens for s in resp.sequences] == [[3, 4, 5], [9]]
    assert [s.stop_reason for s in resp.sequences] == ["stop", "length"]
    assert resp.sequences[0].logprobs == pytest.approx([-0.5, -1.0, -2.0])
    assert resp.prompt_logprobs[0] is None and resp.prompt_logprobs[1] == pytest.approx(-1.5)  # NaN: undefined


def test_garbage_and_non_text_chunks_are_refused():
    with pytest.raises(_proto.ProtoDecodeError):
        _proto.decode_forward_backward_request(b"\x0a\xff\xff\xff")
    image = types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)
    datum = types.Datum(model_input=types.ModelInput(chunks=[image]), loss_fn_inputs={"target_tokens": [1, 2, 3, 4]})
    with pytest.raises(_proto.ProtoDecodeError, match="encoded_text"):
        _proto.decode_forward_backward_request(_request([datum]))
