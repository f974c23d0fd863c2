"""Rollout overhead of the network: the same rollouts with the math env in process and over WebSocket.

    python benchmarks/rollout_overhead.py [--episodes 256] [--repeats 3] [--sampler hf|scripted]

Runs identical episodes (same tasks, same sampling seed, the tiny policy from the quick start)
once with ``MathEnv`` driven by ``EnvRunner`` inside the trainer process and once against
``python -m env_servers.math_env`` over WebSocket, alternating, and prints the median wall
times and their ratio (target: <= 1.1). ``--sampler scripted`` replaces the model by a
zero-cost policy to show the raw env + transport cost per episode.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from env_servers.math_env.env import MathEnv
from trainer.local_server import free_port
from trainer.model import ModelConfig, load_policy
from trainer.quickstart import SYSTEM_PROMPT, math_server, parse_args, task_of
from trainer.rollout import EnvPool, RolloutConfig, RolloutEngine, make_tasks
from trainer.sampling import GenRequest, HFSampler, SampledSequence


class InProcessMath(MathEnv):
    """MathEnv with the quick start's server options."""

    def __init__(self) -> None:
        super().__init__(system_prompt=SYSTEM_PROMPT, instruction="")


class ScriptedPolicy:
    """Answers ``\\boxed{0}`` instantly: what is left is env + transport time."""

    version = 0

    def __init__(self, tok):
        self.ids = tok.encode("\\boxed{0}", add_special_tokens=False) + [tok.eos_token_id]

    def update_weights(self, model, version: int) -> None:
        self.version = version

    async def generate(self, request: GenRequest) -> SampledSequence:
        await asyncio.sleep(0)
        return SampledSequence(list(self.ids), [0.0] * len(self.ids), "stop")


def run_once(engine: RolloutEngine, episodes: int, seed: int) -> tuple[float, float]:
    task = task_of(parse_args([]))  # the quick start's task family
    tasks = make_tasks([{**task, "split": "train", "seed": seed + i} for i in range(episodes // 8)], 8,
                       engine.pool.urls or None)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    trajs = engine.run_sync(tasks)
    wall = time.perf_counter() - t0
    failed = sum(t.infra_failed for t in trajs)
    if failed:
        raise RuntimeError(f"{failed} episodes failed: {next(t.error for t in trajs if t.infra_failed)}")
    return wall, sum(t.reward for t in trajs) / len(trajs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sampler", choices=["hf", "scripted"], default="hf")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds: checks that the script still runs (CI does this)")
    args = p.parse_args(argv)
    if args.smoke:
        args.episodes, args.repeats = 16, 1
    torch.set_num_threads(args.threads)
    model, tok = load_policy(ModelConfig())
    make_sampler = (lambda: HFSampler(model, tok)) if args.sampler == "hf" else (lambda: ScriptedPolicy(tok))
    times: dict[str, list[float]] = {"in process (EnvRunner)": [], "WebSocket (server process)": []}
    cfg = RolloutConfig(max_tokens_per_turn=12, max_in_flight=256)
    with math_server(free_port(), Path("runs/bench/math_server.log")) as url:
        engines = [RolloutEngine(EnvPool(env_cls=InProcessMath), make_sampler(), tok, cfg),
                   RolloutEngine(EnvPool(urls=[url]), make_sampler(), tok, cfg)]
        for engine in engines:  # warm-up: imports, first connections (a training loop keeps them open)
            run_once(engine, args.episodes, 0)
        for r in range(args.repeats):
            for name, engine in zip(times, engines):
                times[name].append(run_once(engine, args.episodes, 1000 * (r + 1))[0])
        for engine in engines:
            engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.episodes} math episodes, sampler={args.sampler}, median of {args.repeats} (alternating runs)")
    for name, m in med.items():
        print(f"  {name:28s} {m:7.3f} s   {args.episodes / m:8.1f} episodes/s   runs: "
              + ", ".join(f"{t:.3f}" for t in times[name]))
    ratio = med["WebSocket (server process)"] / med["in process (EnvRunner)"]
    print(f"  ratio WebSocket / in process: {ratio:.3f}  (target <= 1.1)")


if __name__ == "__main__":
    main()
