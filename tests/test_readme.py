"""README.md's code blocks, as a reader would use them.

Python blocks run (the remote-env block against the README's own GuessEnv, served on a free port).
Each shell command is parsed by the real argument parser of its program (so a renamed option or
subcommand fails here), ``mod:Class`` targets resolve, repository files it names exist, and
``envhub-train`` overrides are applied to the config they name.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, flags=re.S | re.M)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
SHELL = [code for lang, code in BLOCKS if lang in ("bash", "sh", "shell")]


def test_the_readme_has_code_to_check():
    assert len(PYTHON) >= 2 and len(SHELL) >= 5


def _write_an_env_block() -> str:
    (block,) = [code for code in PYTHON if "class GuessEnv(Env)" in code]
    return block


def test_write_an_env_block_defines_a_working_env():
    from envhub import EnvRunner
    from envhub.testing import check_env

    namespace: dict[str, Any] = {}
    exec(compile(_write_an_env_block(), "README.md", "exec"), namespace)
    guess_env = namespace["GuessEnv"]
    check_env(guess_env, sample_action={"tool_name": "guess", "arguments": {"number": 50}})

    async def play() -> float:  # bisection finds the secret within 7 guesses
        runner = EnvRunner(guess_env())
        await runner.reset(seed=3)
        low, high, result = 1, 100, None
        while result is None or not result.done:
            number = (low + high) // 2
            result = await runner.step({"tool_name": "guess", "arguments": {"number": number}})
            low, high = (number + 1, high) if "Higher" in result.observation.text else (low, number - 1)
        return result.reward

    import asyncio

    assert asyncio.run(play()) == 1.0


def test_use_a_remote_env_block_runs_against_a_served_env():
    from envhub.server import ServerThread, create_app

    (block,) = [code for code in PYTHON if "OpenEnv(" in code]
    assert "http://127.0.0.1:8000" in block
    namespace: dict[str, Any] = {}
    exec(compile(_write_an_env_block(), "README.md", "exec"), namespace)
    out = io.StringIO()
    with ServerThread(create_app(namespace["GuessEnv"])) as server, contextlib.redirect_stdout(out):
        exec(compile(block.replace("http://127.0.0.1:8000", server.url), "README.md", "exec"), {})
    printed = out.getvalue().splitlines()
    assert printed[0] == "I picked a number between 1 and 100. Call guess(number)."
    assert "'name': 'guess'" in printed[1]
    assert printed[2] in ("Higher.", "Lower.", "Correct!")


# ------------------------------------------------------------------------------------------ shell


def _commands() -> list[list[str]]:
    variables: dict[str, str] = {}
    commands = []
    for line in "\n".join(SHELL).splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token not in (";", "&", "&&", "||"):
                words.append(re.sub(r"\$(\w+)", lambda m: variables.get(m[1], m[0]), token))
            elif words and words[0] == "export":
                name, _, value = words[1].partition("=")
                variables[name] = value
                words = []
            elif words:
                commands.append(words)
                words = []
    return commands


def _repo_paths(words: list[str]) -> list[str]:
    return [w for w in words if re.fullmatch(r"(examples|compose|scripts|benchmarks|docs)/[\w./-]+", w)]


def _envhub(argv: list[str]) -> None:
    from envhub.cli import build_parser
    from envhub.server.run import load_target

    args = build_parser().parse_args(argv)
    for word in argv:
        if re.fullmatch(r"[\w.]+:\w+", word):
            load_target(word)
    assert args.command


def _envhub_train(argv: list[str]) -> None:
    from trainer.cli import COMMANDS, DEFAULT_COMMAND, ConfigCommand

    name = argv[0] if argv and argv[0] in COMMANDS else DEFAULT_COMMAND
    command = COMMANDS[name]
    args = command.parser().parse_intermixed_args(argv[1:] if argv and argv[0] == name else argv)
    if isinstance(command, ConfigCommand) and args.config and (ROOT / args.config).exists():
        command.load(str(ROOT / args.config), args.overrides)  # every override names a real field


def _envhub_sched(argv: list[str]) -> None:
    from trainer.scheduler.cli import _parser

    _parser().parse_args(argv)


def _python(argv: list[str]) -> None:
    assert argv[0] == "-m", f"expected python -m MODULE, got {argv}"
    parsers: dict[str, Callable[[list[str]], Any]] = {}
    if argv[1] == "env_servers.gomoku_env":
        from env_servers.gomoku_env.__main__ import parse_args

        parsers[argv[1]] = parse_args
    elif argv[1] == "trainer.cli":
        parsers[argv[1]] = _envhub_train
    elif argv[1] == "trainer.quickstart":
        from trainer.quickstart import parse_args as quickstart_args

        parsers[argv[1]] = quickstart_args
    elif argv[1] == "examples.openenv_shout_server":
        from examples.openenv_shout_server import parse_args as shout_args

        parsers[argv[1]] = shout_args
    assert argv[1] in parsers, f"add a parser check for python -m {argv[1]}"
    parsers[argv[1]](argv[2:])


def _torchrun(argv: list[str]) -> None:
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    assert args.module and args.training_script == "trainer.cli"
    _envhub_train(args.training_script_args)


def _accelerate(argv: list[str]) -> None:
    from accelerate.commands.launch import launch_command_parser

    assert argv[0] == "launch", argv
    args = launch_command_parser().parse_args(argv[1:])
    assert args.module and args.training_script == "trainer.cli"
    _envhub_train(args.training_script_args)


def _bash(argv: list[str]) -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / argv[0])]).returncode == 0


def _pip(argv: list[str]) -> None:
    assert argv[0] == "install", argv  # installing the package `envhub init` wrote: tests/envhub/test_init.py runs it


def _docker(argv: list[str]) -> None:
    assert argv[:2] == ["compose", "-f"], argv  # the file is checked below; compose itself needs a Docker engine


PROGRAMS: dict[str, Callable[[list[str]], None]] = {
    "envhub": _envhub, "envhub-train": _envhub_train, "envhub-sched": _envhub_sched, "python": _python,
    "torchrun": _torchrun, "accelerate": _accelerate, "bash": _bash, "docker": _docker, "pip": _pip,
}


@pytest.mark.parametrize("words", _commands(), ids=lambda words: " ".join(words)[:60])
def test_shell_command_is_accepted_by_its_program(words: list[str]) -> None:
    assert words[0] in PROGRAMS, f"README runs {words[0]!r}: add a check for it to tests/test_readme.py"
    for path in _repo_paths(words):
        assert (ROOT / path).exists(), f"README names {path}, which does not exist"
    try:
        PROGRAMS[words[0]](words[1:])
    except SystemExit as exc:  # argparse refusing the line
        pytest.fail(f"{' '.join(words)!r} is refused by its parser (exit {exc.code})")
