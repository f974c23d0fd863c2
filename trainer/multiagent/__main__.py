"""``python -m trainer.multiagent``: two-agent training from a TOML config and ``a.b=c`` overrides.

    python -m trainer.multiagent --config examples/configs/gomoku_two_agent.toml env.url=ws://localhost:8005
    python -m trainer.multiagent --config FILE agents.alice.optim.lr=1e-4 --print-config
"""

from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.multiagent", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", "-c", default=None, help="TOML config file (defaults when omitted)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. agents.alice.optim.lr=1e-4")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from trainer.multiagent.config import load_two_agent_config

    try:
        cfg = load_two_agent_config(args.config, args.overrides)
    except (ValueError, TypeError, OSError) as exc:
        print(f"two-agent: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.to_json())
        return 0
    if not (cfg.env.all_urls() or cfg.env.env_class):
        print("two-agent: no match env: set env.url=ws://host:port (a GomokuMatchEnv server: "
              "python -m env_servers.gomoku_env --two-agent) or env.env_class='pkg.mod:Cls'.", file=sys.stderr)
        return 2
    from trainer.multiagent.two_agent import train_two_agents
    from trainer.rollout.failures import RolloutFailureError

    try:
        summary = train_two_agents(cfg)
    except RolloutFailureError as exc:
        print(f"envhub-train two-agent: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
