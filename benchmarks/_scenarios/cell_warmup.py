"""A warm-up for gomoku's cell move format that also pushes the cell number onto the empty cells.

Imitating random legal moves alone (``trainer.recipes.two_agent_warmup.imitation_warmup``) teaches the
tiny policy ``<move>n</move>`` and leaves the cell number near uniform over all nine, empty or not:
its loss on that token stays at ln 9, and greedy play copies an earlier move's number onto an occupied
cell. Each step here adds, at every demonstrated move's number, the log of the probability mass on the
empty cells of the board the move answers (``-log sum_{empty} p(n)``), so the mass on occupied cells
is pushed down directly; the demonstrated cell still trains as before, so sampling stays diverse.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from trainer.recipes.opponents import empty_cell_numbers

MOVE_OPEN = "<move>"


def cell_targets(tokenizer: Any, ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """``(position, empty-cell token ids)`` for each move in ``ids``: where its number is, and the numbers
    the board before it shows as empty (the last board drawn in the prompt)."""
    opener = tokenizer.encode(MOVE_OPEN, add_special_tokens=False)
    targets = []
    for start in range(1, len(ids)):
        if not (mask[start] and not mask[start - 1]):
            continue  # not the first token of a reply
        pos = start + len(opener)
        if ids[start:pos] != opener or pos >= len(ids):
            continue
        empty = empty_cell_numbers(tokenizer.decode(ids[:start], skip_special_tokens=True))
        digits = [tokenizer.encode(str(n), add_special_tokens=False) for n in empty]
        if digits and all(len(d) == 1 for d in digits):
            targets.append((pos, [d[0] for d in digits]))
    return targets


def legal_cell_warmup(model: Any, tokenizer: Any, demos: list[tuple[list[int], list[int]]], *, steps: int,
                      batch_size: int = 8, lr: float = 3e-3, seed: int = 0, legal_weight: float = 1.0,
                      until_mass: float | None = None, window: int = 25, final_lr: float = 1.0) -> dict[str, float]:
    """At most ``steps`` AdamW steps (a throw-away optimizer; lr decaying linearly to ``final_lr`` x ``lr``) of token-mean
    cross-entropy on the demos' replies plus ``legal_weight`` times the mean ``-log P(empty cell)`` at their
    move numbers; with ``until_mass``, it stops once the mean probability on empty cells over the last
    ``window`` batches reaches it. Returns the last batch's ``sft_loss``, ``legal_loss`` and ``legal_mass``
    (the mean probability on empty cells), the ``window_mass`` and the ``steps`` taken."""
    if not demos:
        raise ValueError("Expected scripted demonstrations to warm up on, got none (did every warm-up game fail?).")
    rng = random.Random(seed)
    encoded = [(ids, mask, cell_targets(tokenizer, ids, mask)) for ids, mask in demos]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 - (1.0 - final_lr) * k / steps)
    pad_id = int(tokenizer.pad_token_id)
    metrics: dict[str, float] = {}
    masses: list[float] = []
    taken = 0
    for _ in range(steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        loss, metrics = _loss(model, batch, pad_id, legal_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        taken += 1
        masses = (masses + [metrics["legal_mass"]])[-window:]
        if until_mass is not None and len(masses) == window and sum(masses) / window >= until_mass:
            break
    optimizer.zero_grad(set_to_none=True)
    return {**metrics, "window_mass": sum(masses) / max(len(masses), 1), "steps": float(taken)}


def _loss(model: Any, batch: list[tuple[list[int], list[int], list[tuple[int, list[int]]]]], pad_id: int,
          legal_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The batch's loss (one right-padded forward: causal, so padding never reaches a real position)."""
    width = max(len(ids) for ids, _, _ in batch)
    ids_BT = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _, _ in batch])
    mask_BT = torch.tensor([mask + [0] * (width - len(mask)) for _, mask, _ in batch], dtype=torch.float32)
    logp_BTV = torch.log_softmax(model(input_ids=ids_BT).logits[:, :-1].float(), dim=-1)
    token_logp_BT = logp_BTV.gather(-1, ids_BT[:, 1:, None])[..., 0]
    sft = -(token_logp_BT * mask_BT[:, 1:]).sum() / mask_BT[:, 1:].sum().clamp(min=1.0)
    # logits at pos - 1 predict the token at pos
    legal_logp = [torch.logsumexp(logp_BTV[b, pos - 1, cells], dim=0)
                  for b, (_, _, targets) in enumerate(batch) for pos, cells in targets]
    legal = -torch.stack(legal_logp).mean() if legal_logp else torch.zeros(())
    mass = float(torch.stack(legal_logp).detach().exp().mean()) if legal_logp else 0.0
    metrics = {"sft_loss": float(sft.detach()), "legal_loss": float(legal.detach()), "legal_mass": mass}
    return sft + legal_weight * legal, metrics


__all__ = ["cell_targets", "legal_cell_warmup"]
