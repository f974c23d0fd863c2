"""Single-turn math (full parameters, or a LoRA adapter): SFT warm-up on train-split demos, then GRPO.

Both train from their config (``examples/configs/scenario_math*.toml``) against the math env server
the quick start runs; validation is the server's held-out split, greedy, never a training problem.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import CONFIGS, RunResult, fresh_run, metric_curve

SFT_TARGET = 0.5  # stop the warm-up at this greedy accuracy on *train* problems, as the quick start does
SFT_LR = 3e-3


def run_math(config: str, seed: int, out: Path, *, smoke: bool = False, sets: Sequence[str] = ()) -> RunResult:
    """Warm up, then GRPO from ``config``; the curve is ``eval/reward_mean`` on the validation split."""
    from trainer.config import load_config
    from trainer.local_server import free_port
    from trainer.model import apply_lora, load_policy
    from trainer.quickstart import collect_demos, listed_size, math_server
    from trainer.recipes.rl import train

    start = time.monotonic()
    overrides = fresh_run(out, seed, smoke=smoke, smoke_overrides=[
        "run.steps=1", "run.batch_size=4", "run.group_size=2", "run.eval_problems=4", "run.eval_every=0"], sets=sets)
    with math_server(free_port(), out / "math_server.log") as url:
        cfg = load_config(CONFIGS / config, [*overrides, f"env.url='{url}'"])
        task = {k: v for k, v in cfg.env.train_task.items() if k != "split"}
        # The warm-up trains all weights of the base; a LoRA config then trains only its adapter on top,
        # as it would on a pretrained model.
        model, tok = load_policy(dataclasses.replace(cfg.model, lora_rank=0))
        size = asyncio.run(listed_size(url, "train", task))
        demos = asyncio.run(collect_demos(url, size or 512, seed, task, by_index=size is not None))
        _warm_up(cfg, model, tok, demos, url, task, size or 64, seed, steps=2 if smoke else 600)
        if cfg.model.lora_rank > 0:
            model = apply_lora(model, cfg.model)
        train(cfg, model=model, tokenizer=tok, log=_quiet)
    return RunResult(metric_curve(out / "metrics.jsonl", "eval/reward_mean"), time.monotonic() - start)


def _warm_up(cfg: Any, model: Any, tok: Any, demos: list[dict[str, Any]], url: str, task: dict[str, Any],
             n_train: int, seed: int, *, steps: int) -> None:
    from trainer.quickstart import train_accuracy
    from trainer.recipes.rl import build_engine
    from trainer.recipes.sft import run_sft

    probe = build_engine(cfg, model, tok)
    try:
        run_sft(model, tok, demos, steps=steps, batch_size=32, lr=SFT_LR, seed=seed, weight_decay=0.1,
                stop_when=lambda step: train_accuracy(probe, url, task, n_train) >= SFT_TARGET, check_every=10)
    finally:
        probe.close()


def _quiet(message: str) -> None:
    if message.startswith("validation"):
        print(f"  [math] {message}", flush=True)
