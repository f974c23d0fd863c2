"""Weights on the wire: a streamed safetensors body, written from live tensors and read into planned ones.

The body of a weight push is a valid ``.safetensors`` file (8-byte little-endian header length, a JSON
header naming each tensor's dtype, shape and byte range, then the raw bytes), so any safetensors
reader can open a captured one. Neither side builds it in memory: :func:`encode` yields the header and
then views of each tensor's own memory, and :class:`TensorStreamReader` checks the header against
what the receiver expects (names, shapes, dtypes, offsets: every size is known before anything is
allocated), then copies the incoming chunks straight into the tensors it planned.

``__metadata__`` carries the push's ``version`` and its ``kind`` (``full`` or ``lora``, with the
adapter's ``lora_config`` as JSON).

>>> import torch
>>> body = b"".join(encode({"w": torch.ones(2)}, {"version": "3"}))
>>> reader = TensorStreamReader(max_header_bytes=1 << 16)
>>> reader.feed(body); header = reader.header
>>> header.metadata["version"], header.specs["w"].shape
('3', (2,))
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

#: safetensors dtype names <-> torch dtypes (the ones a policy's weights use)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
CHUNK_BYTES = 4 << 20  # one write of a large tensor: big enough for loopback speed, small enough to stream
#: the HTTP header of a push whose body comes through the server's weight channel (a plain TCP port)
TICKET_HEADER = "X-Envhub-Weight-Ticket"


class WeightFormatError(ValueError):
    """A weight body that is not the safetensors stream the receiver expects (a 400, with the reason)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a header: its dtype, shape and byte range in the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class StreamHeader:
    """A parsed header: tensor specs in data order and the string metadata."""

    specs: dict[str, TensorSpec]
    metadata: dict[str, str]

    @property
    def data_bytes(self) -> int:
        return max((s.end for s in self.specs.values()), default=0)


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Iterator[bytes | memoryview]:
    """The safetensors body of ``tensors`` (CPU copies made one tensor at a time), chunk by chunk."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    yield struct.pack("<Q", len(raw)) + raw
    for tensor in tensors.values():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel() == 0:
            continue
        view = flat.view(torch.uint8).numpy().data
        for start in range(0, len(view), CHUNK_BYTES):
            yield view[start:start + CHUNK_BYTES]


def parse_header(raw: bytes) -> StreamHeader:
    """The header's specs, in data order, checked: known dtypes, sizes that match the shapes, no gaps."""
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightFormatError(f"Expected a JSON safetensors header, got undecodable bytes ({exc}).") from exc
    if not isinstance(parsed, dict):
        raise WeightFormatError(f"Expected a JSON object as the safetensors header, got {type(parsed).__name__}.")
    metadata = parsed.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WeightFormatError("Expected __metadata__ to map strings to strings.")
    specs = sorted((_spec(name, entry) for name, entry in parsed.items()), key=lambda item: item[1].begin)
    offset = 0
    for name, spec in specs:
        if spec.begin != offset:
            raise WeightFormatError(f"Expected tensor {name!r} to start at byte {offset} (no gaps or overlaps), "
                                    f"got {spec.begin}.")
        offset = spec.end
    return StreamHeader(dict(specs), metadata)


def _spec(name: str, entry: object) -> tuple[str, TensorSpec]:
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise WeightFormatError(f"Expected tensor {name!r} to have a dtype in {sorted(DTYPES)}, got {entry!r:.200}.")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and o >= 0 for o in offsets)):
        raise WeightFormatError(f"Expected tensor {name!r} to have a shape of ints >= 0 and two data_offsets.")
    dtype = DTYPES[entry["dtype"]]
    numel = 1
    for d in shape:
        numel *= d
    if offsets[1] - offsets[0] != numel * dtype.itemsize:
        raise WeightFormatError(f"Expected tensor {name!r} of shape {shape} to span {numel * dtype.itemsize} "
                                f"bytes, got offsets {offsets}.")
    return name, TensorSpec(dtype, tuple(shape), offsets[0], offsets[1])


#: given the checked header, allocate the destination tensors (raising WeightFormatError to refuse it)
Planner = Callable[[StreamHeader], dict[str, torch.Tensor]]


class TensorStreamReader:
    """Reads a streamed safetensors body chunk by chunk into tensors that ``plan`` allocates.

    ``feed(chunk)`` as bytes arrive; ``finish()`` once the body ended returns the filled tensors.
    The header is capped at ``max_header_bytes`` before it is read; ``plan`` sees the checked header
    and returns one destination tensor per name (same shape and dtype), so the receiver decides
    what may be allocated. Without ``plan`` (tests, tools), tensors are allocated as the header says.
    """

    def __init__(self, *, max_header_bytes: int, plan: Planner | None = None):
        self.max_header_bytes = max_header_bytes
        self.plan = plan or _allocate
        self.header: StreamHeader | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self._pending = bytearray()  # bytes before the data section
        self._targets: list[tuple[memoryview, int]] = []  # (destination bytes, data-section end offset)
        self._filled = 0

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes of the body."""
        view = memoryview(chunk)
        if self.header is None:
            view = self._read_header(view)
        while len(view):
            if not self._targets:
                raise WeightFormatError(f"Expected {self._filled} bytes of tensor data, got more.")
            dest, end = self._targets[0]
            start = end - len(dest)
            take = min(len(view), end - self._filled)
            at = self._filled - start
            dest[at:at + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == end:
                self._targets.pop(0)

    def fill(self, recv_into: Callable[[memoryview], int]) -> None:
        """Read the whole body with ``recv_into(buffer) -> bytes read`` (a socket's): the header first, then the
        data straight into the planned tensors, no copy on the way; ``finish()`` then returns them."""
        head = _read_exact(recv_into, 8)
        (size,) = struct.unpack("<Q", head)
        if size > self.max_header_bytes:
            raise WeightFormatError(f"Expected a safetensors header of at most {self.max_header_bytes} bytes, "
                                    f"got {size}.")
        self.feed(head + _read_exact(recv_into, size))
        for dest, end in self._targets:
            at = 0
            while at < len(dest):
                got = recv_into(dest[at:])
                if got == 0:
                    raise WeightFormatError(f"Expected a complete safetensors body, got it cut off after "
                                            f"{end - len(dest) + at} bytes of tensor data.")
                at += got
            self._filled = end
        self._targets = []

    def fill_each(self, recv: Callable[[torch.Tensor], None]) -> None:
        """Once the header alone was fed: fill each planned tensor, in data order, with ``recv(its bytes as a flat
        uint8 tensor)`` (a process group's receive, say); ``finish()`` then returns them."""
        if self.header is None or self._filled:
            raise WeightFormatError("Expected the safetensors header alone before the tensors' bytes.")
        for name, spec in self.header.specs.items():
            if spec.end > spec.begin:
                recv(self.tensors[name].reshape(-1).view(torch.uint8))
                self._filled = spec.end
        self._targets = []

    def finish(self) -> dict[str, torch.Tensor]:
        """The filled tensors; the body must have been complete."""
        if self.header is None or self._targets:
            raise WeightFormatError(f"Expected a complete safetensors body, got it cut off after "
                                    f"{self._filled} bytes of tensor data.")
        return self.tensors

    def _read_header(self, view: memoryview) -> memoryview:
        self._pending += view
        if len(self._pending) < 8:
            return memoryview(b"")
        (size,) = struct.unpack("<Q", self._pending[:8])
        if size > self.max_header_bytes:
            raise WeightFormatError(f"Expected a safetensors header of at most {self.max_header_bytes} bytes, "
                                    f"got {size}.")
        if len(self._pending) < 8 + size:
            return memoryview(b"")
        self.header = parse_header(bytes(self._pending[8:8 + size]))
        rest = memoryview(bytes(self._pending[8 + size:]))
        self._pending = bytearray()
        self.tensors = self.plan(self.header)
        for name, spec in self.header.specs.items():
            dest = self.tensors[name]
            if dest.dtype != spec.dtype or tuple(dest.shape) != spec.shape or not dest.is_contiguous():
                raise WeightFormatError(f"Planned tensor {name!r} does not match its header entry.")
            if spec.end > spec.begin:
                self._targets.append((dest.reshape(-1).view(torch.uint8).numpy().data, spec.end))
        return rest


def _read_exact(recv_into: Callable[[memoryview], int], size: int) -> bytes:
    buf = bytearray(size)
    view, at = memoryview(buf), 0
    while at < size:
        got = recv_into(view[at:])
        if got == 0:
            raise WeightFormatError(f"Expected a safetensors header, got the stream cut off after {at} of {size} bytes.")
        at += got
    return bytes(buf)


def _allocate(header: StreamHeader) -> dict[str, torch.Tensor]:
    return {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in header.specs.items()}


__all__ = ["TICKET_HEADER", "encode", "parse_header", "TensorStreamReader", "StreamHeader", "TensorSpec", "WeightFormatError",
           "DTYPES", "DTYPE_NAMES"]
