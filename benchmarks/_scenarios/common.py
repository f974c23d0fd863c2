"""What every scenario runner returns, and how its validation curve is read back from a run's metrics."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"


@dataclass
class RunResult:
    """One seed of one scenario: the validation curve (``(step, value)``) and the run's wall time."""

    curve: list[tuple[int, float]]
    seconds: float
    extra: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # curves plotted beside it
    overrides: list[str] = field(default_factory=list)  # the ``--set`` config overrides it ran under

    @property
    def before(self) -> float:
        return self.curve[0][1]

    @property
    def after(self) -> float:
        return self.curve[-1][1]


def fresh_run(out: Path, seed: int, *, smoke: bool, smoke_overrides: list[str], sets: Sequence[str] = ()) -> list[str]:
    """Start one seed's single-policy run in ``out``: torch seeded, ``out`` made, an earlier run's
    ``metrics.jsonl`` there removed; returns the config overrides every scenario passes (the run's seed, the
    model's initialisation seed, the output dir), with ``smoke_overrides`` added under ``--smoke`` and the
    user's ``sets`` (``--set key=value``) last, so that they win."""
    import torch

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    overrides = [f"run.seed={seed}", f"model.init_seed={seed}", f"run.output_dir='{out}'"]
    return [*overrides, *(smoke_overrides if smoke else ()), *sets]


def metric_curve(metrics_path: Path, key: str, *, absent: float | None = None) -> list[tuple[int, float]]:
    """``(step, value)`` for every record of ``metrics.jsonl`` holding ``key``, one value per step (the last).

    ``absent``: the value of a validation record (one holding ``eval/episodes``) without ``key``. The
    trainer logs a game's win/loss/draw rates only when some episode reported an outcome, so a validation
    whose games all ran out of turns holds no ``eval/win_rate``: no game was won, ``absent=0.0``.
    """
    by_step: dict[int, float] = {}
    with open(metrics_path) as fh:
        for line in fh:
            record = json.loads(line)
            if key in record:
                by_step[int(record["step"])] = float(record[key])
            elif absent is not None and "eval/episodes" in record:
                by_step[int(record["step"])] = absent
    if not by_step:
        raise ValueError(f"{metrics_path} holds no {key!r}: did the run evaluate?")
    return sorted(by_step.items())
