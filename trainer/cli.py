"""``envhub-train``: RL from env services, or SFT, configured by a TOML file and ``a.b=c`` overrides.

    envhub-train --config examples/configs/math_grpo.toml env.url=ws://localhost:8001 run.steps=50
    envhub-train sft --config my_sft.toml sft.data=demos.jsonl
    envhub-train --config FILE --print-config        # the resolved config, nothing run

Under ``torchrun`` every rank runs its share of the rollouts and the gradients are averaged.
"""

from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="envhub-train", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("mode", nargs="?", default="rl", help="rl (default), sft or two-agent")
    parser.add_argument("--config", "-c", default=None, help="TOML config file (defaults when omitted)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--scheduler", metavar="URL", default=None,
                        help="run as a job of an envhub-sched service (its API key from ENVHUB_SCHEDULER_KEY): "
                             "queued, placed on free GPUs, log streamed here, cancelled on Ctrl-C")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs to ask the scheduler for (default 1)")
    parser.add_argument("--torchrun", action="store_true",
                        help="with --scheduler: launch under torchrun, one rank per GPU")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. algo.name=rloo")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    # "envhub-train algo.name=x" parses the override as the mode: give it back to the overrides.
    if args.mode not in ("rl", "sft", "two-agent"):
        args.overrides.insert(0, args.mode)
        args.mode = "rl"
    if args.scheduler:
        return _submit(args)
    if args.mode == "two-agent":
        from trainer.multiagent.__main__ import main as two_agent_main
        return two_agent_main((["--config", args.config] if args.config else [])
                              + (["--print-config"] if args.print_config else []) + args.overrides)
    from trainer.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, TypeError, OSError) as exc:
        print(f"envhub-train: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.to_json())
        return 0
    if args.mode == "sft":
        from trainer.recipes.sft import train_sft

        summary = train_sft(cfg)
    else:
        if not (cfg.env.all_urls() or cfg.env.env_class):
            print("envhub-train: no environment: set env.url=ws://host:port (or env.urls=[...], or "
                  "env.env_class='pkg.mod:Cls' to run one in process).", file=sys.stderr)
            return 2
        from trainer.recipes.rl import train
        from trainer.rollout.failures import RolloutFailureError

        try:
            summary = train(cfg)
        except RolloutFailureError as exc:
            print(f"envhub-train: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(summary, indent=2))
    return 0


def _submit(args: argparse.Namespace) -> int:
    """Re-run this command as a scheduler job (everything but ``--scheduler``), streaming its log."""
    import os

    from trainer.scheduler.client import submit_self

    argv = [sys.executable, "-m", "trainer.cli", args.mode]
    if args.config:
        argv += ["--config", os.path.abspath(args.config)]
    argv += (["--print-config"] if args.print_config else []) + args.overrides
    kind = "sft" if args.mode == "sft" else "rl"
    return submit_self(args.scheduler, argv, args.gpus, kind, torchrun=args.torchrun)


if __name__ == "__main__":
    sys.exit(main())
