"""Vision geometry: which figure a diagram shows (single-turn), and a side only a ruler tool tells (multi-turn).

Both train from their config (``examples/configs/scenario_geometry_*.toml``; the geometry env runs in
process, with its diagram-only kinds ``figure`` and ``measure``) after a warm-up on the *format* alone:
train-split problems (seeds no RL step draws) answered at random (each diagram by every letter, in the
single-turn one), so the policy starts at chance.
Validation is the env's ``validation`` split, greedy, balanced over the answers.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .common import CONFIGS, RunResult, metric_curve

DEMO_SEED_BASE = 10**9  # warm-up problems: train-split seeds far from the ones the RL steps draw (0, 1, ...)
# warm-up diagrams (each answered by all three letters: 258 demonstrations), steps and lr as examples/vision_train.py's
# colour warm-up
FIGURE_DIAGRAMS, FIGURE_SFT_STEPS, FIGURE_SFT_LR = 86, 25, 1e-2
TOOL_DEMOS, TOOL_SFT_STEPS, TOOL_SFT_LR = 256, 90, 5e-3  # the ~55-token call must come out whole when sampled
CALL_FRACTION = 1.0  # warm-up conversations that call the ruler before answering (the call format; 0.5 let GRPO drop the calls)
TEXT_ONLY = "tiny"


def run_geometry_vision(config: str, seed: int, out: Path, *, smoke: bool = False) -> RunResult:
    """The vision policy of ``config`` and the text-only ``tiny`` on the same data; the curve is the vision
    policy's held-out accuracy (``eval/rewards/accuracy_mean``), the text-only one's beside it."""
    start = time.monotonic()
    curves = {}
    for name in (None, TEXT_ONLY):  # None: the config's own (vision-language) policy
        run_dir = out if name is None else out / "text_only"
        _train_policy(config, seed, run_dir, smoke, name)
        curves[name] = metric_curve(run_dir / "metrics.jsonl", "eval/rewards/accuracy_mean", absent=0.0)
    return RunResult(curves[None], time.monotonic() - start,
                     extra={"text-only policy (tiny)": curves[TEXT_ONLY]})


def run_geometry_tools(config: str, seed: int, out: Path, *, smoke: bool = False) -> RunResult:
    """Warm up on the call and answer formats, then GRPO from ``config``; the curve is held-out accuracy
    (``eval/rewards/accuracy_mean``), the tool-call rate (``eval/tool_call_rate``) beside it."""
    start = time.monotonic()
    _train_policy(config, seed, out, smoke, None, demos=measure_demos)
    metrics = out / "metrics.jsonl"
    return RunResult(metric_curve(metrics, "eval/rewards/accuracy_mean", absent=0.0), time.monotonic() - start,
                     extra={"tool-call rate": metric_curve(metrics, "eval/tool_call_rate")})


def _train_policy(config: str, seed: int, out: Path, smoke: bool, model_name: str | None,
                  demos: Callable[[Any, int, int], list[dict[str, Any]]] | None = None) -> None:
    import torch

    from trainer.config import load_config
    from trainer.model import load_policy
    from trainer.recipes.rl import train
    from trainer.recipes.sft import run_sft
    from trainer.vision import load_vision_processor

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    overrides = [f"run.seed={seed}", f"model.init_seed={seed}", f"run.output_dir='{out}'"]
    if model_name is not None:
        overrides.append(f"model.name='{model_name}'")
    if smoke:
        overrides += ["run.steps=1", "run.batch_size=2", "run.group_size=2", "run.eval_problems=3", "run.eval_every=0"]
    cfg = load_config(CONFIGS / config, overrides)
    model, tok = load_policy(cfg.model)
    if demos is None:
        examples, steps, lr = figure_demos(cfg, 3 if smoke else FIGURE_DIAGRAMS, seed), FIGURE_SFT_STEPS, FIGURE_SFT_LR
    else:
        examples, steps, lr = demos(cfg, 8 if smoke else TOOL_DEMOS, seed), TOOL_SFT_STEPS, TOOL_SFT_LR
    run_sft(model, tok, examples, steps=2 if smoke else steps, batch_size=32, lr=lr, seed=seed, weight_decay=0.1,
            vision=load_vision_processor(cfg.model, tok))
    train(cfg, model=model, tokenizer=tok, log=_quiet)


def _train_problems(cfg: Any, n: int, seed: int) -> Iterator[tuple[Any, list[dict[str, Any]]]]:
    """``n`` train-split problems of ``cfg``'s env (seeds no RL step draws): the env and its first messages."""
    from env_servers.geometry_env import GeometryEnv

    for i in range(n):
        env = GeometryEnv(**cfg.env.env_kwargs)
        env.rng = random.Random(DEMO_SEED_BASE + seed * n + i)
        obs = env.reset(**cfg.env.train_task)
        yield env, [{"role": "system", "content": obs.metadata["system_prompt"]},
                    {"role": "user", "content": [{"type": "image", "image": obs.images[0]},
                                                 {"type": "text", "text": obs.text}]}]


def figure_demos(cfg: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """The warm-up demonstrations: ``n`` train-split diagrams and their question, each answered by *every*
    choice once, so the best fit for every diagram is the uniform choice: the one-letter answer format, nothing
    about which letter is right. (One random letter per diagram, a target 3 epochs at lr 1e-2 can partly
    fit, left seed 2 at chance through 80 GRPO steps; with every letter each seed rose by step 20.)"""
    return [{"prompt": prompt, "completion": choice}
            for env, prompt in _train_problems(cfg, n, seed) for choice in env.current_problem().choices]


def measure_demos(cfg: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` warm-up conversations on train-split triangles: a ``CALL_FRACTION`` of them call the ruler on the
    asked side (Hermes format) and see its real reading; every one answers a *random* length in the env's
    ``answer_format`` (``\\boxed{}``, or the number alone). The formats, and nothing about which length is right:
    the policy starts at chance."""
    from env_servers.geometry_env.figures import MEASURE_LENGTHS

    rng = random.Random(seed)
    demos = []
    for env, messages in _train_problems(cfg, n, seed):
        side = re.search(r"How long is ([A-C]{2})\?", messages[-1]["content"][-1]["text"])
        if side is None:
            raise ValueError(f"Expected a 'measure' problem asking for a side, got {messages[-1]!r}.")
        if rng.random() < CALL_FRACTION:
            call = json.dumps({"name": "measure", "arguments": {"segment": side.group(1)}})
            reading = env.measure(side.group(1)).observation.text
            messages += [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                         {"role": "tool", "name": "measure", "content": reading}]
        length = rng.choice(MEASURE_LENGTHS)
        answer = length if env.config.answer_format == "number" else f"\\boxed{{{length}}}"
        messages.append({"role": "assistant", "content": answer})
        demos.append({"messages": messages, "tools": cfg.env.tools})
    return demos


def _quiet(message: str) -> None:
    if message.startswith("validation"):
        print(f"  [geometry] {message}", flush=True)
