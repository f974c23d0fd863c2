"""Two-agent training configs: shared env/rollout/run sections, and per agent its own model, algorithm and optimizer.

>>> cfg = load_two_agent_config(None, ["agents.a.optim.lr=1e-4", "run.steps=3"])
>>> sorted(cfg.agents), cfg.agents["a"].optim.lr, cfg.run.steps
(['a', 'b'], 0.0001, 3)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import AlgoConfig, EnvConfig, OptimConfig, RunConfig, apply_overrides, from_dict, read_toml
from trainer.model import ModelConfig, for_vllm
from trainer.rollout.engine import RolloutConfig
from trainer.sampling import SamplingConfig

#: the seat name a scripted opponent takes in validation (not allowed as an agent name)
RANDOM_OPPONENT = "random"
EVAL_OPPONENTS = ("other", RANDOM_OPPONENT)


@dataclass
class PlayerConfig:
    """One agent: its own policy (model, LoRA or full), algorithm and optimizer; nothing is shared."""

    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class MatchConfig:
    """How matches are played and agents validated.

    ``eval_opponent``: ``"other"`` (each agent against the other one, both frozen, seats
    alternating) or ``"random"`` (each agent against a scripted player of random empty cells).
    Validation seeds are ``eval_seed_offset + i``, held out from training seeds
    (``run.seed * 1_000_003 + n``). ``eval_greedy``: validation moves are greedy (else sampled at
    ``sampling.temperature``: a greedy policy repeats an invalid move until it forfeits).
    ``parallel_updates`` runs the agents' update phases in two threads (they share nothing); the
    phase barrier waits for both either way.
    """

    max_matches_in_flight: int = 32
    partner_grace_s: float = 5.0
    eval_opponent: str = "other"
    eval_seed_offset: int = 1_000_000_000
    eval_greedy: bool = True
    parallel_updates: bool = True
    swap_seats: bool = True  # alternate which agent moves first from one group to the next

    def __post_init__(self) -> None:
        if self.eval_opponent not in EVAL_OPPONENTS:
            raise ValueError(f"Expected match.eval_opponent in {EVAL_OPPONENTS}, got {self.eval_opponent!r}.")
        if self.max_matches_in_flight < 1:
            raise ValueError(f"Expected match.max_matches_in_flight >= 1, got {self.max_matches_in_flight}.")


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
    agent), ``run.eval_problems`` validation matches.
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
        if self.sampling.servers:  # both agents would push their weights over each other on the same servers
            raise ValueError("Expected no sampling.servers in a two-agent run: sampler servers serve one policy "
                             "per run for now; sample in process (remove sampling.servers).")
        if self.sampling.backend == "vllm":  # each agent gets its own engine: head sizes vLLM accepts
            for agent in self.agents.values():
                agent.model = for_vllm(agent.model)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


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
    agents = data.pop("agents", None)
    cfg = from_dict(TwoAgentConfig, data)
    if agents is not None:
        if not isinstance(agents, dict) or not all(isinstance(v, dict) for v in agents.values()):
            raise ValueError("Expected [agents.NAME] tables, e.g. [agents.alice.model] name = \"tiny\"; got "
                             f"{agents!r}.")
        cfg = dataclasses.replace(cfg, agents={str(name): from_dict(PlayerConfig, section, f"agents.{name}")
                                               for name, section in agents.items()})
    return cfg


__all__ = ["PlayerConfig", "MatchConfig", "TwoAgentConfig", "load_two_agent_config", "RANDOM_OPPONENT",
           "EVAL_OPPONENTS"]
