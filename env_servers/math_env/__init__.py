"""Math environment: built-in and dataset math problems, answers graded by sympy-backed equivalence.

``grading``, ``expressions``, ``tasks`` and ``loaders`` are pure (no envhub); ``env`` (single
turn) and ``tool_env`` (multi-turn with a Python tool) adapt them. Serve with
``python -m env_servers.math_env --port 8001`` (add ``--mode tool`` for the tool env) or
``envhub serve env_servers.math_env:MathEnv``.
"""

from env_servers.math_env.env import MathConfig, MathEnv
from env_servers.math_env.tool_env import MathToolConfig, MathToolEnv

__all__ = ["MathEnv", "MathConfig", "MathToolEnv", "MathToolConfig"]
