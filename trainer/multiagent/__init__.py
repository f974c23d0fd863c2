"""trainer.multiagent: two agents with independent policies trained against each other through a match env.

``train_two_agents(load_two_agent_config("examples/configs/gomoku_two_agent.toml"))`` runs it;
:class:`MatchRollout` plays matches (both seats, each from its own agent's sampler), :class:`Agent`
is one independent policy with its own optimizer, :class:`PhaseBarrier` keeps the agents' rollout
and update phases in step.
"""

from trainer.multiagent.agent import Agent, outcome_metrics
from trainer.multiagent.config import AgentConfig, MatchConfig, TwoAgentConfig, load_two_agent_config
from trainer.multiagent.match_rollout import INFRA_OUTCOMES, SEATS, MatchResult, MatchRollout, MatchSpec, by_agent
from trainer.multiagent.opponents import RandomMoveSampler
from trainer.multiagent.phases import PhaseBarrier
from trainer.multiagent.two_agent import evaluate, train_two_agents

__all__ = ["Agent", "AgentConfig", "MatchConfig", "TwoAgentConfig", "load_two_agent_config", "INFRA_OUTCOMES",
           "SEATS", "MatchResult", "MatchRollout", "MatchSpec", "by_agent", "RandomMoveSampler", "PhaseBarrier",
           "evaluate", "train_two_agents", "outcome_metrics"]
