"""The ``envhub view`` web app: one HTML page and a small JSON API over a run or eval directory.

Routes (every query parameter bounded; no route takes a path, so nothing outside DIR is ever read)::

    GET /                          the page (envhub/view/page.html)
    GET /api/info                  directory kind, summary.json, facets for the filters, bad-line counts
    GET /api/episodes              filtered, paged episode rows (step, reward, stop reason, failure...)
    GET /api/episodes/{i}          one episode as a conversation, with its reward components
    GET /api/episodes/{i}/tokens   the episode's token runs, trained (mask 1) or not (mask 0)
    GET /api/metrics?key=K         the curve of one metric of metrics.jsonl (repeat key for several)
    GET /api/failures              the last records of failures.jsonl
    GET /health                    200 once the server answers (for scripts and process supervisors)
"""

from __future__ import annotations

import json
import threading
from collections import deque
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import Response

from envhub.view._episodes import conversation, reward_components, token_view
from envhub.view._index import EpisodeFilter, EpisodeIndex, MetricSeries
from envhub.view._tail import JsonlTail

RESULTS_FILE = "results.jsonl"           # written by `envhub eval`
TRAJECTORIES_FILE = "trajectories.jsonl"  # written by the trainer
METRICS_FILE = "metrics.jsonl"
FAILURES_FILE = "failures.jsonl"
SUMMARY_FILE = "summary.json"
KNOWN_FILES = (RESULTS_FILE, TRAJECTORIES_FILE, METRICS_FILE, FAILURES_FILE, SUMMARY_FILE, "config.json")
MAX_SUMMARY_BYTES = 1 << 20
MAX_PAGE = 200
MAX_FAILURES = 200
MAX_DETAIL_CHARS = 4000
MAX_CHOICES = 32
MAX_CHOICE_CHARS = 64
_BIG_FIELDS = {"messages", "tokens", "mask", "logprobs", "text", "completion", "segments"}
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class ViewDir:
    """The files of one directory, each indexed on first use and refreshed on every request."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"Expected a run or eval directory, got {root!r}, which is not a directory.")
        if not any((self.root / name).exists() for name in KNOWN_FILES):
            try:  # a directory of runs (one per seed, say): name them
                inside = sorted(d.name for d in self.root.iterdir()
                                if d.is_dir() and any((d / name).exists() for name in KNOWN_FILES))
            except OSError:
                inside = []
            hint = f" Its subdirectories {', '.join(inside[:8])}{' ...' if len(inside) > 8 else ''} hold runs: " \
                   f"envhub view {Path(root) / inside[0]}" if inside else ""
            raise ValueError(f"Expected a training run directory ({TRAJECTORIES_FILE}, {METRICS_FILE}) or an eval "
                             f"directory ({RESULTS_FILE}) in {self.root}, found none of {', '.join(KNOWN_FILES)}."
                             + hint)
        self._lock = threading.Lock()
        self._episodes: EpisodeIndex | None = None
        self.metrics = MetricSeries(self.root / METRICS_FILE)
        self._failures_tail = JsonlTail(self.root / FAILURES_FILE)
        self._failures: deque[dict[str, Any]] = deque(maxlen=MAX_FAILURES)

    @property
    def kind(self) -> str:
        """``eval`` when results.jsonl exists, else ``run`` (trajectories.jsonl, metrics.jsonl)."""
        if (self.root / RESULTS_FILE).exists():
            return "eval"
        return "run"

    def episodes(self) -> EpisodeIndex:
        """The episode index: results.jsonl for an eval, trajectories.jsonl for a run (chosen once it exists)."""
        with self._lock:
            if self._episodes is None or (self._episodes.eval_results is False and self.kind == "eval"):
                is_eval = self.kind == "eval"
                self._episodes = EpisodeIndex(self.root / (RESULTS_FILE if is_eval else TRAJECTORIES_FILE),
                                              eval_results=is_eval)
            return self._episodes

    def failures(self, limit: int) -> dict[str, Any]:
        """The last ``limit`` records of failures.jsonl and its bad-line count."""
        with self._lock:
            generation = self._failures_tail.generation
            for line in self._failures_tail.read_new():
                if self._failures_tail.generation != generation:
                    self._failures.clear()
                    generation = self._failures_tail.generation
                self._failures.append(line.record)
            records = list(self._failures)[-limit:]
        return {"records": records, "bad_lines": self._failures_tail.bad.count}

    def summary(self) -> dict[str, Any] | None:
        """summary.json, or ``{"error": ...}`` when it is unreadable; None when there is none yet."""
        path = self.root / SUMMARY_FILE
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        if size > MAX_SUMMARY_BYTES:
            return {"error": f"{SUMMARY_FILE} is {size} bytes, over the {MAX_SUMMARY_BYTES} shown"}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:  # a summary being rewritten right now reads as broken JSON
            return {"error": f"{SUMMARY_FILE} is not readable JSON: {exc}"}
        return data if isinstance(data, dict) else {"value": data}


def _choices(values: list[str] | None, name: str, max_chars: int = MAX_CHOICE_CHARS) -> frozenset[str] | None:
    if not values:
        return None
    if len(values) > MAX_CHOICES or any(len(v) > max_chars for v in values):
        raise HTTPException(422, f"Expected at most {MAX_CHOICES} values of {name}, each at most "
                                 f"{max_chars} characters.")
    return frozenset(values)


def _details(record: dict[str, Any]) -> dict[str, Any]:
    """The record's small fields, each cut to MAX_DETAIL_CHARS of JSON, for the episode's detail table."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key in _BIG_FIELDS and not (key == "tokens" and isinstance(value, dict)):  # an eval's token counts stay
            continue
        text = json.dumps(value, default=str)
        out[key] = value if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "…"
    return out


Bound = Query(ge=-1e12, le=1e12)


def create_view_app(root: str | Path, *, allowed_hosts: list[str] | None = None) -> FastAPI:
    """The viewer app over ``root`` (a training run or eval directory). ValueError when ``root`` is neither.

    ``allowed_hosts``: the Host headers answered (others get 400), so that a web page elsewhere cannot
    reach a loopback viewer through a DNS name it controls; None answers any.
    """
    view = ViewDir(root)
    app = FastAPI(title="envhub view", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.view = view
    if allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)

    @app.middleware("http")
    async def security_headers(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        response.headers["Content-Security-Policy"] = _CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-store"  # a live run changes under the page
        return response

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return resources.files("envhub.view").joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        episodes = view.episodes()
        return {"dir": str(view.root), "kind": view.kind, "episodes_file": Path(episodes.path).name,
                "summary": view.summary(), "facets": episodes.facets(), "metric_keys": view.metrics.keys(),
                "metrics_bad_lines": view.metrics.bad_lines()}

    @app.get("/api/episodes")
    def episodes(offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
                 limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
                 step_min: Annotated[int | None, Bound] = None, step_max: Annotated[int | None, Bound] = None,
                 reward_min: Annotated[float | None, Bound] = None, reward_max: Annotated[float | None, Bound] = None,
                 stop_reason: Annotated[list[str] | None, Query()] = None,
                 failure: Annotated[list[str] | None, Query()] = None,
                 phase: Annotated[str | None, Query(max_length=MAX_CHOICE_CHARS)] = None,
                 newest_first: bool = False) -> dict[str, Any]:
        flt = EpisodeFilter(step_min, step_max, reward_min, reward_max, _choices(stop_reason, "stop_reason"),
                            _choices(failure, "failure"), phase or None)
        total, rows = view.episodes().page(flt, offset=offset, limit=limit, newest_first=newest_first)
        return {"total": total, "offset": offset, "rows": rows}

    def _record(index: int) -> tuple[dict[str, Any], dict[str, Any]]:
        try:
            return view.episodes().record(index)
        except IndexError as exc:
            raise HTTPException(404, str(exc)) from exc

    @app.get("/api/episodes/{index}")
    def episode(index: Annotated[int, PathParam(ge=0, le=10**9)]) -> dict[str, Any]:
        row, record = _record(index)
        return {"row": row, "rewards": reward_components(record), "messages": conversation(record),
                "details": _details(record), "has_tokens": isinstance(record.get("tokens"), list)}

    @app.get("/api/episodes/{index}/tokens")
    def tokens(index: Annotated[int, PathParam(ge=0, le=10**9)]) -> dict[str, Any]:
        return token_view(_record(index)[1])

    @app.get("/api/metrics")
    def metrics(key: Annotated[list[str] | None, Query()] = None,
                max_points: Annotated[int, Query(ge=2, le=5000)] = 1000) -> dict[str, Any]:
        keys = sorted(_choices(key, "key", max_chars=256) or ())
        return {"series": {k: view.metrics.points(k, max_points) for k in keys}}

    @app.get("/api/failures")
    def failures(limit: Annotated[int, Query(ge=1, le=MAX_FAILURES)] = 50) -> dict[str, Any]:
        return view.failures(limit)

    @app.exception_handler(ValueError)
    async def bad_file(request: Request, exc: ValueError) -> JSONResponse:
        # read_line_at: the file was rewritten between indexing and reading
        return JSONResponse({"detail": str(exc)}, status_code=409)

    return app
