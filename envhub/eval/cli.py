"""``envhub eval``: the command line of :func:`envhub.eval.runner.run_eval`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from envhub.eval import DEFAULT_SYSTEM_PROMPT


def _pairs(values: list[str]) -> dict[str, object]:
    from envhub.cli import parse_set

    return parse_set(values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``envhub eval``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  envhub eval --env math --model tiny --episodes 4 --samples 2 --max-tokens 64 --out runs/eval-math\n"
        "  envhub eval --env ws://localhost:8002 --model http://localhost:8000/v1 --model-name Qwen/Qwen2.5-7B-Instruct\n"
        "  envhub eval ... --resume      # after Ctrl-C or a crash: play only what results.jsonl lacks\n\n"
        "Writes DIR/run.json (arguments), DIR/results.jsonl (one episode per line, transcript included) and\n"
        "DIR/summary.json (mean reward, pass@k, failures by kind); see docs/eval.md.")
    parser.add_argument("--env", required=True, metavar="URL|NAME",
                        help="the env: a server URL (ws://host:port), or a registered name / module:Class that eval "
                             "serves itself on a free loopback port for the run")
    parser.add_argument("--model", required=True, metavar="URL|NAME",
                        help="an OpenAI-compatible base URL (http://host:port/v1), or a local model as envhub-train's "
                             "model.name takes it (tiny, a path to an HF model directory; needs envhub[train])")
    parser.add_argument("--model-name", metavar="NAME", help="the model name sent to an endpoint (default 'default') and recorded")
    parser.add_argument("--api-key", metavar="KEY", help="bearer token for the model endpoint (never written to disk)")
    parser.add_argument("--episodes", type=int, default=10, metavar="N", help="tasks to play (default 10)")
    parser.add_argument("--samples", type=int, default=1, metavar="K",
                        help="samples per task; pass@k is reported for every k <= K (default 1)")
    parser.add_argument("--concurrency", type=int, default=8, metavar="C", help="episodes in flight (default 8)")
    parser.add_argument("--out", default="runs/eval", metavar="DIR", help="output directory (default runs/eval)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="task i resets with seed S+i; also seeds a local model's sampling (default 0)")
    parser.add_argument("--max-turns", type=int, default=10, metavar="T", help="model turns per episode (default 10)")
    parser.add_argument("--history-turns", type=int, default=None, metavar="K",
                        help="show the model the system prompt, its last K turns and the newest observation, not the "
                             "whole conversation (as a run trained with rollout.history_turns=K saw it; default: all)")
    parser.add_argument("--max-tokens", type=int, default=1024, metavar="N", help="tokens per model reply (default 1024)")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="TEMP", help="sampling temperature, 0 = greedy (default 1)")
    parser.add_argument("--pass-threshold", type=float, default=1.0, metavar="R",
                        help="pass@k counts an episode as passed when its reward >= R (default 1.0)")
    parser.add_argument("--episode-timeout", type=float, dest="episode_timeout_s", metavar="S",
                        help="end an episode after S seconds as a timeout failure (default: none)")
    parser.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT, metavar="TEXT",
                        help="used when the env sends none in its first observation's metadata ('' for none)")
    parser.add_argument("--reset", dest="reset_kwargs", action="append", default=[], metavar="KEY=VALUE",
                        help="extra reset argument for every task, e.g. split=test (repeatable; JSON when it parses)")
    parser.add_argument("--set", dest="env_config", action="append", default=[], metavar="KEY=VALUE",
                        help="env constructor argument when eval serves the env itself (repeatable)")
    parser.add_argument("--env-token", metavar="TOKEN", help="bearer token of the env server (never written to disk)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out: skip the (task, sample) pairs results.jsonl holds; refused "
                             "when env, model, seed, limits or prompts differ from run.json")
    parser.add_argument("--retry-failed", action="store_true",
                        help="with --resume: also play again the episodes that failed (env, model or "
                             "infrastructure), replacing their lines")


def run(args: argparse.Namespace) -> int:
    """Run the eval and print the summary's headline numbers; exit 130 when interrupted."""
    from envhub.eval.runner import EvalConfig, run_eval

    config = EvalConfig(env=args.env, model=args.model, episodes=args.episodes, samples=args.samples,
                        concurrency=args.concurrency, out=args.out, seed=args.seed, max_turns=args.max_turns,
                        history_turns=args.history_turns,
                        max_tokens=args.max_tokens, temperature=args.temperature, pass_threshold=args.pass_threshold,
                        model_name=args.model_name, api_key=args.api_key, env_token=args.env_token,
                        episode_timeout_s=args.episode_timeout_s, system_prompt=args.system_prompt or None,
                        reset_kwargs=_pairs(args.reset_kwargs), env_config=_pairs(args.env_config), resume=args.resume,
                        retry_failed=args.retry_failed)
    try:
        summary = run_eval(config)
    except RuntimeError as exc:  # the env server eval started did not come up: its log is in the message
        print(f"envhub eval: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a local --model that is not there (its message says how to get it), an unwritable --out
        print(f"envhub eval: error: {exc}", file=sys.stderr)
        return 2
    headline = {key: summary[key] for key in ("episodes_done", "episodes_failed", "mean_reward", "pass_at_k",
                                              "failures", "completion_tokens_per_s")}
    print(json.dumps(headline))
    print(f"wrote {config.out}/results.jsonl and {config.out}/summary.json", file=sys.stderr)
    if summary["interrupted"]:
        return 130
    if summary["episodes_recorded"] and not summary["episodes_done"]:  # nothing was measured: say why, fail
        print(f"envhub eval: error: no episode completed ({summary['episodes_failed']} failed: "
              f"{', '.join(f'{n} {kind}' for kind, n in summary['failures'].items())}); the first: "
              f"{_first_failure(Path(config.out) / 'results.jsonl')}", file=sys.stderr)
        return 1
    return 0


def _first_failure(results: Path) -> str:
    """The message of the first failed episode in ``results.jsonl``."""
    with open(results, encoding="utf-8") as fh:
        for line in fh:
            try:
                failure = json.loads(line).get("failure")
            except ValueError:  # a line cut off by a kill
                continue
            if failure:
                return str(failure.get("message") or failure.get("kind"))
    return "(none recorded)"
