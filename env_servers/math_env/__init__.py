"""Math environment: built-in and dataset math problems, answers graded by sympy-backed equivalence.

``grading`` and ``tasks`` are pure (no envhub); ``env`` adapts them. Serve with
``python -m env_servers.math_env --port 8001`` or ``envhub serve env_servers.math_env:MathEnv``.
"""

from env_servers.math_env.env import MathConfig, MathEnv

__all__ = ["MathEnv", "MathConfig"]
