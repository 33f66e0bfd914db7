"""The training service's protobuf half against the tinker SDK's own encoder and decoder (tinker 0.38.0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from rlhf.serving import InvalidArgument
from rlhf.v1 import tinker_pb2 as pb
from services.training.wire import decode_forward_backward, encode_forward_backward_output


def _datum(tokens, weights):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.array(weights, dtype=np.float32),
        },
    )


def _sdk_body(data, loss_fn="cross_entropy", config=None, forward_only=False) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=3,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_decodes_what_the_sdk_encodes():
    body = _sdk_body(
        [_datum([5, 6, 7, 8], [0.0, 1.0, 1.0]), _datum([9, 10], [0.5])],
        loss_fn="ppo",
        config={"clip_low_threshold": 0.8, "mode": "x"},
        forward_only=True,
    )
    call = decode_forward_backward(body)
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 3, "ppo", True)
    assert call.loss_fn_config == {"clip_low_threshold": 0.8, "mode": "x"}
    assert call.data[0].tokens.tolist() == [5, 6, 7]
    assert call.data[0].inputs["target_tokens"].dtype == torch.int64
    assert call.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
    assert call.data[0].inputs["weights"].tolist() == [0.0, 1.0, 1.0]
    assert call.data[1].tokens.tolist() == [9] and call.data[1].inputs["weights"].tolist() == [0.5]


def test_the_sdk_reads_what_we_encode():
    outputs = [{"logprobs": torch.tensor([-1.0, -2.5, -0.25])}, {"logprobs": torch.tensor([-3.0])}]
    out = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {"loss:sum": 6.75}))
    assert out.metrics == {"loss:sum": 6.75}
    assert len(out.loss_fn_outputs) == 2
    assert out.loss_fn_outputs[0]["logprobs"].to_numpy().tolist() == [-1.0, -2.5, -0.25]
    assert out.loss_fn_outputs[1]["logprobs"].to_numpy().tolist() == [-3.0]


def test_sparse_top_k_targets_arrive_dense():
    targets = torch.tensor([[7, 0, 0, 0], [0, 9, 0, 0], [0, 0, 0, 3]])  # mostly zero: the SDK sends CSR
    sparse = types.TensorData.from_torch_sparse(targets)
    assert sparse.sparse_crow_indices is not None
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": sparse, "weights": types.TensorData.from_torch(torch.ones(3, 4))},
    )
    call = decode_forward_backward(_sdk_body([datum]))
    assert torch.equal(call.data[0].inputs["target_tokens"], targets)
    bad = pb.ForwardBackwardRequest.FromString(_sdk_body([datum]))
    bad.data[0].loss_fn_inputs["target_tokens"].sparse_csr.col_indices = np.array([9, 9, 9], np.int64).tobytes()
    with pytest.raises(InvalidArgument, match="not a valid sparse CSR tensor"):
        decode_forward_backward(bad.SerializeToString())


def test_refuses_what_it_cannot_read():
    with pytest.raises(InvalidArgument, match="not a tinker ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff")
    with pytest.raises(InvalidArgument, match="data is empty"):
        decode_forward_backward(_sdk_body([]))
    image = types.Datum(
        model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]),
        loss_fn_inputs={"target_tokens": np.zeros(4, dtype=np.int64)},
    )
    with pytest.raises(InvalidArgument, match="image chunks are not supported"):
        decode_forward_backward(_sdk_body([image]))


def test_top_k_outputs_keep_their_trailing_shape():
    outputs = [
        {"logprobs": torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]])},
        {"logprobs": torch.tensor([[-7.0, -8.0]])},
        {"logprobs": torch.tensor([-9.0, -10.0])},  # a 1-D datum after (N, 2) ones: a record of its own
    ]
    out = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {}))
    shapes = [o["logprobs"].shape for o in out.loss_fn_outputs]
    assert shapes == [[3, 2], [1, 2], [2]]
    assert out.loss_fn_outputs[1]["logprobs"].to_numpy().tolist() == [[-7.0, -8.0]]
