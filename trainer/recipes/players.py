"""One player of a two-agent run: its own policy, optimizer, sampler, metrics and checkpoints.

(A player, not a :class:`trainer.rollout.Agent`: that is a conversation strategy the rollout engine runs.)

Nothing is shared between agents: each loads its own model (full parameters or its own LoRA
adapter on its own copy of the base) behind its own training-core client (its own AdamW state over
its own trainable parameters), samples from its own model (in process, or on sampler servers it pushes
its weights to: its own servers, or its adapter under its name on servers both LoRA agents share), and
trains only on trajectories its own seats produced. An update is the same :func:`~trainer.update.policy_update` over the core's
``forward_backward`` / ``optim_step`` that single-agent training runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer import algos
from trainer.core import TrainingClient, has_checkpoint, load_checkpoint, save_checkpoint
from trainer.metrics import MetricsLogger
from trainer.model import hidden_size_of, load_policy
from trainer.recipes.two_agent_config import PlayerConfig, TwoAgentConfig
from trainer.rollout import Trajectory, build_groups
from trainer.sampling import RemoteSampler, make_sampler
from trainer.update import (
    RESULTS,
    adam_params,
    compute_advantages,
    episode_metrics,
    frozen_reference,
    gae_advantages,
    pack,
    policy_update,
    rollout_metrics,
)


class Player:
    """A player with an independent policy: ``player.update(its_trajectories)`` is one optimisation step.

    ``model``/``tokenizer`` may be passed in (e.g. a warmed-up model); otherwise they are loaded from
    ``cfg.model``. Metrics and checkpoints go to ``out_dir``.
    """

    def __init__(self, name: str, cfg: PlayerConfig, shared: TwoAgentConfig, out_dir: str | Path, *,
                 device: torch.device | str = "cpu", model: Any = None, tokenizer: Any = None):
        self.name = name
        self.device = torch.device(device)
        self.out_dir = Path(out_dir)
        self.cfg, self.shared = cfg, shared
        if model is None:
            model, tokenizer = load_policy(cfg.model, self.device)
        model = model.to(self.device).train()
        value_head = algos.ValueHead(hidden_size_of(model)).to(self.device) if cfg.algo.name == "ppo" else None
        self.policy = TrainingClient(model, tokenizer, value_head=value_head,
                                     micro_batch_size=cfg.optim.micro_batch_size)
        self.reference = frozen_reference(self.policy) if cfg.algo.kl_coef > 0 else None
        self.model, self.tokenizer, self.value_head = model, tokenizer, value_head
        # on sampler servers of its own, or as its own adapter (named after it) on servers both agents share
        self.sampler = make_sampler(self.model, self.tokenizer, shared.sampling_for(name),
                                    lora=cfg.model.lora_rank > 0, seed=shared.run.seed, adapter_name=name)
        self.logger = MetricsLogger(self.out_dir)
        self.version = 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """This agent's AdamW (the core client's)."""
        if self.policy.optimizer is None:
            raise ValueError("Expected a trainable policy, got a forward-only one (no trainable parameters).")
        return self.policy.optimizer

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every tensor this agent's optimizer updates."""
        return list(self.policy.params)

    def update(self, trajectories: list[Trajectory], step: int,
               outcomes: list[Trajectory] | None = None) -> dict[str, float]:
        """Train on this agent's own trajectories of one step; returns its metrics, the ``train/`` outcome rates
        those of ``outcomes`` (default: ``trajectories``; the head-to-head games when some were against a
        reference player).

        Infrastructure ends (env down, opponent disconnected or timed out) leave their group out of
        the batch, as in single-agent training; so do zero-variance groups with ``algo.filter_zero_variance``.
        """
        foreign = {t.info.get("agent") for t in trajectories} - {self.name}
        if foreign:
            raise ValueError(f"Expected only agent {self.name!r}'s trajectories, got some of "
                             f"{sorted(map(str, foreign))}: each agent trains on its own seats only.")
        algo, run = self.cfg.algo, self.shared.run
        grouped = build_groups(trajectories, run.group_size, filter_zero_variance=algo.filter_zero_variance)
        shown = trajectories if outcomes is None else outcomes  # every train/ outcome is the head-to-head's
        # train/reward_mean: every game trained on; train/ outcomes: those of `shown`
        metrics = with_counts(rollout_metrics(trajectories, grouped, episodes=shown), shown, "train")
        adam = adam_params(self.cfg.optim, step, run.steps)
        if grouped.groups:
            batch = pack(grouped.trajectories, compute_advantages(algo, grouped.groups), self.tokenizer.pad_token_id)
            old_values = gae_advantages(algo, self.policy, batch) if self.value_head is not None else None
            metrics.update(policy_update(self.policy, batch, adam, algo, temperature=self.shared.sampling.temperature,
                                         seed=run.seed, reference=self.reference, old_values_BS=old_values))
            self.version = self.policy.save_weights_for_sampler(self.sampler, version=step + 1)
        metrics["train/lr"] = adam.learning_rate
        metrics["train/policy_version"] = float(self.version)
        if isinstance(self.sampler, RemoteSampler):  # sampler servers: weight-push time, servers in rotation
            metrics.update(self.sampler.metrics())
        return metrics

    def save(self, step: int, keep_last: int | None = None) -> Path:
        """A checkpoint of this agent alone under ``out_dir/checkpoints``."""
        return save_checkpoint(self.policy, self.out_dir / "checkpoints", step, keep_last=keep_last,
                               metadata={"agent": self.name, "policy_version": self.version})

    def load(self) -> int | None:
        """Restore the latest checkpoint of this agent if there is one; returns its step."""
        if not has_checkpoint(self.out_dir / "checkpoints"):
            return None
        meta = load_checkpoint(self.policy, self.out_dir / "checkpoints")
        step = int(meta["step"])
        self.version = int(meta.get("policy_version", step))
        self.sampler.update_weights(self.model, self.version)
        return step

    def close(self) -> None:
        self.logger.close()
        close = getattr(self.sampler, "close", None)
        if close is not None:
            close()


def outcome_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """One agent's episodes as :func:`~trainer.update.episode_metrics` reports them (win/loss/draw rates
    from the env's ``info["outcome"]``, whatever its end reasons; ``<prefix>/end/<reason>_rate`` apart:
    gomoku's ``too_many_invalid`` is the share of games lost on an invalid move; penalised turns, tool
    calls, named reward components), plus the mean reward and, as :func:`with_counts` adds them, the three
    results, the episode count and the infra failures.

    Rates are over the episodes without an infra failure; with none there is no ``reward_mean`` (no score,
    never a 0.0).
    """
    ok = [t for t in trajectories if not t.infra_failed]
    reward = {f"{prefix}/reward_mean": sum(t.reward for t in ok) / len(ok)} if ok else {}
    return with_counts({**reward, **episode_metrics(ok, prefix)}, trajectories, prefix)


def with_counts(metrics: dict[str, float], trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """``metrics`` (holding :func:`~trainer.update.episode_metrics` of ``trajectories`` under ``prefix``) with
    the three results always reported (0.0 when no episode names one, so every step's metrics have the same
    win/loss/draw keys), ``<prefix>/episodes`` (those without an infra failure) and ``<prefix>/infra_failures``."""
    ok = sum(not t.infra_failed for t in trajectories)
    return {**{f"{prefix}/{o.value}_rate": 0.0 for o in RESULTS}, **metrics,
            f"{prefix}/episodes": float(ok), f"{prefix}/infra_failures": float(len(trajectories) - ok)}


__all__ = ["Player", "outcome_metrics", "with_counts"]
