"""On-policy RL from env services, top to bottom: rollouts -> groups -> advantages -> clipped loss -> AdamW.

The variant implemented, per step (``algo.name`` picks the advantage; everything else is shared):

1. Sample ``run.batch_size`` tasks (``env.train_task`` + a fresh seed each) and run
   ``run.group_size`` episodes of each with the current policy (temperature ``sampling.temperature``)
   against the env servers, many in flight at once (:class:`RolloutEngine`).
2. Keep complete groups only: a group with an infrastructure failure (env down, timeout) leaves
   the batch and is counted, never trained on as reward 0. With ``algo.filter_zero_variance``
   groups whose rewards are all equal are dropped too (they carry no GRPO signal).
3. Advantages, one per policy token:
   - ``grpo``: outcome GRPO, ``(R - mean_group) / (std_group + eps)`` on every token of the trajectory;
   - ``grpo_per_turn``: per-turn returns-to-go (``gamma``) centred per group and turn index, on that turn's tokens;
   - ``rloo``: ``R`` minus the mean of the other ``G - 1`` rewards of the group;
   - ``reinforce_pp``: ``R`` normalised by the mean and std of the whole batch;
   - ``ppo``: GAE(``gamma``, ``lam``) from a value head on the policy's last hidden state, rewards on
     each turn's last token, advantages whitened over the batch; plus a clipped value loss.
   Negative advantages are then scaled by ``algo.negative_weight`` (default 1, the unbiased
   estimate; 0 learns from better-than-baseline samples only, which the CPU quick start uses).
4. Loss: the clipped-ratio surrogate ``max(-A r, -A clip(r, 1-eps, 1+eps_high))`` with
   ``r = pi / pi_old``, ``pi_old`` the policy before this step's update (so ``r = 1`` on a single
   pass), log-probs of ``logits / temperature``; optional ``kl_coef`` * k3 KL to the frozen initial
   policy; token-mean over all policy tokens of the batch (mask 1: only sampled ids count).
5. ``algo.epochs`` x ``algo.minibatches`` AdamW steps, each accumulating gradients over micro-batches
   of ``optim.micro_batch_size`` sequences, clipped to ``optim.grad_clip``; then the sampler gets the
   new weights and the policy version goes up.

Seeds: ``run.seed`` seeds torch/python RNGs while the model is built (the tiny model's initial weights
use ``model.init_seed``; a LoRA adapter draws from ``run.seed``), so every rank builds the same one.
Then each rank reseeds them with :func:`~trainer.distributed.rank_seed` (``run.seed`` on rank 0 and in
a single process, ``run.seed + 1_000_003 * rank`` elsewhere) for sampling: ranks given the same prompt
sample different completions, and a rerun samples the same ones. Task seeds are
``run.seed * 1_000_003 + global task number``, so a resumed run sees the same tasks.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trainer import algos
from trainer.config import TrainConfig
from trainer.distributed import (all_reduce_mean, init_distributed, max_over_ranks, rank, rank_seed, seed_rngs, shard,
                                 world_size, wrap_model)
from trainer.metrics import MetricsLogger, Progress
from trainer.model import hidden_size_of, load_policy, trainable_parameters
from trainer.recipes.batch import PackedBatch, forward_logprobs, image_token_id, micro_batches, pack, token_advantages
from trainer.rollout import (EnvPool, HFSampler, RolloutEngine, Task, Trajectory, build_groups, load_env_class,
                             make_tasks)
from trainer.rollout.failures import FailureWatch, RolloutFailureError
from trainer.vision import load_vision_processor


# -- set-up ------------------------------------------------------------------------------------
def build_engine(cfg: TrainConfig, model: Any, tok: Any) -> RolloutEngine:
    """Sampler + env pool + engine for ``cfg`` (vLLM when ``sampling.backend == "vllm"``); a vision-language
    policy gets its image processor, so observation images reach it."""
    urls = cfg.env.all_urls()
    env_cls = load_env_class(cfg.env.env_class) if cfg.env.env_class and not urls else None
    if env_cls is not None and cfg.env.env_kwargs:
        base, kwargs = env_cls, dict(cfg.env.env_kwargs)
        env_cls = type(base.__name__, (base,), {"__init__": lambda self: base.__init__(self, **kwargs)})
    pool = EnvPool(urls or None, env_cls, connect_retry_s=cfg.env.connect_retry_s,
                   message_timeout_s=cfg.env.message_timeout_s, token=cfg.env.token,
                   action_mapper=cfg.env.action_mapper, tools=cfg.env.tools)
    vision = load_vision_processor(cfg.model, tok)
    if vision is not None and cfg.sampling.backend == "vllm":
        raise ValueError("Expected sampling.backend='hf' for a vision-language policy: the vLLM sampler does not "
                         "take images yet.")
    if cfg.sampling.backend == "vllm":
        from trainer.rollout.vllm_sampler import VLLMSampler

        sampler = VLLMSampler(model, tok, cfg.sampling, lora=cfg.model.lora_rank > 0,
                              seed=rank_seed(cfg.run.seed, rank()))  # ranks sample different completions
    else:
        sampler = HFSampler(model, tok, cfg.sampling)
    return RolloutEngine(pool, sampler, tok, cfg.rollout, model_name=cfg.model.name, vision=vision)


def train_tasks(cfg: TrainConfig, step: int) -> list[Task]:
    """This step's tasks: ``batch_size`` fresh seeds, ``group_size`` copies each, spread over the URLs."""
    first = step * cfg.run.batch_size
    kwargs = [{**cfg.env.train_task, "seed": cfg.run.seed * 1_000_003 + first + i} for i in range(cfg.run.batch_size)]
    return make_tasks(kwargs, cfg.run.group_size, cfg.env.all_urls() or None)


def evaluate(engine: RolloutEngine, cfg: TrainConfig, logger: MetricsLogger | None = None,
             step: int = 0) -> dict[str, float]:
    """Greedy episodes on ``run.eval_problems`` held-out tasks; mean reward over those that ran.

    ``eval/distinct_answers`` counts different completions: a policy answering everything the same
    way scores by luck, and this shows it.
    """
    kwargs = [{**cfg.env.eval_task, cfg.env.eval_key: i} for i in range(cfg.run.eval_problems)]
    trajs = engine.run_sync(make_tasks(kwargs, 1, cfg.env.all_urls() or None), greedy=True)
    ok = [t for t in trajs if not t.infra_failed]
    if logger is not None:
        tok = engine.tokenizer
        logger.log_trajectories(step, [{"phase": "eval", **t.to_record(tok)} for t in trajs[:cfg.run.log_trajectories]])
    completions = {tuple(t.tokens[t.prompt_len:]) for t in ok}
    return {"eval/reward_mean": sum(t.reward for t in ok) / max(len(ok), 1), "eval/episodes": float(len(ok)),
            "eval/infra_failures": float(len(trajs) - len(ok)), "eval/distinct_answers": float(len(completions)),
            "eval/tokens_mean": sum(t.num_policy_tokens for t in ok) / max(len(ok), 1)}


# -- advantages --------------------------------------------------------------------------------
def compute_advantages(cfg: TrainConfig, groups: list[list[Trajectory]]) -> list[list[float]]:
    """Per-token advantages for every trajectory of ``groups`` (flattened in order); PPO fills them later.

    Negative advantages are scaled by ``algo.negative_weight`` (1: as estimated).
    """
    flat = [t for g in groups for t in g]
    name, w = cfg.algo.name, cfg.algo.negative_weight
    if name == "grpo_per_turn":
        per_turn = algos.grpo_per_turn_advantages([t.turn_rewards or [0.0] for t in flat],
                                                  [t.group_id for t in flat], gamma=cfg.algo.gamma,
                                                  normalize_std=cfg.algo.normalize_std)
        return [token_advantages(t, algos.weight_negatives(torch.tensor(a), w).tolist())
                for t, a in zip(flat, per_turn)]
    if name == "ppo":
        return [[0.0] * len(t.tokens) for t in flat]
    rewards_BG = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float)
    if name == "grpo":
        adv_BG = algos.grpo_advantages(rewards_BG, normalize_std=cfg.algo.normalize_std)
    elif name == "rloo":
        adv_BG = algos.rloo_advantages(rewards_BG)
    else:
        adv_BG = algos.reinforce_pp_advantages(rewards_BG.flatten()).view_as(rewards_BG)
    adv_BG = algos.weight_negatives(adv_BG, w)
    return [token_advantages(t, [a]) for t, a in zip(flat, adv_BG.flatten().tolist())]


def ppo_advantages(cfg: TrainConfig, model: Any, value_head: Any, batch: PackedBatch) -> torch.Tensor:
    """GAE from the value head's estimates (no grad); returns [B, S] old values and fills the batch's advantages."""
    values = []
    with torch.no_grad():
        for idx in micro_batches(len(batch), cfg.optim.micro_batch_size):
            mb = batch.select(idx)
            _, hidden = forward_logprobs(model, mb.tokens_BT, mb.attn_BT, hidden=True,
                                         **mb.model_inputs(image_token_id(model)))
            v = torch.zeros(len(idx), batch.mask_BS.shape[1])
            v[:, :hidden.shape[1]] = value_head(hidden).cpu()
            values.append(v)
    values_BS = torch.cat(values)
    adv_BS, returns_BS = algos.gae(batch.rewards_BS, values_BS, batch.mask_BS, gamma=cfg.algo.gamma, lam=cfg.algo.lam)
    valid_BS = batch.mask_BS.bool()
    if int(valid_BS.sum()) > 1:
        mean, std = algos.masked_mean(adv_BS, batch.mask_BS), adv_BS[valid_BS].std().clamp_min(1e-6)
    else:  # nothing to whiten (a rank's padding-only batch under torchrun): no NaN from an empty std
        mean, std = 0.0, 1.0
    batch.advantages_BS = algos.weight_negatives((adv_BS - mean) / std, cfg.algo.negative_weight) * batch.mask_BS
    batch.rewards_BS = returns_BS  # the value targets travel in the rewards slot from here on
    return values_BS


# -- one optimisation step ---------------------------------------------------------------------
def optimise(cfg: TrainConfig, model: Any, optimizer: torch.optim.Optimizer, batch: PackedBatch, *,
             ref_model: Any = None, value_head: Any = None, old_values_BS: torch.Tensor | None = None,
             device: torch.device) -> dict[str, float]:
    """``epochs`` x ``minibatches`` clipped-surrogate AdamW steps over ``batch``; returns averaged metrics.

    The loss metrics (loss, clip_frac, approx_kl, ratio_mean, kl, logprob_mismatch, value ones) are token
    means over the policy tokens of all micro-batches: rows without any (a torchrun rank's loss-free
    padding) count for nothing. grad_norm is the mean over the optimizer steps.
    """
    a, T = cfg.algo, cfg.sampling.temperature
    single_pass = a.epochs == 1 and a.minibatches == 1
    old_lp_BS = None if single_pass else _logprobs_no_grad(cfg, model, batch, device)
    ref_lp_BS = _logprobs_no_grad(cfg, ref_model, batch, device) if ref_model is not None else None
    sums: dict[str, float] = {}    # metric * policy tokens, summed over micro-batches
    counts: dict[str, float] = {}  # policy tokens behind each sum
    grad_norms: list[float] = []
    params = trainable_parameters(model) + (list(value_head.parameters()) if value_head is not None else [])
    gen = torch.Generator().manual_seed(cfg.run.seed)
    for _ in range(a.epochs):
        for rows in _split(list(range(len(batch))), a.minibatches, gen):
            optimizer.zero_grad(set_to_none=True)
            # The loss is a mean over units (policy tokens, or sequences for the seq_mean_* aggregations):
            # each micro-batch's mean is weighted by its share of the minibatch's units.
            if world_size() > 1:
                # DDP/FSDP average the ranks' gradients: dividing by the mean unit count over ranks
                # makes that average the mean over the minibatches of all ranks together
                mean_units = all_reduce_mean(_units(batch.mask_BS[rows], a.aggregation).to(device, torch.float64))
                n_units = max(float(mean_units), 1e-6)
            else:
                n_units = max(float(_units(batch.mask_BS[rows], a.aggregation)), 1.0)
            for idx in micro_batches(len(rows), cfg.optim.micro_batch_size):
                sel = [rows[i] for i in idx]
                mb = _to(batch.select(sel), device)
                S = mb.mask_BS.shape[1]
                lp_BS, hidden = forward_logprobs(model, mb.tokens_BT, mb.attn_BT, temperature=T,
                                                 hidden=value_head is not None,
                                                 **mb.model_inputs(image_token_id(model)))
                old = lp_BS.detach() if old_lp_BS is None else old_lp_BS[sel, :S].to(device)
                ref = None if ref_lp_BS is None else ref_lp_BS[sel, :S].to(device)
                loss, m = algos.policy_loss(lp_BS, old, mb.advantages_BS, mb.mask_BS, clip_eps=a.clip_eps,
                                            clip_eps_high=a.clip_eps_high, ref_logprobs_BT=ref, kl_coef=a.kl_coef,
                                            aggregation=a.aggregation)
                if value_head is not None:
                    vloss, vm = algos.value_loss(value_head(hidden), old_values_BS[sel, :S].to(device),
                                                 mb.rewards_BS, mb.mask_BS, clip_eps=a.value_clip_eps)
                    loss = loss + a.value_coef * vloss
                    m = {**m, **vm, "value_loss": vloss.item()}
                # the mean over the whole minibatch, not the mean of micro-batch means
                mb_tokens = float(mb.mask_BS.sum())
                (loss * (float(_units(mb.mask_BS, a.aggregation)) / n_units)).backward()
                if not mb_tokens:  # padding rows only: their metrics are zeros of nothing, not data
                    continue
                m["loss"] = loss.item()
                m["logprob_mismatch"] = algos.masked_mean((lp_BS.detach() - mb.sampler_logprobs_BS).abs(),
                                                          mb.mask_BS).item()
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v * mb_tokens
                    counts[k] = counts.get(k, 0.0) + mb_tokens
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            grad_norms.append(float(norm))
            optimizer.step()
    return {**{f"train/{k}": v / counts[k] for k, v in sums.items()},
            "train/grad_norm": sum(grad_norms) / max(len(grad_norms), 1)}


def _units(mask_BS: torch.Tensor, aggregation: str) -> torch.Tensor:
    """What the loss averages over: policy tokens (``token_mean``), else sequences with a policy token."""
    if aggregation == "token_mean":
        return mask_BS.sum()
    return (mask_BS.sum(dim=1) > 0).sum().to(mask_BS.dtype)


def _split(rows: list[int], parts: int, gen: torch.Generator) -> list[list[int]]:
    order = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()] if parts > 1 else rows
    size = -(-len(order) // parts)
    return [order[i:i + size] for i in range(0, len(order), size)]


def _to(b: PackedBatch, device: torch.device) -> PackedBatch:
    return b.to(device)


def _logprobs_no_grad(cfg: TrainConfig, model: Any, batch: PackedBatch, device: torch.device) -> torch.Tensor:
    out = torch.zeros_like(batch.mask_BS)
    with torch.no_grad():
        for idx in micro_batches(len(batch), cfg.optim.micro_batch_size):
            mb = _to(batch.select(idx), device)
            lp, _ = forward_logprobs(model, mb.tokens_BT, mb.attn_BT, temperature=cfg.sampling.temperature,
                                     **mb.model_inputs(image_token_id(model)))
            out[idx, :lp.shape[1]] = lp.float().cpu()
    return out


def rollout_metrics(trajs: list[Trajectory], grouped: Any) -> dict[str, float]:
    """Reward, length and failure statistics of one step's rollouts."""
    ok = [t for t in trajs if not t.infra_failed]
    n = max(len(ok), 1)
    return {"train/reward_mean": sum(t.reward for t in ok) / n,
            "train/policy_tokens_mean": sum(t.num_policy_tokens for t in ok) / n,
            "train/turns_mean": sum(t.num_turns for t in ok) / n,
            "train/parse_errors": float(sum(t.parse_errors for t in ok)),
            # turns the env penalised (invalid moves, malformed answers...) among all turns
            "train/penalised_turn_frac": sum(r < 0 for t in ok for r in t.turn_rewards)
            / max(sum(len(t.turn_rewards) for t in ok), 1),
            **{f"rollout/{k}": v for k, v in grouped.metrics().items()}}


# -- the loop ----------------------------------------------------------------------------------
def train(cfg: TrainConfig, *, model: Any = None, tokenizer: Any = None, on_step: Callable | None = None,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``cfg``; returns ``{"val_reward_before", "val_reward_after", "steps", "seconds", ...}``.

    Pass ``model``/``tokenizer`` to continue from a model in memory (the quick start's SFT warm-up).
    """
    start = time.monotonic()
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.to_json())
    log(f"config:\n{cfg.to_json()}")
    info = init_distributed()
    device = info.device if info.distributed or cfg.run.device == "auto" else torch.device(cfg.run.device)
    if model is None:
        model, tokenizer = load_policy(cfg.model, device)
    # run.strategy "auto": DDP under a torchrun world of more than one rank, the plain model otherwise
    model = wrap_model(model.to(device).train(), cfg.run.strategy, info)
    ref_model = _reference(model) if cfg.algo.kl_coef > 0 else None
    value_head = None
    if cfg.algo.name == "ppo":
        # trained alongside the policy, so its gradients are averaged across ranks too (a no-op on one rank)
        value_head = wrap_model(algos.ValueHead(hidden_size_of(model)).to(device), "ddp", info)
    # Everything above drew from the shared run.seed stream, so every rank built the same model (DDP also
    # broadcasts rank 0's; FSDP does not). Sampling draws from this rank's own stream from here on: ranks
    # given the same prompt sample different completions (HFSampler samples with the global torch RNG).
    seed_rngs(rank_seed(cfg.run.seed, info.rank))
    params = trainable_parameters(model) + (list(value_head.parameters()) if value_head is not None else [])
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cfg.optim.lr_factor(s, cfg.run.steps))
    engine = build_engine(cfg, model, tokenizer)
    logger = MetricsLogger(out, is_main=info.is_main)
    first_step = _maybe_resume(cfg, out, model, optimizer, scheduler, log, value_head)

    before = evaluate(engine, cfg, logger, first_step)
    logger.log(first_step, before)
    log(f"validation reward before: {before['eval/reward_mean']:.3f} on {before['eval/episodes']:.0f} episodes")
    # nothing left to do (run.steps=0, or a resumed run already at run.steps): validate and summarise
    last_step = max(cfg.run.steps, first_step)
    progress = Progress(last_step - first_step, desc=cfg.algo.name)
    # a run that trains on nothing says so (console, metrics, failures.jsonl), then stops
    watch = FailureWatch(cfg.run.max_failed_steps, log, out / "failures.jsonl" if info.is_main else None)
    everywhere = (lambda all_failed: not max_over_ranks(int(not all_failed), device)) if info.distributed else None
    for step in range(first_step, cfg.run.steps):
        t0 = time.monotonic()
        # 1. rollouts with the current policy
        trajs = engine.run_sync(shard(train_tasks(cfg, step), info))
        t_rollout = time.monotonic() - t0
        # 2. complete (and informative) groups only
        grouped = build_groups(trajs, cfg.run.group_size, filter_zero_variance=cfg.algo.filter_zero_variance)
        metrics = rollout_metrics(trajs, grouped)
        try:
            metrics.update(watch.check(step + 1, trajs, everywhere))
        except RolloutFailureError:
            logger.close()
            engine.close()
            raise
        kept = grouped.trajectories if grouped.groups else []
        # Under torchrun every rank must run the same forward/backward passes (DDP and FSDP communicate
        # in them): a rank that kept fewer rows this step pads its batch with rows that train nothing.
        rows = max_over_ranks(len(kept), device) if info.distributed else len(kept)
        if rows:
            # 3. advantages, 4-5. clipped loss and optimizer steps
            batch = pack(kept, compute_advantages(cfg, grouped.groups), tokenizer.pad_token_id) if kept else None
            if rows > len(kept):
                batch = _pad_rows(batch, rows, tokenizer.pad_token_id)
            old_values = ppo_advantages(cfg, model, value_head, _to(batch, device)) if value_head is not None else None
            if old_values is not None:
                batch = _to(batch, torch.device("cpu"))
            metrics.update(optimise(cfg, model, optimizer, batch, ref_model=ref_model, value_head=value_head,
                                    old_values_BS=old_values, device=device))
            scheduler.step()
            engine.sampler.update_weights(model, step + 1)
        metrics["time/step_s"] = time.monotonic() - t0
        metrics["time/rollout_s"] = t_rollout
        metrics["train/lr"] = optimizer.param_groups[0]["lr"]
        if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0 and step + 1 < cfg.run.steps:
            metrics.update(evaluate(engine, cfg, logger, step + 1))
        logger.log(step + 1, metrics)
        logger.log_trajectories(step + 1, [t.to_record(tokenizer) for t in trajs[:cfg.run.log_trajectories]])
        progress.update(1, reward=round(metrics["train/reward_mean"], 3), kept=int(metrics["rollout/groups_kept"]))
        if cfg.run.save_every and (step + 1) % cfg.run.save_every == 0:
            _save(cfg, out, model, optimizer, scheduler, step + 1, value_head)
        if on_step is not None:
            on_step(step + 1, metrics)
    progress.close()

    after = evaluate(engine, cfg, logger, last_step)
    logger.log(last_step, after)
    log(f"validation reward after: {after['eval/reward_mean']:.3f} on {after['eval/episodes']:.0f} episodes")
    if cfg.run.steps > first_step:
        _save(cfg, out, model, optimizer, scheduler, cfg.run.steps, value_head)
    logger.close()
    engine.close()
    summary = {"val_reward_before": before["eval/reward_mean"], "val_reward_after": after["eval/reward_mean"],
               "val_distinct_answers_before": int(before["eval/distinct_answers"]),
               "val_distinct_answers_after": int(after["eval/distinct_answers"]),
               "eval_episodes": int(after["eval/episodes"]), "steps": last_step - first_step,
               "seconds": round(time.monotonic() - start, 1), "algorithm": cfg.algo.name}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _pad_rows(batch: PackedBatch | None, rows: int, pad_id: int) -> PackedBatch:
    """``batch`` (or nothing) with rows appended up to ``rows``: two attended pad tokens, mask 0, so no loss."""
    have = 0 if batch is None else len(batch)
    width = 2 if batch is None else batch.tokens_BT.shape[1]
    tokens = torch.full((rows - have, width), pad_id, dtype=torch.long)
    attn = torch.zeros((rows - have, width), dtype=torch.long)
    attn[:, :2] = 1
    pad = PackedBatch(tokens, attn, *(torch.zeros((rows - have, width - 1)) for _ in range(4)))
    if batch is None:
        return pad
    return batch.cat(pad)


def _reference(model: Any) -> Any:
    """A frozen copy of the initial policy for the KL term (of the inner model under DDP: it is never trained)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _extra_modules(value_head: Any) -> dict[str, Any]:
    """Trained modules outside the policy that a checkpoint carries: PPO's value head."""
    return {"value_head": value_head} if value_head is not None else {}


def _save(cfg: TrainConfig, out: Path, model: Any, optimizer: Any, scheduler: Any, step: int,
          value_head: Any = None) -> None:
    from trainer.checkpoint import save_checkpoint

    save_checkpoint(out / "checkpoints", model=model, optimizer=optimizer, scheduler=scheduler, step=step,
                    data_cursor={"step": step}, keep_last=cfg.run.keep_last, modules=_extra_modules(value_head))


def _maybe_resume(cfg: TrainConfig, out: Path, model: Any, optimizer: Any, scheduler: Any,
                  log: Callable[[str], None], value_head: Any = None) -> int:
    if not cfg.run.resume or not (out / "checkpoints").exists():
        return 0
    from trainer.checkpoint import load_checkpoint

    state = load_checkpoint(out / "checkpoints", model=model, optimizer=optimizer, scheduler=scheduler,
                            modules=_extra_modules(value_head))
    log(f"resumed from step {state['step']}")
    return int(state["data_cursor"]["step"])


__all__ = ["train", "evaluate", "build_engine", "train_tasks", "compute_advantages", "optimise"]
