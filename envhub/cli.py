"""The ``envhub`` command: ``serve`` / ``check`` an env, run the ``fleet``, ``list`` / ``init`` envs, ``eval`` a model.

Each subcommand is a ``(name, add_arguments, run)`` entry in :data:`COMMANDS`; adding one is
a new entry and two small functions::

    envhub serve my_env:GuessEnv --port 8000 --max-sessions 64 --set difficulty='"hard"'
    envhub check my_env:GuessEnv
    envhub serve math                       # a name an installed distribution registers (envhub list)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from envhub import _init, _list, fleet
from envhub.eval import cli as eval_cli
from envhub.settings import Settings


class Command(NamedTuple):
    """One ``envhub`` subcommand."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def parse_set(pairs: list[str] | None) -> dict[str, Any]:
    """``key=value`` strings to kwargs; values are JSON when they parse as JSON, else plain strings.

    >>> parse_set(["size=9", "name=gomoku", "opts={\\"a\\": 1}"])
    {'size': 9, 'name': 'gomoku', 'opts': {'a': 1}}
    """
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"Expected --set key=value, got {pair!r}.")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="ENV", help="the env: a name `envhub list` shows (e.g. math), or a class "
                        "as MODULE:CLASS (e.g. my_env:GuessEnv)")
    parser.add_argument("--set", dest="env_config", action="append", metavar="KEY=VALUE", default=[],
                        help="env constructor argument (repeatable; VALUE parsed as JSON when possible); the env "
                             "is built once with them first, so one it refuses is an error before anything runs")


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target(parser)
    defaults = Settings()
    parser.add_argument("--host", help=f"bind address (ENVHUB_HOST, default {defaults.host})")
    parser.add_argument("--port", type=int, help=f"port, 0 = any free port (ENVHUB_PORT, default {defaults.port})")
    parser.add_argument("--max-sessions", type=int, metavar="N", help="concurrent session cap; more get CAPACITY_REACHED "
                        f"(ENVHUB_MAX_SESSIONS, default {defaults.max_sessions})")
    parser.add_argument("--token", help="require 'Authorization: Bearer TOKEN' on /ws and every HTTP route but "
                        "/health (ENVHUB_TOKEN); leave both out for no auth: an empty or placeholder token is refused")
    parser.add_argument("--step-timeout", type=float, dest="step_timeout_s", metavar="S",
                        help="server-side deadline for one reset/step in seconds (ENVHUB_STEP_TIMEOUT_S, "
                             "default none)")
    parser.add_argument("--idle-timeout", type=float, dest="idle_timeout_s", metavar="S",
                        help="close sessions idle this many seconds (ENVHUB_IDLE_TIMEOUT_S, default "
                             f"{defaults.idle_timeout_s:g})")
    parser.add_argument("--resume-grace", type=float, dest="resume_grace_s", metavar="S",
                        help="keep a dropped resumable session this many seconds (ENVHUB_RESUME_GRACE_S, default "
                             f"{defaults.resume_grace_s:g})")
    parser.add_argument("--max-message-bytes", type=int, dest="max_message_bytes", metavar="BYTES",
                        help="larger frames get MESSAGE_TOO_LARGE (ENVHUB_MAX_MESSAGE_BYTES, default "
                             f"{defaults.max_message_bytes})")
    parser.add_argument("--ping-interval", type=float, dest="ping_interval_s", metavar="S",
                        help=f"WebSocket ping interval in seconds (ENVHUB_PING_INTERVAL_S, default "
                             f"{defaults.ping_interval_s:g})")
    parser.add_argument("--ping-timeout", type=float, dest="ping_timeout_s", metavar="S",
                        help=f"close a connection whose pong is this late (ENVHUB_PING_TIMEOUT_S, default "
                             f"{defaults.ping_timeout_s:g})")
    parser.add_argument("--threads", type=int, dest="thread_pool_size", metavar="N",
                        help="worker threads for sync env methods (ENVHUB_THREAD_POOL_SIZE, default "
                             f"{defaults.thread_pool_size})")
    parser.add_argument("--compression", action="store_true", default=None,
                        help="enable permessage-deflate (ENVHUB_COMPRESSION, default off)")
    parser.add_argument("--workers", type=int, metavar="N", help="uvicorn worker processes (ENVHUB_WORKERS, default 1)")
    parser.add_argument("--log-level", help=f"uvicorn log level (ENVHUB_LOG_LEVEL, default {defaults.log_level})")


_SERVE_SETTINGS = ("max_sessions", "token", "step_timeout_s", "idle_timeout_s", "resume_grace_s",
                   "max_message_bytes", "ping_interval_s", "ping_timeout_s", "thread_pool_size", "compression",
                   "workers", "log_level")


def _run_serve(args: argparse.Namespace) -> int:
    from envhub.server import serve

    sys.path.insert(0, os.getcwd())  # `envhub serve my_env:Env` from the env's directory
    serve(args.target, host=args.host, port=args.port, env_config=parse_set(args.env_config),
          **{name: getattr(args, name) for name in _SERVE_SETTINGS})
    return 0


def _check_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target(parser)
    parser.add_argument("--seed", type=int, default=0, help="reset seed used by the checks (default 0)")


def _run_check(args: argparse.Namespace) -> int:
    from envhub.server import load_target
    from envhub.server.run import check_env_config
    from envhub.testing import check_env

    sys.path.insert(0, os.getcwd())
    env_cls = load_target(args.target)
    env_config = parse_set(args.env_config)
    check_env_config(env_cls, env_config)  # a refused --set is one error, not a failure of every check
    results = check_env(env_cls, raise_on_error=False, seed=args.seed, **env_config)
    for result in results:
        print(result)
    failed = sum(not r.passed for r in results)
    print(f"{env_cls.__name__}: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _view_arguments(parser: argparse.ArgumentParser) -> None:
    from envhub.view import DEFAULT_HOST, DEFAULT_PORT  # no FastAPI import: envhub.view loads it lazily

    parser.add_argument("dir", metavar="DIR", help="a training run directory (trajectories.jsonl, metrics.jsonl) "
                        "or an `envhub eval` directory (results.jsonl)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port, 0 = any free port (default {DEFAULT_PORT})")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"bind address (default {DEFAULT_HOST}; the page shows whole transcripts, bind "
                             "another address only on a trusted network)")


def _run_view(args: argparse.Namespace) -> int:
    from envhub.view import serve_view

    serve_view(args.dir, host=args.host, port=args.port)
    return 0


COMMANDS: list[Command] = [
    Command("serve", "serve an env (a registered name or module:Class) over WebSocket and HTTP", _serve_arguments, _run_serve),
    Command("check", "run check_env on an env (a registered name or module:Class) and print the results", _check_arguments, _run_check),
    Command("fleet", "run the env fleet of a compose file as local processes (up, down, status, logs)",
            fleet.add_arguments, fleet.run_cli),
    Command("list", "list the envs installed distributions register (name, class, version, tools)",
            _list.add_arguments, _list.run),
    Command("init", "scaffold a pip-installable env package in ./NAME", _init.add_arguments, _init.run),
    Command("eval", "play N tasks x K samples of an env with a model; write results.jsonl and summary.json",
            eval_cli.add_arguments, eval_cli.run),
    Command("view", "browse a training run's or an eval's episodes, tokens and reward curve in a local web page",
            _view_arguments, _run_view),
]


def build_parser() -> argparse.ArgumentParser:
    """The ``envhub`` argument parser with one subparser per entry of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog="envhub", description="envhub: write, serve, check and evaluate RL environments.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        child = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(child)
        child.set_defaults(_run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``envhub`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, ImportError, argparse.ArgumentTypeError) as exc:
        print(f"envhub {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except SyntaxError as exc:  # in the env's module: where, not the import machinery's traceback
        print(f"envhub {args.command}: error: {exc.filename}:{exc.lineno}: {exc.msg}: {(exc.text or '').strip()}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
