"""``envhub-train serve``: the Tinker-compatible training service on one base model.

    envhub-train serve --port 8900                          # the tiny model on CPU
    envhub-train serve --model Qwen/Qwen3-0.6B --served-name Qwen/Qwen3-0.6B --token tml-secret
    envhub-train serve --sampler-servers http://127.0.0.1:8100,http://127.0.0.1:8101   # sampling on those servers
    # then, in any process:
    #   tinker.ServiceClient(base_url="http://127.0.0.1:8900", api_key="tml-secret")

State (futures, training runs, checkpoints) lives under --state-dir and survives restarts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import while_parent
from trainer.service._settings import ServiceSettings

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = logging.getLogger("envhub.service")


def check_service(base_url: str, timeout_s: float = 10.0) -> None:
    """Return if a training service answers ``GET {base_url}/api/v1/healthz``; else ``RuntimeError`` in one line
    (the tinker SDK itself retries a dead URL for minutes)."""
    import httpx

    try:
        httpx.get(f"{base_url.rstrip('/')}/api/v1/healthz", timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as exc:
        raise RuntimeError(f"no training service answers at {base_url} ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0]}); start one (`envhub-train serve --port 8900`)") from None


@contextlib.contextmanager
def local_service(args: list[str], log_path: str | Path, *, timeout_s: float = 180.0,
                  cwd: str | Path | None = None) -> Iterator[str]:
    """Run ``envhub-train serve --port 0 <args>`` as a subprocess for the block (in ``cwd``: a source tree there
    is imported first; it ends with this process too, however that ends); yields its URL.

    >>> with local_service(["--full-parameter"], "serve.log") as url:     # doctest: +SKIP
    ...     service = tinker.ServiceClient(base_url=url, api_key="tml-local")
    """
    argv = while_parent.argv("trainer.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args)  # ends with this process
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, cwd=cwd)
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(_listening_line(proc.stdout)), daemon=True).start()
        try:
            line = lines.get(timeout=timeout_s)  # "envhub-train serve: listening on http://127.0.0.1:PORT"
        except queue.Empty:
            line = ""
        if "listening on" not in line:
            raise RuntimeError(f"envhub-train serve did not start within {timeout_s:.0f} s; see {log_path}")
        yield line.rsplit(" ", 1)[-1].strip()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _listening_line(stdout: Any) -> str:
    """The ``listening on`` line (other output before it, say a library's log lines, is skipped); "" at EOF."""
    for line in stdout:
        if "listening on" in line:
            return str(line)
    return ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServiceSettings()
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help="TCP port (default: the port envhub-sched reserved for the job, else 8900; 0 picks a "
                             "free one and prints it)")
    parser.add_argument("--model", default=d.model, help="base model: 'tiny' (default) or a Hugging Face name/path")
    parser.add_argument("--served-name", default=None,
                        help="the name clients pass as base_model (default: --model), e.g. the public name of a "
                             "local checkpoint so tokenizer and renderer lookups work")
    parser.add_argument("--sampler", choices=("hf", "vllm"), default=d.sampler,
                        help="sampling backend: hf (default, Hugging Face generate) or vllm (one vLLM engine; needs "
                             "the venv of `ENVHUB_VENV=.venv-vllm bash scripts/setup.sh envs,train,vllm`)")
    parser.add_argument("--token", action="append", default=[],
                        help="an API key clients may send (must start with 'tml-'; repeat for several clients, each "
                             "seeing only its own runs); default: no auth")
    parser.add_argument("--state-dir", default=str(d.state_dir),
                        help=f"SQLite database and checkpoints (default {d.state_dir})")
    parser.add_argument("--max-tenants", type=int, default=d.max_tenants,
                        help=f"training clients held at once (default {d.max_tenants})")
    parser.add_argument("--full-parameter", action="store_true",
                        help="train every weight instead of LoRA (one training client at a time)")
    parser.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s,
                        help=f"unload a session's models after this long without heartbeat (default "
                             f"{d.idle_timeout_s:.0f})")
    parser.add_argument("--batch-window-ms", type=float, default=d.batch_window_s * 1000,
                        help=f"how long a sample request waits for others to share its engine batch (default "
                             f"{d.batch_window_s * 1000:g}; 0: batch only what is already queued)")
    parser.add_argument("--max-pass-tokens", type=int, default=d.max_pass_tokens,
                        help=f"padded tokens one pass of merged forward_backward work computes (with shared prompts, "
                             f"its prefix and suffix passes'); more runs as several passes with the same gradients "
                             f"(default {d.max_pass_tokens})")
    parser.add_argument("--sampler-slots", type=int, default=d.sampler_slots,
                        help=f"sampler adapters held loaded at once (here, or on each sampler server); past them the "
                             f"least recently used is swapped out (default {d.sampler_slots})")
    parser.add_argument("--sampler-servers", default=os.environ.get("ENVHUB_SAMPLER_SERVERS", ""), metavar="URL,...",
                        help="envhub-train sampler servers (comma-separated URLs) that sample for this service: it "
                             "only trains, pushes each sampler's LoRA adapter (full weights with --full-parameter) "
                             "to every server on save_weights_for_sampler, and sends sample/compute_logprobs to the "
                             "least loaded one (default: $ENVHUB_SAMPLER_SERVERS, else sample in this process); "
                             "their bearer token from $ENVHUB_SAMPLER_TOKEN; concurrent requests go to each "
                             "server as one /sample/batch")
    parser.add_argument("--sampler-servers-file", default=None, metavar="PATH",
                        help="more sampler servers, one URL a line (# comments): read at start and every 2 s while "
                             "the service runs; a server added to the file joins once it took the weights, one removed "
                             "from it leaves the pool (not the last one, nor one of --sampler-servers)")
    parser.add_argument("--sampler-weight-group", choices=("off", "gloo"), default=d.sampler_weight_group,
                        help="with --sampler-servers: push weights (LoRA and full) through a torch.distributed gloo "
                             "group with each server instead of its weight channel; a server that cannot join gets "
                             "them over the channel, with one log line (default off)")
    _add_limits(parser, d)
    parser.add_argument("--device", default=d.device,
                        help="torch device: auto (default: cuda when present), cpu, cuda:N")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for model work (default: torch's; 1 is fastest for the tiny model "
                             "on a busy machine)")
    parser.add_argument("--model-config", action="append", default=[], metavar="KEY=VALUE",
                        help="a trainer ModelConfig field, e.g. hidden_size=32 for a smaller tiny model")


def _add_limits(parser: argparse.ArgumentParser, d: ServiceSettings) -> None:
    """The limits an operator sizes to the machine (docs/service.md has them all, with what a client sees)."""
    limits = parser.add_argument_group("limits (each checked before anything that size is allocated)")
    for flag, default, meaning in [
        ("--max-batch-tokens", d.max_batch_tokens, "tokens in one forward_backward"),
        ("--max-batch-datums", d.max_batch_datums, "datums in one forward_backward"),
        ("--max-samples", d.max_samples, "num_samples of one sample request"),
        ("--max-sample-tokens", d.max_sample_tokens, "num_samples * (prompt + max_tokens) of one sample request"),
        ("--max-lora-rank", d.max_lora_rank, "the largest LoRA rank a training client may ask for (with --sampler "
                                             "vllm also the size of the engine's LoRA slots)"),
        ("--max-request-mb", d.max_request_bytes // 2**20, "MiB in one forward_backward body"),
        ("--max-pending", d.max_pending, "requests one client (API key) may have pending"),
        ("--max-queued", d.max_queued, "requests queued in all, every client (past it: 429, overloaded, retry)"),
        ("--max-sessions", d.max_sessions, "live sessions one client may hold"),
        ("--max-checkpoints-per-run", d.max_checkpoints_per_run, "named checkpoints one training run may save"),
    ]:
        limits.add_argument(flag, type=int, default=default, help=f"{meaning} (default {default})")


def settings_from_args(args: argparse.Namespace) -> ServiceSettings:
    return ServiceSettings(model=args.model, served_name=args.served_name, sampler=args.sampler,
                           tokens=tuple(args.token), state_dir=Path(args.state_dir), max_tenants=args.max_tenants,
                           full_parameter=args.full_parameter, idle_timeout_s=args.idle_timeout_s,
                           device=args.device, threads=args.threads, max_batch_tokens=args.max_batch_tokens,
                           max_batch_datums=args.max_batch_datums, max_samples=args.max_samples,
                           max_sample_tokens=args.max_sample_tokens, max_lora_rank=args.max_lora_rank,
                           max_request_bytes=args.max_request_mb * 2**20, max_pending=args.max_pending,
                           max_queued=args.max_queued, batch_window_s=args.batch_window_ms / 1000,
                           max_pass_tokens=args.max_pass_tokens,
                           sampler_slots=args.sampler_slots, max_sessions=args.max_sessions,
                           max_checkpoints_per_run=args.max_checkpoints_per_run,
                           sampler_servers=tuple(args.sampler_servers.split(",")) if args.sampler_servers else (),
                           sampler_token=os.environ.get("ENVHUB_SAMPLER_TOKEN") or None,
                           sampler_weight_group=args.sampler_weight_group,
                           sampler_servers_file=Path(args.sampler_servers_file) if args.sampler_servers_file else None)


def model_config(name: str, overrides: list[str]) -> Any:
    """A :class:`~trainer.model.ModelConfig` for ``name`` with ``KEY=VALUE`` fields (JSON values), each of its
    field's type (``hidden_size=abc`` is refused naming it)."""
    from trainer.config import from_dict
    from trainer.model import ModelConfig

    known = {f.name for f in fields(ModelConfig)} - {"name", "lora_rank"}
    values: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or key not in known:
            raise ValueError(f"Expected --model-config KEY=VALUE with KEY one of {sorted(known)}, got {item!r}.")
        try:
            values[key] = json.loads(raw)
        except json.JSONDecodeError:
            values[key] = raw
    return from_dict(ModelConfig, {"name": name, **values}, "--model-config")


def build_app(settings: ServiceSettings, model_overrides: list[str] | None = None) -> Starlette:
    """The ASGI app with its base model loaded (what ``serve`` runs; tests use it in process)."""
    from trainer.core import ModelHost
    from trainer.model import for_vllm
    from trainer.service._ops import Ops
    from trainer.service.app import create_app

    device = settings.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    model_cfg = model_config(settings.model, model_overrides or [])
    if settings.sampler == "vllm":
        model_cfg = for_vllm(model_cfg)  # the tiny model in heads vLLM's kernels take; real models unchanged
    host = ModelHost(model_cfg, device=device, sampler=settings.sampler, max_lora_rank=settings.max_lora_rank,
                     max_tenants=10**6,  # the service enforces --max-tenants itself, samplers aside
                     max_pass_tokens=settings.max_pass_tokens)
    return create_app(Ops(settings, host))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # vLLM logs to stdout unless told not to configure its logging: its lines then reach stderr through the
    # root logger, and stdout's first line stays the "listening on" one
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        settings = settings_from_args(args)
        app = build_app(settings, args.model_config)
    except (ValueError, OSError, RuntimeError) as exc:  # RuntimeError: VLLMUnavailable, with its fix
        print(f"envhub-train serve: {exc}", file=sys.stderr)
        return 2
    from trainer.scheduler.server import bind_socket

    port = args.port if args.port is not None else int((os.environ.get("ENVHUB_JOB_PORTS") or "8900").split(",")[0])
    try:
        sock = bind_socket(args.host, port)
    except OSError as exc:
        print(f"envhub-train serve: {exc.strerror}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    # one parseable line: the scheduler's service jobs and scripts started with --port 0 read the URL here
    print(f"envhub-train serve: listening on {url}", flush=True)
    log.info("serving %s as %r (state in %s, auth %s)", settings.model, settings.name, settings.state_dir,
             "on" if settings.tokens else "off")
    # keep-alive well past the SDK's 10 s heartbeat, so its pooled connections are reused, never re-opened;
    # connections beyond limit_concurrency get a 503 (which the SDK retries) instead of more memory
    # two busy threads share the GIL (the event loop and the model worker): every request hands off between them,
    # and a hand-off waits up to the switch interval (5 ms by default) while the other thread runs Python
    sys.setswitchinterval(0.0005)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, timeout_keep_alive=75,
                            limit_concurrency=1024)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
