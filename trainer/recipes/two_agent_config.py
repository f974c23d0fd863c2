"""Two-agent training configs: shared env/rollout/run sections, and per agent its own model, algorithm and optimizer.

>>> cfg = load_two_agent_config(None, ["agents.a.optim.lr=1e-4", "run.steps=3"])
>>> sorted(cfg.agents), cfg.agents["a"].optim.lr, cfg.run.steps
(['a', 'b'], 0.0001, 3)
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import (
    AlgoConfig,
    EnvConfig,
    OptimConfig,
    RunConfig,
    apply_overrides,
    check_history,
    from_dict,
    read_toml,
)
from trainer.model import ModelConfig, for_vllm
from trainer.rollout.engine import RolloutConfig
from trainer.sampling import SamplingConfig

#: the seat name a scripted opponent takes in validation (not allowed as an agent name)
RANDOM_OPPONENT = "random"
EVAL_OPPONENTS = ("other", RANDOM_OPPONENT)
#: what a sampler server accepts as an adapter name (a LoRA agent's adapter there is named after the agent)
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


@dataclass
class PlayerSampling:
    """Where one agent samples: ``servers``, sampler servers of its own (``[agents.NAME.sampling]``).

    Empty: the run's ``sampling.servers`` (which then serve both agents), else in process. ``server_token``
    defaults to ``sampling.server_token``.
    """

    servers: list[str] = field(default_factory=list)
    server_token: str | None = None

    def __post_init__(self) -> None:
        bad = [u for u in self.servers if not isinstance(u, str) or not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"Expected agents.NAME.sampling.servers like ['http://host:8100'], got {bad!r}.")


@dataclass
class PlayerConfig:
    """One agent: its own policy (model, LoRA or full), algorithm, optimizer and sampler servers; nothing is shared."""

    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sampling: PlayerSampling = field(default_factory=PlayerSampling)


@dataclass
class MatchConfig:
    """How matches are played and agents validated.

    ``eval_opponent``: ``"other"`` (each agent against the other one, both frozen, seats
    alternating) or ``"random"`` (each agent against a scripted player of random empty cells).
    Validation seeds are ``eval_seed_offset + i``, held out from training seeds
    (``run.seed * 1_000_003 + n``). ``eval_greedy``: validation moves are greedy (else sampled at
    ``sampling.temperature``: a greedy policy repeats an invalid move until it forfeits).
    ``parallel_updates`` runs the agents' update phases in two threads (they share nothing); the
    phase barrier waits for both either way. ``reference_groups``: of each agent's ``run.batch_size`` groups a
    step, how many it plays against the scripted random player (the reference ``eval_opponent = "random"``
    validates against) instead of the other agent; 0 (the default): every group head-to-head. Their outcomes
    are logged apart (``train_reference/``), so ``train/`` win rates stay the head-to-head's. ``past_groups``:
    how many it plays against an earlier version of the other agent instead (a snapshot of it drawn from the
    last ``past_keep``, one taken every ``past_every`` steps, the policy before training the first:
    :mod:`trainer.recipes.past_opponents`; each a copy of the agent's weights sampled in process), logged as
    ``train_past/``.
    """

    max_matches_in_flight: int = 32
    partner_grace_s: float = 5.0
    eval_opponent: str = "other"
    eval_seed_offset: int = 1_000_000_000
    eval_greedy: bool = True
    parallel_updates: bool = True
    swap_seats: bool = True  # alternate which agent moves first from one group to the next
    reference_groups: int = 0
    past_groups: int = 0
    past_every: int = 10
    past_keep: int = 3

    def __post_init__(self) -> None:
        if self.eval_opponent not in EVAL_OPPONENTS:
            raise ValueError(f"Expected match.eval_opponent in {EVAL_OPPONENTS}, got {self.eval_opponent!r}.")
        if self.max_matches_in_flight < 1:
            raise ValueError(f"Expected match.max_matches_in_flight >= 1, got {self.max_matches_in_flight}.")
        for name in ("reference_groups", "past_groups"):
            if getattr(self, name) < 0:
                raise ValueError(f"Expected match.{name} >= 0, got {getattr(self, name)}.")
        for name in ("past_every", "past_keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"Expected match.{name} >= 1, got {getattr(self, name)}.")


def _default_env() -> EnvConfig:
    return EnvConfig(train_task={}, eval_task={}, eval_key="seed")


def _default_agents() -> dict[str, PlayerConfig]:
    # Different initial weights, so the two policies differ from the first move.
    return {"a": PlayerConfig(model=ModelConfig(init_seed=0)), "b": PlayerConfig(model=ModelConfig(init_seed=1))}


@dataclass
class TwoAgentConfig:
    """Everything a two-agent run needs; ``agents`` maps each agent's name to its :class:`PlayerConfig`.

    ``env`` names the match env (``url``/``urls`` of a server, or ``env_class`` in process);
    ``env.train_task`` / ``env.eval_task`` are the reset arguments both seats of a match share.
    ``run.batch_size`` openings per step, ``run.group_size`` matches per opening (a GRPO group per
    agent), ``run.eval_problems`` validation matches. Sampler servers: ``agents.NAME.sampling.servers`` (each
    agent its own), or ``sampling.servers`` for both LoRA agents on one base (each its adapter, named after
    the agent); :func:`check_servers` refuses a server that would hold two agents' full weights.
    """

    env: EnvConfig = field(default_factory=_default_env)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(max_turns=20, tool_mode="text"))
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/two_agent"))
    match: MatchConfig = field(default_factory=MatchConfig)
    agents: dict[str, PlayerConfig] = field(default_factory=_default_agents)

    def __post_init__(self) -> None:
        names = list(self.agents)
        if len(names) != 2:
            raise ValueError(f"Expected exactly two agents in [agents], got {len(names)}: {names}.")
        if RANDOM_OPPONENT in names:
            raise ValueError(f"Expected agent names other than {RANDOM_OPPONENT!r} (the scripted validation "
                             f"opponent's name), got {names}.")
        apart = self.match.reference_groups + self.match.past_groups
        if apart >= self.run.batch_size:
            raise ValueError(f"Expected match.reference_groups + match.past_groups < run.batch_size "
                             f"({self.run.batch_size}: some groups head-to-head), got {apart}.")
        if any("@" in n for n in names):
            raise ValueError(f"Expected agent names without '@' (it names an agent's past snapshots), got {names}.")
        check_servers(self)
        for name, agent in self.agents.items():
            check_history(self.rollout, agent.algo, f"agents.{name}.algo")
        if self.sampling.backend == "vllm":  # each agent gets its own engine: head sizes vLLM accepts
            for agent in self.agents.values():
                agent.model = for_vllm(agent.model)

    def sampling_for(self, name: str) -> SamplingConfig:
        """Agent ``name``'s sampler settings: the run's ``[sampling]`` with its own servers and token, if any."""
        own = self.agents[name].sampling
        return dataclasses.replace(self.sampling, servers=own.servers or self.sampling.servers,
                                   server_token=own.server_token or self.sampling.server_token)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


#: model settings that shape a LoRA adapter, not the base model it sits on
_ADAPTER_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "gradient_checkpointing")


def check_servers(cfg: TwoAgentConfig) -> None:
    """Each sampler server must serve one agent's weights only, or both agents' LoRA adapters on one base.

    A server holds ONE set of full weights (a full-parameter agent's pushes replace them) and any number of
    named adapters on that base: two full-parameter agents (or a full one and a LoRA one) on one server
    would sample each other's weights, so they are refused here rather than trained silently wrong.
    """
    (first, a), (second, b) = cfg.agents.items()
    shared = ({u.rstrip("/") for u in cfg.sampling_for(first).servers}
              & {u.rstrip("/") for u in cfg.sampling_for(second).servers})
    for name, agent in cfg.agents.items():
        if agent.model.lora_rank and cfg.sampling_for(name).servers and not _ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"Expected an agent name of letters, digits or -_.: for a LoRA agent on sampler servers "
                             f"(its adapter's name there), got {name!r}.")
    if not shared:
        return
    fix = (f"give each agent servers of its own: [agents.{first}.sampling] servers = [...] and "
           f"[agents.{second}.sampling] servers = [...]")
    full = [n for n, agent in cfg.agents.items() if not agent.model.lora_rank]
    if full:
        raise ValueError(f"Expected each sampler server to hold one agent's weights, got {sorted(shared)} serving both "
                         f"agents while {' and '.join(map(repr, full))} {'trains' if len(full) == 1 else 'train'} full "
                         f"parameters (a server holds one set of full weights: each agent's pushes would replace the "
                         f"other's); {fix}.")
    base_a, base_b = _base(a.model), _base(b.model)
    if base_a != base_b:
        differ = sorted(k for k, v in dataclasses.asdict(base_a).items() if dataclasses.asdict(base_b)[k] != v)
        raise ValueError(f"Expected LoRA agents that share sampler servers {sorted(shared)} to have one base model "
                         f"(the servers' own), got base settings that differ in {differ}; make them equal, or "
                         f"{fix}.")


def _base(model: ModelConfig) -> ModelConfig:
    defaults = ModelConfig()
    return dataclasses.replace(model, **{k: getattr(defaults, k) for k in _ADAPTER_FIELDS})


def load_two_agent_config(path: str | Path | None, overrides: list[str] | None = None) -> TwoAgentConfig:
    """The config from a TOML file (or the defaults) with ``a.b=c`` overrides (``agents.NAME.optim.lr=...``)."""
    data = read_toml(path)
    if "agents" not in data:  # overrides refine the default pair
        data["agents"] = {name: {"model": {"init_seed": a.model.init_seed}} for name, a in _default_agents().items()}
    apply_overrides(data, overrides)
    env = data.get("env")
    if isinstance(env, dict):  # match envs take no split: default to no task arguments
        env.setdefault("train_task", {})
        env.setdefault("eval_task", {})
        env.setdefault("eval_key", "seed")
    agents = data.get("agents")
    if agents is not None:  # built first: the whole config is checked once, with its own agents
        if not isinstance(agents, dict) or not all(isinstance(v, dict) for v in agents.values()):
            raise ValueError("Expected [agents.NAME] tables, e.g. [agents.alice.model] name = \"tiny\"; got "
                             f"{agents!r}.")
        data["agents"] = {str(name): from_dict(PlayerConfig, section, f"agents.{name}")
                          for name, section in agents.items()}
    return from_dict(TwoAgentConfig, data)


__all__ = ["PlayerConfig", "PlayerSampling", "MatchConfig", "check_servers", "TwoAgentConfig", "load_two_agent_config", "RANDOM_OPPONENT",
           "EVAL_OPPONENTS"]
