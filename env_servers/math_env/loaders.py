r"""Read public math datasets from local files (or an existing ``datasets`` cache): nothing is downloaded.

Two record styles:

* MATH-style: ``{"problem", "solution"}`` where the answer is the last ``\boxed{}`` of the solution
  (an explicit ``"answer"`` field wins); ``"type"`` and ``"level"`` are kept as kind/difficulty.
* GSM8K-style: ``{"question", "answer"}`` where the answer text ends with ``#### 42``.

Files may be ``.jsonl``, ``.json`` (a list of records, or ``{"data": [...]}``) or ``.parquet``
(needs pandas).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from env_servers.datasets import read_records
from env_servers.math_env.tasks import MathTask
from envhub.parsers import extract_boxed

FORMATS = ("auto", "math", "gsm8k")


def gsm8k_answer(answer_text: str) -> str | None:
    """The final answer after ``####`` in a GSM8K answer field, with thousands separators removed."""
    m = re.search(r"####\s*(.+?)\s*$", str(answer_text))
    return m.group(1).replace(",", "").strip() if m else None


def _record_format(record: dict[str, Any]) -> str:
    if "problem" in record:
        return "math"
    if "question" in record:
        return "gsm8k"
    raise ValueError(f"Expected a MATH record ('problem', 'solution') or a GSM8K record ('question', 'answer'), "
                     f"got keys {sorted(record)}.")


def to_task(record: dict[str, Any], *, split: str, index: int, fmt: str = "auto") -> MathTask | None:
    """One record as a :class:`MathTask`; ``None`` when no answer can be found in it."""
    style = _record_format(record) if fmt == "auto" else fmt
    if style == "math":
        problem = str(record.get("problem", ""))
        answer = record.get("answer") or extract_boxed(str(record.get("solution", "")))
        kind = str(record.get("type") or "math")
        level = re.search(r"\d+", str(record.get("level", "")))
        difficulty = int(level.group()) if level else None
        solution = record.get("solution")
    else:
        problem = str(record.get("question", ""))
        answer = gsm8k_answer(record.get("answer", ""))
        kind, difficulty, solution = "gsm8k", None, record.get("answer")
    if not problem or not answer:
        return None
    digest = hashlib.sha256(problem.encode()).hexdigest()[:10]
    return MathTask(f"{style}-{split}-{index}-{digest}", problem, str(answer), kind, difficulty, split,
                    None if solution is None else str(solution))


def to_tasks(records: Iterable[dict[str, Any]], *, split: str, fmt: str = "auto") -> list[MathTask]:
    """Convert records, skipping those without an answer."""
    if fmt not in FORMATS:
        raise ValueError(f"Expected dataset format to be one of {FORMATS}, got {fmt!r}.")
    tasks = (to_task(r, split=split, index=i, fmt=fmt) for i, r in enumerate(records))
    return [t for t in tasks if t is not None]


@lru_cache(maxsize=16)
def load_file(path: str, split: str, fmt: str = "auto") -> tuple[MathTask, ...]:
    """Tasks of one local file, cached per process (every session of a server shares them)."""
    tasks = to_tasks(read_records(path), split=split, fmt=fmt)
    if not tasks:
        raise ValueError(f"No usable records in {path!r} (format {fmt!r}).")
    return tuple(tasks)


@lru_cache(maxsize=16)
def load_cached_dataset(name: str, split: str, config: str | None = None, fmt: str = "auto") -> tuple[MathTask, ...]:
    """Tasks from a ``datasets`` cache already on this machine (offline mode: never downloads)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ImportError(f"Loading {name!r} from the datasets cache needs the 'datasets' package; "
                          "or pass a local .jsonl/.json/.parquet file instead.") from None
    _force_offline(datasets)
    try:
        data = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        raise FileNotFoundError(f"{name!r} (split {split!r}) is not in the local datasets cache and nothing is "
                                f"downloaded at run time; export it to a local file. ({exc})") from exc
    return tuple(to_tasks(data, split=split, fmt=fmt))


def _force_offline(datasets: Any) -> None:
    """Offline even when ``datasets`` was imported before the variables were set (it reads them at import)."""
    for module in (getattr(datasets, "config", None), _hub_constants()):
        for flag in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            if module is not None and hasattr(module, flag):
                setattr(module, flag, True)


def _hub_constants() -> Any:
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return constants


__all__ = ["read_records", "gsm8k_answer", "to_task", "to_tasks", "load_file", "load_cached_dataset", "FORMATS"]
