"""Saving and resuming a recipe's training client: its model, AdamW state, extra trained modules (PPO's
value head) and RNG state, under ``<dir>/step_<n>`` with a ``latest`` pointer and pruning
(:mod:`trainer.checkpoint`). Single-agent RL and every player of two-agent training save the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.core import TrainingClient


def trained_optimizer(client: TrainingClient) -> torch.optim.Optimizer:
    """The client's AdamW; a forward-only client (``params=[]``, e.g. a frozen reference) has none to save."""
    if client.optimizer is None:
        raise ValueError("Expected a trainable training client to checkpoint, got a forward-only one (no "
                         "trainable parameters, so no optimizer state).")
    return client.optimizer


def extra_modules(client: TrainingClient) -> dict[str, nn.Module]:
    """Trained modules outside the policy that a checkpoint carries: PPO's value head."""
    return {"value_head": client.value_head} if client.value_head is not None else {}


def save_client(directory: Path, client: TrainingClient, step: int, *, keep_last: int | None = None,
                extra: dict[str, Any] | None = None) -> Path:
    """Checkpoint ``client`` at ``step`` into ``directory/step_<step>`` (older ones beyond ``keep_last`` pruned)."""
    return save_checkpoint(directory, model=client.model, optimizer=trained_optimizer(client), step=step,
                           data_cursor={"step": step}, extra=extra, keep_last=keep_last,
                           modules=extra_modules(client))


def has_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint to resume from (its ``latest`` pointer)."""
    return (directory / "latest").exists()


def load_client(directory: Path, client: TrainingClient) -> tuple[int, dict[str, Any]]:
    """Restore ``client`` from the latest checkpoint in ``directory``; returns its step and its ``extra``."""
    state = load_checkpoint(directory, model=client.model, optimizer=trained_optimizer(client),
                            modules=extra_modules(client))
    return int(state["data_cursor"]["step"]), dict(state["extra"])


__all__ = ["extra_modules", "has_checkpoint", "load_client", "save_client", "trained_optimizer"]
