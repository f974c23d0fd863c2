"""A scripted validation opponent for board-game match envs: a random empty cell of the board it was shown.

It behaves like a sampler (``await generate(request)``), so it takes a seat through the same rollout
engine as a trained agent. It reads the last board drawn in the conversation as text (a header of
column numbers, then one numbered row per line with ``.`` for an empty cell), and answers
``<move>row,col</move>``; a board drawn with every empty cell as its number (gomoku's
``move_format = "cell"``: ``1 2 X`` / ``4 O 6`` / ``7 8 9``) it answers ``<move>n</move>``. Its ids carry
log-prob 0 and it never trains.
"""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

from trainer.sampling import GenRequest, SampledSequence

_ROW = re.compile(r"^\s*(\d+)((?:\s+[.XO])+)\s*$")
_CELL_ROW = re.compile(r"^\s*(?:(?:\d+|X|O)\s+)+(?:\d+|X|O)\s*$")


def empty_cells(text: str) -> list[tuple[int, int]]:
    """The empty cells of the last board drawn in ``text`` (rows numbered from 0).

    >>> empty_cells("   0 1 2\\n 0 X . .\\n 1 . O .\\n 2 . . X")
    [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    """
    boards: list[list[list[str]]] = []
    for line in text.splitlines():
        m = _ROW.match(line)
        if m is None:
            continue
        row, cells = int(m.group(1)), m.group(2).split()
        if row == 0 or not boards or row != len(boards[-1]):
            boards.append([])
            if row != 0:
                continue
        boards[-1].append(cells)
    if not boards:
        return []
    return [(r, c) for r, cells in enumerate(boards[-1]) for c, cell in enumerate(cells) if cell == "."]


def empty_cell_numbers(text: str) -> list[int]:
    """The numbers of the empty cells of the last numbered board in ``text`` (N lines of N entries).

    >>> empty_cell_numbers("1 2 X\\n4 O 6\\n7 8 9\\nO to move.")
    [1, 2, 4, 6, 7, 8, 9]
    """
    blocks: list[list[list[str]]] = [[]]
    for line in text.splitlines():
        if _CELL_ROW.match(line) and (not blocks[-1] or len(line.split()) == len(blocks[-1][0])):
            blocks[-1].append(line.split())
        elif blocks[-1]:
            blocks.append([])
    boards = [b for b in blocks if b and len(b) == len(b[0])]
    return [int(v) for row in boards[-1] for v in row if v.isdigit()] if boards else []


class RandomMoveSampler:
    """Answers every turn with a random empty cell of the board in the prompt (seeded)."""

    def __init__(self, tokenizer: Any, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.version = 0

    def update_weights(self, model: Any, version: int) -> None:
        """Scripted: nothing to update."""

    async def generate(self, request: GenRequest) -> SampledSequence:
        await asyncio.sleep(0)
        return self._move(request)

    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]:
        """One random move per request, in order."""
        return [self._move(r) for r in requests]

    def close(self) -> None:
        """Scripted: nothing to free."""

    def _move(self, request: GenRequest) -> SampledSequence:
        text = self.tokenizer.decode(request.prompt_ids, skip_special_tokens=True)
        cells, numbers = empty_cells(text), empty_cell_numbers(text)
        if numbers and not cells:
            move = f"<move>{self.rng.choice(numbers)}</move>"
        else:
            move = "<move>{},{}</move>".format(*(self.rng.choice(cells) if cells else (0, 0)))
        ids = [*self.tokenizer.encode(move, add_special_tokens=False),
               int(self.tokenizer.eos_token_id)]
        finish = "stop" if len(ids) <= request.max_new_tokens else "length"
        ids = ids[:request.max_new_tokens]
        return SampledSequence(ids, [0.0] * len(ids), finish)


__all__ = ["RandomMoveSampler", "empty_cell_numbers", "empty_cells"]
