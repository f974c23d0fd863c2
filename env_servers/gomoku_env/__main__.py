"""Serve gomoku: ``python -m env_servers.gomoku_env --host 0.0.0.0 --port 8002 [--two-agent] [--board-size 9 ...]``.

Gomoku flags become the env's ``GomokuConfig``; server settings (sessions, timeouts, token) come
from ``ENVHUB_*`` variables or the flags below. ``--two-agent`` serves ``GomokuMatchEnv``, where
two sessions play one match; it always runs one worker, because matches are coordinated inside
one process.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from env_servers.gomoku_env.board import MOVE_FORMATS
from env_servers.gomoku_env.config import GomokuConfig, GomokuRewards
from env_servers.gomoku_env.opponents import OPPONENTS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m env_servers.gomoku_env", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default=None, help="interface to bind (default ENVHUB_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default ENVHUB_PORT or 8000; 0 picks one)")
    parser.add_argument("--two-agent", action="store_true", help="serve GomokuMatchEnv (two sessions per match)")
    parser.add_argument("--max-sessions", type=int, default=None, help="concurrent sessions (default 256)")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (single-agent mode only)")
    game = parser.add_argument_group("game (GomokuConfig)")
    game.add_argument("--board-size", type=int, default=None)
    game.add_argument("--win-length", type=int, default=None, help="how many in a row win (default 5)")
    game.add_argument("--opponent", choices=OPPONENTS, default=None)
    game.add_argument("--opponent-random-prob", type=float, default=None)
    game.add_argument("--max-invalid-moves", type=int, default=None)
    game.add_argument("--max-moves", type=int, default=None)
    game.add_argument("--opening-max-stones", type=int, default=None)
    game.add_argument("--empty-board-prob", type=float, default=None)
    game.add_argument("--render-image", action="store_true", default=None)
    game.add_argument("--brief-messages", action="store_true", default=None,
                      help="observations hold the board and whose turn it is, no rules or hints")
    game.add_argument("--move-format", choices=MOVE_FORMATS, default=None,
                      help="coords: <move>row,col</move> (default); cell: empty cells shown as numbers, <move>n</move>")
    game.add_argument("--turn-timeout-s", type=float, default=None)
    names = ", ".join(f.name for f in dataclasses.fields(GomokuRewards))
    game.add_argument("--reward", action="append", default=[], metavar="NAME=VALUE", type=_reward,
                      help=f"change one reward of the table (repeatable), e.g. --reward missed_win=-5; names: {names}")
    return parser.parse_args(argv)


def _reward(text: str) -> tuple[str, float]:
    """``NAME=VALUE`` as one entry of the reward table, checked by :meth:`GomokuRewards.coerce` (names, finiteness)."""
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        number: float | str = float(value)
    except ValueError:
        number = value  # coerce names it as not a number
    try:
        table = GomokuRewards.coerce({name.strip(): number})  # type: ignore[dict-item]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name.strip(), float(getattr(table, name.strip()))


def env_config(args: argparse.Namespace) -> dict[str, Any]:
    """The GomokuConfig fields set on the command line (each field has its flag: ``--reward`` fills ``rewards``)."""
    names = [f.name for f in dataclasses.fields(GomokuConfig) if f.name != "rewards"]
    config: dict[str, Any] = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.reward:
        config["rewards"] = dict(args.reward)
    return config


def main(argv: list[str] | None = None) -> None:
    from envhub.server import serve

    args = parse_args(argv)
    target = ("env_servers.gomoku_env.match_env:GomokuMatchEnv" if args.two_agent
              else "env_servers.gomoku_env.env:GomokuEnv")
    settings: dict[str, Any] = {"max_sessions": args.max_sessions, "workers": 1 if args.two_agent else args.workers}
    serve(target, host=args.host, port=args.port, env_config=env_config(args),
          **{k: v for k, v in settings.items() if v is not None})


if __name__ == "__main__":
    main()
