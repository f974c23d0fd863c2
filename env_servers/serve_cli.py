"""Command line of an env server: ``--host/--port/--max-sessions`` plus one flag per config dataclass field.

Shared by ``python -m env_servers.math_env`` and ``python -m env_servers.geometry_env``::

    python -m env_servers.math_env --port 8001 --format-reward 0.1 --data-file test=math500.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from collections.abc import Callable, Sequence
from typing import Any

from envhub import Env

log = logging.getLogger("envhub.env_servers")


def _split_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"Expected KEY=VALUE (e.g. test=data/test.jsonl), got {text!r}.")
    return key, value


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"Expected true or false, got {text!r}.")


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_or_none(text: str) -> Any:
        return None if text.strip().lower() in ("none", "null", "") else parse(text)
    return parse_or_none


def _add_field(parser: argparse._ActionsContainer, field: dataclasses.Field[Any], hint: Any) -> None:
    flag = "--" + field.name.replace("_", "-")
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args and optional else hint
    origin = typing.get_origin(base)
    help_text = f"(default: {field.default!r})" if field.default is not dataclasses.MISSING else ""
    if origin is dict:
        singular = flag.removesuffix("s")
        parser.add_argument(singular, dest=field.name, action="append", type=_split_pair, metavar="KEY=VALUE",
                            help=f"repeatable; fills {field.name}")
        return
    parsers: dict[Any, Callable[[str], Any]] = {bool: _parse_bool, int: int, float: float}
    parse = parsers.get(base, str)
    parser.add_argument(flag, dest=field.name, type=_optional(parse) if optional else parse, default=None,
                        help=help_text)


def build_parser(prog: str, config_cls: type, description: str) -> argparse.ArgumentParser:
    """An argument parser with server flags and one flag per field of ``config_cls``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--host", default=None, help="bind address (default: ENVHUB_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: ENVHUB_PORT or 8000)")
    parser.add_argument("--max-sessions", type=int, default=None, help="concurrent session cap (default 256)")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default 1)")
    hints = typing.get_type_hints(config_cls)
    group = parser.add_argument_group("environment options")
    for field in dataclasses.fields(config_cls):
        _add_field(group, field, hints[field.name])
    return parser


def env_config_from_args(ns: argparse.Namespace, config_cls: type) -> dict[str, Any]:
    """The env constructor kwargs given on the command line (unset flags are left to the defaults)."""
    config: dict[str, Any] = {}
    for field in dataclasses.fields(config_cls):
        value = getattr(ns, field.name, None)
        if value is None:
            continue
        config[field.name] = dict(value) if isinstance(value, list) else value
    config_cls(**config)  # validate now: a bad flag fails at start-up, not on the first connection
    return config


def main(variants: dict[str, tuple[type[Env], type]], argv: Sequence[str] | None = None, *, prog: str) -> None:
    """Parse the command line and serve the chosen env until SIGTERM/SIGINT.

    ``variants`` maps ``--mode`` values to ``(env class, config class)``; the first is the default,
    and a single variant means no ``--mode`` flag.
    """
    from envhub.server import serve

    names = list(variants)
    pre = argparse.ArgumentParser(add_help=False)
    if len(names) > 1:
        pre.add_argument("--mode", choices=names, default=names[0])
    known, _ = pre.parse_known_args(argv)
    mode = getattr(known, "mode", names[0])
    env_cls, config_cls = variants[mode]
    parser = build_parser(prog, config_cls, (env_cls.__doc__ or "").strip().split("\n")[0])
    if len(names) > 1:
        parser.add_argument("--mode", choices=names, default=names[0],
                            help=f"which env to serve: {', '.join(f'{n}={v[0].__name__}' for n, v in variants.items())}")
    ns = parser.parse_args(argv)
    try:
        env_config = env_config_from_args(ns, config_cls)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("serving %s with env config %s", env_cls.__name__, env_config or "(defaults)")
    serve(env_cls, host=ns.host, port=ns.port, env_config=env_config, max_sessions=ns.max_sessions,
          workers=ns.workers)


__all__ = ["build_parser", "env_config_from_args", "main"]
