"""The protobuf messages of the Tinker wire, written and read by hand (no ``protobuf`` dependency).

SDK 0.38 sends ``forward_backward`` as a ``tinker_public.ForwardBackwardRequest`` and reads the
results of ``forward_backward`` and ``asample`` as ``ForwardBackwardOutput`` / ``SampleResponse``.
Only those three messages are needed, so this module speaks the protobuf wire format directly:
varints, 64-bit doubles and length-delimited fields. Field numbers follow the SDK's schema
(``docs/service.md`` lists them). Pure functions over bytes and numpy arrays; nothing here knows
about HTTP or torch.

Decoding is hostile-input safe: every field must have the wire type its schema gives, and the number
of fields, datums, token ids and tensor values is checked against :class:`Bounds` before anything that
size is allocated (a sparse tensor's declared shape, say); anything else is a :class:`ProtoDecodeError`,
a 400 for the client.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

from trainer.service._errors import UserError

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_NUMPY_OF_DTYPE: dict[int, type[np.generic]] = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
_DTYPE_OF_NAME = {"float32": DTYPE_FLOAT32, "int64": DTYPE_INT64, "int32": DTYPE_INT32}
STOP_REASON = {"stop": 0, "length": 1}


class ProtoDecodeError(UserError):
    """The body is not the protobuf message it claims to be, or holds more than the service's limits allow."""


@dataclass(frozen=True)
class Bounds:
    """What one decoded request may hold; checked while decoding, before anything that size is allocated."""

    max_datums: int = 1024
    max_values: int = 1 << 20  # token ids in the batch, and values in any one tensor
    max_inputs: int = 16  # loss_fn_inputs per datum (also: loss_fn_config entries)
    max_chunks: int = 4096  # model_input chunks per datum
    max_name_chars: int = 256  # model id, loss name, input and config names


# -- reading ---------------------------------------------------------------------------------------

def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtoDecodeError("Expected a protobuf message, got a truncated varint.")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtoDecodeError("Expected a protobuf message, got a varint longer than 10 bytes.")


def _fields(buf: bytes, most: int, what: str) -> list[tuple[int, int, int | bytes]]:
    """``(field_number, wire_type, value)`` of each field (LEN values as bytes, the rest as ints), at most ``most``.

    A list, not a generator, with one-byte keys, lengths and varints read inline: this runs for every
    field of every datum of a batch, on the critical path of each training step."""
    out: list[tuple[int, int, int | bytes]] = []
    pos, end, count = 0, len(buf), 0
    while pos < end:
        count += 1
        if count > most:
            raise ProtoDecodeError(f"Expected at most {most} fields in a {what}, got more.")
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire in (_LEN, _VARINT):
            n = buf[pos] if pos < end else 0x80
            if n < 0x80:
                pos += 1
            else:
                n, pos = _read_varint(buf, pos)
            if wire == _LEN:
                value, pos = buf[pos:pos + n], pos + n
            else:
                value = n
        elif wire in (_I64, _I32):
            width = 8 if wire == _I64 else 4
            value, pos = int.from_bytes(buf[pos:pos + width], "little"), pos + width
        else:
            raise ProtoDecodeError(f"Expected a protobuf message, got wire type {wire} in field {number} of a {what}.")
        if pos > end:
            raise ProtoDecodeError(f"Expected a complete {what}, got field {number} running past its end (truncated?).")
        out.append((number, wire, value))
    return out


def _expect(value: int | bytes, wire: int, expected: int, what: str) -> None:
    if wire != expected:
        raise _wrong_wire(what, expected, wire)


def _wrong_wire(what: str, expected: int, wire: int) -> ProtoDecodeError:
    return ProtoDecodeError(f"Expected {what} as protobuf wire type {expected}, got wire type {wire}.")


def _text(value: int | bytes, wire: int, what: str, most: int) -> str:
    _expect(value, wire, _LEN, what)
    assert isinstance(value, bytes)
    if len(value) > most * 4:
        raise ProtoDecodeError(f"Expected {what} of at most {most} characters, got {len(value)} bytes.")
    try:
        text = value.decode()
    except UnicodeDecodeError:
        raise ProtoDecodeError(f"Expected {what} in UTF-8, got undecodable bytes.") from None
    if len(text) > most:
        raise ProtoDecodeError(f"Expected {what} of at most {most} characters, got {len(text)}.")
    return text


def _double(value: int | bytes, wire: int, what: str) -> float:
    _expect(value, wire, _I64, what)
    assert isinstance(value, int)
    return float(struct.unpack("<d", value.to_bytes(8, "little"))[0])


def _array(data: bytes, dtype: type[np.generic] | str, what: str) -> np.ndarray:
    try:
        return np.frombuffer(data, dtype=dtype)
    except ValueError:  # not a whole number of values
        raise ProtoDecodeError(f"Expected {what} in whole {np.dtype(dtype).itemsize}-byte values, got "
                               f"{len(data)} bytes.") from None


def _packed_varints(value: int | bytes, wire: int, most: int, what: str) -> list[int]:
    if wire == _VARINT:  # an unpacked repeated element
        assert isinstance(value, int)
        return [value]
    _expect(value, wire, _LEN, what)
    assert isinstance(value, bytes)
    out, pos = [], 0
    while pos < len(value):
        item, pos = _read_varint(value, pos)
        out.append(item)
        if len(out) > most:
            raise ProtoDecodeError(f"Expected at most {most} {what}, got more.")
    return out


def _map_entry(buf: int | bytes, wire: int, bounds: Bounds, what: str) -> tuple[str, int, int | bytes | None]:
    """``(key, value wire type, value)`` of one map entry."""
    if wire != _LEN or not isinstance(buf, bytes):
        raise _wrong_wire(what, _LEN, wire)
    key, value_wire, value = "", _LEN, None
    for number, w, item in _fields(buf, 4, what):
        if number == 1:
            key = _text(item, w, "map key", bounds.max_name_chars)
        elif number == 2:
            value_wire, value = w, item
    return key, value_wire, value


def _tensor(buf: int | bytes, wire: int, bounds: Bounds, name: str) -> np.ndarray:
    """Input ``name``'s ``Tensor`` (dense or sparse CSR) as a dense numpy array of its declared shape."""
    what = f"loss_fn_inputs[{name!r}]"
    if wire != _LEN or not isinstance(buf, bytes):
        raise _wrong_wire(what, _LEN, wire)
    dense, csr, dtype, shape = b"", None, 0, []
    for number, w, value in _fields(buf, 16, "Tensor"):
        if number == 1:
            if w != _LEN or not isinstance(value, bytes):
                raise _wrong_wire(f"{what} values", _LEN, w)
            dense = value
        elif number == 2:
            if w != _LEN or not isinstance(value, bytes):
                raise _wrong_wire(f"{what} sparse values", _LEN, w)
            csr = {n: v for n, vw, v in _fields(value, 8, "SparseCsr") if isinstance(v, bytes)}
        elif number == 3:
            if w != _VARINT:
                raise _wrong_wire(f"{what} dtype", _VARINT, w)
            dtype = int(value)
        elif number == 4:
            shape += _packed_varints(value, w, 8, "shape dimensions")
    if dtype not in _NUMPY_OF_DTYPE:
        raise ProtoDecodeError(f"Expected {what} of dtype float32, int64 or int32, got dtype {dtype}.")
    size = math.prod(shape)  # Python ints: no overflow whatever the wire says
    if len(shape) > 8 or size > bounds.max_values:
        raise ProtoDecodeError(f"Expected {what} of at most {bounds.max_values} values, got shape {shape}.")
    np_dtype = _NUMPY_OF_DTYPE[dtype]
    if csr is None:
        flat = _array(dense, np_dtype, what)
        if shape and size != flat.size:
            raise ProtoDecodeError(f"Expected {what} of shape {shape} to carry {size} values, got {flat.size}.")
        return flat.reshape(shape) if shape else flat
    return _dense_from_csr(csr, shape, np_dtype, what)


def _dense_from_csr(csr: dict[int, bytes], shape: list[int], np_dtype: type[np.generic], what: str) -> np.ndarray:
    values = _array(bytes(csr.get(1, b"")), np_dtype, what)
    crow = _array(bytes(csr.get(2, b"")), np.int64, f"{what} row indices")
    col = _array(bytes(csr.get(3, b"")), np.int64, f"{what} column indices")
    if (len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or (len(crow) and crow[0] != 0)
            or (len(crow) and crow[-1] != len(values)) or (np.diff(crow) < 0).any()
            or (col.size and (col.min() < 0 or col.max() >= shape[1]))):
        raise ProtoDecodeError(f"Expected {what} as consistent sparse CSR indices for shape {shape}, got others.")
    out = np.zeros(shape, dtype=np_dtype)
    out[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
    return out


@dataclass
class WireDatum:
    """One ``Datum``: the model input's tokens (int32) and its named ``loss_fn_inputs`` arrays."""

    tokens: np.ndarray
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    data: list[WireDatum]
    loss_fn_config: dict[str, float | str]
    forward_only: bool


def _datum(buf: int | bytes, wire: int, bounds: Bounds, budget: list[int]) -> WireDatum:
    """One datum; ``budget`` holds the token ids the rest of the batch may still carry.

    (The checks are written inline, messages built only on failure: this runs for every datum.)"""
    if wire != _LEN or not isinstance(buf, bytes):
        raise _wrong_wire("a Datum", _LEN, wire)
    pieces: list[np.ndarray] = []
    inputs: dict[str, np.ndarray] = {}
    for number, w, value in _fields(buf, bounds.max_chunks + bounds.max_inputs + 8, "Datum"):
        if number == 1:
            if w != _LEN or not isinstance(value, bytes):
                raise _wrong_wire("a model_input chunk", _LEN, w)
            ids = _chunk_tokens(value)
            budget[0] -= sum(len(piece) for piece in ids)
            pieces += ids
            if budget[0] < 0:
                raise ProtoDecodeError(f"Expected at most {bounds.max_values} tokens in one forward_backward "
                                       "(--max-batch-tokens), got more.")
        elif number == 2:
            if len(inputs) >= bounds.max_inputs:
                raise ProtoDecodeError(f"Expected at most {bounds.max_inputs} loss_fn_inputs per datum, got more.")
            name, vw, tensor = _map_entry(value, w, bounds, "loss_fn_inputs entry")
            inputs[name] = _tensor(tensor if tensor is not None else b"", vw, bounds, name)
    tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    return WireDatum(tokens, inputs)


def _chunk_tokens(chunk: bytes) -> list[np.ndarray]:
    """The token ids of one ``Chunk`` (an ``encoded_text`` one: images and audio are refused)."""
    out = []
    for kind, kw, text in _fields(chunk, 4, "model_input chunk"):
        if kind != 1:
            raise ProtoDecodeError("Expected encoded_text model_input chunks (this service is text-only), got an "
                                   "image or audio chunk.")
        if kw != _LEN or not isinstance(text, bytes):
            raise _wrong_wire("an encoded_text chunk", _LEN, kw)
        for tnum, tw, ids in _fields(text, 4, "encoded_text chunk"):
            if tnum == 1:
                if tw != _LEN or not isinstance(ids, bytes):
                    raise _wrong_wire("encoded_text tokens", _LEN, tw)
                out.append(_array(ids, "<i4", "encoded_text tokens"))
    return out


def decode_forward_backward_request(body: bytes, bounds: Bounds | None = None) -> ForwardBackwardRequest:
    """A ``ForwardBackwardRequest``; anything malformed or past ``bounds`` raises :class:`ProtoDecodeError`."""
    bounds = bounds or Bounds()
    req = ForwardBackwardRequest("", 0, "", [], {}, False)
    config_v1: dict[str, float | str] = {}
    budget = [bounds.max_values]
    for number, w, value in _fields(body, bounds.max_datums + 2 * bounds.max_inputs + 16, "ForwardBackwardRequest"):
        if number == 1:
            req.model_id = _text(value, w, "model_id", bounds.max_name_chars)
        elif number == 2:
            _expect(value, w, _VARINT, "seq_id")
            assert isinstance(value, int)
            req.seq_id = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3:
            if len(req.data) >= bounds.max_datums:
                raise ProtoDecodeError(f"Expected at most {bounds.max_datums} datums per forward_backward, got more.")
            req.data.append(_datum(value, w, bounds, budget))
        elif number == 4:
            req.loss_fn = _text(value, w, "loss_fn", bounds.max_name_chars)
        elif number == 5:
            key, vw, bits = _map_entry(value, w, bounds, "loss_fn_config entry")
            config_v1[key] = 0.0 if bits is None else _double(bits, vw, f"loss_fn_config[{key!r}]")  # 0.0: omitted
        elif number == 6:
            _expect(value, w, _VARINT, "forward_only")
            req.forward_only = bool(value)
        elif number == 7:  # map<string, LossConfigValue{double number=1; string text=2}>
            key, vw, entry = _map_entry(value, w, bounds, "loss_fn_config_v2 entry")
            _expect(entry if entry is not None else b"", vw, _LEN, f"loss_fn_config_v2[{key!r}]")
            req.loss_fn_config[key] = 0.0  # a number 0.0 is written as an empty value
            for vnum, iw, item in _fields(bytes(entry or b""), 4, "LossConfigValue"):
                req.loss_fn_config[key] = (_double(item, iw, f"loss_fn_config[{key!r}]") if vnum == 1
                                           else _text(item, iw, f"loss_fn_config[{key!r}]", bounds.max_name_chars))
        if len(config_v1) > bounds.max_inputs or len(req.loss_fn_config) > bounds.max_inputs:
            raise ProtoDecodeError(f"Expected at most {bounds.max_inputs} loss_fn_config entries, got more.")
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
