"""Sampler servers against the in-process sampler: quick-start GRPO step time, rollout time and weight-push
time per step with 0 (in process), 1 and 2 ``envhub-train sampler`` servers on this host, side by side;
then the time to push a tiny and a 0.5B-shaped model over loopback (through a 2-rank gloo group,
``sampling.weight_group = "gloo"``; through the server's weight channel; and as an HTTP body) and the
trainer-vs-server log-prob mismatch after each push (fp32 on both sides).

Part 1 runs ``python -m trainer.quickstart`` three times with the same seed (``--sampler-servers``
for the server runs; the servers are started here with the quick start's model shape and its one torch
thread). Part 2 starts one server per shape and transport, pushes the trainer's weights ``--repeats``
times (``RemoteSampler.update_weights``: a streamed safetensors body, no file) and samples after each
push, comparing the server's log-probs with the trainer's own forward pass on the same ids.

    .venv/bin/python benchmarks/sampler_servers.py                 # both parts
    .venv/bin/python benchmarks/sampler_servers.py --part push --layers-05b 24
    .venv/bin/python benchmarks/sampler_servers.py --smoke         # seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

QUICKSTART_SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256)


def shape_05b(layers: int) -> dict[str, int]:
    return dict(hidden_size=896, num_layers=layers, num_heads=14, num_kv_heads=2, intermediate_size=4864)


def start_server(shape: dict[str, int], log_dir: Path, timeout_s: float = 300.0,
                 threads: int | None = None, channel: bool = True) -> tuple[subprocess.Popen, str]:
    """``python -m trainer.sampler_server`` with ``shape`` (fp32) on a free port, once healthy."""
    from trainer import local_server, while_parent
    from trainer.local_server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = while_parent.argv("trainer.sampler_server", "--port", str(port), "--device", "cpu",  # ends with this run
                             *(["--threads", str(threads)] if threads else []),
                             *([] if channel else ["--weight-port", "-1"]),
                             "model.dtype=fp32", *(f"model.{k}={v}" for k, v in shape.items()))
    return local_server.start(argv, url, log_dir / f"sampler-{port}.log", timeout_s=timeout_s,
                              what="the sampler server"), url


def stop(procs: list[subprocess.Popen]) -> None:
    from trainer import local_server

    for proc in procs:
        local_server.stop(proc)


# -- part 1: the quick start through 0, 1 and 2 servers ------------------------------------------
def run_quickstart(args: argparse.Namespace, servers: int, out: Path) -> dict[str, float]:
    from trainer.quickstart import main as quickstart

    procs: list[subprocess.Popen] = []
    urls: list[str] = []
    argv = ["--steps", str(args.steps), "--out", str(out / "run"), "--seed", str(args.seed), "--threads", "1"]
    if args.sft_steps is not None:  # the warm-up is not what this measures: cap it to save time
        argv += ["--sft-steps", str(args.sft_steps)]
    if args.smoke:
        argv += ["--sft-steps", "2", "--batch", "2", "--group", "2", "--eval-problems", "2", "--eval-every", "0"]
    try:
        for _ in range(servers):
            proc, url = start_server(QUICKSTART_SHAPE, out, threads=1)  # as the quick start's --threads 1
            procs.append(proc)
            urls.append(url)
        if urls:
            argv += ["--sampler-servers", ",".join(urls)]
        summary = quickstart(argv)
    finally:
        stop(procs)
    steps = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "time/step_s" in r]
    return {"step_s": statistics.mean(r["time/step_s"] for r in steps),
            "rollout_s": statistics.mean(r["time/rollout_s"] for r in steps),
            "push_s": statistics.mean(r.get("time/weight_push_s", 0.0) for r in steps),
            "val": summary["val_reward_after"]}


def part_steps(args: argparse.Namespace) -> None:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (0, 1, 2):
            out = Path(tmp) / f"servers{n}"
            out.mkdir()
            rows[n] = run_quickstart(args, n, out)
    base = rows[0]["step_s"]
    print(f"\nquick start GRPO, {args.steps} steps, seed {args.seed}: in process vs sampler servers on this host")
    print(f"{'sampler':<16}{'step s':>9}{'rollout s':>11}{'push s':>9}{'val after':>11}{'step vs in process':>20}")
    for n, r in rows.items():
        name = "in process" if n == 0 else f"{n} server{'s' if n > 1 else ''}"
        print(f"{name:<16}{r['step_s']:>9.3f}{r['rollout_s']:>11.3f}{r['push_s']:>9.3f}{r['val']:>11.3f}"
              f"{r['step_s'] / base:>19.2f}x")


# -- part 2: push time and log-prob mismatch per shape -------------------------------------------
def trainer_logprobs(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> torch.Tensor:
    from trainer.core.forward import run_model, target_logprobs

    tokens = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits, _ = run_model(model.eval(), tokens, torch.ones_like(tokens))
    return target_logprobs(logits[:, :-1], tokens[:, 1:], 1.0)[0, len(prompt) - 1:]


def push_and_compare(shape: dict[str, int], repeats: int, log_dir: Path, via: str) -> dict[str, float]:
    from trainer.model import ModelConfig, load_policy
    from trainer.sampling import GenRequest, RemoteSampler, SamplingConfig

    proc, url = start_server(shape, log_dir, channel=via != "HTTP")
    try:
        model, _ = load_policy(ModelConfig(**shape, dtype="fp32"))
        config = SamplingConfig(weight_group="gloo" if via == "group" else "off")
        sampler = RemoteSampler([url], model, config, log=lambda m: None)
        times, gaps = [], []
        prompt = [11, 12, 13, 14, 15]
        for version in range(1, repeats + 1):
            with torch.no_grad():  # a new policy each time, as after an optimizer step
                for p in model.parameters():
                    p.mul_(1.0 + 1e-3 * version)
            start = time.perf_counter()
            sampler.update_weights(model, version)
            times.append(time.perf_counter() - start)
            gen = asyncio.run(sampler.generate(GenRequest(prompt, 8)))
            assert gen.version == version
            assert not sampler.pool.servers[url].group_failed, "the weight group failed; the push took the channel"
            gaps.append(float((trainer_logprobs(model, prompt, gen.tokens) - torch.tensor(gen.logprobs)).abs().max()))
        megabytes = sampler.last_push_bytes / 1e6
        sampler.close()
    finally:
        stop([proc])
    return {"push_s": statistics.median(times), "mb": megabytes, "gap": max(gaps)}


def part_push(args: argparse.Namespace) -> None:
    shapes = {"tiny (quick start)": QUICKSTART_SHAPE}
    if not args.smoke:
        shapes[f"0.5B-shaped, {args.layers_05b} layers"] = shape_05b(args.layers_05b)
    print(f"\nweight push over loopback (fp32, median of {args.repeats}): the tensors through a gloo group "
          "(sampling.weight_group='gloo'), the body over the server's weight channel (the default) and as the HTTP "
          "request's body (--weight-port -1), the trainer-vs-server log-prob mismatch after each push")
    print(f"{'model':<28}{'via':<9}{'MB':>9}{'push s':>9}{'MB/s':>9}{'max |lp gap|':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in shapes.items():
            for via in ("group", "channel", "HTTP"):
                r = push_and_compare(shape, args.repeats, Path(tmp), via)
                print(f"{name:<28}{via:<9}{r['mb']:>9.1f}{r['push_s']:>9.3f}{r['mb'] / r['push_s']:>9.0f}"
                      f"{r['gap']:>14.2e}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["all", "steps", "push"], default="all")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per quick-start run")
    p.add_argument("--sft-steps", type=int, default=None, help="cap the quick start's SFT warm-up (default: its own)")
    p.add_argument("--layers-05b", type=int, default=24, help="layers of the 0.5B-shaped model (24 in the real one)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs, measures nothing")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.layers_05b, args.repeats = 2, 1, 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    if args.part in ("all", "steps"):
        part_steps(args)
    if args.part in ("all", "push"):
        part_push(args)


if __name__ == "__main__":
    main()
