"""Gomoku settings: the reward table and the game configuration, as plain dataclasses.

``GomokuEnv(**kwargs)`` and ``GomokuMatchEnv(**kwargs)`` accept every ``GomokuConfig`` field as a
keyword; ``rewards`` may be a ``GomokuRewards`` or a dict of the values to change.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from env_servers.gomoku_env.board import MOVE_FORMATS, WIN_LENGTH, check_shape
from env_servers.gomoku_env.opponents import OPPONENTS
from envhub.config import from_kwargs


@dataclass(frozen=True)
class GomokuRewards:
    """Reward per event, given to the player whose result it is.

    Invalid moves (bad format, out of bounds, occupied) keep the game going; the turn stays
    with the offender. ``opponent_forfeit`` (two-agent matches): what a seat earns when the other
    seat's invalid moves end the game; None gives it ``win``. A lower value keeps the opponent's
    mistakes out of a seat's reward (the outcome is still a win).

    ``missed_win`` and ``missed_block`` are shaping, 0 (off) by default: added to a legal move's reward when
    the mover could have completed a line and did not, or left the other side's line open (the move's
    :func:`~env_servers.gomoku_env.game.tactics`); each step names them in ``info["rewards"]``. Against
    a player who rarely punishes them (self-play between weak policies), these are the mistakes the
    outcome alone does not teach.
    """

    valid: float = 0.0
    win: float = 10.0
    loss: float = -10.0
    draw: float = 0.0
    bad_format: float = -1.0
    out_of_bounds: float = -1.0
    occupied: float = -1.0
    too_many_invalid: float = -20.0
    step_limit: float = -20.0
    opponent_forfeit: float | None = None
    missed_win: float = 0.0
    missed_block: float = 0.0

    @property
    def forfeit_win(self) -> float:
        """The reward for a win by the other seat's forfeit: ``opponent_forfeit``, or ``win`` when unset."""
        return self.win if self.opponent_forfeit is None else self.opponent_forfeit

    @classmethod
    def coerce(cls, value: GomokuRewards | dict[str, float] | None) -> GomokuRewards:
        """A reward table from a ``GomokuRewards``, a partial dict of overrides, or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"Expected rewards to be a dict or GomokuRewards, got {type(value).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"Unknown reward name(s) {unknown}; expected some of {sorted(names)}.")
        bad = {k: v for k, v in value.items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)}
        if bad:
            raise ValueError(f"Expected finite numeric rewards, got {bad}.")
        return cls(**{k: float(v) for k, v in value.items()})


@dataclass(frozen=True)
class GomokuConfig:
    """How a gomoku episode is set up and scored.

    Attributes:
        board_size: N for an N×N board (3..19).
        win_length: how many in a row win (3..board_size; five, gomoku's, by default). A small board
            with a short line (3x3 and 3: tic-tac-toe) is a game a tiny policy can learn on a CPU.
        opponent: the scripted O player: ``"random"``, ``"heuristic"`` or ``"mix"``.
        opponent_random_prob: for ``"mix"``, the chance each O move is random instead of heuristic.
        max_invalid_moves: consecutive invalid moves that end the game (reward ``too_many_invalid``).
        max_moves: valid agent moves after which the game is cut short (truncated, reward
            ``step_limit``). Invalid moves do not count. None: no limit besides the board, so every
            game can finish.
        opening_max_stones: random openings place up to this many stones (always an even number).
        empty_board_prob: chance a random opening is the empty board.
        render_image: add a PNG of the board to every observation.
        brief_messages: observations carry the board and whose turn it is, without the rules and
            hints (the system prompt keeps them): a few times fewer tokens per turn on a small board.
        move_format: ``"coords"`` (rows and columns numbered on the board's edges, ``<move>row,col</move>``)
            or ``"cell"`` (every empty cell shown as its number, ``<move>n</move>``: a legal move is a number
            printed on the board, which a tiny policy learns to copy far sooner than it learns to read
            coordinates). Tool calls (``place_stone(row, col)``) take coordinates in both.
        turn_timeout_s: two-agent mode: how long a player waits for the other before the match ends.
        rewards: the reward table.
    """

    board_size: int = 9
    win_length: int = WIN_LENGTH
    opponent: str = "heuristic"
    opponent_random_prob: float = 0.3
    max_invalid_moves: int = 10
    max_moves: int | None = None
    opening_max_stones: int = 6
    empty_board_prob: float = 0.2
    render_image: bool = False
    brief_messages: bool = False
    move_format: str = "coords"
    turn_timeout_s: float = 120.0
    rewards: GomokuRewards = field(default_factory=GomokuRewards)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rewards", GomokuRewards.coerce(self.rewards))
        check_shape(self.board_size, self.win_length)
        checks = [
            (self.opponent in OPPONENTS, f"opponent to be one of {', '.join(OPPONENTS)}", self.opponent),
            (_is_num(self.opponent_random_prob) and 0 <= self.opponent_random_prob <= 1,
             "opponent_random_prob in [0, 1]", self.opponent_random_prob),
            (_is_int(self.max_invalid_moves) and self.max_invalid_moves >= 1, "max_invalid_moves >= 1",
             self.max_invalid_moves),
            (self.max_moves is None or (_is_int(self.max_moves) and self.max_moves >= 1),
             "max_moves to be None or >= 1", self.max_moves),
            (_is_int(self.opening_max_stones) and self.opening_max_stones >= 0, "opening_max_stones >= 0",
             self.opening_max_stones),
            (_is_num(self.empty_board_prob) and 0 <= self.empty_board_prob <= 1, "empty_board_prob in [0, 1]",
             self.empty_board_prob),
            (isinstance(self.render_image, bool), "render_image to be true or false", self.render_image),
            (isinstance(self.brief_messages, bool), "brief_messages to be true or false", self.brief_messages),
            (self.move_format in MOVE_FORMATS, f"move_format to be one of {', '.join(MOVE_FORMATS)}",
             self.move_format),
            (_is_num(self.turn_timeout_s) and self.turn_timeout_s > 0, "turn_timeout_s > 0", self.turn_timeout_s),
        ]
        for ok, expected, got in checks:
            if not ok:
                raise ValueError(f"Expected {expected}, got {got!r}.")

    @property
    def cells(self) -> bool:
        """Whether moves are cell numbers (``move_format = "cell"``)."""
        return self.move_format == "cell"

    def replace(self, **changes: Any) -> GomokuConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(cls, config: dict[str, Any]) -> GomokuConfig:
        """The config from keyword arguments, naming the accepted keys when one is unknown (as every env's)."""
        return from_kwargs(cls, config, what="gomoku")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
