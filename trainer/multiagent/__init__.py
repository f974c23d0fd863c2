"""trainer.multiagent: two agents with independent policies trained against each other through a match env."""

from trainer.multiagent.match_rollout import INFRA_END_REASONS, SEATS, MatchResult, MatchRollout, MatchSpec, by_agent

__all__ = ["INFRA_END_REASONS", "SEATS", "MatchResult", "MatchRollout", "MatchSpec", "by_agent"]
