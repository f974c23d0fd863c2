"""Code sandbox env: programming tasks with hidden tests, a sandboxed ``run_python`` tool and ``submit`` for reward.

``CodeEnv`` is the envhub adapter; :mod:`.sandbox` (pure, reusable by other envs) runs untrusted
code; :mod:`.tasks` and :mod:`.grading` are pure task and grading logic.
"""

from env_servers.code_env.env import CodeEnv, CodeEnvConfig

__all__ = ["CodeEnv", "CodeEnvConfig"]
