"""envhub: environments as concurrent OpenEnv-compatible WebSocket services, and the clients that use them.

Write an env (``Env`` + ``@tool`` / ``@reward``), serve it (``envhub serve mod:Cls`` or
``create_app``), reach it from anywhere (``EnvClient``, ``OpenEnv``, ``EnvTool``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envhub.env import Env, EnvRunner
from envhub.errors import EnvHubError
from envhub.tools import reward, tool
from envhub.types import Action, Observation, StepResult, ToolCall, ToolSpec

__version__ = "0.1.0"

# Heavier pieces load on first use so that `import envhub` stays cheap for env authors.
_LAZY = {
    "EnvClient": "envhub.client",
    "SyncEnvClient": "envhub.client",
    "OpenEnv": "envhub.remote",
    "EnvTool": "envhub.env_tool",
    "ToolManager": "envhub.env_tool",
    "FunctionTool": "envhub.function_tool",
    "LocalEnv": "envhub.local_env",
    "create_app": "envhub.server",
    "serve": "envhub.server",
    "check_env": "envhub.testing",
}

if TYPE_CHECKING:  # pragma: no cover
    from envhub.client import EnvClient, SyncEnvClient
    from envhub.env_tool import EnvTool, ToolManager
    from envhub.function_tool import FunctionTool
    from envhub.local_env import LocalEnv
    from envhub.remote import OpenEnv
    from envhub.server import create_app, serve
    from envhub.testing import check_env


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'envhub' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["Env", "EnvRunner", "Observation", "Action", "StepResult", "ToolSpec", "ToolCall", "tool", "reward",
           "EnvHubError", *_LAZY, "__version__"]
