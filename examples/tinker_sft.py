"""Supervised fine-tuning through the ``tinker`` SDK against ``envhub-train serve`` (LoRA on the tiny model).

    python examples/tinker_sft.py                          # starts a local service; about a minute on CPU
    python examples/tinker_sft.py --base-url http://HOST:8900 --model-name NAME

The loop tinker-cookbook's ``sl_loop`` runs: each step one ``forward_backward(batch, "cross_entropy")``
(weights 1 on the reply tokens, 0 on the prompt, divided by the batch's reply tokens so the summed
loss is a token mean) and one ``optim_step``, with the per-token NLL read back from the returned
``logprobs``. Then it saves the state (``tinker://.../weights/final``, in ``summary.json``) and
greedy-samples each prompt through a sampling client on the trained weights
(``save_weights_and_get_sampling_client``: a snapshot for sampling, without a path of its own). Writes
``runs/tinker_sft/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tinker
from tinker import types

from trainer.service.serve import check_service, local_service

#: (prompt, reply) pairs: the model learns to answer each greeting in kind
PAIRS = [("hello", "hi there!"), ("good morning", "morning!"), ("how are you?", "fine, thanks."),
         ("bye", "see you!"), ("thanks", "you're welcome."), ("good night", "sleep well!")]


def datum(prompt: list[int], reply: list[int], weight: float) -> types.Datum:
    tokens = prompt + reply
    weights = [0.0] * (len(prompt) - 1) + [weight] * len(reply)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def run(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    from trainer.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    pairs = [(encode(f"{p}\n"), encode(r) + [tok.eos_token_id]) for p, r in PAIRS]
    n_reply = sum(len(r) for _, r in pairs)
    service = tinker.ServiceClient(base_url=base_url, api_key=args.api_key)
    try:
        tc = service.create_lora_training_client(base_model=args.model_name, rank=args.rank, seed=args.seed).result()
        nll = []
        for step in range(args.steps):
            out = tc.forward_backward([datum(p, r, 1.0 / n_reply) for p, r in pairs], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=args.lr)).result()
            logprobs = [o["logprobs"].tolist()[len(p) - 1:] for o, (p, _) in zip(out.result().loss_fn_outputs, pairs)]
            nll.append(-sum(sum(lp) for lp in logprobs) / n_reply)  # the reply tokens' mean NLL before this step
            if step % 10 == 0 or step == args.steps - 1:
                print(f"[tinker_sft] step {step}: reply NLL {nll[-1]:.3f}", flush=True)
        state = tc.save_state("final").result().path
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=24, temperature=0.0)
        replies = {}
        for (text, _), (prompt, _) in zip(PAIRS, pairs):
            seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
            replies[text] = tok.decode(seq.tokens, skip_special_tokens=True)
            print(f"[tinker_sft] {text!r} -> {replies[text]!r}", flush=True)
    finally:
        service.close("success").result(timeout=30)
    return {"nll_first": nll[0], "nll_last": nll[-1], "steps": args.steps, "state": state, "replies": replies,
            "exact_replies": sum(replies[p] == r for p, r in PAIRS)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running envhub-train serve (default: start one on the tiny model)")
    p.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", "tml-local"))
    p.add_argument("--model-name", default="tiny")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/tinker_sft")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if args.base_url:
        try:
            check_service(args.base_url)
        except RuntimeError as exc:
            sys.exit(f"tinker_sft: error: {exc} or leave out --base-url")
    with ExitStack() as stack:
        base_url = args.base_url or stack.enter_context(
            local_service(["--threads", "1", "--state-dir", str(out / "service")], out / "service.log"))
        summary = run(args, base_url)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[tinker_sft] reply NLL {summary['nll_first']:.3f} -> {summary['nll_last']:.3f}; "
          f"{summary['exact_replies']}/{len(PAIRS)} replies exact; wrote {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    # `kill` / a CI timeout sends SIGTERM: raise instead, so the servers this script started are stopped
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    main()
