"""Tokens/s of one GRPO training step: envhub's loss + optimizer path against TRL's GRPOTrainer, on the CPU,
and the time of a whole GRPO step, generation included.

Both sides train the same tiny Qwen2 (built from a config, no download) on the same batch: TRL
generates one batch of completions once (fixed prompt and completion lengths: EOS is suppressed
until ``--completion-len`` tokens), and then each side times only its training step on exactly those
token ids and advantages — forward, log-probs, clipped GRPO loss, backward, AdamW step. Generation is
excluded on both sides. TRL's step is ``trainer.compute_loss`` + ``accelerator.backward`` + its
optimizer; ours is the training core's ``ppo`` loss (``trainer.core.losses``) + ``torch.optim.AdamW``.

Whole steps (``--whole-steps``, 15 by default): each side samples ``--group`` completions of each of
``--prompts`` prompts at temperature 1 (EOS suppressed on both sides, so every completion is
``--completion-len`` tokens), scores them with a random reward, computes GRPO advantages and takes its
training step. TRL's is its own ``_prepare_inputs`` (generation with ``transformers`` ``generate``,
rewards, advantages) + ``compute_loss`` + backward + optimizer; ours is ``HFSampler.generate_batch`` (the
lean decode loop of ``trainer.sampling.decode`` on the same model) + the RL update's ``compute_advantages``,
``pack`` and ``policy_update`` over the training core (the code ``envhub-train`` runs each step,
``seq_mean_token_mean`` as TRL's ``loss_type="grpo"``). Machine speed drifts on shared hosts: the two
sides alternate step by step and the medians are compared.

    .venv/bin/python benchmarks/train_step.py                 # the tests' tiny model (hidden 32, 2 layers)
    .venv/bin/python benchmarks/train_step.py --hidden-size 256 --layers 4
    .venv/bin/python benchmarks/train_step.py --smoke         # seconds: checks the script runs

Needs ``pip install trl datasets`` (the ``trl`` extra).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import string
import tempfile
import time
import warnings

import torch

from trainer.core.losses import aggregation_units, aggregation_weights, token_logprobs, weighted_loss

CHARS = string.ascii_letters + string.digits  # 62 characters + <pad> + <eos> = vocab 64


def build_tokenizer():
    """A character-level fast tokenizer, made in memory (nothing downloaded)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def build_model(args, tokenizer):
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
        max_position_embeddings=args.prompt_len + args.completion_len + 8,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return transformers.Qwen2ForCausalLM(config)


def trl_trainer(args, model, tokenizer, out_dir):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rng = random.Random(0)
    prompts = ["".join(rng.choice(CHARS) for _ in range(args.prompt_len)) for _ in range(args.prompts)]

    def random_reward(completions, **kwargs):
        return [rng.random() for _ in completions]

    config = GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to="none", save_strategy="no", logging_steps=10**6,
        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        max_completion_length=args.completion_len, learning_rate=1e-5, beta=0.0, loss_type="grpo",
        epsilon=0.2, temperature=1.0, seed=0, bf16=False, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": args.completion_len},
    )
    trainer = GRPOTrainer(model=model, reward_funcs=random_reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # normally set by Trainer.train(); one micro-batch per step
    return trainer


def trl_inputs(trainer):
    """One generated and scored batch, through TRL's own generation path (not timed)."""
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer._prepare_inputs(batch)


def time_interleaved(step_fns: list, steps: int, warmup: int) -> list[list[float]]:
    """Seconds per step for each function, alternating between them so machine load hits both alike."""
    for _ in range(warmup):
        for fn in step_fns:
            fn()
    times: list[list[float]] = [[] for _ in step_fns]
    for _ in range(steps):
        for fn, out in zip(step_fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def trl_step_fn(trainer, inputs):
    model, optimizer = trainer.model, trainer.optimizer

    def step():
        loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step


def envhub_loss(model, inputs) -> torch.Tensor:
    """Our GRPO loss on TRL's batch: per-sequence token mean then batch mean, as TRL's loss_type="grpo"."""
    completion_ids = inputs["completion_ids"]
    input_ids_BT = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_BT = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    C = completion_ids.shape[1]
    # logits only for the positions that predict completion tokens (C + 1 kept, the last one dropped)
    logits_BCV = model(input_ids=input_ids_BT, attention_mask=attention_BT, logits_to_keep=C + 1).logits[:, :-1]
    logprobs_BC = token_logprobs(logits_BCV, completion_ids)
    mask_BC = inputs["completion_mask"]
    weights_BC = aggregation_weights(mask_BC, "seq_mean_token_mean") / aggregation_units(mask_BC, "seq_mean_token_mean")
    advantages_BC = inputs["advantages"][:, None].expand_as(logprobs_BC)
    loss, _, _ = weighted_loss("ppo", logprobs_BC, {"advantages": advantages_BC, "weights": weights_BC}, {})
    return loss


def envhub_step_fn(model, inputs):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step():
        envhub_loss(model, inputs).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


class _NoEos:
    """The tokenizer with an EOS id no model emits: our sampler then writes full-length completions, like TRL's."""

    def __init__(self, tokenizer):
        self.pad_token_id, self.eos_token_id = tokenizer.pad_token_id, len(tokenizer) + 1000


def envhub_whole_step_fn(args, model, tokenizer, prompt_ids: list[list[int]]):
    """Sample, score, advantages, pack, optimise: one step of the RL recipe on a fixed-length workload."""
    from trainer.config import load_config
    from trainer.core import TrainingClient
    from trainer.rollout import Task, Trajectory
    from trainer.sampling import GenRequest, HFSampler, SamplingConfig
    from trainer.update import adam_params, compute_advantages, pack, policy_update

    cfg = load_config(None, ["algo.name='grpo'", "algo.aggregation='seq_mean_token_mean'", "optim.lr=1e-5",
                             f"optim.micro_batch_size={args.prompts * args.group}", "sampling.temperature=1.0"])
    policy = TrainingClient(model, tokenizer, micro_batch_size=cfg.optim.micro_batch_size)
    sampler = HFSampler(model, _NoEos(tokenizer), SamplingConfig(temperature=1.0, max_batch_size=10**6))
    rng = random.Random(0)

    def step():
        reqs = [GenRequest(p, args.completion_len) for p in prompt_ids for _ in range(args.group)]
        groups: list[list] = []
        for i, res in enumerate(sampler.generate_batch(reqs)):
            traj = Trajectory(task=Task({}, group_id=i // args.group), reward=rng.random())
            traj.append(reqs[i].prompt_ids, policy=False)
            traj.append(res.tokens, policy=True, logprobs=res.logprobs)
            if i % args.group == 0:
                groups.append([])
            groups[-1].append(traj)
        batch = pack([t for g in groups for t in g], compute_advantages(cfg.algo, groups), tokenizer.pad_token_id)
        policy_update(policy, batch, adam_params(cfg.optim, 0, 1), cfg.algo, temperature=cfg.sampling.temperature,
                      seed=cfg.run.seed)
        policy.save_weights_for_sampler(sampler)

    return step


def trl_whole_step_fn(trainer):
    model, optimizer = trainer.model, trainer.optimizer
    batches = iter(())

    def step():
        nonlocal batches
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(trainer.get_train_dataloader())
            batch = next(batches)
        model.train()
        inputs = trainer._prepare_inputs(batch)  # generation, rewards, advantages
        loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    return step


def max_gradient_gap(model, trainer, inputs) -> tuple[float, float]:
    """(largest |grad difference|, largest |grad|) of the two losses on the same weights and batch."""
    model.train()
    envhub_loss(model, inputs).backward()
    trainer.compute_loss(trainer.model, inputs).backward()
    pairs = list(zip(model.parameters(), trainer.model.parameters()))
    gap = max((a.grad - b.grad).abs().max().item() for a, b in pairs)
    scale = max(b.grad.abs().max().item() for _, b in pairs)
    trainer.model.zero_grad(set_to_none=True)
    return gap, scale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--whole-steps", type=int, default=15, help="whole GRPO steps (generation included) to time")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs, measures nothing")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.group, args.prompt_len, args.completion_len = 2, 2, 8, 8
        args.steps, args.warmup, args.whole_steps = 2, 1, 1
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    tokenizer = build_tokenizer()
    base = build_model(args, tokenizer)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = trl_trainer(args, copy.deepcopy(base), tokenizer, out_dir)
        inputs = trl_inputs(trainer)
        shape = (tuple(inputs["prompt_ids"].shape), tuple(inputs["completion_ids"].shape))
        tokens = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
        gap = max_gradient_gap(copy.deepcopy(base), trainer, inputs)
        ours, theirs = time_interleaved(
            [envhub_step_fn(copy.deepcopy(base), inputs), trl_step_fn(trainer, inputs)], args.steps, args.warmup
        )
        whole_trainer = trl_trainer(args, copy.deepcopy(base), tokenizer, out_dir)
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"]
                      for p in whole_trainer.train_dataset["prompt"][:args.prompts]]
        whole_ours, whole_theirs = time_interleaved(
            [envhub_whole_step_fn(args, copy.deepcopy(base), tokenizer, prompt_ids), trl_whole_step_fn(whole_trainer)],
            args.whole_steps, 1)
    report(args, shape, tokens, ours, theirs, gap)
    report_whole(args, whole_ours, whole_theirs)


def report(args, shape, tokens: int, ours: list[float], theirs: list[float], gap: tuple[float, float]) -> None:
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    print(f"model: Qwen2 hidden={args.hidden_size} layers={args.layers} vocab=64 | torch threads={args.threads}")
    print(f"batch: prompt_ids {shape[0]}, completion_ids {shape[1]}; {tokens} tokens per step; "
          f"median of {args.steps} interleaved steps after {args.warmup} warm-up; generation excluded on both sides")
    print(f"same objective: max |gradient difference| {gap[0]:.1e} (largest |gradient| {gap[1]:.1e})")
    print(f"{'path':<20}{'step ms':>10}{'tokens/s':>12}")
    print(f"{'envhub':<20}{1000 * ours_s:>10.1f}{tokens / ours_s:>12.0f}")
    print(f"{'TRL GRPOTrainer':<20}{1000 * theirs_s:>10.1f}{tokens / theirs_s:>12.0f}")
    print(f"ratio envhub / TRL tokens/s: {theirs_s / ours_s:.2f}x")


def report_whole(args, ours: list[float], theirs: list[float]) -> None:
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    print(f"\nwhole GRPO step, generation included: {args.prompts} prompts x {args.group} samples x "
          f"{args.completion_len} new tokens; median of {args.whole_steps} interleaved steps after 1 warm-up")
    print(f"{'path':<20}{'step ms':>10}")
    print(f"{'envhub':<20}{1000 * ours_s:>10.1f}")
    print(f"{'TRL GRPOTrainer':<20}{1000 * theirs_s:>10.1f}")
    print(f"ratio envhub / TRL step time: {ours_s / theirs_s:.2f}x (target <= 0.5x)")


if __name__ == "__main__":
    main()
