"""Read geometry3k-format data from a local path (nothing is downloaded).

Two layouts are accepted:

* an exported table (``.jsonl``, ``.json`` or ``.parquet``) with ``problem`` (may contain an
  ``<image>`` tag), ``answer`` and ``images`` (a list of PNG bytes, base64 strings,
  ``{"bytes": ...}`` / ``{"path": ...}`` objects) or ``image`` (one of those);
* the original release: ``<root>/<split>/<id>/data.json`` (``problem_text``, ``choices``, and the
  ``answer`` letter) next to ``img_diagram.png``; the ground truth is the chosen choice's value.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from env_servers.datasets import read_records
from env_servers.geometry_env.problems import GeometryProblem

_SPLIT_DIRS = {"train": ("train",), "validation": ("val", "validation", "valid"), "test": ("test",)}


def _image_bytes(item: Any, base: Path) -> bytes | None:
    if item is None:
        return None
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, dict):
        return _image_bytes(item.get("bytes"), base) or _image_bytes(item.get("path"), base)
    if isinstance(item, str):
        candidate = base / item
        if len(item) < 1024 and candidate.is_file():
            return candidate.read_bytes()
        try:
            return base64.b64decode(item, validate=True)
        except ValueError:
            return None
    return None


def _images_of(record: dict[str, Any], base: Path) -> bytes | None:
    images = record.get("images")
    if images is None:
        return _image_bytes(record.get("image"), base)
    if hasattr(images, "tolist"):  # numpy arrays out of parquet
        images = images.tolist()
    if isinstance(images, (list, tuple)) and images:
        return _image_bytes(images[0], base)
    return None


def _problem(statement: str, answer: str, split: str, index: int, image: bytes | None) -> GeometryProblem:
    text = statement.replace("<image>", "").strip()
    pid = f"geometry3k-{split}-{index}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    return GeometryProblem(pid, text, answer, "geometry3k", None, split, None, image)


def load_table(path: str, split: str) -> tuple[GeometryProblem, ...]:
    """Problems of one exported file."""
    base = Path(path).parent
    problems = []
    for i, record in enumerate(read_records(path)):
        statement, answer = record.get("problem") or record.get("problem_text"), record.get("answer")
        if statement and answer not in (None, ""):
            problems.append(_problem(str(statement), str(answer), split, i, _images_of(record, base)))
    return tuple(problems)


def _choice_answer(data: dict[str, Any]) -> str | None:
    answer, choices = str(data.get("answer", "")).strip(), data.get("choices") or []
    if len(answer) == 1 and answer.isalpha() and ord(answer.upper()) - 65 < len(choices):
        return str(choices[ord(answer.upper()) - 65])
    return answer or None


def load_original(root: str, split: str) -> tuple[GeometryProblem, ...]:
    """Problems of the original directory layout for one split."""
    folder = next((Path(root) / name for name in _SPLIT_DIRS[split] if (Path(root) / name).is_dir()), None)
    if folder is None:
        raise FileNotFoundError(f"Expected a {'/'.join(_SPLIT_DIRS[split])} folder under {root!r} for split {split!r}.")
    problems = []
    for i, item in enumerate(sorted(folder.iterdir(), key=lambda p: (len(p.name), p.name))):
        meta = item / "data.json"
        if not meta.is_file():
            continue
        data = json.loads(meta.read_text(encoding="utf-8"))
        answer = _choice_answer(data)
        image = item / "img_diagram.png"
        if data.get("problem_text") and answer:
            problems.append(_problem(str(data["problem_text"]), answer, split, i,
                                     image.read_bytes() if image.is_file() else None))
    return tuple(problems)


@lru_cache(maxsize=16)
def load(path: str, split: str) -> tuple[GeometryProblem, ...]:
    """Problems of ``split`` from a file (exported table) or a directory (original layout); cached per process."""
    if split not in _SPLIT_DIRS:
        raise ValueError(f"Expected split to be one of {sorted(_SPLIT_DIRS)}, got {split!r}.")
    problems = load_original(path, split) if os.path.isdir(path) else load_table(path, split)
    if not problems:
        raise ValueError(f"No usable geometry3k records for split {split!r} in {path!r}.")
    return problems


__all__ = ["load", "load_table", "load_original"]
