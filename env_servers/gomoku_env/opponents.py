"""Scripted gomoku opponents: random, a threat-aware heuristic, and a seeded mix of the two.

Every opponent draws its randomness from the ``random.Random`` it is handed (the env's RNG), so a
seed reproduces a game. Pure Python, no envhub imports.

The heuristic plays, in order: a winning move; a block of the other side's winning line; a move that
makes its own open four (or a double threat); a block of every cell where the other side would
make an open four (this blocks open and broken threes); otherwise the cell that best extends its
own lines and cuts the other side's, ties broken at random. Wins and blocks follow the board's
``win_length``; the shapes (fours, threes) are those of five in a row.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Protocol

from env_servers.gomoku_env.board import DIRECTIONS, Board, Move, O, X, other

# Line patterns, seen from the side to move: '#' own stone, '.' empty, '|' opponent or edge.
# The centre of each line is the stone just placed; a pattern counts only if it uses that stone.
_REACH = 5
_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("five", ("#####",)),
    ("open_four", (".####.",)),
    ("four", ("####.", ".####", "###.#", "#.###", "##.##")),
    ("open_three", ("..###.", ".###..", ".##.#.", ".#.##.")),
    ("three", ("###..", "..###", "##.#.", ".#.##", "#.#.#", "##..#", "#..##", "#.##.", ".##.#")),
    ("two", ("..##..", ".#.#.", "..##.", ".##..", ".#..#.")),
)
_WEIGHTS = {"five": 1_000_000, "open_four": 50_000, "four": 4_000, "open_three": 3_000, "three": 300,
            "two": 60, None: 5}


def _covers(line: str, pattern: str) -> bool:
    """Whether ``pattern`` occurs in ``line`` using the centre stone."""
    start = line.find(pattern)
    while start != -1:
        offset = _REACH - start
        if 0 <= offset < len(pattern) and pattern[offset] == "#":
            return True
        start = line.find(pattern, start + 1)
    return False


@functools.lru_cache(maxsize=1 << 16)
def classify(line: str) -> str | None:
    """The strongest shape the centre stone of ``line`` is part of, or None.

    Cached: lines repeat a lot (3^10 possible, far fewer seen), and this is the opponent's hot loop.
    """
    for name, patterns in _PATTERNS:
        if any(_covers(line, p) for p in patterns):
            return name
    return None


@dataclass(frozen=True)
class Threat:
    """What placing one stone on one cell would create, over the four directions."""

    shapes: tuple[str | None, ...]

    @property
    def wins(self) -> bool:
        return "five" in self.shapes

    @property
    def forces_win(self) -> bool:
        """An open four, two fours, or a four plus an open three: unstoppable without a five threat."""
        fours = self.shapes.count("four")
        return "open_four" in self.shapes or fours >= 2 or (fours == 1 and "open_three" in self.shapes)

    @property
    def score(self) -> float:
        base = sum(_WEIGHTS[s] for s in self.shapes)
        if self.shapes.count("open_three") >= 2:  # a double three is one move from a forced win
            base += 20_000
        return base


# A line seen from one side: own stones '#', the other side's stones and the edge '|'.
_SEEN_BY = {X: str.maketrans({X: "#", O: "|"}), O: str.maketrans({O: "#", X: "|"})}


def threats(board: Board, row: int, col: int) -> dict[str, Threat]:
    """For each stone, the shapes it would make by playing at the empty cell (row, col)."""
    lines = [board.line(row, col, dr, dc, _REACH) for dr, dc in DIRECTIONS]
    out = {}
    for stone, table in _SEEN_BY.items():
        # the centre is empty on the board; seen from the mover it holds its own stone
        out[stone] = Threat(tuple(classify(f"{ln[:_REACH]}#{ln[_REACH + 1:]}".translate(table)) for ln in lines))
    return out


def threat(board: Board, row: int, col: int, stone: str) -> Threat:
    """The shapes ``stone`` would make by playing at the empty cell (row, col)."""
    return threats(board, row, col)[stone]


def candidate_cells(board: Board, radius: int = 2) -> list[Move]:
    """Empty cells within ``radius`` of a stone (the centre on an empty board), in row-major order."""
    if not board.moves:
        mid = board.size // 2
        return [(mid, mid)]
    near = set()
    for r, c, _ in board.moves:
        for rr in range(max(0, r - radius), min(board.size, r + radius + 1)):
            for cc in range(max(0, c - radius), min(board.size, c + radius + 1)):
                if board.is_empty(rr, cc):
                    near.add((rr, cc))
    return sorted(near) or board.empty_cells()


class Opponent(Protocol):
    """Chooses a move for ``stone`` on a board with at least one empty cell."""

    name: str

    def choose(self, board: Board, stone: str, rng: random.Random) -> Move: ...


class RandomOpponent:
    """A uniformly random empty cell."""

    name = "random"

    def choose(self, board: Board, stone: str, rng: random.Random) -> Move:
        return rng.choice(board.empty_cells())


class HeuristicOpponent:
    """Takes wins, blocks fives and open-four threats (so open and broken threes), extends its own lines."""

    name = "heuristic"

    def __init__(self, defense_weight: float = 0.9):
        self.defense_weight = defense_weight

    def choose(self, board: Board, stone: str, rng: random.Random) -> Move:
        foe = other(stone)
        cells = candidate_cells(board)
        both = {cell: threats(board, *cell) for cell in cells}
        mine = {cell: t[stone] for cell, t in both.items()}
        theirs = {cell: t[foe] for cell, t in both.items()}
        # The tiers below are in the order a strong player checks them; within a tier the best
        # combined score wins, so a block that also builds our own line is preferred.
        # wins and blocks are read off the board, so they hold for any win_length; the shapes are five's
        for tier in ([c for c in cells if board.makes_line(*c, stone)], [c for c in cells if board.makes_line(*c, foe)],
                     [c for c in cells if mine[c].forces_win], [c for c in cells if theirs[c].forces_win]):
            if tier:
                return self._best(tier, mine, theirs, board, rng)
        return self._best(cells, mine, theirs, board, rng)

    def _best(self, cells: list[Move], mine: dict[Move, Threat], theirs: dict[Move, Threat], board: Board,
              rng: random.Random) -> Move:
        mid = (board.size - 1) / 2

        def value(cell: Move) -> float:
            centre = 1.0 / (1.0 + abs(cell[0] - mid) + abs(cell[1] - mid))
            return mine[cell].score + self.defense_weight * theirs[cell].score + centre

        best = max(value(c) for c in cells)
        return rng.choice([c for c in cells if value(c) >= best - 1e-9])


class MixOpponent:
    """Random with probability ``random_prob``, heuristic otherwise (one draw per move)."""

    name = "mix"

    def __init__(self, random_prob: float = 0.3):
        if not 0.0 <= random_prob <= 1.0:
            raise ValueError(f"Expected opponent_random_prob in [0, 1], got {random_prob!r}.")
        self.random_prob = random_prob
        self._random, self._heuristic = RandomOpponent(), HeuristicOpponent()

    def choose(self, board: Board, stone: str, rng: random.Random) -> Move:
        pick = self._random if rng.random() < self.random_prob else self._heuristic
        return pick.choose(board, stone, rng)


OPPONENTS = ("random", "heuristic", "mix")


def make_opponent(name: str, random_prob: float = 0.3) -> Opponent:
    """An opponent by name: ``"random"``, ``"heuristic"`` or ``"mix"``."""
    if name == "random":
        return RandomOpponent()
    if name == "heuristic":
        return HeuristicOpponent()
    if name == "mix":
        return MixOpponent(random_prob)
    raise ValueError(f"Expected opponent to be one of {', '.join(OPPONENTS)}, got {name!r}.")
