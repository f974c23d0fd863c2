"""One agent of a two-agent run: its own policy, optimizer, sampler, metrics and checkpoints.

Nothing is shared between agents: each loads its own model (full parameters or its own LoRA
adapter on its own copy of the base) behind its own training-core client (its own AdamW state over
its own trainable parameters), samples from its own model, and trains only on trajectories its own
seats produced. An update is the same :func:`~trainer.recipes.update.policy_update` over the core's
``forward_backward`` / ``optim_step`` that single-agent training runs.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from envhub.types import Outcome
from trainer import algos
from trainer.config import TrainConfig
from trainer.core import TrainingClient
from trainer.metrics import MetricsLogger
from trainer.model import hidden_size_of, load_policy
from trainer.multiagent.config import AgentConfig, TwoAgentConfig
from trainer.recipes.batch import pack
from trainer.recipes.update import adam_params, compute_advantages, policy_update, ppo_advantages, rollout_metrics
from trainer.rollout import Trajectory, build_groups
from trainer.sampling import make_sampler


class Agent:
    """A player with an independent policy: ``agent.update(its_trajectories)`` is one optimisation step.

    ``model``/``tokenizer`` may be passed in (e.g. a warmed-up model); otherwise they are loaded from
    ``cfg.model``. Metrics and checkpoints go to ``out_dir``.
    """

    def __init__(self, name: str, cfg: AgentConfig, shared: TwoAgentConfig, out_dir: str | Path, *,
                 device: torch.device | str = "cpu", model: Any = None, tokenizer: Any = None):
        self.name = name
        self.device = torch.device(device)
        self.out_dir = Path(out_dir)
        # The single-agent loss code reads its settings from a TrainConfig: this agent's own sections.
        self.train_cfg = TrainConfig(env=shared.env, model=cfg.model, rollout=shared.rollout, sampling=shared.sampling,
                                     algo=cfg.algo, optim=cfg.optim, run=shared.run)
        if model is None:
            model, tokenizer = load_policy(cfg.model, self.device)
        model = model.to(self.device).train()
        value_head = algos.ValueHead(hidden_size_of(model)).to(self.device) if cfg.algo.name == "ppo" else None
        self.policy = TrainingClient(model, tokenizer, value_head=value_head,
                                     micro_batch_size=cfg.optim.micro_batch_size)
        self.reference = (TrainingClient(_frozen_copy(model), tokenizer, params=[],
                                         micro_batch_size=cfg.optim.micro_batch_size)
                          if cfg.algo.kl_coef > 0 else None)
        self.model, self.tokenizer, self.value_head = model, tokenizer, value_head
        self.sampler = make_sampler(self.model, self.tokenizer, shared.sampling, lora=cfg.model.lora_rank > 0,
                                    seed=shared.run.seed)
        self.logger = MetricsLogger(self.out_dir)
        self.version = 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """This agent's AdamW (the core client's)."""
        return self.policy.optimizer

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every tensor this agent's optimizer updates."""
        return list(self.policy.params)

    def update(self, trajectories: list[Trajectory], step: int) -> dict[str, float]:
        """Train on this agent's own trajectories of one step; returns its metrics.

        Infrastructure ends (env down, opponent disconnected or timed out) leave their group out of
        the batch, as in single-agent training; so do zero-variance groups with ``algo.filter_zero_variance``.
        """
        foreign = {t.info.get("agent") for t in trajectories} - {self.name}
        if foreign:
            raise ValueError(f"Expected only agent {self.name!r}'s trajectories, got some of "
                             f"{sorted(map(str, foreign))}: each agent trains on its own seats only.")
        cfg = self.train_cfg
        grouped = build_groups(trajectories, cfg.run.group_size, filter_zero_variance=cfg.algo.filter_zero_variance)
        metrics = rollout_metrics(trajectories, grouped)
        metrics.update(outcome_metrics(trajectories, "train"))
        adam = adam_params(cfg.optim, step, cfg.run.steps)
        if grouped.groups:
            batch = pack(grouped.trajectories, compute_advantages(cfg, grouped.groups), self.tokenizer.pad_token_id)
            old_values = ppo_advantages(cfg, self.policy, batch) if self.value_head is not None else None
            metrics.update(policy_update(cfg, self.policy, batch, adam, reference=self.reference,
                                         old_values_BS=old_values))
            self.version = self.policy.save_weights_for_sampler(self.sampler, version=step + 1)
        metrics["train/lr"] = adam.learning_rate
        metrics["train/policy_version"] = float(self.version)
        return metrics

    def save(self, step: int, keep_last: int | None = None) -> Path:
        """A checkpoint of this agent alone under ``out_dir/checkpoints``."""
        from trainer.checkpoint import save_checkpoint

        return save_checkpoint(self.out_dir / "checkpoints", model=self.model, optimizer=self.optimizer, step=step,
                               data_cursor={"step": step}, extra={"agent": self.name, "policy_version": self.version},
                               keep_last=keep_last, modules=self._extra_modules())

    def load(self) -> int | None:
        """Restore the latest checkpoint of this agent if there is one; returns its step."""
        from trainer.checkpoint import load_checkpoint

        if not (self.out_dir / "checkpoints" / "latest").exists():
            return None
        state = load_checkpoint(self.out_dir / "checkpoints", model=self.model, optimizer=self.optimizer,
                                modules=self._extra_modules())
        self.version = int(state["extra"].get("policy_version", state["step"]))
        self.sampler.update_weights(self.model, self.version)
        return int(state["data_cursor"]["step"])

    def close(self) -> None:
        self.logger.close()
        close = getattr(self.sampler, "close", None)
        if close is not None:
            close()

    def _extra_modules(self) -> dict[str, Any]:
        # PPO's value head is trained alongside the policy: a checkpoint carries it too
        return {"value_head": self.value_head} if self.value_head is not None else {}


def outcome_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """Reward, win/loss/draw rates and infra failures of one agent's episodes (rates over non-infra episodes).

    Results are the env's ``info["outcome"]`` (:class:`envhub.types.Outcome`), whatever its end reasons.
    """
    ok = [t for t in trajectories if not t.infra_failed]
    n = max(len(ok), 1)
    outcomes = [Outcome.of(t.info) for t in ok]
    return {f"{prefix}/reward_mean": sum(t.reward for t in ok) / n,
            f"{prefix}/win_rate": outcomes.count(Outcome.WIN) / n,
            f"{prefix}/loss_rate": outcomes.count(Outcome.LOSS) / n,
            f"{prefix}/draw_rate": outcomes.count(Outcome.DRAW) / n,
            f"{prefix}/episodes": float(len(ok)),
            f"{prefix}/infra_failures": float(len(trajectories) - len(ok))}


def _frozen_copy(model: Any) -> Any:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


__all__ = ["Agent", "outcome_metrics"]
