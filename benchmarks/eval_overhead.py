"""``envhub eval``'s episode loop against the trainer's rollout engine: the same episodes, the same tiny policy.

    python benchmarks/eval_overhead.py [--episodes 128] [--concurrency 8] [--repeats 3] [--max-tokens 12]

Both play the quick start's math tasks (seeds 0..N-1) against one ``python -m env_servers.math_env``
server over WebSocket, ``--concurrency`` episodes in flight, sampling from identical tiny models with the same HF
sampler: once through :class:`trainer.rollout.RolloutEngine` (token-exact, what training uses) and
once through :func:`envhub.eval.runner.play_all` with the ``local`` chat model (OpenAI messages, the
whole chat re-rendered per turn, one JSON line per episode written). Runs alternate; it prints the
median wall times and the ratio eval / engine: what evaluating through chat messages costs.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from envhub.eval.episode import EpisodeLimits, EpisodeSpec
from envhub.eval.runner import Progress, play_all
from trainer.chat_model import LocalChatModel
from trainer.local_server import free_port
from trainer.quickstart import math_server, parse_args, task_of
from trainer.rollout import EnvPool, RolloutConfig, RolloutEngine, make_tasks
from trainer.sampling import HFSampler


def run_engine(engine: RolloutEngine, task: dict, episodes: int) -> float:
    tasks = make_tasks([{**task, "seed": i} for i in range(episodes)], 1, engine.pool.urls)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    trajs = engine.run_sync(tasks)
    wall = time.perf_counter() - t0
    if any(t.infra_failed for t in trajs):
        raise RuntimeError(f"an episode failed: {next(t.error for t in trajs if t.infra_failed)}")
    return wall


def run_eval(model: LocalChatModel, url: str, task: dict, episodes: int, concurrency: int, out: Path) -> float:
    specs = [EpisodeSpec(i, 0, i, dict(task)) for i in range(episodes)]
    out.write_text("")
    limits = EpisodeLimits(max_turns=1, system_prompt=None)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    asyncio.run(play_all(url, model, specs, limits, concurrency, out, Progress(episodes, 0, io.StringIO())))
    wall = time.perf_counter() - t0
    failed = [line for line in out.read_text().splitlines() if '"reward": null' in line]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed: {failed[0][:500]}")
    return wall


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8, help="episodes in flight (both)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: checks that the script still runs (CI does this)")
    args = p.parse_args(argv)
    if args.smoke:
        args.episodes, args.repeats = 8, 1
    torch.set_num_threads(1)
    task = task_of(parse_args([]))
    chat_model = LocalChatModel("tiny", max_tokens=args.max_tokens)  # the default tiny shape, init seed 0
    engine_sampler = HFSampler(chat_model.model, chat_model.tokenizer)  # the same weights
    cfg = RolloutConfig(max_tokens_per_turn=args.max_tokens, max_turns=1, max_in_flight=args.concurrency)
    times: dict[str, list[float]] = {"rollout engine (token-exact)": [], "envhub eval (chat messages)": []}
    with tempfile.TemporaryDirectory() as tmp, math_server(free_port(), Path(tmp) / "math.log") as url:
        engine = RolloutEngine(EnvPool(urls=[url]), engine_sampler, chat_model.tokenizer, cfg)
        results = Path(tmp) / "results.jsonl"
        run_engine(engine, task, args.episodes)  # warm-up: imports, first connections
        run_eval(chat_model, url, task, args.episodes, args.concurrency, results)
        for _ in range(args.repeats):
            times["rollout engine (token-exact)"].append(run_engine(engine, task, args.episodes))
            times["envhub eval (chat messages)"].append(run_eval(chat_model, url, task, args.episodes, args.concurrency, results))
        engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.episodes} single-turn math episodes, {args.max_tokens} tokens per reply, {args.concurrency} in flight, "
          f"median of {args.repeats} (alternating runs)")
    for name, m in med.items():
        print(f"  {name:30s} {m:7.3f} s   {args.episodes / m:8.1f} episodes/s   runs: "
              + ", ".join(f"{t:.3f}" for t in times[name]))
    print(f"  ratio eval / engine: {med['envhub eval (chat messages)'] / med['rollout engine (token-exact)']:.3f}")


if __name__ == "__main__":
    main()
