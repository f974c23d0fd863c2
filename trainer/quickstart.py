"""The quick start: a tiny model learns single-digit arithmetic with GRPO against the math env server.

``python -m trainer.quickstart`` (or ``bash scripts/quickstart.sh``) does, on CPU, in a few minutes:

1. starts the math env server as a local process (``python -m env_servers.math_env``) on a free
   loopback port, and stops it at the end, also on an error or Ctrl-C;
2. builds a tiny Qwen2 model (random weights, the shipped byte-level tokenizer);
3. warms it up with SFT on demonstrations from the server's *train* split (each of its 125
   single-digit ``add`` problems once: the answer format ``\\boxed{N}`` and a first grip on the
   sums), stopping as soon as its greedy accuracy on the train problems reaches ``--sft-target``
   (0.5; validation accuracy is then about 0.3);
4. trains it with GRPO over WebSocket (48 problems x 8 samples per step; negative advantages
   weighted by ``--negative-weight``, 0 by default: each step learns from the samples that beat
   their group's mean, which a tiny model from a weak start does several times faster than with
   the full estimator; the learning rate decays linearly to 0), evaluating greedy answers on
   held-out *validation* problems before and after: every one of the validation split's 19
   problems once (a disjoint split: sums the model never trained on, graded by the same server);
5. writes ``runs/quickstart/``: ``summary.json``, ``metrics.jsonl``, ``trajectories.jsonl``,
   ``reward.png`` and a checkpoint.

Options: ``--seed``, ``--steps``, ``--sft-steps``, ``--out``, ``--threads`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import local_server, while_parent
from trainer.local_server import free_port

if TYPE_CHECKING:
    from torch import nn

    from trainer.config import TrainConfig
    from trainer.rollout.engine import RolloutEngine

SYSTEM_PROMPT = "Put the answer in \\boxed{}."


@contextmanager
def env_server(module: str, args: list[str], log_path: Path, *, port: int | None = None,
               cwd: str | Path | None = None) -> Iterator[str]:
    """Run ``python -m <module> --host 127.0.0.1 --port <port> <args>`` until the block ends (whatever ends it)
    or this process does (a SIGKILL too: the server gets SIGTERM, on Linux).

    Yields the server's ``http://`` URL once ``/health`` answers; output goes to ``log_path``.
    """
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    argv = while_parent.argv(module, "--host", "127.0.0.1", "--port", str(port), *args)  # ends with this process
    proc = local_server.start(argv, url, log_path, what=f"The env server ({module})", cwd=cwd)
    try:
        yield url
    finally:
        local_server.stop(proc)


def math_server(port: int, log_path: Path) -> AbstractContextManager[str]:
    """The math env server (the quick start's system prompt, no extra instruction) on ``port``."""
    return env_server("env_servers.math_env", ["--system-prompt", SYSTEM_PROMPT, "--instruction", ""], log_path,
                      port=port)


def _rise(before: float | None, after: float | None) -> float | None:
    """after - before, or None when a validation completed no episode (it has no score)."""
    return round(after - before, 4) if before is not None and after is not None else None


def _score(value: float | None) -> str:
    return "none (no episode completed)" if value is None else f"{value:.3f}"


def task_of(args: argparse.Namespace) -> dict[str, Any]:
    """The math env task family the quick start trains and evaluates on."""
    return {"kind": args.kind, "difficulty": args.difficulty}


async def collect_demos(url: str, n: int, seed: int, task: dict[str, Any], *,
                        by_index: bool = False) -> list[dict[str, Any]]:
    """``n`` demonstrations from the server's train split: its prompt, and the answer its grader expects.

    ``by_index`` asks for train problems ``0..n-1`` (for a split the env lists whole, each problem
    once); otherwise each demonstration is a problem drawn with its own seed.
    """
    from envhub.client import EnvClient

    async def one(i: int) -> dict[str, Any]:
        pick = {"index": i} if by_index else {"seed": seed * 100_003 + i}
        async with EnvClient(url) as env:
            first = await env.reset(split="train", **pick, **task)
            graded = await env.step({"text": ""})  # an empty answer: the grader reports the expected one
        truth = graded.info["ground_truth"]
        messages = [{"role": "system", "content": first.observation.metadata["system_prompt"]},
                    {"role": "user", "content": first.observation.text},
                    {"role": "assistant", "content": f"\\boxed{{{truth}}}"}]
        return {"messages": messages}

    sem = asyncio.Semaphore(32)

    async def gated(i: int) -> dict[str, Any]:
        async with sem:
            return await one(i)

    return list(await asyncio.gather(*(gated(i) for i in range(n))))


def quickstart_config(url: str, args: argparse.Namespace) -> TrainConfig:
    """The GRPO config the quick start runs (tuned for 2 CPU cores)."""
    from trainer.config import load_config

    return load_config(None, [
        f"env.url='{url}'",
        f"env.train_task={{ split = 'train', kind = '{args.kind}', difficulty = {args.difficulty} }}",
        f"env.eval_task={{ split = 'validation', kind = '{args.kind}', difficulty = {args.difficulty} }}",
        "env.eval_key='index'",
        f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "model.num_heads=4",
        "model.num_kv_heads=2", f"model.intermediate_size={4 * args.hidden}", f"model.init_seed={args.seed}",
        "rollout.max_tokens_per_turn=12", "rollout.max_total_tokens=12", "rollout.max_in_flight=256",
        "sampling.temperature=1.0", f"sampling.backend='{args.sampler}'",
        f"rollout.max_staleness={args.max_staleness}",
        "algo.name='grpo'", "algo.filter_zero_variance=true", "algo.clip_eps=0.2",
        f"algo.negative_weight={args.negative_weight}",
        f"algo.epochs={args.epochs}", f"algo.minibatches={args.minibatches}",
        f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}", "optim.lr_schedule='linear'",
        f"optim.weight_decay={args.weight_decay}",
        "optim.micro_batch_size=256", "optim.grad_clip=1.0",
        f"run.steps={args.steps}", f"run.batch_size={args.batch}", f"run.group_size={args.group}",
        *([f"run.eval_problems={args.eval_problems}"] if args.eval_problems is not None else []),
        f"run.eval_every={args.eval_every}", f"run.seed={args.seed}",
        f"run.output_dir='{args.out}'",
        "run.log_trajectories=4", "run.device='cpu'",
        *([f"sampling.servers={args.sampler_servers.split(',')!r}"] if args.sampler_servers else []),
    ])


async def listed_size(url: str, split: str, task: dict[str, Any]) -> int | None:
    """How many problems ``split`` holds when the env lists it whole (its ``split_size`` metadata), else None."""
    from envhub.client import EnvClient

    async with EnvClient(url) as env:
        first = await env.reset(split=split, index=0, **task)
    return first.observation.metadata.get("split_size")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.quickstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", default="add", help="math_env task family (default: add, single digits at difficulty 1)")
    p.add_argument("--difficulty", type=int, default=1, help="task difficulty 1-3 (default 1)")
    p.add_argument("--steps", type=int, default=200, help="GRPO steps")
    p.add_argument("--sft-steps", type=int, default=600, help="the most SFT warm-up steps")
    p.add_argument("--sft-target", type=float, default=0.5,
                   help="stop the SFT warm-up once greedy accuracy on train problems reaches this")
    p.add_argument("--sft-demos", type=int, default=512,
                   help="demonstrations drawn for the warm-up when the train split is not listed whole "
                        "(add at difficulty 1-2 uses every train problem once)")
    p.add_argument("--batch", type=int, default=48, help="tasks per GRPO step")
    p.add_argument("--group", type=int, default=8, help="samples per task")
    p.add_argument("--lr", type=float, default=2e-3, help="GRPO learning rate (decays linearly to 0)")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5, help="GRPO learning-rate warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=1, help="optimisation passes over each batch of rollouts")
    p.add_argument("--minibatches", type=int, default=1, help="optimizer steps per pass")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--negative-weight", type=float, default=0.0,
                   help="scale of negative GRPO advantages "
                        "(default 0: learn from better-than-average samples; 1: unbiased)")
    p.add_argument("--eval-problems", type=int, default=None,
                   help="validation episodes (default: every validation problem once when the server "
                        "lists the split whole, as for add at difficulty 1-2; else 64)")
    p.add_argument("--eval-every", type=int, default=25,
                   help="also evaluate every N GRPO steps (0: before and after only)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for a tiny model)")
    p.add_argument("--sampler", choices=["hf", "vllm"], default="hf",
                   help="hf (transformers generate) or vllm (needs the vllm extra: scripts/setup.sh envs,train,vllm; "
                        "the tiny model then has 2 heads of 32 instead of 4 of 16)")
    p.add_argument("--max-staleness", type=int, default=0,
                   help="asynchronous rollouts: sample the next batch while a step trains, at most this many "
                        "policy versions behind (default 0: synchronous)")
    p.add_argument("--sampler-servers", default=None, metavar="URL,...",
                   help="sample on these envhub-train sampler servers (started with the same model settings) "
                        "instead of in process; the weights are pushed to them after every step")
    p.add_argument("--out", default="runs/quickstart")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.monotonic()
    import torch

    from trainer.model import load_policy
    from trainer.recipes.rl import build_engine, train
    from trainer.recipes.sft import run_sft

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "trajectories.jsonl"):
        (out / stale).unlink(missing_ok=True)
    port = free_port()
    print(f"[quickstart] starting the math env server on port {port} (log: {out / 'math_server.log'})", flush=True)
    with math_server(port, out / "math_server.log") as url:
        args.train_size = asyncio.run(listed_size(url, "train", task_of(args)))
        if args.eval_problems is None:
            args.eval_problems = asyncio.run(listed_size(url, "validation", task_of(args))) or 64
        cfg = quickstart_config(url, args)
        model, tok = load_policy(cfg.model)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[quickstart] tiny Qwen2 policy: {n_params / 1e3:.0f}k parameters, vocabulary {len(tok)}", flush=True)
        demos = asyncio.run(collect_demos(url, args.train_size or args.sft_demos, args.seed, task_of(args),
                                          by_index=args.train_size is not None))
        print(f"[quickstart] SFT warm-up: at most {args.sft_steps} steps on {len(demos)} train-split demonstrations, "
              f"until greedy accuracy on train problems reaches {args.sft_target:.2f}", flush=True)
        probe = build_engine(cfg, model, tok)
        sft = run_sft(model, tok, demos, steps=args.sft_steps, batch_size=32, lr=args.sft_lr, seed=args.seed,
                      weight_decay=args.weight_decay, stop_when=lambda step: _warm(probe, url, step, args, model),
                      check_every=10)
        probe.close()
        if hasattr(probe.sampler, "close"):
            probe.sampler.close()
        print(f"[quickstart] GRPO: {args.steps} steps x {args.batch} tasks x {args.group} samples over {url}", flush=True)
        summary = train(cfg, model=model, tokenizer=tok, log=_quiet_log)
    summary.update({"sft_steps": int(sft["steps"]), "sft_final_loss": round(sft["sft_loss"], 4), "seed": args.seed,
                    "parameters": n_params, "seconds": round(time.monotonic() - start, 1),
                    "rise": _rise(summary["val_reward_before"], summary["val_reward_after"])})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[quickstart] validation reward before GRPO: {_score(summary['val_reward_before'])}  "
          f"after: {_score(summary['val_reward_after'])}  ({summary['eval_episodes']} held-out episodes)")
    print(f"[quickstart] {summary['steps']} GRPO steps, {summary['seconds']:.0f} s in all; wrote {out}/summary.json "
          f"and {summary['reward_plot']}", flush=True)
    return summary


def train_accuracy(engine: RolloutEngine, url: str, task: dict[str, Any], n: int) -> float:
    """Greedy accuracy on ``n`` train-split problems (never validation ones)."""
    from trainer.rollout import make_tasks

    trajs = engine.run_sync(make_tasks([{**task, "split": "train", "index": i} for i in range(n)], 1, [url]),
                            greedy=True)
    return sum(t.reward for t in trajs) / len(trajs)


def _warm(engine: RolloutEngine, url: str, step: int, args: argparse.Namespace, model: nn.Module | None = None) -> bool:
    if model is not None:  # a vLLM probe holds its own weights: give it the SFT model's (HF shares them)
        engine.sampler.update_weights(model, 0)
    acc = train_accuracy(engine, url, task_of(args), args.train_size or 64)
    done = bool(acc >= args.sft_target)
    if done or step % 50 == 0:
        print(f"[quickstart] SFT step {step}: greedy accuracy on train problems {acc:.2f}", flush=True)
    return done


def _quiet_log(message: str) -> None:
    # The full config goes to config.json; the console gets the one-line messages.
    if not message.startswith("config:"):
        print(f"[quickstart] {message}", flush=True)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt, so a script's env server is stopped on the way out."""
    # `kill` / a CI timeout sends SIGTERM: raise so that env_server's `finally` stops the server.
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    exit_on_sigterm()
    try:
        main()
    except KeyboardInterrupt:
        print("\n[quickstart] interrupted; the math server was stopped.", file=sys.stderr)
        sys.exit(130)
