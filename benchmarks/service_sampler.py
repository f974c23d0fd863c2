"""Sampling through ``envhub-train serve``: ``--sampler vllm`` against ``--sampler hf``, the same requests.

    .venv-vllm/bin/python benchmarks/service_sampler.py [--rounds 5] [--tokens 32] [--lora]
    .venv/bin/python benchmarks/service_sampler.py --lora --sampler-servers 1   # + on 1 sampler server

Two servers on the same tiny model (a shape vLLM's CPU kernels take: hidden 64 in 2 heads), one torch
thread each, driven by the official ``tinker`` SDK. A round is what a GRPO step asks of the sampler:
``save_weights_and_get_sampling_client`` then 16 prompts x 8 samples of ``--tokens`` tokens
(temperature 1, no stop; seeded by the round unless ``--unseeded``). With ``--lora`` the run is a rank-8
LoRA tenant (the snapshot is an adapter registered in vLLM), else a full-parameter run (its weights
synced into the engine in memory). Each round is preceded by one optimizer step, so each sampler has
new weights to pick up. Prints the median seconds per round of each and the ratio hf / vllm. Run it
from ``.venv-vllm``.

``--sampler-servers K`` also runs the service with ``--sampler-servers`` on K ``envhub-train sampler``
processes (HF backend, one torch thread each, like the service): a round then includes pushing the
snapshot to the servers, and the ratio servers / hf is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from trainer import local_server, while_parent
from trainer.local_server import free_port
from trainer.service.serve import local_service

SHAPE = ["--model-config", "hidden_size=64", "--model-config", "num_heads=2", "--model-config", "num_kv_heads=2"]
PROMPTS, GROUP = 16, 8


@contextlib.contextmanager
def sampler_servers(count: int, workdir: Path) -> Iterator[list[str]]:
    """``count`` HF sampler servers on the benchmark's model shape, one torch thread each; their URLs."""
    procs, urls = [], []
    model = [f"model.{arg.split('=')[0]}={arg.split('=')[1]}" for arg in SHAPE[1::2]]
    try:
        for i in range(count):  # started side by side, then waited for
            port = free_port()
            procs.append(local_server.spawn(while_parent.argv("trainer.sampler_server", "--port", str(port), *model),
                                            workdir / f"sampler-{i}.log", env={**os.environ, "OMP_NUM_THREADS": "1"}))
            urls.append(f"http://127.0.0.1:{port}")
        for i, (proc, url) in enumerate(zip(procs, urls)):
            local_server.wait_healthy(url, proc, workdir / f"sampler-{i}.log", timeout_s=300,
                                      what=f"sampler server {url}")
        yield urls
    finally:
        for proc in procs:
            local_server.stop(proc, grace_s=30)


def rounds(sampler: str, lora: bool, n_rounds: int, tokens: int, workdir: Path, servers: int = 0,
           seeded: bool = True) -> list[float]:
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(sampler_servers(servers, workdir)) if servers else []
        extra = ["--sampler-servers", ",".join(urls)] if urls else []
        return _rounds(sampler, lora, n_rounds, tokens, workdir, extra, seeded)


def _rounds(sampler: str, lora: bool, n_rounds: int, tokens: int, workdir: Path, extra: list[str],
            seeded: bool) -> list[float]:
    import tinker
    from tinker import types

    name = f"{sampler}-servers" if extra else sampler
    args = ["--threads", "1", "--sampler", sampler, "--state-dir", str(workdir / name), *SHAPE, *extra]
    args += [] if lora else ["--full-parameter"]
    with local_service(args, workdir / f"{name}.log") as url:
        sc = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
        text = list(range(40, 88))
        datum = types.Datum(model_input=types.ModelInput.from_ints(text[:-1]),
                            loss_fn_inputs={"target_tokens": text[1:], "weights": [1.0] * (len(text) - 1)})
        times = []
        for r in range(n_rounds + 1):  # the first round warms up
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            start = time.perf_counter()
            sampler_client = tc.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=tokens, temperature=1.0, stop=[],
                                           seed=r if seeded else None)
            futures = [sampler_client.sample(types.ModelInput.from_ints([10 + p, 20 + r, 30]), GROUP, params)
                       for p in range(PROMPTS)]
            for f in futures:
                assert all(len(s.tokens) == tokens for s in f.result().sequences)
            if r:
                times.append(time.perf_counter() - start)
        sc.close("success").result(timeout=30)
    return times


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="timed sampling rounds per server")
    p.add_argument("--tokens", type=int, default=32, help="tokens per sample")
    p.add_argument("--lora", action="store_true", help="a rank-8 LoRA run instead of full-parameter training")
    p.add_argument("--sampler-servers", type=int, default=0, metavar="K",
                   help="also run the service with --sampler-servers on K HF sampler server processes")
    p.add_argument("--unseeded", action="store_true",
                   help="sample without seeds (a seeded request decodes alone, here and on a server; unseeded ones "
                        "with equal settings share a decode)")
    p.add_argument("--no-vllm", action="store_true", help="skip the --sampler vllm run")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, seconds: checks that the script still runs (CI does this; HF only without vLLM)")
    args = p.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    samplers = ["hf"] if args.no_vllm else ["hf", "vllm"]
    if args.smoke:
        args.rounds, args.tokens = 1, 4
        if importlib.util.find_spec("vllm") is None:
            print("note: vLLM is not installed in this interpreter; smoke run of --sampler hf only")
            samplers = ["hf"]
    with tempfile.TemporaryDirectory() as tmp:
        med: dict[str, float] = {}
        for sampler in samplers:
            times = rounds(sampler, args.lora, args.rounds, args.tokens, Path(tmp), seeded=not args.unseeded)
            med[sampler] = statistics.median(times)
            print(f"  --sampler {sampler:4s} {med[sampler]:8.3f} s/round   runs: {', '.join(f'{x:.3f}' for x in times)}")
        if args.sampler_servers:
            times = rounds("hf", args.lora, args.rounds, args.tokens, Path(tmp), servers=args.sampler_servers,
                           seeded=not args.unseeded)
            med["servers"] = statistics.median(times)
            print(f"  --sampler-servers x{args.sampler_servers} {med['servers']:8.3f} s/round   runs: "
                  f"{', '.join(f'{x:.3f}' for x in times)}")
    mode = "LoRA rank 8" if args.lora else "full-parameter"
    ratio = f"ratio hf / vllm: {med['hf'] / med['vllm']:.2f}" if "vllm" in med else "no vLLM run"
    if "servers" in med:
        ratio += f"; ratio servers / hf: {med['servers'] / med['hf']:.2f}"
    print(f"tiny model, {mode}; a round = {PROMPTS} prompts x {GROUP} samples x {args.tokens} tokens; {ratio}")
    return med


if __name__ == "__main__":
    main()
