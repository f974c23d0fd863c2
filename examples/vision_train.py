"""A vision-language policy learns from images what text alone cannot tell: the colour of the shape.

    python examples/vision_train.py                 # about 10 min on 2 CPU cores: both runs, the table
    python examples/vision_train.py --policies tiny-vl --steps 40

It starts the shapes env (``examples/shapes_env.py``) as a server on a free loopback port (its PNGs
travel as msgpack binary frames), then for each policy, from the same config
(``examples/configs/shapes_vision_grpo.toml``):

1. builds it locally: ``tiny-vl`` (a random Qwen2-VL: vision tower + tiny language model, the
   picture becomes 36 image tokens) or ``tiny`` (the text-only Qwen2: it sees the question alone);
2. warms it up with SFT on the answer *format*: the question (with its picture, for ``tiny-vl``)
   answered by a colour letter (r, g, b, k) drawn at random, independent of the picture, so the
   warm-up teaches "answer with one of four letters" and nothing about which;
3. trains it with GRPO against the server and validates greedy answers on the 40 held-out pictures
   (10 per colour) before and after.

The vision run rises well above chance (0.25); the text-only run cannot, whatever it learns. The
table and ``runs/vision/summary.json`` give both, ``runs/vision/<policy>/`` each run's metrics.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.shapes_env import COLOURS, LETTERS, QUESTION, SHAPES, draw  # noqa: E402

CONFIG = ROOT / "examples" / "configs" / "shapes_vision_grpo.toml"


def format_demos(n: int, seed: int, system_prompt: str) -> list[dict[str, Any]]:
    """``n`` warm-up demonstrations: a training-style picture and question, answered by a random colour's letter."""
    rng = random.Random(seed)
    demos = []
    for _ in range(n):
        picture = draw(rng.choice(list(COLOURS)), rng.choice(SHAPES), rng)
        prompt = [{"role": "system", "content": system_prompt},
                  {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": QUESTION}]}]
        demos.append({"prompt": prompt, "completion": LETTERS[rng.choice(list(COLOURS))]})
    return demos


def run_policy(name: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up and train one policy against the server at ``url``; its summary."""
    from trainer.config import load_config
    from trainer.model import load_policy
    from trainer.recipes.rl import train
    from trainer.recipes.sft import run_sft
    from trainer.vision import load_vision_processor

    out = Path(args.out) / name
    cfg = load_config(CONFIG, [f"model.name='{name}'", f"env.url='{url}'", f"run.steps={args.steps}",
                               f"run.eval_problems={args.eval_problems}", f"run.eval_every={args.eval_every}",
                               f"run.seed={args.seed}", f"model.init_seed={args.seed}", f"run.output_dir='{out}'",
                               f"run.batch_size={args.batch}"])
    for stale in ("metrics.jsonl", "trajectories.jsonl"):
        (out / stale).unlink(missing_ok=True)
    start = time.monotonic()
    model, tok = load_policy(cfg.model)
    print(f"[vision] {name}: {sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters; SFT format warm-up, "
          f"{args.sft_steps} steps", flush=True)
    run_sft(model, tok, format_demos(args.sft_demos, args.seed, cfg.rollout.system_prompt), steps=args.sft_steps,
            batch_size=32, lr=1e-2,
            seed=args.seed, vision=load_vision_processor(cfg.model, tok))
    print(f"[vision] {name}: GRPO, {args.steps} steps x {cfg.run.batch_size} pictures x {cfg.run.group_size} "
          "samples", flush=True)
    summary = train(cfg, model=model, tokenizer=tok, log=lambda m: None if m.startswith("config:") else
                    print(f"[vision] {name}: {m}", flush=True))
    summary["rise"] = round(summary["val_reward_after"] - summary["val_reward_before"], 4)
    summary["seconds"] = round(time.monotonic() - start, 1)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the tiny vision policy and a text-only one on the colour of a "
                                            "shape; compare their held-out validation rise.")
    p.add_argument("--policies", default="tiny-vl,tiny", help="comma-separated model.name values to run")
    p.add_argument("--steps", type=int, default=60, help="GRPO steps per policy")
    p.add_argument("--batch", type=int, default=24, help="pictures per GRPO step (6 samples each)")
    p.add_argument("--sft-steps", type=int, default=25, help="format warm-up steps (random colour answers)")
    p.add_argument("--sft-demos", type=int, default=256)
    p.add_argument("--eval-problems", type=int, default=40, help="held-out pictures (balanced over the 4 colours)")
    p.add_argument("--eval-every", type=int, default=10, help="validate every N steps as well (0: before/after only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", default="runs/vision")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from trainer.local_server import free_port
    from trainer.quickstart import env_server

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with env_server("examples.shapes_env", [], out / "shapes_server.log", port=free_port(), cwd=ROOT) as url:
        print(f"[vision] shapes env serving at {url}", flush=True)
        for name in args.policies.split(","):
            results[name] = run_policy(name.strip(), url, args)
    print(f"\n{'policy':<10} {'val before':>10} {'val after':>10} {'rise':>7} {'seconds':>8}")
    for name, s in results.items():
        print(f"{name:<10} {s['val_reward_before']:>10.3f} {s['val_reward_after']:>10.3f} {s['rise']:>+7.3f} "
              f"{s['seconds']:>8.0f}")
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    from trainer.model import ModelLoadError
    from trainer.quickstart import exit_on_sigterm
    from trainer.rollout.failures import RolloutFailureError

    exit_on_sigterm()
    try:
        main()
    except (ModelLoadError, RolloutFailureError) as exc:  # a --policies name that is not there, a failing env
        sys.exit(f"[vision] error: {exc}")
    except KeyboardInterrupt:
        print("\n[vision] interrupted; the shapes env server was stopped.", file=sys.stderr)
        sys.exit(130)
