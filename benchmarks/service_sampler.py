"""Sampling through ``envhub-train serve``: ``--sampler vllm`` against ``--sampler hf``, the same requests.

    .venv-vllm/bin/python benchmarks/service_sampler.py [--rounds 5] [--tokens 32] [--lora]

Two servers on the same tiny model (a shape vLLM's CPU kernels take: hidden 64 in 2 heads), one torch
thread each, driven by the official ``tinker`` SDK. A round is what a GRPO step asks of the sampler:
``save_weights_and_get_sampling_client`` then 16 prompts x 8 samples of ``--tokens`` tokens
(temperature 1, no stop). With ``--lora`` the run is a rank-8 LoRA tenant (the snapshot is an adapter
registered in vLLM), else a full-parameter run (its weights synced into the engine in memory). Each
round is preceded by one optimizer step, so each sampler has new weights to pick up. Prints the
median seconds per round of each and the ratio hf / vllm. Run it from ``.venv-vllm``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

from trainer.service.serve import local_service

SHAPE = ["--model-config", "hidden_size=64", "--model-config", "num_heads=2", "--model-config", "num_kv_heads=2"]
PROMPTS, GROUP = 16, 8


def rounds(sampler: str, lora: bool, n_rounds: int, tokens: int, workdir: Path) -> list[float]:
    import tinker
    from tinker import types

    args = ["--threads", "1", "--sampler", sampler, "--state-dir", str(workdir / sampler), *SHAPE]
    args += [] if lora else ["--full-parameter"]
    with local_service(args, workdir / f"{sampler}.log") as url:
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
            params = types.SamplingParams(max_tokens=tokens, temperature=1.0, stop=[], seed=r)
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
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, seconds: checks that the script still runs (CI does this; HF only without vLLM)")
    args = p.parse_args(argv)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    samplers = ["hf", "vllm"]
    if args.smoke:
        args.rounds, args.tokens = 1, 4
        if importlib.util.find_spec("vllm") is None:
            print("note: vLLM is not installed in this interpreter; smoke run of --sampler hf only")
            samplers = ["hf"]
    with tempfile.TemporaryDirectory() as tmp:
        med: dict[str, float] = {}
        for sampler in samplers:
            times = rounds(sampler, args.lora, args.rounds, args.tokens, Path(tmp))
            med[sampler] = statistics.median(times)
            print(f"  --sampler {sampler:4s} {med[sampler]:8.3f} s/round   runs: {', '.join(f'{x:.3f}' for x in times)}")
    mode = "LoRA rank 8" if args.lora else "full-parameter"
    ratio = f"ratio hf / vllm: {med['hf'] / med['vllm']:.2f}" if "vllm" in med else "no vLLM run"
    print(f"tiny model, {mode}; a round = {PROMPTS} prompts x {GROUP} samples x {args.tokens} tokens; {ratio}")
    return med


if __name__ == "__main__":
    main()
