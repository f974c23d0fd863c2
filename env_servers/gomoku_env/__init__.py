"""Gomoku (five in a row) as an envhub env: pure board rules, opponents and rendering, adapted by
``GomokuEnv`` (one agent vs a scripted opponent) and ``GomokuMatchEnv`` (two agents in one match)."""

from env_servers.gomoku_env.config import GomokuConfig, GomokuRewards
from env_servers.gomoku_env.env import GomokuEnv
from env_servers.gomoku_env.match_env import GomokuMatchEnv

__all__ = ["GomokuEnv", "GomokuMatchEnv", "GomokuConfig", "GomokuRewards"]
