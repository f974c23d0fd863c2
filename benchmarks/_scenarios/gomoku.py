"""Multi-turn gomoku against the env's scripted opponent: a warm-up on random legal games, then GRPO.

The warm-up imitates the games' moves and pushes the cell number's probability onto the empty cells
(:mod:`.cell_warmup`): imitation alone (600 steps) left it near uniform over all nine cells, and on
seeds 1 and 2 greedy play then put every validation game's second move on an occupied cell (0.0 before
and after 40 GRPO steps; seed 0 happened to start legal, 0.22 -> 0.81).

Trains from ``examples/configs/scenario_gomoku.toml`` (the env runs in process, as the config names it);
the curve is the win rate over held-out games (``eval/win_rate``: the env's ``info["outcome"]``, greedy,
the env's ``validation`` split), with the share of those games lost on an invalid move beside it
(``eval/end/too_many_invalid_rate``, the env's end reason; ``penalised_turn_frac`` would count a legal move
answered by the opponent's winning line too).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import CONFIGS, RunResult, fresh_run, metric_curve

DEMO_GAMES = 256      # warm-up games of random legal moves (the train split, seeds the RL run never draws)
DEMO_SEED_BASE = 10**9
WARMUP_STEPS = 300   # with the empty-cell term (cell_warmup), as the two-agent scenario's warm-up
WARMUP_LR = 3e-3


def run_gomoku(config: str, seed: int, out: Path, *, smoke: bool = False, sets: Sequence[str] = ()) -> RunResult:
    """Warm up on the move format, then GRPO from ``config``; the curve is ``eval/win_rate``."""
    from trainer.config import load_config
    from trainer.model import load_policy
    from trainer.recipes.rl import train
    from trainer.recipes.setup import in_process_env
    from trainer.recipes.sft import encode_demo

    from .cell_warmup import legal_cell_warmup

    start = time.monotonic()
    overrides = fresh_run(out, seed, smoke=smoke, smoke_overrides=[
        "run.steps=1", "run.batch_size=2", "run.group_size=2", "run.eval_problems=2", "run.eval_every=0",
        "rollout.max_turns=2"], sets=sets)
    cfg = load_config(CONFIGS / config, overrides)
    env_cls = in_process_env(cfg.env)
    if env_cls is None:
        raise ValueError(f"Expected {config} to name env.env_class (the gomoku scenario runs its env in process).")
    model, tok = load_policy(cfg.model)
    demos = random_games(env_cls, cfg.rollout.system_prompt or "", 4 if smoke else DEMO_GAMES,
                         cfg.rollout.max_turns, seed)
    warmup = legal_cell_warmup(model, tok, [encode_demo(tok, d) for d in demos], steps=2 if smoke else WARMUP_STEPS,
                               lr=WARMUP_LR, seed=seed)
    print(f"  [gomoku] warm-up: probability on empty cells {warmup['window_mass']:.2f} (last 25 batches)", flush=True)
    train(cfg, model=model, tokenizer=tok, log=_quiet)
    metrics = out / "metrics.jsonl"
    # a validation whose games all ran out of turns reports no outcome: it won none of them
    return RunResult(metric_curve(metrics, "eval/win_rate", absent=0.0), time.monotonic() - start,
                     extra={"games lost on an invalid move": metric_curve(metrics, "eval/end/too_many_invalid_rate",
                                                                          absent=0.0)})


def random_games(env_cls: Any, system_prompt: str, n: int, max_turns: int, seed: int) -> list[dict[str, Any]]:
    """``n`` whole games (train split) in which X plays a random empty cell each turn, as chat demonstrations:
    the reply format in the multi-turn context the policy plays in, and no strategy."""
    from envhub import Action

    rng = random.Random(seed)
    demos = []
    for i in range(n):
        env = env_cls()
        obs = env.reset(seed=DEMO_SEED_BASE + seed * n + i, split="train")
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": obs.text}]
        for _ in range(max_turns):
            move = demo_move(env, rng.choice(env.game.board.empty_cells()))
            messages.append({"role": "assistant", "content": move})
            result = env.step(Action(text=move))
            if result.done or result.truncated:
                break
            messages.append({"role": "user", "content": result.observation.text})
        demos.append({"messages": messages})
    return demos


def demo_move(env: Any, cell: tuple[int, int]) -> str:
    """The reply that plays ``cell`` in the env's move format (``<move>n</move>`` or ``<move>r,c</move>``)."""
    if env.config.cells:  # cells are numbered from 1 at the top left, row by row (Board.render_cells)
        return f"<move>{cell[0] * env.config.board_size + cell[1] + 1}</move>"
    return "<move>{},{}</move>".format(*cell)


def _quiet(message: str) -> None:
    if message.startswith("validation"):
        print(f"  [gomoku] {message}", flush=True)
