"""Gomoku board rules (freestyle: ``win_length`` *or more* in a row wins, five by default), move parsing and
legal random openings.

Pure Python, no envhub imports. Coordinates are ``(row, col)``, zero-based, row 0 at the top.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

X, O, EMPTY = "X", "O", "."  # noqa: E741 (the stone is called O)
WIN_LENGTH = 5  # gomoku's; a shorter line (3 on a 3x3 board: tic-tac-toe) makes a small, quick game
MIN_WIN_LENGTH = 3
MIN_SIZE, MAX_SIZE = 3, 19
MOVE_FORMATS = ("coords", "cell")  # <move>row,col</move>, or <move>n</move> with n a cell's number (1 at top left)
DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))

Move = tuple[int, int]


def other(stone: str) -> str:
    """The opposing stone."""
    return O if stone == X else X


class Board:
    """An N×N gomoku board where ``win_length`` (default five) or more in a row wins.

    >>> b = Board(5)
    >>> for c in range(5): b.place(2, c, X)
    >>> b.winner()
    'X'
    >>> t = Board(3, win_length=3)
    >>> for r in range(3): t.place(r, r, O)
    >>> t.winner()
    'O'
    """

    def __init__(self, size: int = 9, win_length: int = WIN_LENGTH):
        check_shape(size, win_length)
        self.size = size
        self.win_length = win_length
        self.cells = [[EMPTY] * size for _ in range(size)]
        self.moves: list[tuple[int, int, str]] = []  # (row, col, stone) in play order
        self._winner: str | None = None

    def copy(self) -> Board:
        """An independent copy (used by opponents to look ahead)."""
        dup = Board(self.size, self.win_length)
        dup.cells = [row[:] for row in self.cells]
        dup.moves = list(self.moves)
        dup._winner = self._winner
        return dup

    # -- queries ---------------------------------------------------------------------------
    def in_bounds(self, row: int, col: int) -> bool:
        return 0 <= row < self.size and 0 <= col < self.size

    def is_empty(self, row: int, col: int) -> bool:
        return self.cells[row][col] == EMPTY

    def empty_cells(self) -> list[Move]:
        """Every empty cell, in row-major order."""
        return [(r, c) for r in range(self.size) for c in range(self.size) if self.cells[r][c] == EMPTY]

    def is_full(self) -> bool:
        return len(self.moves) == self.size * self.size

    def count(self, stone: str) -> int:
        return sum(row.count(stone) for row in self.cells)

    def winner(self) -> str | None:
        """The stone that made ``win_length`` or more in a row, if any."""
        return self._winner

    def run_length(self, row: int, col: int, stone: str, dr: int, dc: int) -> int:
        """Length of the line of ``stone`` through (row, col) along one direction, counting (row, col) itself."""
        total = 1
        for sign in (1, -1):
            r, c = row + sign * dr, col + sign * dc
            while self.in_bounds(r, c) and self.cells[r][c] == stone:
                total += 1
                r, c = r + sign * dr, c + sign * dc
        return total

    def makes_line(self, row: int, col: int, stone: str) -> bool:
        """Whether placing ``stone`` at the (empty or own) cell gives ``win_length`` or more in a row."""
        return any(self.run_length(row, col, stone, dr, dc) >= self.win_length for dr, dc in DIRECTIONS)

    def winning_cells(self, stone: str) -> list[Move]:
        """Empty cells where ``stone`` would complete a winning line right now, in row-major order.

        Only the empty neighbours of ``stone``'s own stones are looked at (a cell that completes a line
        extends a run of them), and none with fewer stones than a line less one: an env asks this on every
        move (its ``tactics`` statistics), where a scan of the whole board would cost more than the move.
        """
        own = [(r, c) for r, c, s in self.moves if s == stone]
        if len(own) < self.win_length - 1:
            return []
        near = {(r + dr, c + dc) for r, c in own for dr in (-1, 0, 1) for dc in (-1, 0, 1)}
        return sorted((r, c) for r, c in near
                      if self.in_bounds(r, c) and self.cells[r][c] == EMPTY and self.makes_line(r, c, stone))

    def line(self, row: int, col: int, dr: int, dc: int, reach: int = 5) -> str:
        """The cells within ``reach`` of (row, col) along a direction, centre at index ``reach``.

        Cells read ``X``, ``O`` or ``.``; off the board reads ``|``. The centre cell is read as is.
        """
        size, cells = self.size, self.cells
        out = []
        for k in range(-reach, reach + 1):
            r, c = row + k * dr, col + k * dc
            out.append(cells[r][c] if 0 <= r < size and 0 <= c < size else "|")
        return "".join(out)

    # -- mutation --------------------------------------------------------------------------
    def place(self, row: int, col: int, stone: str) -> None:
        """Put a stone on an empty in-bounds cell (callers check legality first)."""
        if stone not in (X, O):
            raise ValueError(f"Expected stone 'X' or 'O', got {stone!r}.")
        if not self.in_bounds(row, col) or not self.is_empty(row, col):
            raise ValueError(f"Cell ({row},{col}) is not an empty cell of a {self.size}x{self.size} board.")
        self.cells[row][col] = stone
        self.moves.append((row, col, stone))
        if self._winner is None and self.makes_line(row, col, stone):
            self._winner = stone

    # -- rendering -------------------------------------------------------------------------
    def render(self) -> str:
        """The board as text: a column header, then one numbered row per line; ``.`` is empty.

        >>> print(Board(5).render())
           0 1 2 3 4
         0 . . . . .
         1 . . . . .
         2 . . . . .
         3 . . . . .
         4 . . . . .
        """
        width = len(str(self.size - 1))
        header = " " * (width + 2) + " ".join(str(c).rjust(width) for c in range(self.size))
        rows = [str(r).rjust(width + 1) + " " + " ".join(cell.rjust(width) for cell in self.cells[r])
                for r in range(self.size)]
        return "\n".join([header, *rows])

    def render_cells(self) -> str:
        """The board as text with every empty cell shown as its number (1 at the top left, row by row).

        A legal move in the ``"cell"`` format is then a number printed on the board.

        >>> b = Board(3, win_length=3); b.place(0, 2, X); b.place(1, 1, O); print(b.render_cells())
        1 2 X
        4 O 6
        7 8 9
        """
        width = len(str(self.size * self.size))
        return "\n".join(" ".join((str(r * self.size + c + 1) if cell == EMPTY else cell).rjust(width)
                                  for c, cell in enumerate(row)) for r, row in enumerate(self.cells))

    def rows(self) -> list[str]:
        """The board as one string per row (for observation metadata)."""
        return ["".join(row) for row in self.cells]


def line_name(win_length: int) -> str:
    """How a winning line is named in texts: ``"five"`` for 5."""
    return {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}.get(win_length, str(win_length))


def check_shape(size: object, win_length: object) -> None:
    """``ValueError`` with the fix unless ``size`` is a board size and ``win_length`` a line that fits on it."""
    if isinstance(size, bool) or not isinstance(size, int) or not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"Expected board_size to be an integer in {MIN_SIZE}..{MAX_SIZE}, got {size!r}.")
    if isinstance(win_length, bool) or not isinstance(win_length, int) or not MIN_WIN_LENGTH <= win_length <= size:
        raise ValueError(f"Expected win_length to be an integer in {MIN_WIN_LENGTH}..board_size ({size}), got "
                         f"{win_length!r}; a board smaller than the line cannot be won.")


# -- parsing model output ---------------------------------------------------------------------
_MOVE_TAG = re.compile(r"<move>(.*?)</move>", re.IGNORECASE | re.DOTALL)
#: ASCII digits, at most 9 of them: a longer number is malformed (int() of thousands of digits raises)
_COORDS = re.compile(r"\(?\s*([0-9]{1,9})\s*,\s*([0-9]{1,9})\s*\)?")


def parse_move(text: str | None) -> Move | None:
    """The move in the LAST ``<move>row,col</move>`` tag of a model's text, or None if it is malformed.

    Spaces and parentheses are tolerated; a negative number or anything else inside the tag is
    malformed. Range is not checked here (out-of-bounds is a different error).

    >>> parse_move("<move>1,1</move> no wait <move> 4 , 5 </move>")
    (4, 5)
    >>> parse_move("<move>-1,2</move>") is None
    True
    """
    if not isinstance(text, str):
        return None
    tags = _MOVE_TAG.findall(text)
    if not tags:
        return None
    match = _COORDS.fullmatch(tags[-1].strip())
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


_CELL = re.compile(r"\s*([0-9]{1,9})\s*")


def parse_cell(text: str | None, size: int) -> Move | None:
    """The move named by a cell number (``render_cells``): the LAST ``<move>n</move>`` tag, or a reply that is
    only the number; None if malformed. Numbers past the board map off it (out of bounds, not malformed).

    >>> parse_cell("<move>2</move> no, <move>6</move>", 3), parse_cell(" 7", 3), parse_cell("<move>1,1</move>", 3)
    ((1, 2), (2, 0), None)
    >>> parse_cell("<move>0</move>", 3), parse_cell("<move>10</move>", 3)
    ((-1, 0), (3, 0))
    """
    if not isinstance(text, str):
        return None
    tags = _MOVE_TAG.findall(text)
    match = _CELL.fullmatch(tags[-1] if tags else text)
    if match is None:
        return None
    number = int(match.group(1))
    return divmod(number - 1, size) if number >= 1 else (-1, 0)


def cell_number(move: Move, size: int) -> int:
    """The number ``render_cells`` prints on ``move``'s cell."""
    return move[0] * size + move[1] + 1


def parse_reply(text: str | None, size: int, move_format: str = "coords") -> Move | None:
    """A model's move in ``move_format`` (one of ``MOVE_FORMATS``)."""
    return parse_cell(text, size) if move_format == "cell" else parse_move(text)


def coerce_move(row: object, col: object) -> Move | None:
    """Tool-call arguments as a move: ints, or strings of digits; anything else (bools, floats, text) is None."""
    out = []
    for value in (row, col):
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            out.append(value)
        elif isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]{1,9}\s*", value):
            out.append(int(value))
        else:
            return None
    return out[0], out[1]


# -- openings ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpeningConfig:
    """How random openings are drawn: an empty board with ``empty_prob``, else up to ``max_stones`` stones."""

    max_stones: int = 6
    empty_prob: float = 0.2


def random_opening(rng: random.Random, size: int, config: OpeningConfig = OpeningConfig(),
                   win_length: int = WIN_LENGTH) -> list[Move]:
    """A legal opening for X to move: alternating X, O from X, equal counts, no winning line, no threat of one.

    A stone that would complete a line, or leave either side one move from a line, is redrawn, so
    the game never starts decided. Returns the moves in play order (X first).
    """
    if rng.random() < config.empty_prob or config.max_stones < 2:
        return []
    pairs = rng.randint(1, config.max_stones // 2)  # empty boards come only from empty_prob
    board = Board(size, win_length)
    for i in range(2 * pairs):
        stone = X if i % 2 == 0 else O
        cells = board.empty_cells()
        rng.shuffle(cells)
        for r, c in cells:
            if board.makes_line(r, c, stone):
                continue
            board.place(r, c, stone)
            if board.winning_cells(stone):  # one move from a line: undo and redraw
                board.cells[r][c] = EMPTY
                board.moves.pop()
                continue
            break
        else:  # no safe cell for this stone (tiny crowded boards): stop here
            break
    moves = [(r, c) for r, c, _ in board.moves]
    return moves[: len(moves) - len(moves) % 2]


def opening_moves(raw: object) -> list[Move]:
    """A client's opening (``[[row, col], ...]``) as moves; ``ValueError`` saying what is wrong with its shape."""
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"Expected opening to be a list of [row, col] pairs, got {type(raw).__name__}.")
    moves = []
    for i, move in enumerate(raw):
        if not (isinstance(move, (list, tuple)) and len(move) == 2 and all(type(v) is int for v in move)):
            raise ValueError(f"Expected opening move {i} to be [row, col] integers, got {move!r}.")
        moves.append((move[0], move[1]))
    return moves


def board_from_moves(size: int, moves: list[Move], win_length: int = WIN_LENGTH) -> Board:
    """Replay moves alternately from X, checking that the result is a legal position with X to move.

    Raises ``ValueError`` (saying what is wrong) for an odd number of moves, an out-of-bounds or
    repeated cell, or a position that already has a winning line.
    """
    if len(moves) % 2:
        raise ValueError(f"Expected an even number of opening moves (X and O alternate, X to move), got {len(moves)}.")
    board = Board(size, win_length)
    for i, (r, c) in enumerate(opening_moves(moves)):
        if not board.in_bounds(r, c) or not board.is_empty(r, c):
            raise ValueError(f"Opening move {i} ({r},{c}) is off the {size}x{size} board or on an occupied cell.")
        board.place(r, c, X if i % 2 == 0 else O)
    if board.winner():
        raise ValueError(f"The opening already has {line_name(board.win_length)} in a row; pass a position where "
                         "the game is still open.")
    return board
