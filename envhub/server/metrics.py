"""Server counters rendered as Prometheus text at ``GET /metrics``.

Counting costs a few attribute updates per request: no locks (one event loop owns them) and
no client library.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

# Step latency buckets in seconds: sub-millisecond echo steps up to minute-long sandbox runs.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Sessions, requests, errors by code and a step latency histogram for one server process."""

    def __init__(self) -> None:
        self.sessions_active = 0
        self.sessions_total = 0
        self.steps_total = 0
        self.resets_total = 0
        self.resumes_total = 0
        self.errors: Counter[str] = Counter()
        self._bucket_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._latency_sum_s = 0.0

    def session_opened(self) -> None:
        self.sessions_active += 1
        self.sessions_total += 1

    def session_closed(self) -> None:
        self.sessions_active -= 1

    def observe(self, op: str, seconds: float) -> None:
        """Record one finished ``reset``/``step`` (other ops are not counted)."""
        if op == "step":
            self.steps_total += 1
            self._bucket_counts[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            self._latency_sum_s += seconds
        elif op == "reset":
            self.resets_total += 1

    def error(self, code: str) -> None:
        self.errors[code] += 1

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        lines = [
            "# HELP envhub_sessions_active Sessions currently holding an env instance.",
            "# TYPE envhub_sessions_active gauge",
            f"envhub_sessions_active {self.sessions_active}",
            "# HELP envhub_sessions_total Sessions opened since start.",
            "# TYPE envhub_sessions_total counter",
            f"envhub_sessions_total {self.sessions_total}",
            "# HELP envhub_resets_total Episodes started.",
            "# TYPE envhub_resets_total counter",
            f"envhub_resets_total {self.resets_total}",
            "# HELP envhub_steps_total Steps completed.",
            "# TYPE envhub_steps_total counter",
            f"envhub_steps_total {self.steps_total}",
            "# HELP envhub_resumes_total Sessions resumed after a dropped connection.",
            "# TYPE envhub_resumes_total counter",
            f"envhub_resumes_total {self.resumes_total}",
            "# HELP envhub_errors_total Error replies and error closes, by wire code.",
            "# TYPE envhub_errors_total counter",
        ]
        lines += [f'envhub_errors_total{{code="{code}"}} {n}' for code, n in sorted(self.errors.items())]
        lines += ["# HELP envhub_step_latency_seconds Server-side step latency.",
                  "# TYPE envhub_step_latency_seconds histogram"]
        cumulative = 0
        for bound, count in zip(LATENCY_BUCKETS_S, self._bucket_counts):
            cumulative += count
            lines.append(f'envhub_step_latency_seconds_bucket{{le="{bound:g}"}} {cumulative}')
        lines.append(f'envhub_step_latency_seconds_bucket{{le="+Inf"}} {self.steps_total}')
        lines.append(f"envhub_step_latency_seconds_sum {self._latency_sum_s:.6f}")
        lines.append(f"envhub_step_latency_seconds_count {self.steps_total}")
        return "\n".join(lines) + "\n"
