"""Local dataset files and stable train/validation/test splits, shared by the env servers (pure, no envhub).

Nothing is downloaded: records come from ``.jsonl``, ``.json`` or ``.parquet`` files on disk,
and a problem's split is a stable hash of its statement, so every server (and every run)
puts the same problem in the same split::

    >>> split_of("What is 2 + 2?") in SPLITS
    True
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

SPLITS = ("train", "validation", "test")
_SPLIT_BUCKETS = {"train": range(80), "validation": range(80, 90), "test": range(90, 100)}


def split_of(problem: str) -> str:
    """The split a statement belongs to, from a stable hash of its text."""
    bucket = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "big") % 100
    return next(name for name, r in _SPLIT_BUCKETS.items() if bucket in r)


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a local ``.jsonl``, ``.json`` or ``.parquet`` file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Expected a dataset file at {str(p)!r}; it does not exist.")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        with p.open(encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    if suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        data = data.get("data", data) if isinstance(data, dict) else data
        if not isinstance(data, list):
            raise ValueError(f"Expected {p} to hold a JSON list of records (or {{'data': [...]}}).")
        return data
    if suffix == ".parquet":
        try:
            import pandas
        except ImportError:
            raise ImportError(f"Reading {p} needs pandas: pip install pandas pyarrow (or convert it to .jsonl).") from None
        records: list[dict[str, Any]] = pandas.read_parquet(p).to_dict(orient="records")
        return records
    raise ValueError(f"Expected a .jsonl, .json or .parquet file, got {p.name!r}.")


__all__ = ["SPLITS", "split_of", "read_records"]
