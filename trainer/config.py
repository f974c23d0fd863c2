"""Training configs: plain dataclasses, loaded from TOML, overridden by ``a.b=c``, logged in full at start.

>>> cfg = load_config(None, ["algo.name=rloo", "run.steps=3", "env.urls=['ws://localhost:8001']"])
>>> cfg.algo.name, cfg.run.steps, cfg.env.urls
('rloo', 3, ['ws://localhost:8001'])
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from trainer.core.losses import AGGREGATIONS
from trainer.distributed import MIXED_PRECISIONS, STRATEGIES
from trainer.model import ModelConfig, for_vllm
from trainer.rollout.actions import load_action_mapper
from trainer.rollout.engine import RolloutConfig
from trainer.sampling import SamplingConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Config = TypeVar("_Config", bound="DataclassInstance")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LR_SCHEDULES = ("constant", "linear", "cosine")
ALGORITHMS = ("grpo", "grpo_per_turn", "ppo", "rloo", "reinforce_pp")


@dataclass
class EnvConfig:
    """Where episodes run and which tasks they get.

    ``urls`` (or one ``url``) of env servers, or ``env_class`` (``"pkg.mod:Cls"``) run in process.
    ``action_mapper`` reshapes actions for a third-party env (``auto``: from the server's ``/schema``;
    see :mod:`trainer.rollout.actions`); ``tools`` (OpenAI function schemas) replace the tools the
    env lists, for servers that publish none.
    ``train_task``/``eval_task`` are ``reset`` arguments; each training task also gets a fresh
    ``seed``, each eval task ``index = i`` (``eval_key="index"``) or ``seed = i`` (``"seed"``).
    """

    urls: list[str] = field(default_factory=list)
    url: str | None = None
    env_class: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    train_task: dict[str, Any] = field(default_factory=lambda: {"split": "train"})
    eval_task: dict[str, Any] = field(default_factory=lambda: {"split": "validation"})
    eval_key: str = "index"
    token: str | None = None
    connect_retry_s: float = 30.0
    message_timeout_s: float = 120.0
    action_mapper: str = "auto"
    tools: list[dict[str, Any]] | None = None

    def all_urls(self) -> list[str]:
        return [*([self.url] if self.url else []), *self.urls]

    def __post_init__(self) -> None:
        if self.eval_key not in ("index", "seed"):
            raise ValueError(f"Expected env.eval_key to be 'index' or 'seed', got {self.eval_key!r}.")
        load_action_mapper(self.action_mapper)  # a typo fails here, with the accepted forms


@dataclass
class AlgoConfig:
    """The RL algorithm: ``grpo`` (outcome), ``grpo_per_turn``, ``ppo`` (GAE + value head), ``rloo``, ``reinforce_pp``."""

    name: str = "grpo"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0  # entropy bonus, estimated on the sampled tokens (trainer.core.losses)
    normalize_std: bool = True
    filter_zero_variance: bool = True
    aggregation: str = "token_mean"  # one of trainer.core.losses.AGGREGATIONS
    epochs: int = 1            # optimisation passes over each batch of rollouts
    minibatches: int = 1       # optimizer steps per pass
    gamma: float = 1.0
    lam: float = 0.95
    value_coef: float = 0.5
    value_clip_eps: float = 0.2
    negative_weight: float = 1.0  # scale of negative advantages: 1 = unbiased, 0 = better-than-baseline samples only
    target_kl: float = 0.0     # > 0: a step's update stops at the first minibatch whose approx KL to pi_old passes it

    def __post_init__(self) -> None:
        if not 0.0 <= self.negative_weight <= 1.0:
            raise ValueError(f"Expected algo.negative_weight in [0, 1], got {self.negative_weight}.")
        if self.name not in ALGORITHMS:
            raise ValueError(f"Expected algo.name in {ALGORITHMS}, got {self.name!r}.")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"Expected algo.aggregation in {AGGREGATIONS}, got {self.aggregation!r}.")
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError(f"Expected algo.epochs and algo.minibatches >= 1, got {self.epochs}, {self.minibatches}.")
        if not (math.isfinite(self.entropy_coef) and self.entropy_coef >= 0):
            raise ValueError(f"Expected algo.entropy_coef >= 0, got {self.entropy_coef}.")
        if not (math.isfinite(self.target_kl) and self.target_kl >= 0):
            raise ValueError(f"Expected algo.target_kl >= 0 (0: no early stop), got {self.target_kl}.")


@dataclass
class OptimConfig:
    """AdamW with linear warm-up, an optional decay, gradient accumulation over micro-batches and norm clipping.

    ``lr_schedule``: ``constant`` (after the warm-up), or ``linear`` / ``cosine`` decay from ``lr``
    to ``min_lr_ratio * lr`` over the rest of the run.
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8  # AdamW's denominator term: larger, a weight whose gradient is far smaller moves in proportion to it
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 16  # sequences per forward/backward; gradients accumulate over the rest

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.micro_batch_size < 1:
            raise ValueError(f"Expected optim.lr > 0 and optim.micro_batch_size >= 1, got {self.lr}, "
                             f"{self.micro_batch_size}.")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"Expected optim.lr_schedule in {LR_SCHEDULES}, got {self.lr_schedule!r}.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"Expected optim.min_lr_ratio in [0, 1], got {self.min_lr_ratio}.")
        if not self.eps > 0:
            raise ValueError(f"Expected optim.eps > 0, got {self.eps}.")
        betas = tuple(self.betas)  # TOML gives a list
        if len(betas) != 2:
            raise ValueError(f"Expected optim.betas to be two numbers like [0.9, 0.999], got {list(betas)}.")
        self.betas = (betas[0], betas[1])

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The multiplier of ``lr`` for optimizer step ``step`` (0-based) of a run of ``total_steps``.

        >>> cfg = OptimConfig(warmup_steps=2, lr_schedule="linear")
        >>> [round(cfg.lr_factor(s, 6), 2) for s in range(6)]
        [0.5, 1.0, 0.8, 0.6, 0.4, 0.2]
        """
        warmup = max(self.warmup_steps, 1)
        if step < warmup - 1 or self.lr_schedule == "constant":
            return min(1.0, (step + 1) / warmup)
        span = max(total_steps - warmup + 1, 1)  # the last step keeps a little learning rate
        progress = min(max((step - warmup + 1) / span, 0.0), 1.0)
        shape = 1.0 - progress if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@dataclass
class RunConfig:
    """Run length, batch shape, evaluation, checkpoints, seeds and the output directory."""

    steps: int = 100
    batch_size: int = 8        # groups (distinct tasks) per step
    group_size: int = 8        # samples per task
    eval_every: int = 0        # 0: evaluate only before and after
    eval_problems: int = 64
    save_every: int = 0        # 0: save only at the end
    keep_last: int = 2
    log_trajectories: int = 8  # trajectories per step written to trajectories.jsonl
    seed: int = 0
    output_dir: str = "runs/train"
    resume: bool = False
    strategy: str = "auto"     # under torchrun: auto (DDP with > 1 rank) | ddp | fsdp | none (single process only)
    mixed_precision: str = "auto"  # no | bf16 | fp16 (autocast forward); auto: accelerate launch's, else no
    device: str = "auto"
    max_failed_steps: int = 3  # stop when every episode failed this many steps in a row (0: never)

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.group_size < 1:
            raise ValueError(f"Expected run.steps >= 0, run.batch_size >= 1, run.group_size >= 1, got "
                             f"{self.steps}, {self.batch_size}, {self.group_size}.")
        if self.max_failed_steps < 0:
            raise ValueError(f"Expected run.max_failed_steps >= 0 (0: never stop), got {self.max_failed_steps}.")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Expected run.strategy in {STRATEGIES}, got {self.strategy!r}.")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ValueError(f"Expected run.mixed_precision in {MIXED_PRECISIONS}, got {self.mixed_precision!r}.")


@dataclass
class SFTConfig:
    """The SFT recipe: demonstrations from a JSONL file of ``{"messages": [...]}`` (or prompt/completion)."""

    data: str = ""
    steps: int = 100
    batch_size: int = 16
    epochs_limit: int = 0  # stop after this many passes over the data if sft.steps has not ended the run; 0: no limit

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.epochs_limit < 0:
            raise ValueError(f"Expected sft.steps >= 0, sft.batch_size >= 1 and sft.epochs_limit >= 0 (0: no limit), "
                             f"got {self.steps}, {self.batch_size}, {self.epochs_limit}.")


def check_history(rollout: RolloutConfig, algo: AlgoConfig, where: str = "algo") -> None:
    """PPO's GAE runs along one sequence per episode: a history window (``rollout.history_turns``, one
    sequence per turn) would cut its returns at every turn, so the two are refused together."""
    if rollout.history_turns is not None and algo.name == "ppo":
        raise ValueError(f"Expected {where}.name other than 'ppo' with rollout.history_turns set: PPO's GAE needs "
                         "the whole episode in one sequence (each turn of a history window is a sequence of its "
                         "own); use grpo_per_turn, or leave rollout.history_turns unset.")


@dataclass
class TrainConfig:
    """Everything one ``envhub-train`` run needs."""

    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def __post_init__(self) -> None:
        if self.sampling.backend == "vllm":  # the tiny model's default head size is one vLLM's CPU kernel refuses
            self.model = for_vllm(self.model)
        check_history(self.rollout, self.algo)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


def from_dict(cls: type[_Config], data: dict[str, Any], where: str = "") -> _Config:
    """Build dataclass ``cls`` from nested dicts, naming the accepted keys when one is unknown."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"Unknown key(s) {unknown} in [{where or 'top level'}]; expected some of {sorted(names)}.")
    kwargs = {}
    for key, value in data.items():
        hint, name = hints[key], f"{where}.{key}" if where else key
        if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = from_dict(hint, value, name)
        elif not _fits(hint, value):
            raise ValueError(f"Expected {name} to be {_type_name(hint)}, got {value!r}.")
        kwargs[key] = value
    return cls(**kwargs)


def _fits(hint: Any, value: Any) -> bool:
    """Whether a config value (from TOML or an override) has the field's type: ``int`` (not a bool), ``float``
    (an int too), ``str``, ``bool``, lists, tuples and dicts of those, unions; any other hint (``Any``, a
    class, a callable) accepts every value and leaves the check to the config's own ``__post_init__``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(arg, value) for arg in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(_fits(args[0], v) for v in value) if args else isinstance(value, list)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(args[0], v) for v in value)
        return not args or (len(args) == len(value) and all(_fits(a, v) for a, v in zip(args, value)))
    if origin is dict:
        return isinstance(value, dict) and (not args or all(_fits(args[1], v) for v in value.values()))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return isinstance(value, (dict, hint))
    return True


def _type_name(hint: Any) -> str:
    """``hint`` as a config user reads it: ``an integer``, ``a number``, ``a list of strings``..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "none (left out)"}
    if hint in names:
        return names[hint]
    if origin is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if origin is tuple:
        return f"a list of {len(args)} values" if args and args[-1] is not Ellipsis else "a list"
    if origin is dict:
        return "a table"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "a table"
    return str(hint)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=c"`` -> (["a", "b"], value), the value read as TOML (so ``3``, ``true``, ``[1, 2]``) or a string."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"Expected an override like section.key=value, got {item!r}.")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def read_toml(path: str | Path | None) -> dict[str, Any]:
    """The tables of a TOML config file; ``{}`` for ``None`` (the defaults)."""
    if path is None:
        return {}
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """``data`` with each ``a.b=c`` override set in place (missing sections are created); returns ``data``."""
    for item in overrides or []:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"Cannot set {item!r}: {k!r} is not a section.")
        node[keys[-1]] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """The config from a TOML file (or the defaults) with ``a.b=c`` overrides applied."""
    return from_dict(TrainConfig, apply_overrides(read_toml(path), overrides))


__all__ = ["TrainConfig", "EnvConfig", "AlgoConfig", "OptimConfig", "RunConfig", "SFTConfig", "ModelConfig",
           "RolloutConfig", "SamplingConfig", "load_config", "from_dict", "parse_override", "ALGORITHMS"]
