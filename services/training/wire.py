"""The tinker SDK's protobuf bodies <-> tensors: the forward_backward request in, the ForwardBackwardOutput out.

Schema: proto/rlhf/v1/tinker.proto (the SDK's field numbers). Tensors dense or sparse CSR (densified, unlisted
entries 0) and encoded-text chunks are read; image and audio chunks are refused with a message naming them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError

from rlhf.serving import InvalidArgument
from rlhf.v1 import tinker_pb2 as pb

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    tokens: torch.Tensor  # [T] int64: the model input, chunks concatenated
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs by the SDK's names (target_tokens, weights, ...)


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool
    data: list[Datum]


def _tensor(msg: pb.Tensor, where: str) -> torch.Tensor:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise InvalidArgument(f"{where}: dtype {pb.DType.Name(msg.dtype)} is not float32 or int64", field=where)
    if msg.WhichOneof("encoding") == "sparse_csr":
        return _csr(msg, dtype, where)
    arr = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape) or [arr.size]
    if int(np.prod(shape)) != arr.size:
        raise InvalidArgument(f"{where}: shape {shape} does not match its {arr.size} values", field=where)
    return torch.from_numpy(arr.reshape(shape).copy())


def _csr(msg: pb.Tensor, dtype, where: str) -> torch.Tensor:
    """A 2-D tensor the SDK sent as CSR (``TensorData.from_torch_sparse``), dense, unlisted entries 0."""
    shape = list(msg.shape)
    if len(shape) != 2:
        raise InvalidArgument(f"{where}: a sparse CSR tensor must be 2-D, got shape {shape}", field=where)
    try:
        values = torch.from_numpy(np.frombuffer(msg.sparse_csr.values, dtype=dtype).copy())
        crow = torch.from_numpy(np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64).copy())
        col = torch.from_numpy(np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64).copy())
        with torch.sparse.check_sparse_tensor_invariants():
            return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=True).to_dense()
    except (ValueError, RuntimeError) as err:
        raise InvalidArgument(f"{where}: not a valid sparse CSR tensor of shape {shape}: {err}", field=where) from None


def _tokens(datum: pb.Datum, where: str) -> torch.Tensor:
    parts = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidArgument(
                f"{where}.model_input[{j}]: {kind} chunks are not supported (text tokens only)",
                field=f"{where}.model_input",
            )
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    if not parts or sum(p.size for p in parts) == 0:
        raise InvalidArgument(f"{where}.model_input is empty: send at least one token", field=f"{where}.model_input")
    return torch.from_numpy(np.concatenate(parts).astype(np.int64))


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    try:
        msg = pb.ForwardBackwardRequest.FromString(body)
    except DecodeError as err:
        raise InvalidArgument(f"the body is not a tinker ForwardBackwardRequest protobuf: {err}") from None
    config: dict[str, float | str] = {}
    for key, value in msg.loss_fn_config.items():
        config[key] = float(value)
    for key, value in msg.loss_fn_config_v2.items():  # the SDK writes both; v2 wins (it also carries strings)
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, datum in enumerate(msg.data):
        where = f"data[{i}]"
        inputs = {name: _tensor(t, f"{where}.loss_fn_inputs.{name}") for name, t in datum.loss_fn_inputs.items()}
        data.append(Datum(_tokens(datum, where), inputs))
    if not data:
        raise InvalidArgument("data is empty: send at least one datum", field="data")
    return ForwardBackwardCall(msg.model_id, msg.seq_id, msg.loss_fn, config or None, msg.forward_only, data)


def encode_forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """Per-datum float32 outputs (``logprobs``: (N,) or (N, K)) as ArrayRecords of BatchedTensors, as the SDK reads
    them: one record per run of data with the same trailing shape (the SDK concatenates the records in order)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    start = 0
    while start < len(outputs):
        trailing = {name: tuple(t.shape[1:]) for name, t in outputs[start].items()}
        end = start + 1
        while end < len(outputs) and {n: tuple(t.shape[1:]) for n, t in outputs[end].items()} == trailing:
            end += 1
        out.loss_fn_outputs.append(_record(outputs[start:end], trailing))
        start = end
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return out.SerializeToString()


def _record(outputs: list[dict[str, torch.Tensor]], trailing: dict[str, tuple[int, ...]]) -> pb.ArrayRecord:
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in trailing:
        arrays = [o[name].detach().to(torch.float32).cpu().numpy().ravel() for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        batched = pb.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
        )
        batched.trailing_shape.extend(trailing[name])
        record.fields[name].CopyFrom(batched)
    return record
