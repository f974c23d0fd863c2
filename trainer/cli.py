"""``envhub-train``: RL from env services, SFT or two-agent training, each configured by a TOML file and
``a.b=c`` overrides.

    envhub-train --config examples/configs/math_grpo.toml env.url=ws://localhost:8001 run.steps=50
    envhub-train sft --config my_sft.toml sft.data=demos.jsonl
    envhub-train two-agent --config examples/configs/gomoku_two_agent.toml env.url=ws://localhost:8005
    envhub-train --config FILE --print-config        # the resolved config, nothing run
    envhub-train serve --port 8900                   # the Tinker-compatible training service (docs/service.md)
    envhub-train sampler --port 8100                 # a sampler server (sampling.servers=["http://host:8100"])
    envhub-train COMMAND --help                      # a command's own options
    envhub-train --config examples/configs/openenv_shout_grpo.toml env.action_mapper=message  # any OpenEnv server

The command comes first; without one, ``rl`` runs; an unknown one is an error (exit 2) that lists them.
Under ``torchrun`` every rank runs its share of the rollouts and the gradients are averaged.

A command is a :class:`Command` (name, help, ``configure(parser)``, ``run(args) -> exit status``) added
with :func:`register`; :class:`ConfigCommand` is the shape every training mode shares (``--config``,
overrides, ``--print-config``, ``--scheduler``; load errors exit 2 with the message).

Exit status: 0 when the run finished, 1 when every episode failed ``run.max_failed_steps`` steps
in a row (the reason and an example are printed), 2 for a config error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PROG = "envhub-train"


@dataclass
class Command:
    """One ``envhub-train`` subcommand: ``configure`` adds its options, ``run`` gets the parsed args."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=f"{PROG} {self.name}", description=self.help)
        self.configure(parser)
        return parser

    def main(self, argv: list[str]) -> int:
        return self.run(self.parser().parse_intermixed_args(argv))


class ConfigCommand(Command):
    """A training mode: ``load(path, overrides) -> cfg``, ``check(cfg) -> error or None`` (before running),
    ``execute(cfg) -> summary`` (printed as JSON). ``kind`` is the scheduler job kind for ``--scheduler``."""

    def __init__(self, name: str, help: str, *, load: Callable[[str | None, list[str]], Any],
                 execute: Callable[[Any], dict[str, Any]], check: Callable[[Any], str | None] = lambda cfg: None,
                 kind: str = "rl"):
        super().__init__(name, help, self._configure, self._run)
        self.load, self.execute, self.check, self.kind = load, execute, check, kind

    def _configure(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", "-c", default=None, help="TOML config file (defaults when omitted)")
        parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        parser.add_argument("--scheduler", metavar="URL", default=None,
                            help="run as a job of an envhub-sched service (its API key from ENVHUB_SCHEDULER_KEY): "
                                 "queued, placed on free GPUs, log streamed here, cancelled on Ctrl-C")
        parser.add_argument("--gpus", type=int, default=1, help="GPUs to ask the scheduler for (default 1)")
        parser.add_argument("--torchrun", action="store_true",
                            help="with --scheduler: launch under torchrun, one rank per GPU")
        parser.add_argument("--nodes", type=int, default=1,
                            help="with --scheduler on its Ray backend: spread --gpus over this many nodes "
                                 "(one torchrun per node, rendezvous set by the scheduler)")
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.steps=10")

    def _run(self, args: argparse.Namespace) -> int:
        if args.scheduler:
            return self._submit(args)
        try:
            cfg = self.load(args.config, args.overrides)
        except (ValueError, TypeError, OSError) as exc:
            print(f"{PROG} {self.name}: {exc}", file=sys.stderr)
            return 2
        if args.print_config:
            print(cfg.to_json())
            return 0
        problem = self.check(cfg)
        if problem:
            print(f"{PROG} {self.name}: {problem}", file=sys.stderr)
            return 2
        from trainer.model import ModelLoadError
        from trainer.recipes.sft import DemoFileError
        from trainer.rollout.failures import RolloutFailureError

        try:
            summary = self.execute(cfg)
        except (ModelLoadError, DemoFileError) as exc:  # a model or data file that is not there: what to do
            print(f"{PROG} {self.name}: {exc}", file=sys.stderr)
            return 2
        except RolloutFailureError as exc:  # every episode failed for several steps: nothing was learned
            print(f"{PROG} {self.name}: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(summary, indent=2))
        return 0

    def _submit(self, args: argparse.Namespace) -> int:
        """Re-run this command as a scheduler job (everything but ``--scheduler``), streaming its log."""
        from trainer.scheduler.client import submit_self

        argv = [sys.executable, "-m", "trainer.cli", self.name]
        if args.config:
            argv += ["--config", os.path.abspath(args.config)]
        argv += (["--print-config"] if args.print_config else []) + args.overrides
        return submit_self(args.scheduler, argv, args.gpus, self.kind, torchrun=args.torchrun, nodes=args.nodes)


COMMANDS: dict[str, Command] = {}
DEFAULT_COMMAND = "rl"


def register(command: Command) -> Command:
    """Add ``command`` to ``envhub-train`` (by its name)."""
    COMMANDS[command.name] = command
    return command


# -- the training modes --------------------------------------------------------------------------
def _load_train(path: str | None, overrides: list[str]) -> Any:
    from trainer.config import load_config

    return load_config(path, overrides)


def _rl_env(cfg: Any) -> str | None:
    if cfg.env.all_urls() or cfg.env.env_class:
        return _in_process_env_problem(cfg)
    return ("no environment: set env.url=ws://host:port (or env.urls=[...], or env.env_class='pkg.mod:Cls' to "
            "run one in process).")


def _in_process_env_problem(cfg: Any) -> str | None:
    """An ``env.env_class`` that does not import, or refuses ``env.env_kwargs``: said before any model loads
    (the env is built once and closed, as ``envhub serve`` checks its ``--set``)."""
    from envhub.server.run import check_env_config
    from trainer.rollout.envs import load_env_class

    if cfg.env.all_urls() or not cfg.env.env_class:
        return None
    try:
        check_env_config(load_env_class(cfg.env.env_class), dict(cfg.env.env_kwargs))
    except (ImportError, AttributeError, ValueError) as exc:
        return f"env.env_class={cfg.env.env_class!r}: {exc}"
    return None


def _run_rl(cfg: Any) -> dict[str, Any]:
    from trainer.recipes.rl import train

    return train(cfg)


def _sft_data(cfg: Any) -> str | None:
    if cfg.sft.data:
        return None  # the run reads it first thing (one read): a bad file is a DemoFileError, status 2
    return "no demonstrations: pass sft.data=path/to/demos.jsonl (one JSON object a line)."


def _run_sft(cfg: Any) -> dict[str, Any]:
    from trainer.recipes.sft import train_sft

    return train_sft(cfg)


def _load_two_agent(path: str | None, overrides: list[str]) -> Any:
    from trainer.recipes.two_agent_config import load_two_agent_config

    return load_two_agent_config(path, overrides)


def _match_env(cfg: Any) -> str | None:
    if cfg.env.all_urls() or cfg.env.env_class:
        return _in_process_env_problem(cfg)
    return ("no match env: set env.url=ws://host:port (a GomokuMatchEnv server: python -m env_servers.gomoku_env "
            "--two-agent) or env.env_class='pkg.mod:Cls'.")


def _run_two_agent(cfg: Any) -> dict[str, Any]:
    from trainer.recipes.two_agent import train_two_agents

    return train_two_agents(cfg)


register(ConfigCommand("rl", "On-policy RL (GRPO, PPO, RLOO, REINFORCE++) from env services; the default.",
                       load=_load_train, check=_rl_env, execute=_run_rl))
register(ConfigCommand("sft", "Supervised fine-tuning on demonstrations (sft.data, JSONL).",
                       load=_load_train, check=_sft_data, execute=_run_sft, kind="sft"))
register(ConfigCommand("two-agent", "Two policies trained against each other through a match env.",
                       load=_load_two_agent, check=_match_env, execute=_run_two_agent))


def _configure_serve(parser: argparse.ArgumentParser) -> None:
    from trainer.service import serve

    parser.formatter_class, parser.epilog = argparse.RawDescriptionHelpFormatter, _plain(serve.__doc__)
    serve.add_arguments(parser)


def _plain(doc: str | None) -> str:
    """A module docstring as --help text: its reStructuredText literals (in double backquotes) as plain words."""
    return (doc or "").replace("``", "")


def _run_serve(args: argparse.Namespace) -> int:
    from trainer.service import serve

    return serve.serve(args)


register(Command("serve", "The Tinker-compatible training service: the tinker SDK drives it (docs/service.md).",
                 _configure_serve, _run_serve))


def _configure_sampler(parser: argparse.ArgumentParser) -> None:
    from trainer.sampler_server import serve

    parser.formatter_class, parser.epilog = argparse.RawDescriptionHelpFormatter, _plain(serve.__doc__)
    serve.add_arguments(parser)


def _run_sampler(args: argparse.Namespace) -> int:
    from trainer.sampler_server import serve

    return serve.serve(args)


register(Command("sampler", "A sampler server the trainer pushes weights to; also speaks the OpenAI API.",
                 _configure_sampler, _run_sampler))


# -- entry point ---------------------------------------------------------------------------------
def usage() -> str:
    lines = [f"usage: {PROG} [COMMAND] [options] [key=value ...]", "", __doc__.split("\n\n")[0], "", "commands:"]
    lines += [f"  {name:<12} {cmd.help}" for name, cmd in COMMANDS.items()]
    lines += ["", f"Without a command, {DEFAULT_COMMAND} runs. `{PROG} COMMAND --help` lists a command's options."]
    return "\n".join(lines)


def _dispatch(argv: list[str]) -> int:
    """Run the command ``argv`` names (``rl`` when it names none); its exit status."""
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]].main(argv[1:])
    if argv and _names_a_command(argv[0]):
        print(f"{PROG}: unknown command {argv[0]!r}; the commands are {', '.join(COMMANDS)} (without one, "
              f"{DEFAULT_COMMAND} runs).\n\n{usage()}", file=sys.stderr)
        return 2
    return COMMANDS[DEFAULT_COMMAND].main(argv)


def _names_a_command(word: str) -> bool:
    """Whether ``word``, first on the command line, can only be a command's name: neither an option nor a
    ``key=value`` override of the default command."""
    return not word.startswith("-") and "=" not in word


def _rank_of_a_process_group() -> bool:
    dist = sys.modules.get("trainer.distributed")  # imported by the runs that can join one, not by --help
    return bool(dist is not None and dist.joined_process_group())


def main(argv: list[str] | None = None) -> int:
    """``envhub-train``. A torchrun rank ends through ``trainer.distributed.exit_rank`` (its traceback
    printed first if the run raised): a plain interpreter exit can abort it after a successful run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _dispatch(argv)
    except BaseException:
        if not _rank_of_a_process_group():
            raise
        traceback.print_exc()
        code = 1
    if _rank_of_a_process_group():
        sys.modules["trainer.distributed"].exit_rank(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
