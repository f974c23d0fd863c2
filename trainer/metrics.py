"""Training telemetry: JSONL metrics and trajectories, TensorBoard scalars, a tqdm progress bar, a reward plot.

Only the main rank writes; other ranks get a logger whose methods do nothing, so a training loop can
call it unconditionally.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tqdm import tqdm

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

METRICS_FILE = "metrics.jsonl"
TRAJECTORIES_FILE = "trajectories.jsonl"


def _scalar(value: Any) -> float | None:
    """A float from a python number, one-element tensor or numpy scalar; None for anything else."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return float(item())
        except (ValueError, RuntimeError, TypeError):  # multi-element arrays, non-numeric items
            return None
    return None


class MetricsLogger:
    """Append-only metrics: ``log(step, {"train/reward_mean": 0.4})`` -> one JSON line in ``metrics.jsonl``.

    With ``tensorboard=True`` the same scalars go to TensorBoard event files in ``out_dir`` when
    ``torch.utils.tensorboard`` imports; otherwise JSONL alone is written.

    >>> logger = MetricsLogger("runs/demo")
    >>> logger.log(1, {"train/loss": 0.5}); logger.close()
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, tensorboard: bool = True, is_main: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.is_main = is_main
        self._metrics: TextIO | None = None
        self._trajectories: TextIO | None = None
        self._writer: SummaryWriter | None = None
        if not is_main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.out_dir / METRICS_FILE, "a", encoding="utf-8")
        if tensorboard:
            self._writer = _tensorboard_writer(self.out_dir)

    @property
    def tensorboard_enabled(self) -> bool:
        """True when scalars also go to TensorBoard."""
        return self._writer is not None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write the scalar entries of ``metrics`` (numbers, 0-d tensors); non-scalars are skipped."""
        if self._metrics is None:
            return
        scalars = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        record = {"step": int(step), "time": round(time.time(), 3), **scalars}
        self._metrics.write(json.dumps(record, allow_nan=True) + "\n")
        self._metrics.flush()
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, global_step=int(step))

    def log_trajectories(self, step: int, trajectories: Iterable[dict[str, Any]]) -> None:
        """Append trajectories (dicts: messages, rewards, stop reason...) to ``trajectories.jsonl``."""
        if not self.is_main:
            return
        if self._trajectories is None:
            self._trajectories = open(self.out_dir / TRAJECTORIES_FILE, "a", encoding="utf-8")
        for trajectory in trajectories:
            self._trajectories.write(json.dumps({"step": int(step), **trajectory}, default=str) + "\n")
        self._trajectories.flush()

    def close(self) -> None:
        """Flush and close every file; the logger ignores calls afterwards."""
        for handle in (self._metrics, self._trajectories):
            if handle is not None:
                handle.close()
        self._metrics = self._trajectories = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.is_main = False

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tensorboard_writer(out_dir: Path) -> SummaryWriter | None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: JSONL only
        return None
    return SummaryWriter(log_dir=str(out_dir))


def read_metrics(metrics_jsonl_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order."""
    with open(metrics_jsonl_path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_rewards(metrics_jsonl_path: str | os.PathLike[str], out_png: str | os.PathLike[str],
                 keys: list[str] | None = None, *, ylabel: str | None = None) -> Path:
    """Plot metric curves from ``metrics.jsonl`` to a PNG; by default every key containing "reward".

    The y axis names what is plotted: ``ylabel``, else :func:`axis_label` of the keys (``reward``
    only when every key is a reward). Raises ValueError when none of the keys occurs in the file.
    """
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on training machines
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_jsonl_path)
    if keys is None:
        keys = sorted({k for r in records for k in r if "reward" in k})
    series = {k: [(r["step"], r[k]) for r in records if k in r and not _is_nan(r[k])] for k in keys}
    series = {k: points for k, points in series.items() if points}
    if not series:
        raise ValueError(
            f"Expected reward metrics in {metrics_jsonl_path}, found none of {keys or 'keys containing reward'}; "
            "log e.g. {'train/reward_mean': ...} or pass keys=[...]."
        )
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, points in series.items():
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel or axis_label(list(series)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def axis_label(keys: list[str]) -> str:
    """The y-axis label for plotting ``keys``: ``reward`` when all are rewards, the key for one, else ``value``.

    >>> axis_label(["train/reward_mean", "eval/reward_mean"]), axis_label(["train/penalised_turn_frac"])
    ('reward', 'train/penalised_turn_frac')
    """
    if keys and all("reward" in k for k in keys):
        return "reward"
    return keys[0] if len(keys) == 1 else "value"


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


class Progress:
    """A tqdm progress bar that also suits logs: on a TTY it redraws in place (tqdm's bar); written to
    a file or pipe it prints tqdm's status line, one plain line every ``every_pct`` %, so a log has no
    carriage returns.

    A total of 0 (nothing left to do: ``run.steps=0``, or a resumed run already at its last step) is a
    finished bar that prints nothing.

    >>> import io
    >>> log = io.StringIO()
    >>> with Progress(4, desc="train", file=log, every_pct=50) as bar:
    ...     for _ in range(4):
    ...         bar.update(1, loss=0.5)
    >>> print(log.getvalue().splitlines()[-1])  # doctest: +ELLIPSIS
    train: 100%|██████████| 4/4 [00:00<00:00, ...it/s, loss=0.5]
    """

    def __init__(self, total: int, desc: str = "", *, file: TextIO | None = None, every_pct: float = 5.0) -> None:
        if total < 0:
            raise ValueError(f"Expected a total >= 0, got {total}.")
        self.total, self.desc, self.n = total, desc, 0
        self.file = file if file is not None else sys.stdout
        self.every_pct = every_pct
        self._postfix: dict[str, Any] = {}
        self._last_bucket = -1
        self._start = time.monotonic()
        is_tty = bool(getattr(self.file, "isatty", lambda: False)())
        self._bar = tqdm(total=total, desc=desc, file=self.file, dynamic_ncols=True) if is_tty and total else None

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advance by ``n`` and show ``postfix`` values (e.g. loss=0.3) next to the bar."""
        if self.total == 0:  # nothing to do, nothing to show
            return
        n = min(n, self.total - self.n)
        self.n += n
        self._postfix.update(postfix)
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix_text(), refresh=False)
            self._bar.update(n)
            return
        bucket = int(100 * self.n / self.total // self.every_pct)
        if bucket > self._last_bucket or self.n == self.total:
            self._last_bucket = bucket
            line = tqdm.format_meter(self.n, self.total, time.monotonic() - self._start,
                                     prefix=self.desc, postfix=self._postfix_text() or None)
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        """Finish the bar (on a TTY, tqdm leaves its last state on the line and moves on)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _postfix_text(self) -> str:
        return ", ".join(f"{k}={_fmt(v)}" for k, v in self._postfix.items())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fmt(value: Any) -> str:
    scalar = _scalar(value)
    if scalar is None:
        return str(value)
    return f"{scalar:.4g}"
