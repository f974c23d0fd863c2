"""Rollout throughput: HF ``generate`` vs vLLM tokens/s, and GRPO step time synchronous vs asynchronous.

Part 1 times generation alone on the same random-weight model and the same batch (``--batch`` prompts
of ``--prompt-len`` token ids, ``--new-tokens`` new tokens each, sampled at temperature 1): Hugging Face
``generate`` itself, then the trainer's own samplers, ``HFSampler.generate_batch`` (the lean decode loop
of ``trainer.sampling.decode``) and ``VLLMSampler.generate_batch``, vLLM twice: in the trainer's fp32 (log-probs equal
the trainer's) and with bf16 weights (``sampling.vllm_dtype = "bfloat16"``). Two model
shapes: the quick start's tiny Qwen2 (hidden 64, 2 layers, heads of 32 as with vLLM) and a
Qwen2.5-0.5B-shaped one (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864) cut to ``--layers-05b``
layers, with the project's byte-level vocabulary. HF runs first, before vLLM is in the process
(vLLM's CPU worker binds threads). Needs vLLM (``scripts/setup.sh envs,train,vllm``); without it only
HF is timed.

Part 2 runs the quick start (``python -m trainer.quickstart``: SFT warm-up, then GRPO against the
math env server) twice with the same seed, ``--max-staleness 0`` and ``1``, and compares the mean GRPO
step time (``time/step_s``) and the final validation reward.

    .venv-vllm/bin/python benchmarks/rollout_throughput.py            # both parts, full quick start
    .venv-vllm/bin/python benchmarks/rollout_throughput.py --smoke    # a few seconds per part (CI)
    .venv/bin/python benchmarks/rollout_throughput.py --part steps --quickstart-steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def shapes(args) -> dict[str, dict]:
    return {"tiny (quick start)": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                                       intermediate_size=256),
            f"0.5B-shaped, {args.layers_05b} layers": dict(hidden_size=896, num_layers=args.layers_05b, num_heads=14,
                                                            num_kv_heads=2, intermediate_size=4864)}


def requests(args, vocab: int):
    from trainer.sampling import GenRequest

    gen = torch.Generator().manual_seed(0)
    return [GenRequest(torch.randint(3, vocab - 1, (args.prompt_len,), generator=gen).tolist(), args.new_tokens)
            for _ in range(args.batch)]


def tokens_per_s(sampler, reqs, repeats: int) -> float:
    sampler.generate_batch(reqs[:2])  # warm-up (first-call set-up is not throughput)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = sampler.generate_batch(reqs)
        rates.append(sum(len(r.tokens) for r in results) / (time.perf_counter() - start))
    return statistics.median(rates)


class GenerateBaseline:
    """``transformers`` ``generate`` on a left-padded batch with the HF sampler's settings (the reference)."""

    def __init__(self, model, tok):
        self.model, self.pad, self.eos = model.eval(), tok.pad_token_id, tok.eos_token_id

    def generate_batch(self, reqs):
        from trainer.sampling import SampledSequence

        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids):], attn[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids), 1
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=reqs[0].max_new_tokens,
                                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=self.eos,
                                      pad_token_id=self.pad, return_dict_in_generate=True, output_logits=True)
        return [SampledSequence(row.tolist(), [], "length") for row in out.sequences[:, width:]]


def part_generation(args) -> list[list]:
    """Per model: name, generate tok/s, HF sampler tok/s, then vLLM fp32 and bf16 tok/s when vLLM is here."""
    from trainer.model import ModelConfig, load_policy
    from trainer.sampling import HFSampler, SamplingConfig

    try:
        import vllm  # noqa: F401
        have_vllm = True
    except ImportError:
        have_vllm = False
        print("vLLM is not installed in this venv: timing HF only (scripts/setup.sh envs,train,vllm installs it)")
    sampling = SamplingConfig(temperature=1.0, max_batch_size=args.batch)
    built = {}
    rows = []
    for name, shape in shapes(args).items():  # every HF timing before vLLM enters the process
        torch.manual_seed(0)
        model, tok = load_policy(ModelConfig(**shape, max_position_embeddings=1024))
        reqs = requests(args, len(tok))
        built[name] = (model, tok, reqs)
        hf = HFSampler(model, tok, sampling)
        baseline = GenerateBaseline(model, tok)
        rates: dict[str, list[float]] = {"generate": [], "sampler": []}
        for _ in range(args.repeats):  # alternated, so drifts in machine speed hit both alike
            rates["generate"].append(tokens_per_s(baseline, reqs, 1))
            rates["sampler"].append(tokens_per_s(hf, reqs, 1))
        rows.append([name, statistics.median(rates["generate"]), statistics.median(rates["sampler"])])
    if have_vllm:
        from trainer.sampling.vllm_engine import VLLMSampler

        for row in rows:
            model, tok, reqs = built[row[0]]
            for dtype in ("auto", "bfloat16"):  # the trainer's fp32, then bf16 copies of the weights
                config = SamplingConfig(temperature=1.0, max_batch_size=args.batch, vllm_dtype=dtype)
                sampler = VLLMSampler(model, tok, config, max_model_len=1024, max_num_seqs=args.batch)
                row.append(tokens_per_s(sampler, reqs, args.repeats))
                sampler.close()
    return rows


def run_quickstart(args, staleness: int, out: Path) -> dict:
    from trainer.quickstart import main as quickstart

    argv = ["--steps", str(args.quickstart_steps), "--max-staleness", str(staleness), "--out", str(out),
            "--seed", str(args.seed), "--sampler", args.sampler, "--threads", str(args.threads)]
    if args.smoke:
        argv += ["--sft-steps", "10", "--batch", "4", "--group", "4", "--eval-problems", "4", "--eval-every", "0"]
    summary = quickstart(argv)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["time/step_s"] for r in steps if "time/step_s" in r]
    return {"step_s": statistics.mean(step_s), "val": summary["val_reward_after"],
            "before": summary["val_reward_before"], "steps": len(step_s),
            "stale": max((r.get("rollout/staleness_max", 0.0) for r in steps), default=0.0)}


def part_steps(args) -> dict[int, dict]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in (0, 1):
            out[staleness] = run_quickstart(args, staleness, Path(tmp) / f"staleness{staleness}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["all", "generation", "steps"], default="all")
    p.add_argument("--batch", type=int, default=64, help="prompts per generate call")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--layers-05b", type=int, default=12, help="layers of the 0.5B-shaped model (24 in the real one)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quickstart-steps", type=int, default=200, help="GRPO steps per quick-start run")
    p.add_argument("--sampler", choices=["hf", "vllm"], default="hf", help="the quick start's sampler in part 2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs, measures nothing")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt_len, args.new_tokens, args.layers_05b, args.repeats = 4, 8, 8, 1, 1
        args.quickstart_steps = 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(max(args.threads, torch.get_num_threads()) if args.part != "steps" else args.threads)
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} CPUs, load average {load:.1f} at start; torch threads {torch.get_num_threads()}")
    if args.part in ("all", "generation"):
        rows = part_generation(args)
        print(f"\ngeneration: {args.batch} prompts x {args.prompt_len} ids, {args.new_tokens} new tokens, temperature 1")
        print("tokens/s: transformers generate, the HF sampler (sampling.backend='hf'), vLLM in the trainer's fp32 "
              "and in bf16 (sampling.vllm_dtype)")
        print(f"{'model':<30}{'generate':>10}{'HF sampler':>12}{'vLLM fp32':>11}{'vLLM bf16':>11}"
              f"{'HF/generate':>13}{'vLLM fp32/HF':>14}{'vLLM bf16/HF':>14}")
        for name, gen, hf, *vl in rows:
            vl32, vl16 = vl if vl else (None, None)
            cells = [f"{v:.0f}" if v else "-" for v in (vl32, vl16)]
            ratios = [f"{v / hf:.2f}x" if v else "-" for v in (vl32, vl16)]
            print(f"{name:<30}{gen:>10.0f}{hf:>12.0f}{cells[0]:>11}{cells[1]:>11}{hf / gen:>12.2f}x{ratios[0]:>14}"
                  f"{ratios[1]:>14}")
    if args.part in ("all", "steps"):
        torch.set_num_threads(args.threads)
        res = part_steps(args)
        print(f"\nquick start GRPO ({args.quickstart_steps} steps, sampler {args.sampler}, seed {args.seed}): "
              f"synchronous vs asynchronous rollouts")
        print(f"{'rollout.max_staleness':<24}{'step s':>9}{'val before':>12}{'val after':>11}{'max staleness':>15}")
        for k, r in res.items():
            print(f"{k:<24}{r['step_s']:>9.2f}{r['before']:>12.3f}{r['val']:>11.3f}{r['stale']:>15.0f}")
        print(f"async speed-up (step time 0 / 1): {res[0]['step_s'] / res[1]['step_s']:.2f}x; "
              f"final validation reward {res[1]['val']:.3f} vs {res[0]['val']:.3f}")


if __name__ == "__main__":
    main()
