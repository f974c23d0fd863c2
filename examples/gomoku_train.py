"""Multi-turn RL on gomoku: the tiny model learns to stop making invalid moves.

    python examples/gomoku_train.py [--steps 40] [--seed 0]

Starts the gomoku env server (``python -m env_servers.gomoku_env``, 5x5 board, random opponent) on a
free loopback port, warms the tiny model up with 150 SFT steps on ``<move>r,c</move>`` replies to
real opening boards (random cells, many of them occupied: it learns the format, not the rules; with
much fewer steps its replies end after ``<move>``),
then trains it with per-turn GRPO over several moves per game. Every invalid move costs -1 and
the game goes on, so the rate of penalised turns is the invalid-move rate; it is printed before
and after and plotted to ``runs/gomoku/invalid_rate.png``. Slower than the quick start (longer
multi-turn sequences): about 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.quickstart import env_server

SYSTEM = "Reply with one move as <move>row,col</move> on an empty cell ('.')."


async def demos(url: str, n: int, rng: random.Random) -> list[dict]:
    """``n`` format demonstrations: a real first board from the server, a random cell as the move."""
    from envhub.client import EnvClient

    async def one(i: int) -> dict:
        async with EnvClient(url) as env:
            first = await env.reset(seed=10_000 + i)
        size = first.observation.metadata["board_size"]
        move = f"<move>{rng.randrange(size)},{rng.randrange(size)}</move>"
        return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first.observation.text},
                             {"role": "assistant", "content": move}]}

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/gomoku")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"expected --steps >= 1 (the invalid-move rate is measured over GRPO steps), got {args.steps}")
    import torch

    from trainer.config import load_config
    from trainer.metrics import plot_rewards
    from trainer.model import load_policy
    from trainer.recipes.rl import train
    from trainer.recipes.sft import run_sft

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    server_args = ["--board-size", "5", "--opponent", "random", "--opening-max-stones", "6", "--empty-board-prob", "0"]
    with env_server("env_servers.gomoku_env", server_args, out / "server.log") as url:
        cfg = load_config(None, [
            f"env.url='{url}'", "env.train_task={}", "env.eval_task={}", "env.eval_key='seed'",
            "model.hidden_size=64", "model.num_layers=2", f"model.init_seed={args.seed}",
            "rollout.max_turns=4", "rollout.max_tokens_per_turn=16", "rollout.max_total_tokens=64",
            "rollout.tool_mode='text'", "rollout.use_env_system_prompt=false", f"rollout.system_prompt='{SYSTEM}'",
            "algo.name='grpo_per_turn'", "algo.filter_zero_variance=true",
            "optim.lr=1e-3", "optim.micro_batch_size=32", f"run.steps={args.steps}", "run.batch_size=8",
            "run.group_size=8", "run.eval_problems=32", f"run.seed={args.seed}", f"run.output_dir='{out}'",
            "run.device='cpu'"])
        model, tok = load_policy(cfg.model)
        data = asyncio.run(demos(url, 64, random.Random(args.seed)))
        run_sft(model, tok, data, steps=args.sft_steps, batch_size=16, lr=3e-3, seed=args.seed)
        start = time.monotonic()
        summary = train(cfg, model=model, tokenizer=tok, log=lambda m: None if m.startswith("config") else print(m))
    rates = [json.loads(line)["train/penalised_turn_frac"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "train/penalised_turn_frac" in line]
    k = max(len(rates) // 5, 1)
    first, last = sum(rates[:k]) / k, sum(rates[-k:]) / k
    plot_rewards(out / "metrics.jsonl", out / "invalid_rate.png", keys=["train/penalised_turn_frac"],
                 ylabel="fraction of turns penalised as invalid")
    summary.update({"invalid_rate_first_steps": round(first, 3), "invalid_rate_last_steps": round(last, 3),
                    "train_seconds": round(time.monotonic() - start, 1)})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"invalid-move rate: {first:.2f} over the first {k} steps -> {last:.2f} over the last {k} "
          f"({summary['steps']} steps); plot: {out / 'invalid_rate.png'}")


if __name__ == "__main__":
    main()
