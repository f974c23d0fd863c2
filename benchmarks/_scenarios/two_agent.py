"""Two-agent gomoku: two independent policies trained against each other through the match env.

Trains from ``examples/configs/scenario_gomoku_two_agent.toml`` (the match env runs in process) after
a warm-up of each agent on the moves of two scripted random players, each move prompted with its board
alone as the config's history window does (``rollout.history_turns = 0``), that also pushes probability
off the occupied cells (:mod:`.cell_warmup`), so that greedy play starts legal. The validation curve
is the weaker agent's win rate against the scripted random player at each validation (the lower of the
agents' ``eval/win_rate`` in their ``metrics.jsonl``: greedy, held-out seeds), so the scenario meets its
target only when both agents rise; plotted beside it, each agent's own validation win rate and
the head-to-head, each agent's win rate in the step's training matches against the other
(``train/win_rate``): what one agent gains there the other loses. :func:`two_agent_facts` reads the
issue's two checks from a run's curves: how each agent's validation moved at the first validation after
training began (both rise at first), and how the head-to-head moved from step to step (zero-sum: the
changes of the two agents' rates are opposite, as far as draws allow).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import CONFIGS, RunResult, metric_curve

WARMUP_GAMES = 256        # scripted games of random legal moves, on seeds neither training nor validation draws
WARMUP_SEED_BASE = 2 * 10**9
WARMUP_STEPS = 1500        # at most; it stops once the last 25 batches put WARMUP_MASS on the empty cells
WARMUP_MASS = 0.99         # with one board a prompt, greedy play is then legal on every held-out position
WARMUP_LEGAL_WEIGHT = 3.0
WARMUP_LR = 3e-3
WARMUP_BATCH = 64          # moves a step (each its own prompt: about 14 games)
VS_RANDOM = " vs random"        # each agent's validation curve in RunResult.extra: "<name> vs random"
HEAD_TO_HEAD = "head-to-head"  # each agent's training-match curve: "<name> vs <other> (head-to-head)"


def run_two_agent(config: str, seed: int, out: Path, *, smoke: bool = False, sets: Sequence[str] = ()) -> RunResult:
    """Warm both agents up on the move format, then train them against each other from ``config``.

    The warm-ups run in spawned processes, which import the calling script again: a script that calls
    this (or ``benchmarks.scenarios.run_one`` on this scenario) does so under ``if __name__ == "__main__":``."""
    from trainer.recipes.two_agent import train_two_agents

    start = time.monotonic()
    cfg, agents = warmed_up_players(config, seed, out, smoke=smoke, sets=sets)
    train_two_agents(cfg, agents=agents, log=_quiet)
    return _result(out, list(agents), time.monotonic() - start)


def warmed_up_players(config: str, seed: int, out: Path, *, smoke: bool = False,
                      sets: Sequence[str] = ()) -> tuple[Any, dict[str, Any]]:
    """``(two-agent config, {name: Player})`` for ``seed``: each agent a fresh initialisation of its own,
    warmed up before its player is built, so that its KL reference (``algo.kl_coef``) is the warmed-up policy."""
    import torch

    from trainer.model import load_policy
    from trainer.recipes.players import Player
    from trainer.recipes.two_agent_config import load_two_agent_config

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [f"run.seed={seed}", f"run.output_dir='{out}'"]
    if smoke:  # batch 6: the config's 3 groups against the random player, 2 against past versions, one head-to-head
        overrides += ["run.steps=1", "run.batch_size=6", "run.group_size=2", "run.eval_problems=2",
                      "run.eval_every=0", "rollout.max_turns=2"]
    cfg = load_two_agent_config(CONFIGS / config, [*overrides, *sets])  # the user's --set last: they win
    if not cfg.env.env_class:
        raise ValueError(f"Expected {config} to name env.env_class (the two-agent scenario runs its env in process).")
    names = list(cfg.agents)
    for k, name in enumerate(names):  # each seed: two fresh, different initialisations
        model = dataclasses.replace(cfg.agents[name].model, init_seed=len(names) * seed + k)
        cfg.agents[name] = dataclasses.replace(cfg.agents[name], model=model)
        (out / name / "metrics.jsonl").unlink(missing_ok=True)
    policies = {n: load_policy(a.model) for n, a in cfg.agents.items()}
    _warm_up(cfg, policies, seed, games=4 if smoke else WARMUP_GAMES, steps=2 if smoke else WARMUP_STEPS)
    agents = {n: Player(n, a, cfg, out / n, model=policies[n][0], tokenizer=policies[n][1])
              for n, a in cfg.agents.items()}
    return cfg, agents


def _warm_up(cfg: Any, policies: dict[str, tuple[Any, Any]], seed: int, *, games: int, steps: int) -> None:
    """Warm each ``(model, tokenizer)`` in ``policies`` up in place, each on its own scripted games.

    Each agent warms up in its own process (its training uses one core: torch runs on one thread here),
    so that the two warm-ups take the time of one; the result is the same as warming them up in turn (the
    warm-up is deterministic: seeded games, batches and initialisation), and each process's weights are
    loaded into ``policies``."""
    import concurrent.futures
    import multiprocessing

    import torch

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(policies), mp_context=context, initializer=torch.set_num_threads,
                                                initargs=(1,)) as pool:
        futures = {name: pool.submit(warm_up_agent, cfg, name, k, seed, games=games, steps=steps)
                   for k, name in enumerate(policies)}
        for name, future in futures.items():
            state, metrics = future.result()
            policies[name][0].load_state_dict(state)
            print(f"  [gomoku-two-agent] warm-up {name}: probability on empty cells {metrics['window_mass']:.2f} "
                  f"(last 25 batches) after {metrics['steps']:.0f} steps", flush=True)


def warm_up_agent(cfg: Any, name: str, k: int, seed: int, *, games: int,
                  steps: int) -> tuple[dict[str, Any], dict[str, float]]:
    """Agent ``name`` (the ``k``-th of ``cfg.agents``, built from its config: ``init_seed`` as the harness
    sets it) warmed up on its own ``games`` scripted games: its weights after at most ``steps`` warm-up
    steps and the warm-up's metrics."""
    from trainer.model import load_policy
    from trainer.recipes.two_agent import build_pool
    from trainer.recipes.two_agent_warmup import demos_from, scripted_games

    from .cell_warmup import legal_cell_warmup

    model, tokenizer = load_policy(cfg.agents[name].model)
    seats = asyncio.run(scripted_games(build_pool(cfg), tokenizer, cfg.rollout, matches=games,
                                       seed=WARMUP_SEED_BASE + (seed * len(cfg.agents) + k) * games,
                                       reset_kwargs=cfg.env.train_task, prefix=f"warmup-{name}"))
    metrics = legal_cell_warmup(model, tokenizer, demos_from(seats, max_turns=cfg.rollout.max_turns),
                                steps=steps, batch_size=WARMUP_BATCH, lr=WARMUP_LR, seed=seed,
                                legal_weight=WARMUP_LEGAL_WEIGHT, until_mass=WARMUP_MASS, final_lr=0.1)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, metrics


def _result(out: Path, names: list[str], seconds: float) -> RunResult:
    """The weaker agent's validation win rate at each validation, with each agent's curves beside it."""
    evals = {n: dict(metric_curve(out / n / "metrics.jsonl", "eval/win_rate")) for n in names}
    steps = sorted(set.intersection(*(set(c) for c in evals.values())))
    curve = [(s, min(evals[n][s] for n in names)) for s in steps]
    extra: dict[str, list[tuple[int, float]]] = {}
    for n in names:
        extra[f"{n}{VS_RANDOM}"] = sorted(evals[n].items())
    for n in names:
        extra[f"{n} vs {'/'.join(m for m in names if m != n)} ({HEAD_TO_HEAD})"] = metric_curve(
            out / n / "metrics.jsonl", "train/win_rate")
    return RunResult(curve, seconds, extra=extra)


def two_agent_facts(result: RunResult) -> dict[str, float]:
    """Per agent, ``<name>_first_rise`` (its validation at the first validation after step 0, less its level
    before) and ``<name>_rise`` (at the last); ``head_to_head_change_corr``, the correlation of the two agents'
    step-to-step changes in their head-to-head win rates (-1 when one's gain is exactly the other's loss), and
    ``head_to_head_draw_rate``, the mean share of training matches drawn (what keeps it from -1)."""
    facts: dict[str, float] = {}
    for name, curve in result.extra.items():
        if name.endswith(VS_RANDOM) and len(curve) > 1:
            agent = name.removesuffix(VS_RANDOM)
            facts[f"{agent}_first_rise"] = curve[1][1] - curve[0][1]
            facts[f"{agent}_rise"] = curve[-1][1] - curve[0][1]
    h2h = [dict(c) for n, c in result.extra.items() if n.endswith(f"({HEAD_TO_HEAD})")]
    if len(h2h) == 2:
        steps = sorted(set(h2h[0]) & set(h2h[1]))
        facts["head_to_head_draw_rate"] = statistics.mean(1.0 - h2h[0][s] - h2h[1][s] for s in steps)
        changes = [[c[b] - c[a] for a, b in itertools.pairwise(steps)] for c in h2h]
        if len(changes[0]) > 1 and min(statistics.pstdev(c) for c in changes) > 0:
            facts["head_to_head_change_corr"] = statistics.correlation(*changes)
    return facts


def _quiet(message: str) -> None:
    if message.startswith("validation"):
        print(f"  [gomoku-two-agent] {message}", flush=True)
