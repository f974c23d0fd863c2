"""Every training scenario learns: held-out validation before and over training, one panel each, on CPU.

``python -m benchmarks.scenarios [--out DIR] [--only NAME,...] [--seeds N] [--smoke]`` trains each
scenario from its config under ``examples/configs/`` and writes ``DIR/scenarios.png`` (one panel per
scenario: validation over training steps, the before-training level dashed, the band over seeds) and
``DIR/summary.json`` (one entry per scenario: ``name``, ``metric``, ``before``, ``after``, ``rise``,
``target``, ``seeds_met``, ``steps``, ``seconds``). It compares each scenario's validation after training
with its own level before, against the rise the scenario must reach. ``--smoke`` trains one step per
scenario (seconds; the targets are not checked).

Each run leaves ``DIR/<name>/seed<k>/result.json`` (its curves and seconds); ``--keep-done`` reads a seed back
from there instead of training it again (``--seeds 3 --keep-done`` after a one-seed run trains seeds 1 and 2);
``--replot`` trains nothing and builds the figure and the summary again from those files, so scenarios run at
different times (``--only``) into one ``DIR`` end up in one figure.

``--set key=value`` (repeatable) overrides the configs as ``envhub-train``'s ``key=value`` arguments do, after
the harness's own (seed, output dir, ``--smoke``), so that a variant of a scenario runs the way the figure
did: ``--only gomoku-two-agent --set match.past_groups=2 --out runs/variant``. Each ``result.json`` and the
summary entry record them; ``--keep-done`` refuses a kept seed that ran under other ones, and the summary a
scenario whose seeds did.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (`python benchmarks/scenarios.py`) from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks._scenarios.common import RunResult  # noqa: E402
from benchmarks._scenarios.geometry import run_geometry_tools, run_geometry_vision  # noqa: E402
from benchmarks._scenarios.gomoku import run_gomoku  # noqa: E402
from benchmarks._scenarios.math import run_math  # noqa: E402
from benchmarks._scenarios.two_agent import HEAD_TO_HEAD, run_two_agent, two_agent_facts  # noqa: E402

SMOOTH_STEPS = 5  # the per-seed panels' running mean


class Runner(Protocol):
    """Trains one seed of a scenario from its config into ``out``; ``sets``: config overrides after the harness's own."""

    def __call__(self, config: str, seed: int, out: Path, *, smoke: bool = False,
                 sets: Sequence[str] = ()) -> RunResult: ...


@dataclass(frozen=True)
class Scenario:
    """A named training run from ``config``, its validation ``metric`` and the ``target`` rise it must reach.

    ``command``: the ``envhub-train`` command that runs the config alone (``rl`` or ``two-agent``);
    ``policies``: how many policies one run trains (two agents, or a policy and the twin plotted beside it);
    ``own_panel``: the curves of ``RunResult.extra`` whose name holds it get a panel of their own, one line per
    seed (not a mean over seeds: the two-agent head-to-head, whose winner differs from seed to seed);
    ``facts``: what the summary reports per seed beside the rise (the two-agent scenario's rise at first and
    zero-sum check), read from a run's curves so that ``--replot`` computes them for runs kept earlier.
    """

    name: str
    config: str
    metric: str
    target: float
    run: Runner
    command: str = "rl"
    policies: int = 1
    own_panel: str | None = None
    facts: Callable[[RunResult], dict[str, float]] | None = None


SCENARIOS = [
    Scenario("math", "scenario_math.toml", "validation accuracy (greedy, held-out sums)", 0.3, run_math),
    Scenario("math-lora", "scenario_math_lora.toml", "validation accuracy (greedy, held-out sums)", 0.3, run_math),
    Scenario("geometry-vision", "scenario_geometry_vision.toml",
             "accuracy (greedy, held-out diagrams: which figure)", 0.3, run_geometry_vision, policies=2),
    Scenario("geometry-tools", "scenario_geometry_tools.toml",
             "accuracy (greedy, held-out triangles, ruler tool)", 0.2, run_geometry_tools),
    Scenario("gomoku", "scenario_gomoku.toml", "win rate vs the random opponent (greedy, held-out games)", 0.2, run_gomoku),
    Scenario("gomoku-two-agent", "scenario_gomoku_two_agent.toml",
             "weaker agent's win rate vs a random player (greedy, held-out games)", 0.2,
             run_two_agent, command="two-agent",
             policies=2, own_panel=HEAD_TO_HEAD, facts=two_agent_facts),
]


def pick(only: str | None) -> list[Scenario]:
    """The scenarios named in ``only`` (comma-separated), or all; an unknown name is an error naming the known ones."""
    if not only:
        return SCENARIOS
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {s.name: s for s in SCENARIOS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"Unknown scenario(s) {unknown}; expected some of {sorted(known)}.")
    return [known[n] for n in names]


def summarise(scenario: Scenario, runs: list[RunResult]) -> dict[str, Any]:
    """The summary entry: means over seeds, and how many seeds reached the target rise."""
    if any(r.overrides != runs[0].overrides for r in runs):
        raise SystemExit(f"The seeds of {scenario.name} ran under different --set overrides "
                         f"({[r.overrides for r in runs]}); keep each variant in its own --out.")
    rises = [r.after - r.before for r in runs]
    facts = {"facts_per_seed": [{k: round(v, 4) for k, v in scenario.facts(r).items()} for r in runs]} \
        if scenario.facts else {}
    return {"name": scenario.name, "metric": scenario.metric, "config": f"examples/configs/{scenario.config}",
            "before": round(statistics.mean(r.before for r in runs), 4),
            "after": round(statistics.mean(r.after for r in runs), 4),
            "rise": round(statistics.mean(rises), 4), "target": scenario.target,
            "seeds": len(runs), "seeds_met": sum(rise >= scenario.target for rise in rises),
            "rise_per_seed": [round(x, 4) for x in rises], "steps": runs[0].curve[-1][0],
            "seconds": round(sum(r.seconds for r in runs), 1),
            **({"overrides": runs[0].overrides} if runs[0].overrides else {}), **facts}


def plot(results: list[tuple[Scenario, list[RunResult]]], path: Path) -> Path:
    """One panel per scenario (rows of three, four past six panels): the mean validation curve over seeds, the
    min-max band, the before level dashed, and the scenario's curves plotted beside it (``RunResult.extra``,
    dotted, a mean over seeds); a scenario's ``own_panel`` curves in a panel of their own after it, per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[Scenario, list[RunResult], bool]] = []
    for scenario, runs in results:
        panels.append((scenario, runs, False))
        if scenario.own_panel and any(scenario.own_panel in name for r in runs for name in r.extra):
            panels.append((scenario, runs, True))
    ncols = min(3 if len(panels) <= 6 else 4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.ravel()[len(panels):]:
        ax.axis("off")
    for ax, (scenario, runs, own) in zip(axes.ravel(), panels):
        if own:
            _plot_per_seed(ax, scenario, runs)
        else:
            _plot_validation(ax, scenario, runs)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_validation(ax: Any, scenario: Scenario, runs: list[RunResult]) -> None:
    steps = [s for s, _ in runs[0].curve]
    columns = [[dict(r.curve).get(s, r.curve[-1][1]) for r in runs] for s in steps]
    mean = [statistics.mean(c) for c in columns]
    ax.plot(steps, mean, marker="o", label="validation")
    if len(runs) > 1:
        ax.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], alpha=0.25)
    for name in runs[0].extra:  # plotted beside the metric (e.g. gomoku's invalid-move rate), seed mean
        if scenario.own_panel and scenario.own_panel in name:
            continue
        curves = [dict(r.extra[name]) for r in runs if name in r.extra]
        beside = sorted(set().union(*curves))
        ax.plot(beside, [statistics.mean(c[s] for c in curves if s in c) for s in beside], linestyle=":",
                marker=".", label=name)
    ax.axhline(mean[0], linestyle="--", color="grey", label="before training")
    rise = mean[-1] - mean[0]
    ax.set_title(f"{scenario.name}: {mean[0]:.2f} -> {mean[-1]:.2f} ({rise:+.2f}, target +{scenario.target})",
                 fontsize=9)
    ax.set_xlabel("training step")
    ax.set_ylabel(scenario.metric, fontsize=8)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)


def _plot_per_seed(ax: Any, scenario: Scenario, runs: list[RunResult], window: int = SMOOTH_STEPS) -> None:
    """The ``own_panel`` curves, one colour per seed and one line style per curve, each a running mean over
    ``window`` steps (a step's training matches are 64 games: its rate alone moves by 0.06 a game or so)."""
    own = scenario.own_panel or ""
    for seed, run in enumerate(runs):
        names = [n for n in run.extra if own and own in n]
        for k, name in enumerate(names):
            steps, values = zip(*run.extra[name])
            ax.plot(steps, running_mean(list(values), window), color=f"C{seed}",
                    linestyle=("-", "--", ":", "-.")[k % 4],
                    label=f"seed {seed}: {name.replace(f'({own})', '').strip()}")
    ax.axhline(0.5, linestyle="--", color="grey", linewidth=0.8)
    ax.set_title(f"{scenario.name}: {scenario.own_panel} per seed ({window}-step mean)", fontsize=9)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"win rate in the step's training matches ({scenario.own_panel})", fontsize=8)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=6, ncol=3, loc="lower center")


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value with up to ``window - 1`` values before it (the first ones over fewer)."""
    return [statistics.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def run_one(scenario: Scenario, seed: int, out: Path, smoke: bool, sets: Sequence[str] = ()) -> RunResult:
    """Train one seed of ``scenario`` under ``out/<name>/seed<k>`` and keep its curves there (``result.json``);
    ``sets``: config overrides (``key=value``) applied after the harness's own."""
    print(f"[scenarios] {scenario.name}, seed {seed}: {scenario.config}" + "".join(f" {s}" for s in sets), flush=True)
    run_dir = out / scenario.name / f"seed{seed}"
    result = scenario.run(scenario.config, seed, run_dir, smoke=smoke, sets=tuple(sets))
    result.overrides = list(sets)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "result.json").write_text(json.dumps(dataclasses.asdict(result)))
    print(f"[scenarios] {scenario.name}, seed {seed}: {result.before:.3f} -> {result.after:.3f} "
          f"in {result.seconds:.0f} s", flush=True)
    return result


def stored_run(path: Path) -> RunResult:
    """The run an earlier ``run_one`` kept in ``path`` (its ``result.json``)."""
    raw = json.loads(path.read_text())
    return RunResult([(int(s), float(v)) for s, v in raw["curve"]], float(raw["seconds"]),
                     {k: [(int(s), float(v)) for s, v in c] for k, c in raw.get("extra", {}).items()},
                     [str(o) for o in raw.get("overrides", [])])


def stored_runs(scenario_dir: Path) -> list[RunResult]:
    """The runs an earlier ``run_one`` kept under ``scenario_dir`` (``seed*/result.json``), by seed."""
    return [stored_run(path) for path in sorted(scenario_dir.glob("seed*/result.json"))]


def seed_runs(scenario: Scenario, args: argparse.Namespace, out: Path) -> list[RunResult]:
    """Seeds 0 .. ``--seeds``-1 of ``scenario``: each trained, or with ``--keep-done`` read back where its
    ``result.json`` is already in ``out`` (so more seeds can be added to a figure without training the first again)."""
    runs = []
    for seed in range(args.seeds):
        done = out / scenario.name / f"seed{seed}" / "result.json"
        if args.keep_done and done.exists():
            kept = stored_run(done)
            if kept.overrides != args.set:
                raise SystemExit(f"{done} ran under --set {kept.overrides or 'nothing'}, not {args.set or 'nothing'}; "
                                 "keep each variant in its own --out.")
            print(f"[scenarios] {scenario.name}, seed {seed}: kept from {done}", flush=True)
            runs.append(kept)
        else:
            runs.append(run_one(scenario, seed, out, args.smoke, args.set))
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scenarios", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/scenarios", help="where scenarios.png, summary.json and each run go")
    p.add_argument("--only", default=None, help=f"comma-separated names among {[s.name for s in SCENARIOS]}")
    p.add_argument("--seeds", type=int, default=1, help="seeds per scenario (0, 1, ...); the figure shows the band")
    p.add_argument("--smoke", action="store_true", help="one training step per scenario, seconds (CI)")
    p.add_argument("--keep-done", action="store_true",
                   help="a seed whose result.json is already in --out is read back, not trained again")
    p.add_argument("--replot", action="store_true",
                   help="train nothing: the figure and summary from the result.json files of earlier runs in --out")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every scenario run (repeatable), as envhub-train's key=value, "
                        "e.g. --set match.past_groups=2")
    args = p.parse_args(argv)
    bad = [s for s in args.set if "=" not in s or not s.split("=", 1)[0].strip()]
    if bad:
        p.error(f"Expected --set KEY=VALUE (e.g. run.steps=10), got {bad}.")
    if not 1 <= args.seeds <= 10:
        p.error(f"Expected --seeds between 1 and 10, got {args.seeds}.")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the tiny models run fastest on one thread; the env servers get the other core
    out = Path(args.out)
    results = [(s, stored_runs(out / s.name)) for s in pick(args.only)] if args.replot else \
        [(s, seed_runs(s, args, out)) for s in pick(args.only)]
    results = [(s, runs) for s, runs in results if runs]
    if not results:
        raise SystemExit(f"No result.json of a scenario run under {out}; run the scenarios there first.")
    summary = [summarise(s, runs) for s, runs in results]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    figure = plot(results, out / "scenarios.png")
    for entry in summary:
        print(f"[scenarios] {entry['name']:<16} {entry['before']:.3f} -> {entry['after']:.3f}  rise {entry['rise']:+.3f} "
              f"(target +{entry['target']}, {entry['seeds_met']}/{entry['seeds']} seeds met)  {entry['seconds']:.0f} s")
        for seed, facts in enumerate(entry.get("facts_per_seed", [])):
            print(f"[scenarios]   seed {seed}: " + ", ".join(f"{k} {v:+.2f}" if k.endswith("rise") else f"{k} {v:.2f}"
                                                         for k, v in facts.items()))
    print(f"[scenarios] wrote {out / 'summary.json'} and {figure}", flush=True)
    return summary


if __name__ == "__main__":
    main()
