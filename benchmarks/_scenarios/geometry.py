"""Vision geometry: which figure a diagram shows (single-turn), and a side only a ruler tool tells (multi-turn).

Both train from their config (``examples/configs/scenario_geometry_*.toml``; the geometry env runs in
process, with its diagram-only kinds ``figure`` and ``measure``) after a warm-up on train-split problems (seeds
no RL step draws). ``figure``: each diagram answered by every letter, the answer format alone, so the policy
starts at chance. ``measure``: the policy learns to read the ruler's reading into its answer, and to call the
ruler on a few questions only (:func:`measure_phases`): it starts answering at once, at chance, and RL has to
find that calling pays.
Validation is the env's ``validation`` split, greedy, balanced over the answers.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .common import CONFIGS, RunResult, fresh_run, metric_curve

DEMO_SEED_BASE = 10**9  # warm-up problems: train-split seeds far from the ones the RL steps draw (0, 1, ...)
# warm-up diagrams (each answered by all three letters: 258 demonstrations), steps and lr as examples/vision_train.py's
# colour warm-up
FIGURE_DIAGRAMS, FIGURE_SFT_STEPS, FIGURE_SFT_LR = 86, 25, 1e-2
TOOL_DEMOS = 1024  # the tool warm-up's triangles
# its phases, (name, steps, lr), batches of 32, no weight decay: "read", the answer turn alone after the call and the
# ruler's reading, answered with the reading, until it reads: the loss of the answer turn (digit and <|im_end|>) sits
# at ~1.04, the digit at chance, then falls to ~0.02 within ~50 steps; at lr 3e-3 that came at steps 125-150 on seeds
# 0-2, at lr 1e-3 after 225 to 1025 by the seed. "mix", the first turn too: a CALL_FRACTION of the questions answered
# with the call, the others with a random length at once, and the read demonstrations again (300 steps; at lr 1e-3,
# 100 left the call at 0.002 of the first token's probability)
TOOL_PHASES = (("read", 1500, 3e-3), ("mix", 300, 3e-3))
READ_UNTIL_LOSS = 0.1
# 0.1: the warmed-up policy gives the call's first token 0.05-0.10 (seeds 0-2), under the likeliest length's
# 0.16-0.19, so the greedy policy answers at once (chance) and sampling at the config's temperature calls on a few
# percent of the episodes: the signal RL needs. Each seed reads unseen train triangles' readings, 24 of 24
CALL_FRACTION = 0.1
TEXT_ONLY = "tiny"


class Phase(NamedTuple):
    """One supervised warm-up pass: its demonstrations, steps, lr and weight decay; with ``until_loss`` > 0 it ends
    early once the mean loss of its last 25 batches is below that."""

    demos: list[dict[str, Any]]
    steps: int
    lr: float
    weight_decay: float = 0.0
    until_loss: float = 0.0


class _Losses:
    """A ``run_sft`` logger that keeps the batches' losses; ``reached`` (its ``stop_when``): the mean of the last 25
    is below ``until``."""

    def __init__(self, until: float) -> None:
        self.until = until
        self.losses: list[float] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.losses.append(metrics["sft/sft_loss"])

    def recent(self) -> float:
        last = self.losses[-25:]
        return sum(last) / max(len(last), 1)

    def reached(self, step: int) -> bool:
        return self.recent() < self.until


def run_geometry_vision(config: str, seed: int, out: Path, *, smoke: bool = False,
                        sets: Sequence[str] = ()) -> RunResult:
    """The vision policy of ``config`` and the text-only ``tiny`` on the same data; the curve is the vision
    policy's held-out accuracy (``eval/rewards/accuracy_mean``), the text-only one's beside it."""
    start = time.monotonic()
    curves = {}
    for name in (None, TEXT_ONLY):  # None: the config's own (vision-language) policy
        run_dir = out if name is None else out / "text_only"
        _train_policy(config, seed, run_dir, smoke, name, sets=sets)
        curves[name] = metric_curve(run_dir / "metrics.jsonl", "eval/rewards/accuracy_mean", absent=0.0)
    return RunResult(curves[None], time.monotonic() - start,
                     extra={"text-only policy (tiny)": curves[TEXT_ONLY]})


def run_geometry_tools(config: str, seed: int, out: Path, *, smoke: bool = False,
                       sets: Sequence[str] = ()) -> RunResult:
    """Warm up (:func:`measure_phases`: read the ruler, call it on a few questions), then GRPO from ``config``; the
    curve is held-out accuracy (``eval/rewards/accuracy_mean``), the tool-call rate (``eval/tool_call_rate``) beside
    it."""
    start = time.monotonic()
    _train_policy(config, seed, out, smoke, None, phases=measure_phases, probe=tool_probe, sets=sets)
    metrics = out / "metrics.jsonl"
    return RunResult(metric_curve(metrics, "eval/rewards/accuracy_mean", absent=0.0), time.monotonic() - start,
                     extra={"tool-call rate": metric_curve(metrics, "eval/tool_call_rate")})


def _train_policy(config: str, seed: int, out: Path, smoke: bool, model_name: str | None,
                  phases: Callable[[Any, int, int], list[Phase]] | None = None,
                  probe: Callable[..., str] | None = None, sets: Sequence[str] = ()) -> None:
    from trainer.config import load_config
    from trainer.model import load_policy
    from trainer.recipes.rl import train
    from trainer.recipes.sft import run_sft
    from trainer.vision import load_vision_processor

    overrides = fresh_run(out, seed, smoke=smoke, smoke_overrides=[
        "run.steps=1", "run.batch_size=2", "run.group_size=2", "run.eval_problems=3", "run.eval_every=0"], sets=sets)
    if model_name is not None:
        overrides.append(f"model.name='{model_name}'")
    cfg = load_config(CONFIGS / config, overrides)
    model, tok = load_policy(cfg.model)
    vision = load_vision_processor(cfg.model, tok)
    if phases is None:
        warm_up = [Phase(figure_demos(cfg, 3 if smoke else FIGURE_DIAGRAMS, seed), FIGURE_SFT_STEPS, FIGURE_SFT_LR, 0.1)]
    else:
        warm_up = phases(cfg, 8 if smoke else TOOL_DEMOS, seed)
    for phase in warm_up:
        losses = _Losses(phase.until_loss)
        done = run_sft(model, tok, phase.demos, steps=2 if smoke else phase.steps, batch_size=32, lr=phase.lr,
                       seed=seed, weight_decay=phase.weight_decay, vision=vision, logger=losses,
                       stop_when=losses.reached if phase.until_loss else None)
        print(f"  [geometry] warm-up: {int(done['steps'])} steps, loss of the last 25 batches {losses.recent():.3f}",
              flush=True)
    if probe is not None:
        print(f"  [geometry] after the warm-up: {probe(model, tok, vision, cfg, seed, 3 if smoke else 24)}", flush=True)
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


def measure_phases(cfg: Any, n: int, seed: int, calls: int | None = None) -> list[Phase]:
    """The ``TOOL_PHASES`` of the tool warm-up on ``n`` train-split triangles. "read": the question, the ruler called
    on the asked side (Hermes format) and its real reading as the prompt, the reading as the completion, in the
    env's ``answer_format`` (``\\boxed{}``, or the number alone). "mix": the first turn as well, the call for the
    first ``calls`` (default ``CALL_FRACTION`` of ``n``) questions and a *random* length for the others, with the read
    demonstrations."""
    from env_servers.geometry_env.figures import MEASURE_LENGTHS

    rng = random.Random(seed)
    reads, first_turns = [], []
    for i, (env, messages) in enumerate(_train_problems(cfg, n, seed)):
        side = re.search(r"How long is ([A-C]{2})\?", messages[-1]["content"][-1]["text"])
        if side is None:
            raise ValueError(f"Expected a 'measure' problem asking for a side, got {messages[-1]!r}.")
        call = json.dumps({"name": "measure", "arguments": {"segment": side.group(1)}})
        turn = {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"}
        reading = env.measure(side.group(1)).observation.text
        reads.append({"prompt": [*messages, turn, {"role": "tool", "name": "measure", "content": reading}],
                      "completion": _answer(env, reading), "tools": cfg.env.tools})
        calling = i < (round(CALL_FRACTION * n) if calls is None else calls)
        first = turn["content"] if calling else _answer(env, rng.choice(MEASURE_LENGTHS))
        first_turns.append({"prompt": messages, "completion": first, "tools": cfg.env.tools})
    (_, read_steps, read_lr), (_, mix_steps, mix_lr) = TOOL_PHASES
    return [Phase(reads, read_steps, read_lr, until_loss=READ_UNTIL_LOSS), Phase(first_turns + reads, mix_steps, mix_lr)]


def tool_probe(model: Any, tok: Any, vision: Any, cfg: Any, seed: int, n: int) -> str:
    """What the warmed-up policy does on ``n`` train-split triangles the warm-up never showed (teacher-forced): the
    probability of the call's first token and of the likeliest length as the first turn begins, and how often the
    likeliest length after the call and the ruler's reading is that reading (with ``answer_format = "number"``, where
    a length's first token is its digit)."""
    import math

    from env_servers.geometry_env.figures import MEASURE_LENGTHS
    from trainer.core import Datum, TrainingClient
    from trainer.recipes.sft import encode_image_demo

    client = TrainingClient(model, tok)

    def first_logprob(prompt: list[dict[str, Any]], completion: str) -> float:
        ids, mask, images = encode_image_demo(tok, {"prompt": prompt, "completion": completion}, vision)
        datum = Datum.from_sequence(ids, weights=mask)
        datum.images = list(images)
        logprobs = client.forward([datum], "cross_entropy").loss_fn_outputs[0]["logprobs"]
        return float(logprobs[mask[1:].index(1)])

    call_p = likeliest = reads = 0.0
    read_phase, mix_phase = measure_phases(cfg, n, 10**6 + seed, calls=n)  # seeds far from the warm-up's
    for read, first in zip(read_phase.demos, mix_phase.demos[:n], strict=True):
        call_p += math.exp(first_logprob(first["prompt"], first["completion"])) / n
        likeliest += max(math.exp(first_logprob(first["prompt"], length)) for length in MEASURE_LENGTHS) / n
        after = {length: first_logprob(read["prompt"], length) for length in MEASURE_LENGTHS}
        reads += (max(after, key=after.__getitem__) == read["completion"]) / n
    model.train()
    return (f"the call's first token {call_p:.3f}, the likeliest length {likeliest:.3f} (mean probabilities); "
            f"answers with the ruler's reading {reads:.2f} (on {n} unseen train-split triangles)")


def _answer(env: Any, length: str) -> str:
    return length if env.config.answer_format == "number" else f"\\boxed{{{length}}}"


def _quiet(message: str) -> None:
    if message.startswith("validation"):
        print(f"  [geometry] {message}", flush=True)
