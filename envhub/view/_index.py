"""Indexes over growing JSONL files: episodes (byte offsets + the fields filters need) and metric curves.

A run's ``trajectories.jsonl`` can be hundreds of MB: each line is parsed once, when it first appears,
and only its offset, length and :class:`~envhub.view._episodes.EpisodeSummary` stay in memory; an
episode's full record is read back from disk by offset when it is opened.
"""

from __future__ import annotations

import math
import os
import threading
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Any

from envhub.view._episodes import EpisodeSummary, summarize
from envhub.view._tail import DEFAULT_MAX_LINE_BYTES, JsonlTail, read_line_at

NO_FAILURE = "none"  # the failure filter's value for episodes that did not fail
NO_STOP_REASON = "none"  # ... and the stop-reason filter's for episodes without one


@dataclass(frozen=True)
class EpisodeFilter:
    """Which episodes to list; ``None`` fields do not filter. ``failures`` may hold :data:`NO_FAILURE`,
    ``stop_reasons`` :data:`NO_STOP_REASON`.

    A reward bound drops episodes without a reward (an eval's infrastructure failures).
    """

    step_min: int | None = None
    step_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    stop_reasons: frozenset[str] | None = None
    failures: frozenset[str] | None = None
    phase: str | None = None

    def accepts(self, s: EpisodeSummary) -> bool:
        """True when ``s`` passes every bound given."""
        if (self.step_min is not None or self.step_max is not None) and s.step is None:
            return False
        if s.step is not None and not _within(s.step, self.step_min, self.step_max):
            return False
        if (self.reward_min is not None or self.reward_max is not None) and s.reward is None:
            return False
        if s.reward is not None and not _within(s.reward, self.reward_min, self.reward_max):
            return False
        if self.stop_reasons is not None and (s.stop_reason or NO_STOP_REASON) not in self.stop_reasons:
            return False
        if self.failures is not None and (s.failure or NO_FAILURE) not in self.failures:
            return False
        return self.phase is None or s.phase == self.phase


def _within(value: float, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


class EpisodeIndex:
    """The episodes of one JSONL file, refreshed on every call so a live run's new lines show up.

    >>> index = EpisodeIndex("runs/demo/trajectories.jsonl", eval_results=False)  # doctest: +SKIP
    >>> total, rows = index.page(EpisodeFilter(reward_min=0.5), offset=0, limit=20)  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], *, eval_results: bool,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self.path = os.fspath(path)
        self.eval_results = eval_results
        self._tail = JsonlTail(path, max_line_bytes=max_line_bytes)
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._generation = self._tail.generation
        self._offsets = array("q")
        self._lengths = array("q")
        self._line_numbers = array("q")
        self._summaries: list[EpisodeSummary] = []
        self._facets: dict[str, Counter[str]] = {"stop_reason": Counter(), "failure": Counter(), "phase": Counter()}
        self._steps: tuple[int, int] | None = None

    def refresh(self) -> None:
        """Index the lines completed since the last refresh (all of them again if the file was replaced)."""
        with self._lock:
            for line in self._tail.read_new():
                if self._tail.generation != self._generation:
                    self._reset()
                try:
                    summary = summarize(line.record, eval_result=self.eval_results)
                except ValueError as exc:
                    self._tail.bad.add(line.number, str(exc))
                    continue
                self._add(line.offset, line.length, line.number, summary)
            if self._tail.generation != self._generation:  # replaced by an empty or partial file
                self._reset()

    def _add(self, offset: int, length: int, number: int, s: EpisodeSummary) -> None:
        self._offsets.append(offset)
        self._lengths.append(length)
        self._line_numbers.append(number)
        self._summaries.append(s)
        self._facets["stop_reason"][s.stop_reason or NO_STOP_REASON] += 1
        self._facets["failure"][s.failure or NO_FAILURE] += 1
        if s.phase is not None:
            self._facets["phase"][s.phase] += 1
        if s.step is not None:
            low, high = self._steps or (s.step, s.step)
            self._steps = (min(low, s.step), max(high, s.step))

    def __len__(self) -> int:
        return len(self._summaries)

    def page(self, flt: EpisodeFilter, *, offset: int, limit: int, newest_first: bool = False
             ) -> tuple[int, list[dict[str, Any]]]:
        """``(matching episodes, rows offset..offset+limit of them)``; each row is a summary with its ``index``."""
        self.refresh()
        with self._lock:
            order = range(len(self._summaries) - 1, -1, -1) if newest_first else range(len(self._summaries))
            matches = [i for i in order if flt.accepts(self._summaries[i])]
            rows = [self._row(i) for i in matches[offset:offset + limit]]
        return len(matches), rows

    def _row(self, i: int) -> dict[str, Any]:
        s = self._summaries[i]
        return {"index": i, "line": self._line_numbers[i], "step": s.step, "reward": s.reward,
                "stop_reason": s.stop_reason, "failure": s.failure, "phase": s.phase, "turns": s.turns,
                "title": s.title}

    def record(self, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(row, full record)`` of episode ``i``; IndexError when there is no such episode."""
        self.refresh()
        with self._lock:
            if not 0 <= i < len(self._summaries):
                raise IndexError(f"Expected an episode index in [0, {len(self._summaries)}), got {i}.")
            row, offset, length = self._row(i), self._offsets[i], self._lengths[i]
        return row, read_line_at(self.path, offset, length)

    def facets(self) -> dict[str, Any]:
        """Counts per stop reason, failure kind and phase, the step range, and the bad lines so far."""
        self.refresh()
        with self._lock:
            return {"episodes": len(self._summaries), "steps": list(self._steps) if self._steps else None,
                    **{name: dict(sorted(c.items())) for name, c in self._facets.items()},
                    "bad_lines": self._tail.bad.count,
                    "bad_examples": [{"line": n, "why": why} for n, why in self._tail.bad.examples]}


class MetricSeries:
    """The scalar curves of ``metrics.jsonl``: per key, the ``(step, value)`` points, read incrementally."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._tail = JsonlTail(path)
        self._lock = threading.Lock()
        self._generation = self._tail.generation
        self._series: dict[str, tuple[array[float], array[float]]] = {}

    def refresh(self) -> None:
        """Read the records appended since the last call (all again if the file was replaced)."""
        with self._lock:
            for line in self._tail.read_new():
                if self._tail.generation != self._generation:
                    self._generation, self._series = self._tail.generation, {}
                self._add(line.number, line.record)
            if self._tail.generation != self._generation:
                self._generation, self._series = self._tail.generation, {}

    def _add(self, number: int, record: dict[str, Any]) -> None:
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            self._tail.bad.add(number, f"expected a numeric 'step', got {step!r}")
            return
        for key, value in record.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                steps, values = self._series.setdefault(key, (array("d"), array("d")))
                steps.append(float(step))
                values.append(float(value))

    def keys(self) -> list[str]:
        """Every metric key seen, reward keys first."""
        self.refresh()
        with self._lock:
            return sorted(self._series, key=lambda k: ("reward" not in k, k))

    def bad_lines(self) -> int:
        """Lines of ``metrics.jsonl`` that were not metric records."""
        return self._tail.bad.count

    def points(self, key: str, max_points: int) -> list[list[float]]:
        """``[[step, value], ...]`` of ``key``, thinned to at most ``max_points`` by taking every n-th point
        (the last point always kept); empty for an unknown key."""
        self.refresh()
        with self._lock:
            steps, values = self._series.get(key, (array("d"), array("d")))
            n = len(steps)
            stride = max(1, math.ceil(n / max(max_points, 1)))
            picks = list(range(0, n, stride))
            if n and picks[-1] != n - 1:
                picks[-1] = n - 1
            return [[steps[i], values[i]] for i in picks]
