"""Supervised fine-tuning on demonstrations: token-mean cross-entropy on the assistant tokens only.

Each step is two calls to the training core: ``forward_backward`` with its ``cross_entropy`` loss (weights
``mask / tokens``, so the core's weighted sum is the token mean) and ``optim_step`` (AdamW).

A demonstration is ``{"messages": [...]}`` (every assistant message is trained on) or
``{"prompt": [...messages], "completion": "text"}`` (the completion alone is trained on: assistant
turns inside the prompt are context). Each is rendered with the model's chat template; trained
assistant turns (their text and the closing ``<|im_end|>``) get mask 1, everything else mask 0.
For a vision-language policy (``run_sft(..., vision=...)``) user contents may be lists of image and
text parts; the image placeholders are expanded to each image's token count (mask 0) and the pixel
patches go into the forward pass. ``envhub-train sft --config FILE`` reads them from ``sft.data`` (JSONL).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.config import TrainConfig
from trainer.core import AdamParams, Datum, TrainingClient
from trainer.metrics import MetricsLogger, Progress
from trainer.model import load_policy
from trainer.vision import VisionProcessor, images_in, load_vision_processor, text_only


def encode_demo(tokenizer: Any, demo: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(ids, mask) for one demonstration; mask 1 on trained assistant content (every assistant message of
    ``messages``; a ``completion`` alone) and its end-of-turn token."""
    if "messages" in demo:
        messages = demo["messages"]
        first_trained = 0
    elif "prompt" in demo and "completion" in demo:
        prompt = demo["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages = prompt + [{"role": "assistant", "content": demo["completion"]}]
        first_trained = len(prompt)  # assistant turns in the prompt are context: they come with mask 0
    else:
        raise ValueError(f"Expected a demonstration with 'messages' or 'prompt' + 'completion', got keys {sorted(demo)}.")
    ids: list[int] = []
    mask: list[int] = []
    eos = tokenizer.eos_token_id
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or i < first_trained:
            continue
        # The prefix up to this turn's generation prompt, then the turn itself: both via the template.
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True,
                                               tools=demo.get("tools"))
        prefix_ids = tokenizer.encode(prefix, add_special_tokens=False)
        if prefix_ids[:len(ids)] != ids:
            raise ValueError("The chat template is not prefix-preserving for this demonstration.")
        mask += [0] * (len(prefix_ids) - len(ids))
        ids = prefix_ids
        turn = tokenizer.encode(msg["content"], add_special_tokens=False) + [eos]
        ids, mask = ids + turn, mask + [1] * len(turn)
        newline = tokenizer.encode("\n", add_special_tokens=False)
        ids, mask = ids + newline, mask + [0] * len(newline)
    if not any(mask):
        raise ValueError("Expected at least one assistant message to train on, got none.")
    return ids, mask


def encode_image_demo(tokenizer: Any, demo: dict[str, Any],
                      vision: VisionProcessor) -> tuple[list[int], list[int], list[Any]]:
    """(ids, mask, images) for a demonstration with image parts: placeholders expanded, mask 0 on them."""
    ids, mask = encode_demo(tokenizer, demo)
    messages = demo.get("messages") or demo.get("prompt")
    images = vision.features(images_in(messages if isinstance(messages, list) else []))
    return vision.expand(ids, images), vision.expand(ids, images, mask), images


def _text_only(demo: dict[str, Any]) -> dict[str, Any]:
    # A text-only policy sees the text parts of a demonstration with images, as in its rollouts.
    return {k: text_only(v) if k in ("messages", "prompt") and isinstance(v, list) else v for k, v in demo.items()}


class DemoFileError(ValueError):
    """A demonstrations file that cannot be read, or a line of it that is not a JSON object (the message names
    the file and the line; ``envhub-train sft`` prints it as one line)."""


def load_demos(path: str | Path) -> list[dict[str, Any]]:
    """Demonstrations from a JSONL file (one JSON object a line; blank lines skipped). A missing file or a line
    that is not a JSON object is a :class:`DemoFileError` naming the file and the line."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise DemoFileError(f"Could not read the demonstrations file {str(path)!r}: {exc.strerror}.") from None
    demos = []
    with fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                demo = json.loads(line)
            except ValueError as exc:
                raise DemoFileError(f"{path}:{number}: expected a JSON object a line, got invalid JSON ({exc}).") from None
            if not isinstance(demo, dict):
                raise DemoFileError(f"{path}:{number}: expected a JSON object a line, got {type(demo).__name__}.")
            demos.append(demo)
    return demos


def sft_step(client: TrainingClient, batch: list[tuple[Any, ...]], adam: AdamParams) -> dict[str, float]:
    """One step on a batch of encoded demonstrations, ``(ids, mask)`` or with images ``(ids, mask, images)`` as
    :func:`encode_image_demo` gives them: ``forward_backward`` (token-mean cross-entropy on the mask-1
    tokens) then ``optim_step``. Returns sft_loss, token_acc, num_tokens and grad_norm."""
    tokens = sum(sum(item[1][1:]) for item in batch)
    data = []
    for ids, mask, *images in batch:
        datum = Datum.from_sequence(ids, weights=[m / max(tokens, 1) for m in mask])
        datum.images = list(images[0]) if images else []  # placeholders sit in the prompt, inside model_input
        data.append(datum)
    out = client.forward_backward(data, "cross_entropy")
    grad_norm = client.optim_step(adam)["grad_norm"]
    return {"sft_loss": out.metrics["loss:sum"], "token_acc": out.metrics.get("token_acc:mean", 0.0),
            "num_tokens": out.metrics["tokens:sum"], "grad_norm": grad_norm}


class StepLogger(Protocol):
    """Where :func:`run_sft` sends each step's metrics: a :class:`MetricsLogger`, or anything with its ``log``."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...


def run_sft(model: Any, tokenizer: Any, demos: list[dict[str, Any]], *, steps: int, batch_size: int, lr: float,
            seed: int = 0, grad_clip: float = 1.0, weight_decay: float = 0.0, logger: StepLogger | None = None,
            desc: str = "sft", device: torch.device | str = "cpu", stop_when: Callable[[int], bool] | None = None,
            check_every: int = 25, epochs_limit: int | None = None,
            vision: VisionProcessor | None = None) -> dict[str, float]:
    """Up to ``steps`` AdamW steps of ``batch_size`` demonstrations drawn in shuffled epochs.

    Batches are consecutive slices of a stream of shuffled passes over ``demos`` (a batch may span
    two passes). ``epochs_limit`` (0 or None: no limit) also ends the run after that many passes, the
    last batch holding only what is left of the last pass; whichever of ``steps`` and ``epochs_limit``
    comes first ends it. ``stop_when(step)``, called every ``check_every`` steps, ends the run early
    when it returns True. ``vision`` (a vision-language policy's processor) lets demonstrations carry
    images (:func:`encode_image_demo`). Returns the last step's metrics plus ``steps`` (how many ran) and ``epochs``
    (passes over the data, fractional).
    """
    if epochs_limit is not None and epochs_limit < 0:
        raise ValueError(f"Expected epochs_limit >= 0 (0 or None: no limit), got {epochs_limit}.")
    if not demos:
        raise ValueError("Expected at least one demonstration, got none.")
    encoded = [encode_image_demo(tokenizer, d, vision) if vision is not None else encode_demo(tokenizer, _text_only(d))
               for d in demos]
    total = steps
    if epochs_limit:
        total = min(steps, -(-epochs_limit * len(encoded) // batch_size))
    rng = random.Random(seed)
    model.train()
    client = TrainingClient(model.to(device), tokenizer)
    # torch's AdamW defaults (betas 0.9, 0.999; eps 1e-8), as this recipe always used
    adam = AdamParams(learning_rate=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay,
                      grad_clip_norm=grad_clip)
    order: list[int] = []
    passes = seen = done = 0
    metrics: dict[str, float] = {}
    progress = Progress(total, desc=desc)
    for step in range(total):
        if len(order) < batch_size and not (epochs_limit and passes == epochs_limit):
            fresh = list(range(len(encoded)))
            rng.shuffle(fresh)
            order += fresh
            passes += 1
        batch, order = [encoded[i] for i in order[:batch_size]], order[batch_size:]
        metrics = sft_step(client, batch, adam)
        seen, done = seen + len(batch), step + 1
        if logger is not None:
            logger.log(step + 1, {f"sft/{k}": v for k, v in metrics.items()})
        progress.update(1, loss=round(metrics["sft_loss"], 3), acc=round(metrics["token_acc"], 3))
        if stop_when is not None and (step + 1) % check_every == 0 and stop_when(step + 1):
            break
    progress.close()
    return {**metrics, "steps": float(done), "epochs": seen / len(encoded)}


def train_sft(cfg: TrainConfig, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The ``envhub-train sft`` entry point: load the model, fine-tune on ``cfg.sft.data``, save a checkpoint.

    It runs ``sft.steps`` steps, or fewer when ``sft.epochs_limit`` passes over the data end first.
    """
    start = time.monotonic()
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    if not cfg.sft.data:
        raise ValueError("Expected sft.data to name a JSONL file of demonstrations; pass sft.data=path/to/demos.jsonl.")
    demos = load_demos(cfg.sft.data)  # read once, before the model loads: a bad file is said at once
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.to_json())
    log(f"config:\n{cfg.to_json()}")
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.run.device != "cpu" else "cpu")
    model, tok = load_policy(cfg.model, device)
    logger = MetricsLogger(out)
    metrics = run_sft(model, tok, demos, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size,
                      lr=cfg.optim.lr, seed=cfg.run.seed, grad_clip=cfg.optim.grad_clip,
                      weight_decay=cfg.optim.weight_decay, logger=logger, device=device,
                      epochs_limit=cfg.sft.epochs_limit, vision=load_vision_processor(cfg.model, tok))
    from trainer.export import export_hf

    export_hf(model, tok, out / "model")
    logger.close()
    summary = {"steps": int(metrics["steps"]), "epochs": round(metrics["epochs"], 3),
               "final_loss": metrics.get("sft_loss"), "seconds": round(time.monotonic() - start, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


__all__ = ["DemoFileError", "encode_demo", "encode_image_demo", "load_demos", "StepLogger", "sft_step", "run_sft", "train_sft"]
