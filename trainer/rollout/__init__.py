"""trainer.rollout: env sessions -> multi-turn episodes -> trajectories with exact token ids, masks and stop reasons."""

from trainer.rollout.actions import load_action_mapper
from trainer.rollout.agents import Agent, AnswerAgent, Decision, ToolCallingAgent, ToolResult, load_agent_class
from trainer.rollout.engine import RolloutConfig, RolloutEngine
from trainer.rollout.envs import EnvPool, EnvSession, InProcessSession, MappedSession, load_env_class
from trainer.rollout.groups import GroupedBatch, build_groups, make_tasks
from trainer.rollout.render import ChatRenderer
from trainer.rollout.stream import RolloutStream
from trainer.rollout.types import EpisodeState, StopReason, Task, Trajectory

__all__ = ["Agent", "AnswerAgent", "ToolCallingAgent", "Decision", "ToolResult", "load_agent_class",
           "MappedSession", "load_action_mapper", "RolloutConfig", "RolloutEngine", "EnvPool", "EnvSession",
           "InProcessSession", "load_env_class",
           "GroupedBatch", "build_groups", "make_tasks", "ChatRenderer", "RolloutStream",
           "EpisodeState", "StopReason", "Task", "Trajectory"]
