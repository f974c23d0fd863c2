"""Two agents with independent policies learn gomoku against each other, on the CPU.

    python examples/two_agent_gomoku.py                                   # starts a match server itself
    python examples/two_agent_gomoku.py env.url=ws://localhost:8005       # or use a running one
    python examples/two_agent_gomoku.py run.steps=4 run.eval_problems=4   # any config override

1. serves ``GomokuMatchEnv`` (``python -m env_servers.gomoku_env --two-agent``) on a free loopback
   port unless ``env.url`` is given, and stops it at the end;
2. builds the two agents of ``examples/configs/gomoku_two_agent.toml`` (alice: full parameters,
   bob: LoRA), each with its own optimizer;
3. warms each one up on a scripted random player's moves, so that it writes ``<move>r,c</move>``
   (``--warmup-steps 0`` skips it: random tiny models never move legally);
4. trains both against each other, logging each agent's validation reward (against a scripted
   random player, held-out seeds) to ``runs/gomoku_two_agent/<agent>/metrics.jsonl``, with a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from trainer.quickstart import env_server

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "examples" / "configs" / "gomoku_two_agent.toml"


def match_server(log_path: Path, board_size: int) -> AbstractContextManager[str]:
    """``python -m env_servers.gomoku_env --two-agent`` on a free port until the block ends."""
    return env_server("env_servers.gomoku_env", ["--two-agent", "--board-size", str(board_size),
                                                 "--max-invalid-moves", "3"], log_path, cwd=ROOT)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--warmup-steps", type=int, default=100, help="imitation steps per agent before RL (0: none)")
    p.add_argument("--warmup-lr", type=float, default=5e-3)
    p.add_argument("--warmup-games", type=int, default=32, help="scripted games to imitate")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    from trainer.metrics import plot_rewards
    from trainer.recipes.players import Player
    from trainer.recipes.two_agent import build_pool, train_two_agents
    from trainer.recipes.two_agent_config import load_two_agent_config
    from trainer.recipes.two_agent_warmup import demos_from, imitation_warmup, scripted_games

    torch.set_num_threads(args.threads)
    try:
        cfg = load_two_agent_config(args.config, args.overrides)
    except (ValueError, TypeError, OSError) as exc:  # a bad override or config file, said as envhub-train says it
        sys.exit(f"two_agent_gomoku: error: {exc}")
    out = Path(cfg.run.output_dir)
    given_url = any(o.startswith(("env.url=", "env.urls=")) for o in args.overrides)
    server = match_server(out / "server.log", int(cfg.env.train_task.get("board_size", 9))) if not given_url else None
    with server or _as_is(cfg.env.url) as url:
        cfg.env.url = url
        agents = {n: Player(n, a, cfg, out / n) for n, a in cfg.agents.items()}
        if args.warmup_steps:
            pool = build_pool(cfg)
            for name, agent in agents.items():
                games = asyncio.run(scripted_games(pool, agent.tokenizer, cfg.rollout, matches=args.warmup_games,
                                                   seed=cfg.run.seed, reset_kwargs=cfg.env.train_task))
                m = imitation_warmup(agent.model, agent.tokenizer, demos_from(games, max_turns=2),
                                     steps=args.warmup_steps, lr=args.warmup_lr, seed=cfg.run.seed)
                print(f"[two-agent] {name}: imitation warm-up, {args.warmup_steps} steps on {len(games)} scripted "
                      f"seats, loss {m['sft_loss']:.3f}", flush=True)
        summary = train_two_agents(cfg, agents=agents, log=lambda line: print(f"[two-agent] {line}", flush=True))
    for name in agents:
        plot_rewards(out / name / "metrics.jsonl", out / name / "reward.png",
                     keys=["train/reward_mean", "eval/reward_mean"])
    print(json.dumps(summary, indent=2))
    return summary


@contextmanager
def _as_is(url: str | None) -> Iterator[str | None]:
    yield url


if __name__ == "__main__":
    from trainer.model import ModelLoadError
    from trainer.rollout.failures import RolloutFailureError

    try:
        main()
    except (ModelLoadError, RolloutFailureError) as exc:  # the reason is logged above; the match server is stopped
        sys.exit(f"two_agent_gomoku: error: {exc}")
