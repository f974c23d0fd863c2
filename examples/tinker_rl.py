"""GRPO in the client/server split: episodes and the loop here, every model computation behind the ``tinker`` SDK.

    python examples/tinker_rl.py            # starts the math env server and `envhub-train serve`, then trains
    python examples/tinker_rl.py --base-url http://HOST:8900 --env-url http://HOST:8001 --model-name NAME

The client (this file) owns the environment and the algorithm: it draws single-digit ``add`` problems
from an envhub math env server through ``envhub.OpenEnv``, renders prompts with the tiny model's
tokenizer, and runs the loop tinker-cookbook's ``rl_loop`` runs, over four SDK calls:
``save_weights_and_get_sampling_client`` -> ``sample`` -> ``forward_backward`` -> ``optim_step``.
The service owns the weights, the optimizer and the sampler. Like ``python -m trainer.quickstart`` it
first warms the random tiny model up with SFT on the server's train split (``cross_entropy``, until
greedy train accuracy reaches ``--sft-target``), then runs GRPO: 8 samples per problem, advantages
centred per group and divided by its std, groups with equal rewards dropped, negative advantages
dropped (``--negative-weight 0``: learn from better-than-average samples), ``importance_sampling``
loss with every advantage divided by the step's completion tokens (Tinker losses are sums: this
makes it a token mean). Validation is greedy, on every held-out validation problem, before and
after GRPO. Writes ``runs/tinker_rl/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinker
from tinker import types

from envhub import OpenEnv
from envhub.errors import EnvHubError
from trainer.quickstart import math_server
from trainer.service.serve import check_service, local_service

NAME = "tinker_rl"
TASK = {"kind": "add", "difficulty": 1}
_START = time.monotonic()


def log(message: str) -> None:
    print(f"[tinker_rl {time.monotonic() - _START:5.0f}s] {message}", flush=True)


# -- the two servers ------------------------------------------------------------------------------

def training_service(out: Path, seed: int):
    """``envhub-train serve`` on a free loopback port for the block: the tiny model, full-parameter."""
    return local_service(["--full-parameter", "--threads", "1", "--state-dir", str(out / "service"),
                          "--model-config", f"init_seed={seed}"], out / "service.log")


# -- episodes (client side) -----------------------------------------------------------------------

class MathEpisodes:
    """Prompts and rewards from the env server through ``OpenEnv``: each ``reset`` starts a new episode, and each
    worker thread keeps its own session open for the next one."""

    def __init__(self, url: str, tokenizer: Any, workers: int = 16):
        self.url, self.tokenizer = url, tokenizer
        self.pool = ThreadPoolExecutor(workers)
        self._local = threading.local()
        self._envs: list[OpenEnv] = []
        self._prompts: dict[tuple[str, int], list[int]] = {}

    def _env(self) -> OpenEnv:
        if not hasattr(self._local, "env"):
            self._local.env = OpenEnv(self.url, action_mapper=lambda _name, args: {"text": args["text"]})
            self._envs.append(self._local.env)
        return self._local.env

    def size(self, split: str) -> int:
        return int(self._env().reset(split=split, index=0, **TASK).observation.metadata["split_size"])

    def prompt(self, split: str, index: int) -> list[int]:
        if (split, index) not in self._prompts:
            obs = self._env().reset(split=split, index=index, **TASK).observation
            messages = [{"role": "system", "content": obs.metadata["system_prompt"]},
                        {"role": "user", "content": obs.text}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            self._prompts[split, index] = self.tokenizer.encode(text, add_special_tokens=False)
        return self._prompts[split, index]

    def reward(self, split: str, index: int, completion: list[int]) -> float:
        env = self._env()
        env.reset(split=split, index=index, **TASK)
        return env.step("answer", {"text": self.tokenizer.decode(completion, skip_special_tokens=True)}).reward

    def rewards(self, jobs: list[tuple[str, int, list[int]]]) -> list[float]:
        return list(self.pool.map(lambda job: self.reward(*job), jobs))

    def answer(self, split: str, index: int) -> str:
        env = self._env()
        env.reset(split=split, index=index, **TASK)
        return str(env.step("answer", {"text": ""}).info["ground_truth"])  # the grader names the expected answer

    def close(self) -> None:
        self.pool.shutdown()
        for env in self._envs:
            env.close()


# -- the loop (client side; model work through the SDK) -------------------------------------------

def sample_all(sampler: Any, prompts: list[list[int]], n: int, temperature: float, max_tokens: int) -> list[Any]:
    """One ``sample`` call per prompt, all in flight at once; returns each call's sequences."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    futures = [sampler.sample(types.ModelInput.from_ints(p), n, params) for p in prompts]
    return [f.result().sequences for f in futures]


def accuracy(sampler: Any, episodes: MathEpisodes, split: str, indices: list[int], max_tokens: int) -> float:
    seqs = sample_all(sampler, [episodes.prompt(split, i) for i in indices], 1, 0.0, max_tokens)
    rewards = episodes.rewards([(split, i, s[0].tokens) for i, s in zip(indices, seqs)])
    return sum(rewards) / len(rewards)


def datum(prompt: list[int], completion: list[int], **per_token: list[float]) -> types.Datum:
    """Input ``prompt + completion[:-1]`` predicting ``(prompt + completion)[1:]``; per-token inputs are 0 on the
    prompt and given for each completion token."""
    tokens = prompt + completion
    pad = [0.0] * (len(prompt) - 1)
    inputs = {"target_tokens": tokens[1:], **{k: pad + list(v) for k, v in per_token.items()}}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def sft_warmup(tc: Any, episodes: MathEpisodes, args: argparse.Namespace, n_train: int) -> tuple[int, float]:
    """SFT on each train problem's expected answer until greedy train accuracy reaches ``--sft-target``."""
    eos = [episodes.tokenizer.eos_token_id]
    answers = episodes.pool.map(lambda i: episodes.answer("train", i), range(n_train))
    demos = [(episodes.prompt("train", i), episodes.tokenizer.encode(f"\\boxed{{{answer}}}") + eos)
             for i, answer in enumerate(answers)]
    order = list(range(n_train))
    random.Random(args.seed).shuffle(order)
    acc, step = 0.0, 0
    for step in range(1, args.sft_steps + 1):
        batch = [demos[order[(step * 32 + j) % n_train]] for j in range(32)]
        n_tokens = sum(len(c) for _, c in batch)
        fb = tc.forward_backward([datum(p, c, weights=[1.0 / n_tokens] * len(c)) for p, c in batch], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=args.sft_lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                       weight_decay=args.weight_decay, grad_clip_norm=1.0)).result()
        loss = fb.result().metrics["loss:sum"]  # the token-mean NLL, as the weights sum to 1
        if step % 10 == 0:
            acc = accuracy(tc.save_weights_and_get_sampling_client().result(), episodes, "train",
                           list(range(min(n_train, args.check_problems or n_train))), args.max_tokens)
            log(f"SFT step {step}: loss {loss:.3f}, greedy train accuracy {acc:.2f}")
            if acc >= args.sft_target:
                break
    return step, acc


def grpo_step(tc: Any, episodes: MathEpisodes, indices: list[int], args: argparse.Namespace, lr: float) -> dict:
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompts = [episodes.prompt("train", i) for i in indices]
    groups = sample_all(sampler, prompts, args.group, 1.0, args.max_tokens)
    rewards = episodes.rewards([("train", i, s.tokens) for i, g in zip(indices, groups) for s in g])
    rows = []  # (prompt, sequence, advantage)
    for k, (prompt, group) in enumerate(zip(prompts, groups)):
        r = rewards[k * args.group:(k + 1) * args.group]
        mean = sum(r) / len(r)
        std = (sum((x - mean) ** 2 for x in r) / (len(r) - 1)) ** 0.5
        if std == 0:
            continue  # a group with equal rewards carries no signal
        for seq, reward in zip(group, r):
            adv = (reward - mean) / (std + 1e-6)
            rows.append((prompt, seq, adv if adv > 0 else adv * args.negative_weight))
    if rows:
        n_tokens = sum(len(s.tokens) for _, s, _ in rows)
        data = [datum(p, s.tokens, logprobs=s.logprobs, advantages=[a / n_tokens] * len(s.tokens)) for p, s, a in rows]
        fb = tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                       weight_decay=args.weight_decay, grad_clip_norm=1.0)).result()
        fb.result()
    return {"reward": sum(rewards) / len(rewards), "kept_groups": len(rows) // args.group}


def run(args: argparse.Namespace, base_url: str, env_url: str) -> dict[str, Any]:
    from trainer.tokenizer import build_tiny_tokenizer

    episodes = MathEpisodes(env_url, build_tiny_tokenizer())
    n_train, n_val = episodes.size("train"), episodes.size("validation")
    service = tinker.ServiceClient(base_url=base_url, api_key=args.api_key)
    try:
        tc = service.create_lora_training_client(base_model=args.model_name, rank=8, seed=args.seed).result()
        sft_steps, sft_acc = sft_warmup(tc, episodes, args, n_train)
        val = list(range(n_val))
        before = accuracy(tc.save_weights_and_get_sampling_client().result(), episodes, "validation", val,
                          args.max_tokens)
        log(f"validation reward before GRPO: {before:.3f} ({n_val} held-out problems)")
        history = []
        for step in range(args.steps):
            lr = args.lr * min(1.0, (step + 1) / 5) * (1 - step / args.steps)  # warm-up, then linear decay
            indices = [(step * args.batch + j) % n_train for j in range(args.batch)]
            history.append(grpo_step(tc, episodes, indices, args, lr))
            if step % 10 == 0 or step == args.steps - 1:
                log(f"GRPO step {step}: train reward {history[-1]['reward']:.3f}")
        after = accuracy(tc.save_weights_and_get_sampling_client().result(), episodes, "validation", val,
                         args.max_tokens)
        log(f"validation reward after GRPO: {after:.3f}")
    finally:
        service.close("success").result(timeout=30)
        episodes.close()
    return {"val_reward_before": before, "val_reward_after": after, "rise": after - before, "sft_steps": sft_steps,
            "sft_train_accuracy": sft_acc, "grpo_steps": args.steps,
            "train_reward_first": history[0]["reward"] if history else None,
            "train_reward_last": history[-1]["reward"] if history else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running envhub-train serve (default: start one, full-parameter tiny model)")
    p.add_argument("--env-url", help="a running math env server (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", "tml-local"))
    p.add_argument("--model-name", default="tiny", help="the base_model the service serves (default tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60, help="GRPO steps")
    p.add_argument("--batch", type=int, default=48, help="problems per GRPO step")
    p.add_argument("--group", type=int, default=8, help="samples per problem")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--negative-weight", type=float, default=0.0)
    p.add_argument("--sft-steps", type=int, default=600, help="the most SFT warm-up steps")
    p.add_argument("--sft-target", type=float, default=0.5)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--check-problems", type=int, default=0,
                   help="train problems in each SFT accuracy check (default 0: all of them)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--out", default="runs/tinker_rl")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    start = time.monotonic()
    if args.base_url:
        try:
            check_service(args.base_url)
        except RuntimeError as exc:
            sys.exit(f"{NAME}: error: {exc} or leave out --base-url")
    with ExitStack() as stack:
        env_url = args.env_url or stack.enter_context(math_server(0, out / "math_server.log"))
        base_url = args.base_url or stack.enter_context(training_service(out, args.seed))
        log(f"env server {env_url}, training service {base_url}")
        try:
            summary = run(args, base_url, env_url)
        except EnvHubError as exc:  # the env server is not there or went away; the servers started here stop
            sys.exit(f"{NAME}: error: {exc}")
    summary["seconds"] = round(time.monotonic() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[tinker_rl] rise {summary['rise']:+.3f} in {summary['seconds']:.0f} s; wrote {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    # `kill` / a CI timeout sends SIGTERM: raise instead, so the servers this script started are stopped
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    main()
