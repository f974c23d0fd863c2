"""On-policy RL from env services, top to bottom: rollouts -> groups -> advantages -> clipped loss -> AdamW.

The variant implemented, per step (``algo.name`` picks the advantage; everything else is shared):

1. Sample ``run.batch_size`` tasks (``env.train_task`` + a fresh seed each) and run
   ``run.group_size`` episodes of each with the current policy (temperature ``sampling.temperature``)
   against the env servers, many in flight at once (:class:`RolloutEngine`). With
   ``rollout.max_staleness = k > 0`` the batches come from a :class:`RolloutStream` instead: batch
   ``s`` starts sampling once version ``s - k`` is published, so the next batch is sampled while
   this step trains; every turn records its version, every step logs ``rollout/staleness_*``.
   Either way the loop asks one batch source (:mod:`trainer.recipes.batches`) for the step's batch.
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
4. ``forward_backward`` with the training core's ``ppo`` loss (:mod:`trainer.core`, the one copy of
   every loss): the clipped-ratio surrogate ``max(-A r, -A clip(r, 1-eps, 1+eps_high))`` with
   ``r = pi / pi_old``, ``pi_old`` the policy before this step's update (so ``r = 1`` on a single
   pass; with asynchronous rollouts the behaviour policy: the sampler's own log-probs), log-probs of
   ``logits / temperature``; optional ``kl_coef`` * k3 KL to the frozen initial policy; per-token
   weights make the core's sum the ``algo.aggregation`` mean (default: token mean over all policy
   tokens of the batch; mask 1: only sampled ids count). See :mod:`trainer.update`.
5. ``optim_step`` (AdamW, clipped to ``optim.grad_clip``, the learning rate of this step's schedule),
   ``algo.epochs`` x ``algo.minibatches`` times, each after a ``forward_backward`` over the minibatch in
   micro-batches of ``optim.micro_batch_size`` sequences; then ``save_weights_for_sampler`` hands the
   sampler the new weights and the policy version goes up. Under torchrun a rank that kept fewer
   rows than another trains on loss-free padding rows too (:func:`~trainer.distributed.pad_to_ranks`):
   every rank runs the same forward/backward passes.

Seeds: ``run.seed`` seeds torch/python RNGs while the model is built (the tiny model's initial weights
use ``model.init_seed``; a LoRA adapter draws from ``run.seed``), so every rank builds the same one.
Then each rank reseeds them with :func:`~trainer.distributed.rank_seed` (``run.seed`` on rank 0 and in
a single process, ``run.seed + 1_000_003 * rank`` elsewhere) for sampling: ranks given the same prompt
sample different completions, and a rerun samples the same ones. Task seeds are
``run.seed * 1_000_003 + global task number``, so a resumed run sees the same tasks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer import algos
from trainer.config import TrainConfig
from trainer.core import TrainingClient, has_checkpoint, load_checkpoint, save_checkpoint
from trainer.distributed import (
    DistInfo,
    init_distributed,
    max_over_ranks,
    pad_to_ranks,
    rank,
    rank_seed,
    seed_rngs,
    shard,
    wrap_model,
)
from trainer.metrics import MetricsLogger, Progress, plot_rewards
from trainer.model import hidden_size_of, load_policy
from trainer.recipes.batches import BatchSource, SampledBatches, StreamedBatches
from trainer.recipes.setup import in_process_env, start_run
from trainer.rollout import (
    EnvPool,
    RolloutEngine,
    Task,
    Trajectory,
    build_groups,
    make_tasks,
)
from trainer.rollout.failures import FailureWatch, RolloutFailureError, failure_summary
from trainer.sampling import RemoteSampler, make_sampler
from trainer.update import (
    adam_params,
    compute_advantages,
    episode_metrics,
    frozen_reference,
    gae_advantages,
    pack,
    padding_row,
    policy_update,
    rollout_metrics,
)
from trainer.vision import load_vision_processor


# -- set-up ------------------------------------------------------------------------------------
def build_engine(cfg: TrainConfig, model: Any, tok: Any) -> RolloutEngine:
    """Sampler + env pool + engine for ``cfg`` (vLLM when ``sampling.backend == "vllm"``); a vision-language
    policy gets its image processor, so observation images reach it."""
    pool = EnvPool(cfg.env.all_urls() or None, in_process_env(cfg.env), connect_retry_s=cfg.env.connect_retry_s,
                   message_timeout_s=cfg.env.message_timeout_s, token=cfg.env.token,
                   action_mapper=cfg.env.action_mapper, tools=cfg.env.tools)
    vision = load_vision_processor(cfg.model, tok)
    if vision is not None and cfg.sampling.backend == "vllm":
        raise ValueError("Expected sampling.backend='hf' for a vision-language policy: the vLLM sampler does not "
                         "take images yet.")
    # ranks sample different completions (vLLM's seed; HF samples from the reseeded global RNG);
    # asynchronous rollouts sample while the trainer updates: the HF sampler then holds its own copy
    sampler = make_sampler(model, tok, cfg.sampling, lora=cfg.model.lora_rank > 0,
                           seed=rank_seed(cfg.run.seed, rank()), own_copy=cfg.rollout.max_staleness > 0)
    return RolloutEngine(pool, sampler, tok, cfg.rollout, model_name=cfg.model.name, vision=vision)


def train_tasks(cfg: TrainConfig, step: int) -> list[Task]:
    """This step's tasks: ``batch_size`` fresh seeds, ``group_size`` copies each, spread over the URLs."""
    first = step * cfg.run.batch_size
    kwargs = [{**cfg.env.train_task, "seed": cfg.run.seed * 1_000_003 + first + i} for i in range(cfg.run.batch_size)]
    return make_tasks(kwargs, cfg.run.group_size, cfg.env.all_urls() or None)


def evaluate(engine: RolloutEngine, cfg: TrainConfig, logger: MetricsLogger | None = None,
             step: int = 0, log: Callable[[str], None] | None = None) -> dict[str, float]:
    """Greedy episodes on ``run.eval_problems`` held-out tasks; mean reward over those that ran, and how they
    went (:func:`~trainer.update.episode_metrics`: win/loss/draw rates of a game, tool-call rate, penalised
    turns, each named reward component's mean). When none ran (the env unreachable...) there is no
    ``eval/reward_mean`` at all, and ``log`` gets why.

    ``eval/distinct_answers`` counts different completions: a policy answering everything the same
    way scores by luck, and this shows it.
    """
    kwargs = [{**cfg.env.eval_task, cfg.env.eval_key: i} for i in range(cfg.run.eval_problems)]
    trajs = engine.run_sync(make_tasks(kwargs, 1, cfg.env.all_urls() or None), greedy=True)
    ok = [t for t in trajs if not t.infra_failed]
    if logger is not None:
        tok = engine.tokenizer
        logger.log_trajectories(step, [{"phase": "eval", **t.to_record(tok)} for t in trajs[:cfg.run.log_trajectories]])
    metrics = {"eval/episodes": float(len(ok)), "eval/infra_failures": float(len(trajs) - len(ok))}
    if not ok:  # nothing was measured: no score (never a 0.0), and why
        if trajs and log is not None:
            log(f"validation at step {step}: no episode completed: {failure_summary(trajs).describe()}")
        return metrics
    completions = {tuple(t.tokens[t.prompt_len:]) for t in ok}
    return {"eval/reward_mean": sum(t.reward for t in ok) / len(ok), **metrics,
            "eval/distinct_answers": float(len(completions)),
            "eval/tokens_mean": sum(t.num_policy_tokens for t in ok) / len(ok), **episode_metrics(ok, "eval")}


def validation_line(when: str, metrics: dict[str, float]) -> str:
    """``validation reward before: 0.238 on 21 episodes``, or that none completed."""
    if "eval/reward_mean" not in metrics:
        return f"validation reward {when}: none (no episode completed, {metrics['eval/infra_failures']:.0f} failed)"
    return f"validation reward {when}: {metrics['eval/reward_mean']:.3f} on {metrics['eval/episodes']:.0f} episodes"


# -- the loop ----------------------------------------------------------------------------------
def train(cfg: TrainConfig, *, model: Any = None, tokenizer: Any = None,
          on_step: Callable[[int, dict[str, float]], None] | None = None,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``cfg``; returns ``{"val_reward_before", "val_reward_after", "steps", "seconds", ...}``.

    Pass ``model``/``tokenizer`` to continue from a model in memory (the quick start's SFT warm-up).
    """
    start = time.monotonic()
    out = start_run(cfg.run.seed, cfg.run.output_dir, cfg.to_json())
    log(f"config:\n{cfg.to_json()}")
    info = init_distributed()
    device = info.device if info.distributed or cfg.run.device == "auto" else torch.device(cfg.run.device)
    policy, reference = _policy(cfg, info, device, model, tokenizer)
    tokenizer = policy.tokenizer
    # Everything above drew from the shared run.seed stream, so every rank built the same model (DDP also
    # broadcasts rank 0's; FSDP does not). Sampling draws from this rank's own stream from here on: ranks
    # given the same prompt sample different completions (HFSampler samples with the global torch RNG).
    seed_rngs(rank_seed(cfg.run.seed, info.rank))
    engine = build_engine(cfg, policy.model, tokenizer)
    logger = MetricsLogger(out, is_main=info.is_main)
    first_step = _maybe_resume(cfg, out, policy, log)
    if first_step:  # the sampler was built from the initial weights: give it the checkpoint's
        policy.save_weights_for_sampler(engine.sampler, version=first_step)

    before = evaluate(engine, cfg, logger, first_step, log)
    logger.log(first_step, before)
    log(validation_line("before", before))
    if not before["eval/episodes"] and before["eval/infra_failures"]:  # a dead env: say so now, not steps later
        _close(logger, engine)
        raise RolloutFailureError(f"Every validation episode before training failed ({before['eval/infra_failures']:.0f}"
                                  f"), so the run stops here; the reason is above. Check env.url and the server.")
    # nothing left to do (run.steps=0, or a resumed run already at run.steps): validate and summarise
    last_step = max(cfg.run.steps, first_step)
    progress = Progress(last_step - first_step, desc=cfg.algo.name)
    # a run that trains on nothing says so (console, metrics, failures.jsonl), then stops
    watch = FailureWatch(cfg.run.max_failed_steps, log, out / "failures.jsonl" if info.is_main else None)
    everywhere = (lambda all_failed: not max_over_ranks(int(not all_failed), device)) if info.distributed else None
    source = _batch_source(cfg, engine, info, first_step)
    pad_row = padding_row(tokenizer.pad_token_id)
    for step in range(first_step, cfg.run.steps):
        t0 = time.monotonic()
        # 1. sample: episodes with the current policy (or one at most max_staleness versions older)
        trajs = source.next_batch(step)
        t_rollout = time.monotonic() - t0
        # 2. complete (and informative) groups only
        grouped = build_groups(trajs, cfg.run.group_size, filter_zero_variance=cfg.algo.filter_zero_variance)
        metrics = rollout_metrics(trajs, grouped)
        try:
            metrics.update(watch.check(step + 1, trajs, everywhere))
        except RolloutFailureError:
            for closing in (source, logger, engine):
                closing.close()
            raise
        metrics.update(source.metrics(trajs))
        kept = grouped.trajectories if grouped.groups else []
        # 3. advantages, one per token (PPO: GAE from the value head's forward-only pass, below)
        advantages = compute_advantages(cfg.algo, grouped.groups) if kept else []
        # under torchrun every rank trains as many rows as the fullest one: loss-free rows make up the rest
        rows = pad_to_ranks(list(zip(kept, advantages)), pad_row, device)
        adam = adam_params(cfg.optim, step, cfg.run.steps)
        if rows:
            batch = pack([t for t, _ in rows], [a for _, a in rows], tokenizer.pad_token_id)
            old_values = gae_advantages(cfg.algo, policy, batch) if policy.value_head is not None else None
            # 4. forward_backward + optim_step, epochs x minibatches of them
            metrics.update(policy_update(policy, batch, adam, cfg.algo, temperature=cfg.sampling.temperature,
                                         seed=cfg.run.seed, off_policy=source.off_policy, reference=reference,
                                         old_values_BS=old_values))
        # 5. the sampler gets the new weights (streamed batches: the version moves on even without an update)
        source.publish(policy, step + 1, updated=bool(rows))
        metrics.update({"time/step_s": time.monotonic() - t0, "time/rollout_s": t_rollout,
                        "train/lr": adam.learning_rate})
        if isinstance(engine.sampler, RemoteSampler):  # sampler servers: weight-push time, servers in rotation
            metrics.update(engine.sampler.metrics())
        _end_step(cfg, step + 1, metrics, trajs, engine, logger, policy, log)
        progress.update(1, reward=round(metrics["train/reward_mean"], 3), kept=int(metrics["rollout/groups_kept"]))
        if on_step is not None:
            on_step(step + 1, metrics)
    progress.close()
    source.close()

    after = evaluate(engine, cfg, logger, last_step, log)
    logger.log(last_step, after)
    log(validation_line("after", after))
    if cfg.run.steps > first_step:
        save_checkpoint(policy, out / "checkpoints", cfg.run.steps, keep_last=cfg.run.keep_last)
    _close(logger, engine)
    summary = {"val_reward_before": before.get("eval/reward_mean"), "val_reward_after": after.get("eval/reward_mean"),
               "val_distinct_answers_before": int(before.get("eval/distinct_answers", 0)),
               "val_distinct_answers_after": int(after.get("eval/distinct_answers", 0)),
               "eval_episodes": int(after["eval/episodes"]), "steps": last_step - first_step,
               "seconds": round(time.monotonic() - start, 1), "algorithm": cfg.algo.name,
               "reward_plot": _reward_plot(out) if info.is_main else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _close(logger: MetricsLogger, engine: RolloutEngine) -> None:
    """The end of a run, finished or stopped: the logs, the env sessions, the sampler (vLLM: its engine and files)."""
    logger.close()
    engine.close()
    engine.sampler.close()


def _reward_plot(out: Path) -> str | None:
    """``reward.png`` in the run directory: the training reward per step and each validation's (None without
    matplotlib, or when no reward was logged: a run whose validations completed no episode and took no step)."""
    try:
        import matplotlib  # noqa: F401  (the train extra installs it; a bare install may not)
    except ImportError:
        return None
    try:
        return str(plot_rewards(out / "metrics.jsonl", out / "reward.png", keys=["train/reward_mean", "eval/reward_mean"]))
    except ValueError:
        return None


def _batch_source(cfg: TrainConfig, engine: RolloutEngine, info: DistInfo, first_step: int) -> BatchSource:
    """This rank's batches: sampled when asked, or (``rollout.max_staleness > 0``) streamed ahead while the
    loop trains, at most ``max_staleness`` versions old."""
    def tasks(step: int) -> list[Task]:
        return shard(train_tasks(cfg, step), info)

    if cfg.rollout.max_staleness > 0 and first_step < cfg.run.steps:
        return StreamedBatches(engine, tasks, first_step=first_step, max_staleness=cfg.rollout.max_staleness,
                               max_open_groups=cfg.rollout.max_open_groups)
    return SampledBatches(engine, tasks)


def _end_step(cfg: TrainConfig, step: int, metrics: dict[str, float], trajs: list[Trajectory],
              engine: RolloutEngine, logger: MetricsLogger, policy: TrainingClient, log: Callable[[str], None]) -> None:
    """After step ``step``: validation every ``run.eval_every`` steps, the step's logs, a checkpoint every
    ``run.save_every`` steps."""
    if cfg.run.eval_every and step % cfg.run.eval_every == 0 and step < cfg.run.steps:
        metrics.update(evaluate(engine, cfg, logger, step, log))
    logger.log(step, metrics)
    logger.log_trajectories(step, [t.to_record(engine.tokenizer) for t in trajs[:cfg.run.log_trajectories]])
    if cfg.run.save_every and step % cfg.run.save_every == 0:
        save_checkpoint(policy, Path(cfg.run.output_dir) / "checkpoints", step, keep_last=cfg.run.keep_last)


def _policy(cfg: TrainConfig, info: Any, device: torch.device, model: Any,
            tokenizer: Any) -> tuple[TrainingClient, TrainingClient | None]:
    """The policy as a core client (model wrapped for the run's strategy, PPO's value head beside it), and
    the frozen KL reference when ``algo.kl_coef > 0``."""
    if model is None:
        model, tokenizer = load_policy(cfg.model, device)
    # run.strategy "auto": DDP under a torchrun world of more than one rank, the plain model otherwise
    model = wrap_model(model.to(device).train(), cfg.run.strategy, info, mixed_precision=cfg.run.mixed_precision)
    value_head = None
    if cfg.algo.name == "ppo":
        # trained alongside the policy, so its gradients are averaged across ranks too (a no-op on one rank)
        value_head = wrap_model(algos.ValueHead(hidden_size_of(model)).to(device), "ddp", info,
                                mixed_precision=cfg.run.mixed_precision)
    policy = TrainingClient(model, tokenizer, value_head=value_head, micro_batch_size=cfg.optim.micro_batch_size)
    return policy, (frozen_reference(policy) if cfg.algo.kl_coef > 0 else None)


def _maybe_resume(cfg: TrainConfig, out: Path, policy: TrainingClient, log: Callable[[str], None]) -> int:
    if not cfg.run.resume or not has_checkpoint(out / "checkpoints"):
        return 0
    # the learning rate is a function of the step (adam_params), so the step is all the schedule needs
    step = int(load_checkpoint(policy, out / "checkpoints")["step"])
    log(f"resumed from step {step}")
    return step


__all__ = ["train", "evaluate", "build_engine", "train_tasks"]
