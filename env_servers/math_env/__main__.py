"""``python -m env_servers.math_env [--mode single|tool] --host H --port P [--max-sessions N] [env options]``."""

from env_servers.math_env.env import MathConfig, MathEnv
from env_servers.math_env.tool_env import MathToolConfig, MathToolEnv
from env_servers.serve_cli import main

if __name__ == "__main__":
    main({"single": (MathEnv, MathConfig), "tool": (MathToolEnv, MathToolConfig)}, prog="python -m env_servers.math_env")
