"""A warmed-up tiny base model for the tenants: full-parameter SFT in process, exported in Hugging Face format.

The random tiny model solves none of the math env's ``add`` problems, so GRPO from it has no reward to
raise. Like ``examples/tinker_rl.py`` the benchmark first warms it up with SFT on the train split's
expected answers (``\\boxed{answer}`` after the chat prompt the tenants sample from), here in process and
only until greedy accuracy on train problems reaches ``target`` (short of what GRPO can add), and serves
the result as the shared base: every tenant's LoRA adapter starts from it, so each tenant's validation
reward before its GRPO steps is the base's, and what it gains is its own.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from trainer.core import AdamParams, Datum, SamplingParams, TrainingClient
from trainer.export import export_hf
from trainer.model import ModelConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def greedy_accuracy(client: TrainingClient, episodes: Any, split: str, indices: list[int]) -> float:
    """Mean reward of one greedy completion per problem (rewards from the env server)."""
    sampler = client.sampling_client()
    jobs = [(split, i, sampler.sample(episodes.prompt(split, i), 1, GREEDY).sequences[0].tokens) for i in indices]
    rewards = episodes.rewards(jobs)
    return sum(rewards) / len(rewards)


def warmed_base(episodes: Any, out: Path, *, target: float, max_steps: int, seed: int = 0,
                lr: float = 3e-3) -> tuple[Path, int, float]:
    """SFT the tiny model until greedy train accuracy (32 problems) reaches ``target``; ``(its directory, steps,
    accuracy)``."""
    torch.manual_seed(seed)
    client = TrainingClient.from_config(ModelConfig(name="tiny"))
    eos = client.tokenizer.eos_token_id
    n_train = episodes.size("train")
    answers = list(episodes.pool.map(lambda i: episodes.answer("train", i), range(n_train)))
    demos = []
    for i, answer in enumerate(answers):
        prompt, completion = episodes.prompt("train", i), client.tokenizer.encode(f"\\boxed{{{answer}}}") + [eos]
        demos.append(Datum.from_sequence(prompt + completion, weights=[0.0] * len(prompt) + [1.0] * len(completion)))
    order = list(range(n_train))
    random.Random(seed).shuffle(order)
    probe = order[:32]
    acc, step = 0.0, 0
    for step in range(1, max_steps + 1):
        batch = [demos[order[(step * 32 + j) % n_train]] for j in range(32)]
        tokens = sum(float(d.loss_fn_inputs["weights"].sum()) for d in batch)
        # token-mean NLL: the loss is a sum over the weights
        client.forward_backward([Datum(d.model_input, {**d.loss_fn_inputs, "weights": d.loss_fn_inputs["weights"] / tokens})
                                 for d in batch], "cross_entropy")
        client.optim_step(AdamParams(learning_rate=lr, beta2=0.999, weight_decay=0.1, grad_clip_norm=1.0))
        if step % 10 == 0:
            acc = greedy_accuracy(client, episodes, "train", probe)
            if acc >= target:
                break
    path = export_hf(client.model, client.tokenizer, out)
    return path, step, acc
