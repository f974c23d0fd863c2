"""The protobuf messages of the Tinker wire, written and read by hand (no ``protobuf`` dependency).

SDK 0.38 sends ``forward_backward`` as a ``tinker_public.ForwardBackwardRequest`` and reads the
results of ``forward_backward`` and ``asample`` as ``ForwardBackwardOutput`` / ``SampleResponse``.
Only those three messages are needed, so this module speaks the protobuf wire format directly:
varints, 64-bit doubles and length-delimited fields. Field numbers follow the SDK's schema
(``docs/service.md`` lists them). Pure functions over bytes and numpy arrays; nothing here knows
about HTTP or torch.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_NUMPY_OF_DTYPE = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
_DTYPE_OF_NAME = {"float32": DTYPE_FLOAT32, "int64": DTYPE_INT64, "int32": DTYPE_INT32}
STOP_REASON = {"stop": 0, "length": 1}


class ProtoDecodeError(ValueError):
    """The body is not the protobuf message it claims to be."""


# -- reading ---------------------------------------------------------------------------------------

def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoDecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtoDecodeError("varint longer than 10 bytes")


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Yield ``(field_number, wire_type, value)``; LEN values are bytes, the rest ints."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire == _I64:
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire == _I32:
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        elif wire == _LEN:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise ProtoDecodeError(f"unsupported wire type {wire} for field {number}")
        if pos > len(buf):
            raise ProtoDecodeError(f"field {number} runs past the end of the message")
        yield number, wire, value


def _double(bits: int) -> float:
    return struct.unpack("<d", bits.to_bytes(8, "little"))[0]


def _packed_varints(value: int | bytes) -> list[int]:
    if isinstance(value, int):  # an unpacked repeated element
        return [value]
    out, pos = [], 0
    while pos < len(value):
        item, pos = _read_varint(value, pos)
        out.append(item)
    return out


def _map_entry(buf: bytes) -> tuple[str, int | bytes | None]:
    key, value = "", None
    for number, _, item in _fields(buf):
        if number == 1:
            key = bytes(item).decode()
        elif number == 2:
            value = item
    return key, value


def _tensor(buf: bytes) -> np.ndarray:
    """A ``Tensor`` (dense or CSR) as a dense numpy array of its declared shape."""
    dense, csr, dtype, shape = None, None, 0, []
    for number, _, value in _fields(buf):
        if number == 1:
            dense = bytes(value)
        elif number == 2:
            csr = {n: bytes(v) for n, _, v in _fields(value)}
        elif number == 3:
            dtype = value
        elif number == 4:
            shape += _packed_varints(value)
    if dtype not in _NUMPY_OF_DTYPE:
        raise ProtoDecodeError(f"tensor dtype {dtype} is not float32, int64 or int32")
    np_dtype = _NUMPY_OF_DTYPE[dtype]
    if csr is None:
        flat = np.frombuffer(dense or b"", dtype=np_dtype)
        if shape and int(np.prod(shape)) != flat.size:
            raise ProtoDecodeError(f"tensor of shape {shape} carries {flat.size} values")
        return flat.reshape(shape) if shape else flat
    values = np.frombuffer(csr.get(1, b""), dtype=np_dtype)
    crow = np.frombuffer(csr.get(2, b""), dtype=np.int64)
    col = np.frombuffer(csr.get(3, b""), dtype=np.int64)
    if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
        raise ProtoDecodeError(f"sparse tensor of shape {shape} has inconsistent CSR indices")
    out = np.zeros(shape, dtype=np_dtype)
    for row in range(shape[0]):
        out[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
    return out


@dataclass
class WireDatum:
    """One ``Datum``: the model input's tokens and its named ``loss_fn_inputs`` arrays."""

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    data: list[WireDatum]
    loss_fn_config: dict[str, float | str]
    forward_only: bool


def _datum(buf: bytes) -> WireDatum:
    datum = WireDatum(tokens=[])
    for number, _, value in _fields(buf):
        if number == 1:
            for kind, _, chunk in _fields(value):
                if kind != 1:
                    raise ProtoDecodeError("only encoded_text chunks are supported (no image or audio)")
                for tnum, _, tokens in _fields(chunk):
                    if tnum == 1:
                        datum.tokens += np.frombuffer(bytes(tokens), dtype="<i4").tolist()
        elif number == 2:
            name, tensor = _map_entry(value)
            datum.loss_fn_inputs[name] = _tensor(bytes(tensor or b""))
    return datum


def decode_forward_backward_request(body: bytes) -> ForwardBackwardRequest:
    req = ForwardBackwardRequest("", 0, "", [], {}, False)
    config_v1: dict[str, float | str] = {}
    for number, _, value in _fields(body):
        if number == 1:
            req.model_id = bytes(value).decode()
        elif number == 2:
            req.seq_id = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3:
            req.data.append(_datum(bytes(value)))
        elif number == 4:
            req.loss_fn = bytes(value).decode()
        elif number == 5:
            key, bits = _map_entry(value)
            config_v1[key] = _double(bits or 0)
        elif number == 6:
            req.forward_only = bool(value)
        elif number == 7:  # map<string, LossConfigValue{double number=1; string text=2}>
            key, entry = _map_entry(value)
            for vnum, _, item in _fields(bytes(entry or b"")):
                req.loss_fn_config[key] = _double(item) if vnum == 1 else bytes(item).decode()
    # v2 carries every key when the client writes it; v1 is the fallback for older clients.
    req.loss_fn_config = req.loss_fn_config or config_v1
    return req


# -- writing ---------------------------------------------------------------------------------------

def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _len_field(number: int, payload: bytes) -> bytes:
    return _key(number, _LEN) + _varint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:
    return _key(number, _VARINT) + _varint(value) if value else b""


def _double_entry(key: str, value: float) -> bytes:
    return _len_field(1, key.encode()) + _key(2, _I64) + struct.pack("<d", value)


def _batched_tensor(arrays: list[np.ndarray], dtype: str) -> bytes:
    np_dtype = _NUMPY_OF_DTYPE[_DTYPE_OF_NAME[dtype]]
    parts = [np.ascontiguousarray(a, dtype=np_dtype).tobytes() for a in arrays]
    offsets = np.cumsum([0] + [len(p) for p in parts], dtype=np.int64)
    return (_len_field(1, b"".join(parts)) + _len_field(2, offsets.tobytes())
            + _int_field(3, _DTYPE_OF_NAME[dtype]))


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput``: one ``ArrayRecord`` with a 1-D field per name, one row per datum."""
    record = _len_field(1, b"ArrayRecord")
    for name in (outputs[0] if outputs else {}):
        dtype = "int64" if np.issubdtype(outputs[0][name].dtype, np.integer) else "float32"
        entry = _len_field(1, name.encode()) + _len_field(2, _batched_tensor([o[name] for o in outputs], dtype))
        record += _len_field(2, entry)
    record += _int_field(3, len(outputs))
    body = _len_field(1, b"ArrayRecord") + _len_field(2, record)
    for name, value in metrics.items():
        body += _len_field(3, _double_entry(name, float(value)))
    return body


@dataclass
class WireSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"


def encode_sample_response(sequences: list[WireSequence], prompt_logprobs: list[float] | None = None) -> bytes:
    """``SampleResponse``: tokens as int32 and log-probs as float32, little-endian."""
    body = b""
    for seq in sequences:
        msg = (_int_field(1, STOP_REASON[seq.stop_reason])
               + _len_field(2, np.asarray(seq.tokens, dtype="<i4").tobytes())
               + _len_field(3, np.asarray(seq.logprobs, dtype="<f4").tobytes()))
        body += _len_field(1, msg)
    if prompt_logprobs is not None:
        body += _len_field(2, np.asarray(prompt_logprobs, dtype="<f4").tobytes())
    return body
