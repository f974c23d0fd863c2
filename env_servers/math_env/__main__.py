"""``python -m env_servers.math_env [--mode single|tool] --host H --port P [--max-sessions N] [env options]``."""

import sys

from env_servers.math_env.cli import main
from env_servers.math_env.env import MathConfig, MathEnv
from env_servers.math_env.tool_env import MathToolConfig, MathToolEnv


def run(argv: list[str] | None = None) -> None:
    """Serve MathEnv, or MathToolEnv with ``--mode tool``."""
    args = list(sys.argv[1:] if argv is None else argv)
    mode = "single"
    for i, arg in enumerate(args):
        if arg == "--mode" and i + 1 < len(args):
            mode = args.pop(i + 1)
            args.pop(i)
            break
        if arg.startswith("--mode="):
            mode = args.pop(i).split("=", 1)[1]
            break
    if mode not in ("single", "tool"):
        raise SystemExit(f"Expected --mode single or --mode tool, got {mode!r}.")
    env_cls, config_cls = (MathEnv, MathConfig) if mode == "single" else (MathToolEnv, MathToolConfig)
    main(env_cls, config_cls, args, prog="python -m env_servers.math_env")


if __name__ == "__main__":
    run()
