"""``python -m trainer.multiagent``: the same as ``envhub-train two-agent`` (a TOML config and ``a.b=c`` overrides).

    python -m trainer.multiagent --config examples/configs/gomoku_two_agent.toml env.url=ws://localhost:8005
    python -m trainer.multiagent --config FILE agents.alice.optim.lr=1e-4 --print-config
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from trainer.cli import main as cli_main

    return cli_main(["two-agent", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
