"""What every recipe does before its loop: seed the run, write its config, and find its env."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from envhub import Env
from trainer.config import EnvConfig
from trainer.rollout import load_env_class


def start_run(seed: int, output_dir: str, config_json: str) -> Path:
    """Seed Python's and torch's RNGs with ``seed`` (everything built next draws from them), create
    ``output_dir`` and write the resolved config there as ``config.json``; returns the directory."""
    random.seed(seed)
    torch.manual_seed(seed)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config_json)
    return out


def in_process_env(env: EnvConfig) -> type[Env] | None:
    """The env class to run in process (``env.env_class``, built with ``env.env_kwargs``), or None when the
    config names server URLs (or no class)."""
    if env.all_urls() or not env.env_class:
        return None
    cls = load_env_class(env.env_class)
    if not env.env_kwargs:
        return cls
    base, kwargs = cls, dict(env.env_kwargs)

    def init(self: Any) -> None:  # the pool builds envs without arguments: these are the config's
        base.__init__(self, **kwargs)

    return type(base.__name__, (base,), {"__init__": init})


__all__ = ["in_process_env", "start_run"]
