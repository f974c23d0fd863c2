"""``python -m env_servers.code_env --host H --port P [--backend B] [--slots N] [env options]``.

Env options are the fields of :class:`CodeEnvConfig` as flags (``--reward-mode all_or_nothing``,
``--stateful true``, ``--tasks-path tasks.jsonl``...). The sandbox backend is probed at
start-up (or forced with ``--backend``) and shown in ``/metadata``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from collections.abc import Callable
from typing import Any

from env_servers.code_env.env import CodeEnv, CodeEnvConfig
from env_servers.sandbox import BACKENDS, SandboxConfig, make_backend, set_default_backend


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"Expected true or false, got {text!r}.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m env_servers.code_env", description=CodeEnv.__doc__)
    parser.add_argument("--host", default=None, help="bind address (default: ENVHUB_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: ENVHUB_PORT or 8000)")
    parser.add_argument("--max-sessions", type=int, default=None, help="concurrent session cap")
    parser.add_argument("--backend", choices=("auto", *BACKENDS), default=None,
                        help="sandbox backend (default: ENVHUB_SANDBOX_BACKEND or auto)")
    parser.add_argument("--slots", type=int, default=None, help="concurrent sandbox runs (default: CPU cores)")
    group = parser.add_argument_group("environment options")
    hints = typing.get_type_hints(CodeEnvConfig)
    parsers: dict[Any, Callable[[str], Any]] = {bool: _bool, int: int, float: float}
    for field in dataclasses.fields(CodeEnvConfig):
        hint = hints[field.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        parse = parsers.get(base, str)
        group.add_argument("--" + field.name.replace("_", "-"), dest=field.name, type=parse, default=None,
                           help=f"(default: {field.default!r})")
    return parser


def parse(argv: list[str] | None = None) -> tuple[SandboxConfig | None, dict[str, Any], dict[str, Any]]:
    """(sandbox config when ``--backend``/``--slots`` were given, env kwargs, server settings) from the flags."""
    args = build_parser().parse_args(argv)
    sandbox = None
    if args.backend is not None or args.slots is not None:
        base = SandboxConfig.from_env()
        sandbox = dataclasses.replace(base, backend=args.backend or base.backend, slots=args.slots or base.slots)
    env_config = {f.name: getattr(args, f.name) for f in dataclasses.fields(CodeEnvConfig)
                  if getattr(args, f.name) is not None}
    CodeEnvConfig.build(env_config)  # fail fast, before the server starts
    settings = {"host": args.host, "port": args.port}
    if args.max_sessions is not None:
        settings["max_sessions"] = args.max_sessions
    return sandbox, env_config, settings


def main(argv: list[str] | None = None) -> None:
    from envhub.server import serve

    sandbox, env_config, settings = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if sandbox is not None:
        set_default_backend(make_backend(sandbox))
    backend = CodeEnv.backend()
    if hasattr(backend, "warm"):
        backend.warm()  # start every slot's zygote now rather than on the first episodes
    logging.getLogger("env_servers.code_env").info("sandbox: %s", backend.info())
    serve(CodeEnv, env_config=env_config, **settings)


if __name__ == "__main__":
    main()
