"""The TRL recipe: ``GRPOTrainer`` trains a policy against an envhub env server through ``adapters.trl``.

    python examples/trl_grpo.py                                  # tiny local model, math env served here, CPU
    python examples/trl_grpo.py --env-url ws://localhost:8001 --model Qwen/Qwen2.5-0.5B-Instruct \\
        --steps 200 --max-completion-length 512                  # the fleet's math server, a real model
    python examples/trl_grpo.py --env-url ws://localhost:8003 --model Qwen/Qwen2.5-1.5B-Instruct   # tool env

The env owns the task and the reward: each dataset row carries a ``seed``, every one of the
``--num-generations`` rollouts of a row resets the env with it (same problem, as GRPO needs),
the env's prompt is appended to the (empty) user message, and the env scores the rollout. Tool
envs get their tools as methods (TRL's multi-turn tool loop); text envs get the completion
submitted as the answer. ``--model tiny`` builds a random Qwen2 locally (nothing downloaded);
other names load from the local Hugging Face cache.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from typing import Any

from adapters.trl import EnvhubEnvironment, grpo_kwargs, seed_dataset
from envhub.errors import EnvHubError
from envhub.server import ServerThread, create_app


def load_model(name: str, tools: bool) -> tuple[Any, Any]:
    """``tiny``: a 2-layer Qwen2 built from a config with the project's byte-level tokenizer; else a local HF model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if name != "tiny":
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True, padding_side="left")
        return AutoModelForCausalLM.from_pretrained(name, local_files_only=True), tok
    from trainer.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    if tools:  # TRL parses tool calls for the chat templates it ships; use its copy of Qwen2.5's
        from trl.chat_template_utils import qwen2_5_chat_template

        tok.chat_template = qwen2_5_chat_template
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config), tok


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env-url", help="env server (default: serve the math env in this process)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4, help="rollouts per device per step (whole groups)")
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--output-dir", default="runs/trl_grpo")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.num_generations < 2:
        parser.error(f"expected --steps >= 1, --batch-size >= 1 and --num-generations >= 2 (GRPO compares a group), "
                     f"got {args.steps}, {args.batch_size} and {args.num_generations}")
    if args.batch_size % args.num_generations:
        parser.error(f"expected --batch-size to be a multiple of --num-generations (whole groups per step), "
                     f"got {args.batch_size} and {args.num_generations}")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is marked experimental
    import torch
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    with ExitStack() as stack:
        if args.env_url is None:
            from env_servers.math_env import MathEnv

            args.env_url = stack.enter_context(ServerThread(create_app(MathEnv), log_level="warning")).url
        try:
            kwargs = grpo_kwargs(args.env_url)
        except (EnvHubError, ValueError) as exc:  # the server is not there, or its env does not fit the adapter
            sys.exit(f"trl_grpo: error: {exc}")
        try:
            model, tok = load_model(args.model, tools=issubclass(kwargs["environment_factory"], EnvhubEnvironment))
        except OSError as exc:  # not a local directory and not in the Hugging Face cache
            sys.exit(f"trl_grpo: error: could not load --model {args.model!r} from a local directory or the Hugging "
                     f"Face cache (nothing is downloaded; --model tiny needs nothing): {str(exc).splitlines()[0]}")
        config = GRPOConfig(output_dir=args.output_dir, max_steps=args.steps, num_generations=args.num_generations,
                            per_device_train_batch_size=args.batch_size,
                            max_completion_length=args.max_completion_length, learning_rate=args.learning_rate,
                            logging_steps=1, save_strategy="no", report_to="none", seed=args.seed,
                            use_cpu=not torch.cuda.is_available())
        trainer = GRPOTrainer(model=model, args=config, processing_class=tok,
                              train_dataset=seed_dataset(args.steps * args.batch_size, start=args.seed * 100_000),
                              **kwargs)
        trainer.train()
    logs = [{k: v for k, v in row.items() if k in ("step", "reward", "reward_std", "loss")}
            for row in trainer.state.log_history if "reward" in row]
    for row in logs:
        print(row)
    return logs


if __name__ == "__main__":
    main()
