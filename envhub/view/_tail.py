"""Incremental reading of a JSONL file that may still be growing: complete new lines only, bad lines counted.

A writer appends whole lines, but a reader can see the last one half written: :class:`JsonlTail` never
parses a line without its newline, and picks it up on a later :meth:`JsonlTail.read_new` once complete.
A file that shrank or was replaced (another inode) is read again from the start.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

DEFAULT_MAX_LINE_BYTES = 256 * 1024 * 1024  # one episode with many inline images stays well under this
MAX_BAD_LINES_KEPT = 20  # examples kept for the report; the count goes on


@dataclass(frozen=True)
class Line:
    """One complete JSON object line: its 1-based number, byte offset and length, and the parsed object."""

    number: int
    offset: int
    length: int
    record: dict[str, Any]


@dataclass
class BadLines:
    """Lines that were not one JSON object: how many, and the first few as ``(line number, why)``."""

    count: int = 0
    examples: list[tuple[int, str]] = field(default_factory=list)

    def add(self, number: int, why: str) -> None:
        self.count += 1
        if len(self.examples) < MAX_BAD_LINES_KEPT:
            self.examples.append((number, why))


class JsonlTail:
    """Reads the complete lines appended to ``path`` since the last call.

    >>> tail = JsonlTail("runs/demo/trajectories.jsonl")   # doctest: +SKIP
    >>> [line.record["reward"] for line in tail.read_new()]  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        if max_line_bytes < 2:
            raise ValueError(f"Expected max_line_bytes >= 2, got {max_line_bytes}.")
        self.path = Path(path)
        self.max_line_bytes = max_line_bytes
        self.bad = BadLines()
        self.lines_read = 0  # complete lines consumed, blank and bad ones included
        self._pos = 0        # byte offset of the first line not consumed yet
        self._inode: int | None = None
        self.generation = 0  # bumped whenever the file is read again from the start

    def _check_identity(self) -> os.stat_result | None:
        """Stat the file; start over when it was replaced or truncated below what was read."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        if self._inode is not None and (st.st_ino != self._inode or st.st_size < self._pos):
            self._pos, self.lines_read, self.bad = 0, 0, BadLines()
            self.generation += 1
        self._inode = st.st_ino
        return st

    def read_new(self) -> Iterator[Line]:
        """Yield the JSON object lines completed since the last call; bad lines go to :attr:`bad`."""
        st = self._check_identity()
        if st is None or st.st_size == self._pos:
            return
        with open(self.path, "rb") as handle:
            handle.seek(self._pos)
            while True:
                start = handle.tell()
                raw = handle.readline(self.max_line_bytes + 1)
                if not raw.endswith(b"\n"):
                    if len(raw) <= self.max_line_bytes or not _skip_rest_of_line(handle):
                        return  # end of file, or a last line still being written: wait for its newline
                    self._consume(handle.tell())
                    self.bad.add(self.lines_read, f"longer than {self.max_line_bytes} bytes")
                    continue
                self._consume(handle.tell())
                line = self._parse(raw, start)
                if line is not None:
                    yield line

    def _consume(self, end: int) -> None:
        self._pos = end
        self.lines_read += 1

    def _parse(self, raw: bytes, offset: int) -> Line | None:
        if not raw.strip():
            return None
        try:
            record = _loads(raw)
        except ValueError as exc:
            self.bad.add(self.lines_read, f"not JSON: {exc}")
            return None
        except RecursionError:  # nested deeper than the stdlib parser goes (orjson refused it first)
            self.bad.add(self.lines_read, "not JSON: nested too deep")
            return None
        if not isinstance(record, dict):
            self.bad.add(self.lines_read, f"expected a JSON object, got {type(record).__name__}")
            return None
        return Line(self.lines_read, offset, len(raw), record)


def _loads(raw: bytes) -> Any:
    """orjson, with the stdlib as the fallback for the NaN and Infinity that Python's json writes (and for a
    lone surrogate escape such as ``"\\ud800"``, which becomes U+FFFD so that the record can be served)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _scrub(json.loads(raw))


def _scrub(value: Any) -> Any:
    """``value`` with every string's lone surrogates replaced (they cannot be encoded as UTF-8)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    return value


def _skip_rest_of_line(handle: Any, chunk_bytes: int = 1 << 20) -> bool:
    """Move past the next newline without holding the line; False (position unchanged) when none is written yet."""
    start = handle.tell()
    while chunk := handle.read(chunk_bytes):
        newline = chunk.find(b"\n")
        if newline >= 0:
            handle.seek(handle.tell() - len(chunk) + newline + 1)
            return True
    handle.seek(start)
    return False


def read_line_at(path: str | os.PathLike[str], offset: int, length: int) -> dict[str, Any]:
    """The JSON object stored at ``offset`` (``length`` bytes) of ``path``, as :class:`JsonlTail` indexed it."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        raw = handle.read(length)
    record = _loads(raw)
    if not isinstance(record, dict):
        raise ValueError(f"Expected a JSON object at byte {offset} of {path}; the file changed under the index.")
    return record
