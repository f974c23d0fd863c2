"""The agent protocol coordinator: two sessions of one server process play one turn-based match.

Pure asyncio, no envhub imports. A module-level ``REGISTRY`` maps match ids to ``Match``
objects, so every session of the process that names the same ``match_id`` joins the same match.

Protocol, per player:

* ``join`` takes a seat (the one asked for, or the free one; X moves first).
* ``wait_turn`` is the barrier before a move: it returns when it is the player's turn or the match
  is over. The second player's ``reset`` waits here, so its first observation shows the first move.
* ``play`` waits for the turn, applies the move, and, if the move was legal and the game goes on,
  waits again until the opponent has moved or the match ended. So a player's result always shows
  the opponent's reply, and a loss caused by the opponent's winning move lands on the loser's own
  next result (zero-sum: +R to the winner's result, -R to the loser's).
* An illegal move is answered at once with its penalty; the turn stays with the offender.
* ``leave`` (the session closed) and a wait longer than ``turn_timeout_s`` end the match for
  both players as *truncated*, reward 0: an infrastructure end, not a loss.

Each player is ``running`` (its turn: its agent is choosing a move), ``pending`` (waiting for the
other), ``done`` (the match ended for it) or ``left``.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from env_servers.gomoku_env.game import Ruling, SeatEnd, TwoPlayerGame

RUNNING, PENDING, DONE, LEFT = "running", "pending", "done", "left"
#: the match id that pairs a session with any other session that asked for it
AUTO = "auto"
OPPONENT_DISCONNECTED, OPPONENT_TIMEOUT, TURN_TIMEOUT, DISCONNECTED = (
    "opponent_disconnected", "opponent_timeout", "turn_timeout", "disconnected")


class TurnGame(Protocol):
    """A two-player game: ``players`` in move order, ``play`` judges and applies one move."""

    players: tuple[str, str]

    def play(self, player: str, move: Any) -> Ruling: ...


#: the game a match (and a registry of matches) holds
G = TypeVar("G", bound=TurnGame)


@dataclass
class Report:
    """What one player learns from one ``play`` (or from a match that ended while it waited).

    ``reward`` is everything this player earned since its last report: the move's own reward plus,
    when the match ended, its final reward. ``end`` is set once the match is over for this player.
    """

    event: str
    reward: float
    move: Any = None
    opponent_move: Any = None
    end: SeatEnd | None = None
    #: the game's statistics of this player's move (gomoku: :func:`~env_servers.gomoku_env.game.tactics`)
    stats: dict[str, int] = field(default_factory=dict)
    #: the shaping components included in ``reward`` (gomoku: :func:`~env_servers.gomoku_env.game.shaping`)
    shaping: dict[str, float] = field(default_factory=dict)


class Match(Generic[G]):
    """One match between two seats, with turn order enforced by an ``asyncio.Condition``."""

    def __init__(self, match_id: str, game: G, turn_timeout_s: float):
        self.match_id = match_id
        self.game = game
        self.turn_timeout_s = turn_timeout_s
        self.turn = game.players[0]
        self.status: dict[str, str] = {}
        self.last_move: dict[str, Any] = {}
        self.ends: dict[str, SeatEnd] = {}
        self._delivered: set[str] = set()
        self._cond = asyncio.Condition()
        #: called once when the match ends (the registry forgets it then)
        self.on_end: Callable[[Match[G]], None] | None = None

    @property
    def over(self) -> bool:
        return bool(self.ends)

    @property
    def free_seats(self) -> list[str]:
        return [p for p in self.game.players if p not in self.status]

    def other(self, player: str) -> str:
        first, second = self.game.players
        return second if player == first else first

    def join(self, seat: str | None = None) -> str:
        """Take ``seat`` (or the first free one) and return it; ``ValueError`` if it is not free."""
        if seat is not None and seat not in self.game.players:
            raise ValueError(f"Expected seat to be one of {list(self.game.players)}, got {seat!r}.")
        free = self.free_seats
        if not free or (seat is not None and seat not in free):
            taken = seat if seat is not None else "every seat"
            raise ValueError(f"Match {self.match_id!r}: {taken} is already taken; pick a free seat "
                             f"({free or 'none'}) or another match_id.")
        player = seat if seat is not None else free[0]
        self.status[player] = RUNNING if self.turn == player else PENDING
        return player

    # -- barriers --------------------------------------------------------------------------
    async def wait_turn(self, player: str) -> None:
        """Return when it is ``player``'s turn or the match is over; a too-long wait ends the match."""
        async with self._cond:
            await self._wait_locked(player)

    async def _wait_locked(self, player: str) -> None:
        try:
            await asyncio.wait_for(self._cond.wait_for(lambda: self.turn == player or self.over),
                                   self.turn_timeout_s)
        except asyncio.TimeoutError:
            if not self.over:
                self._end({player: SeatEnd(OPPONENT_TIMEOUT, 0.0, truncated=True),
                           self.other(player): SeatEnd(TURN_TIMEOUT, 0.0, truncated=True)})

    # -- moves -----------------------------------------------------------------------------
    async def play(self, player: str, move: Any) -> Report:
        """Make ``player``'s move when it is its turn; return once the opponent replied or the match ended."""
        async with self._cond:
            await self._wait_locked(player)
            if self.over:
                return self._final_report(player, "match_over", 0.0, move)
            ruling = self.game.play(player, move)
            if ruling.ends is not None:
                if ruling.legal:
                    self.last_move[player] = move
                self._end(ruling.ends)
                return self._final_report(player, ruling.event, 0.0, move, ruling)
            if not ruling.legal:
                return Report(ruling.event, ruling.reward, move=move, stats=ruling.stats, shaping=ruling.shaping)
            self.last_move[player] = move
            self.turn = self.other(player)
            self._refresh_status()
            self._cond.notify_all()
            await self._wait_locked(player)
            if self.ends:  # the match ended during the wait
                return self._final_report(player, ruling.event, ruling.reward, move, ruling)
            return Report(ruling.event, ruling.reward, move=move, opponent_move=self.last_move.get(self.other(player)),
                          stats=ruling.stats, shaping=ruling.shaping)

    async def leave(self, player: str) -> None:
        """The player's session closed: if the match is still on, it ends for both, truncated."""
        async with self._cond:
            if not self.over:
                self._end({player: SeatEnd(DISCONNECTED, 0.0, truncated=True),
                           self.other(player): SeatEnd(OPPONENT_DISCONNECTED, 0.0, truncated=True)})
            self.status[player] = LEFT

    def take_end(self, player: str) -> SeatEnd | None:
        """The player's end of the match, the first time it is asked for after the match ended."""
        if player in self.ends and player not in self._delivered:
            self._delivered.add(player)
            return self.ends[player]
        return None

    # -- internals -------------------------------------------------------------------------
    def _refresh_status(self) -> None:
        # Only seated players have a status: a seat nobody joined yet must stay free.
        for player, status in self.status.items():
            if status not in (LEFT, DONE):
                self.status[player] = RUNNING if self.turn == player else PENDING

    def _end(self, ends: dict[str, SeatEnd]) -> None:
        self.ends = dict(ends)
        for player in self.game.players:
            if player in self.status and self.status[player] != LEFT:
                self.status[player] = DONE
        self._cond.notify_all()
        if self.on_end is not None:
            self.on_end(self)

    def _final_report(self, player: str, event: str, reward: float, move: Any,
                      ruling: Ruling | None = None) -> Report:
        end = self.take_end(player)
        earned = reward + (end.reward if end is not None else 0.0)
        return Report(event, earned, move=move, opponent_move=self.last_move.get(self.other(player)),
                      end=end or self.ends.get(player), stats=dict(ruling.stats) if ruling else {},
                      shaping=dict(ruling.shaping) if ruling else {})


class MatchRegistry(Generic[G]):
    """Matches by id, shared by all sessions of a process. Ended or abandoned matches are dropped."""

    def __init__(self) -> None:
        self._matches: dict[str, Match[G]] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._matches)

    def get(self, match_id: str) -> Match[G] | None:
        return self._matches.get(match_id)

    def join(self, match_id: str | None, seat: str | None,
             create: Callable[[str], Match[G]]) -> tuple[Match[G], str, bool]:
        """Join match ``match_id``, created with ``create`` if absent (an ended match is replaced).

        ``match_id=None`` creates a private match under a fresh random id (unguessable: only whoever is told it
        can join); ``"auto"`` pairs with any open
        ``"auto"`` match. Returns the match, the seat taken, and whether this call created the match.
        """
        self._drop_finished()
        if match_id is None:
            match_id = f"match-{secrets.token_hex(8)}"
        elif match_id == AUTO:
            match_id = next((mid for mid, m in self._matches.items()
                             if mid.startswith("auto-") and m.free_seats and (seat is None or seat in m.free_seats)),
                            None) or f"auto-{next(self._ids)}"
        match = self._matches.get(match_id)
        created = match is None
        if match is None:
            match = self._matches[match_id] = create(match_id)
            match.on_end = self.discard
        return match, match.join(seat), created

    def discard(self, match: Match[G]) -> None:
        """Forget ``match`` if it is over or everyone left (called when a player leaves)."""
        if self._matches.get(match.match_id) is match and (
                match.over or all(s == LEFT for s in match.status.values())):
            del self._matches[match.match_id]

    def _drop_finished(self) -> None:
        for mid in [mid for mid, m in self._matches.items() if m.over]:
            del self._matches[mid]


#: the process-wide registry every GomokuMatchEnv session uses
REGISTRY: MatchRegistry[TwoPlayerGame] = MatchRegistry()
