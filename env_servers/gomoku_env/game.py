"""Gomoku game logic: judging one move, and a full single-agent game (agent X against a scripted O).

Pure domain code (no envhub imports): ``GomokuGame.play`` takes a parsed move (or None when the
model's output was malformed) and returns an ``Outcome`` with the event, the reward from the
config's table, and whether the game ended.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from env_servers.gomoku_env.board import Board, Move, O, X, board_from_moves
from env_servers.gomoku_env.config import GomokuConfig, GomokuRewards
from env_servers.gomoku_env.opponents import make_opponent

# Events an agent's step can produce; each names a field of GomokuRewards.
VALID, WIN, LOSS, DRAW = "valid", "win", "loss", "draw"
BAD_FORMAT, OUT_OF_BOUNDS, OCCUPIED = "bad_format", "out_of_bounds", "occupied"
TOO_MANY_INVALID, STEP_LIMIT = "too_many_invalid", "step_limit"
OPPONENT_FORFEIT = "opponent_forfeit"  # two-agent: the other seat made too many invalid moves
INVALID_EVENTS = (BAD_FORMAT, OUT_OF_BOUNDS, OCCUPIED)


def judge(board: Board, move: Move | None) -> str:
    """``valid``, or the kind of invalid move (``bad_format`` for None)."""
    if move is None:
        return BAD_FORMAT
    if not board.in_bounds(*move):
        return OUT_OF_BOUNDS
    if not board.is_empty(*move):
        return OCCUPIED
    return VALID


def tactics(board: Board, stone: str, move: Move | None) -> dict[str, int]:
    """How ``stone``'s move (None: malformed) met the board's immediate tactics, judged on the board it moved on.

    ``win_chances`` is 1 when ``stone`` could complete a line, ``wins_missed`` 1 when it could and ``move``
    does not; ``block_chances`` is 1 when only the other side could complete one (next move), ``blocks_missed``
    1 when ``move`` is not on such a cell. An invalid move misses whatever chance there was. Counted over an
    episode (the trainer sums ``info["stats"]``), ``1 - wins_missed / win_chances`` is the share of wins taken.

    >>> board = board_from_moves(3, [(0, 0), (1, 1), (0, 1), (2, 2)], win_length=3)  # X to move, (0, 2) wins
    >>> tactics(board, X, (0, 2))["wins_missed"], tactics(board, X, (2, 0))["wins_missed"]
    (0, 1)
    """
    wins = board.winning_cells(stone)
    blocks = [] if wins else board.winning_cells(O if stone == X else X)
    return {"win_chances": int(bool(wins)), "wins_missed": int(bool(wins) and move not in wins),
            "block_chances": int(bool(blocks)), "blocks_missed": int(bool(blocks) and move not in blocks)}


def shaping(rewards: GomokuRewards, stats: dict[str, int], legal: bool) -> dict[str, float]:
    """The shaping components a move earns from its :func:`tactics` (``GomokuRewards.missed_win`` /
    ``missed_block``; those left at 0 are not named). Only a legal move earns them: an invalid one has its own
    penalty.

    >>> shaping(GomokuRewards(missed_win=-5.0), {"wins_missed": 1, "blocks_missed": 0}, legal=True)
    {'missed_win': -5.0}
    """
    if not legal:
        return {}
    terms = {"missed_win": (rewards.missed_win, stats.get("wins_missed", 0)),
             "missed_block": (rewards.missed_block, stats.get("blocks_missed", 0))}
    return {name: value * count for name, (value, count) in terms.items() if value and count}


@dataclass
class Outcome:
    """The result of one agent step. ``move`` is what the agent asked for (even if invalid)."""

    event: str
    reward: float
    done: bool = False
    truncated: bool = False
    move: Move | None = None
    opponent_move: Move | None = None
    #: :func:`tactics` of the agent's move
    stats: dict[str, int] = field(default_factory=dict)
    #: the shaping components included in ``reward`` (:func:`shaping`)
    shaping: dict[str, float] = field(default_factory=dict)

    @property
    def legal(self) -> bool:
        """Whether the agent's move was on the board (valid, or a legal move that ended the game)."""
        return self.event not in (*INVALID_EVENTS, TOO_MANY_INVALID)

    @property
    def ended(self) -> bool:
        return self.done or self.truncated


class GomokuGame:
    """One game: the agent plays X and moves first; the scripted opponent answers each valid move.

    >>> game = GomokuGame(GomokuConfig(board_size=5, opponent="random"), random.Random(0))
    >>> game.play((2, 2)).event
    'valid'
    >>> game.play(None).event, game.invalid_streak
    ('bad_format', 1)
    """

    def __init__(self, config: GomokuConfig, rng: random.Random, opening: list[Move] | None = None):
        self.config = config
        self.rng = rng
        self.board = board_from_moves(config.board_size, list(opening or []), config.win_length)
        self.opponent = make_opponent(config.opponent, config.opponent_random_prob)
        self.invalid_streak = 0
        self.agent_moves = 0
        self.end_reason: str | None = None

    @property
    def over(self) -> bool:
        return self.end_reason is not None

    def play(self, move: Move | None) -> Outcome:
        """Apply the agent's move and, if the game goes on, the opponent's reply."""
        if self.over:
            raise RuntimeError(f"The game is over ({self.end_reason}); start a new one.")
        stats = tactics(self.board, X, move)
        outcome = self._play(move)
        outcome.stats = stats
        outcome.shaping = shaping(self.config.rewards, stats, outcome.legal)
        outcome.reward += sum(outcome.shaping.values())
        return outcome

    def _play(self, move: Move | None) -> Outcome:
        rewards = self.config.rewards
        kind = judge(self.board, move)
        if kind != VALID:
            self.invalid_streak += 1
            if self.invalid_streak >= self.config.max_invalid_moves:
                return self._end(Outcome(TOO_MANY_INVALID, rewards.too_many_invalid, done=True, move=move))
            return Outcome(kind, getattr(rewards, kind), move=move)
        assert move is not None
        self.invalid_streak = 0
        self.agent_moves += 1
        self.board.place(*move, X)
        if self.board.winner() == X:
            return self._end(Outcome(WIN, rewards.win, done=True, move=move))
        if self.board.is_full():
            return self._end(Outcome(DRAW, rewards.draw, done=True, move=move))
        reply = self.opponent.choose(self.board, O, self.rng)
        self.board.place(*reply, O)
        if self.board.winner() == O:
            return self._end(Outcome(LOSS, rewards.loss, done=True, move=move, opponent_move=reply))
        if self.board.is_full():
            return self._end(Outcome(DRAW, rewards.draw, done=True, move=move, opponent_move=reply))
        if self.config.max_moves is not None and self.agent_moves >= self.config.max_moves:
            return self._end(Outcome(STEP_LIMIT, rewards.step_limit, truncated=True, move=move,
                                     opponent_move=reply))
        return Outcome(VALID, rewards.valid, move=move, opponent_move=reply)

    def _end(self, outcome: Outcome) -> Outcome:
        self.end_reason = outcome.event
        return outcome


# -- two players ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SeatEnd:
    """How a finished game ends for one player: the reason, its final reward, and whether it was cut short."""

    reason: str
    reward: float
    truncated: bool = False


@dataclass
class Ruling:
    """The judgement on one move in a two-player game.

    An illegal move (``legal`` False) leaves the turn with the mover. When ``ends`` is set the
    game is over and it says how for each player (zero-sum for decisive games).
    """

    event: str
    legal: bool
    reward: float = 0.0
    ends: dict[str, SeatEnd] | None = None
    #: :func:`tactics` of the move
    stats: dict[str, int] = field(default_factory=dict)
    #: the mover's shaping components (:func:`shaping`), included in ``reward``, or in its end's when the move ended
    #: the game
    shaping: dict[str, float] = field(default_factory=dict)


class TwoPlayerGame:
    """Gomoku between two agents, X moving first; the rules and rewards of ``GomokuConfig``, no opponent.

    >>> game = TwoPlayerGame(GomokuConfig(board_size=5))
    >>> game.play(X, (2, 2)).event, game.play(O, (2, 2)).event
    ('valid', 'occupied')
    """

    players = (X, O)

    def __init__(self, config: GomokuConfig, opening: list[Move] | None = None):
        self.config = config
        self.board = board_from_moves(config.board_size, list(opening or []), config.win_length)
        self.invalid_streak = {X: 0, O: 0}
        self.valid_moves = {X: 0, O: 0}

    def play(self, stone: str, move: Move | None) -> Ruling:
        """Judge and apply ``stone``'s move (the caller enforces turn order)."""
        stats = tactics(self.board, stone, move)
        ruling = self._play(stone, move)
        ruling.stats = stats
        ruling.shaping = shaping(self.config.rewards, stats, ruling.legal)
        extra = sum(ruling.shaping.values())
        if ruling.ends is not None and extra:
            ruling.ends[stone] = replace(ruling.ends[stone], reward=ruling.ends[stone].reward + extra)
        else:
            ruling.reward += extra
        return ruling

    def _play(self, stone: str, move: Move | None) -> Ruling:
        rewards = self.config.rewards
        foe = O if stone == X else X
        kind = judge(self.board, move)
        if kind != VALID:
            self.invalid_streak[stone] += 1
            if self.invalid_streak[stone] >= self.config.max_invalid_moves:
                return Ruling(TOO_MANY_INVALID, False, ends={
                    stone: SeatEnd(TOO_MANY_INVALID, rewards.too_many_invalid),
                    foe: SeatEnd(OPPONENT_FORFEIT, rewards.forfeit_win)})
            return Ruling(kind, False, getattr(rewards, kind))
        assert move is not None
        self.invalid_streak[stone] = 0
        self.valid_moves[stone] += 1
        self.board.place(*move, stone)
        if self.board.winner() == stone:
            return Ruling(WIN, True, ends={stone: SeatEnd(WIN, rewards.win), foe: SeatEnd(LOSS, rewards.loss)})
        if self.board.is_full():
            return Ruling(DRAW, True, ends={stone: SeatEnd(DRAW, rewards.draw), foe: SeatEnd(DRAW, rewards.draw)})
        limit = self.config.max_moves
        if limit is not None and min(self.valid_moves.values()) >= limit:
            end = SeatEnd(STEP_LIMIT, rewards.step_limit, truncated=True)
            return Ruling(STEP_LIMIT, True, ends={stone: end, foe: end})
        return Ruling(VALID, True, rewards.valid)
