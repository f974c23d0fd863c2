"""Geometry environment: generated problems with rendered diagrams (or geometry3k data), calculator tools, a verifier.

``problems``, ``render``, ``calculator`` and ``loaders`` are pure (no envhub); ``env`` adapts
them and grades with :mod:`env_servers.math_grading.grading`. Serve with
``python -m env_servers.geometry_env --port 8003`` or ``envhub serve env_servers.geometry_env:GeometryEnv``.
"""

from env_servers.geometry_env.env import GeometryConfig, GeometryEnv

__all__ = ["GeometryEnv", "GeometryConfig"]
