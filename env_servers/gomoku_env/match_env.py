"""``GomokuMatchEnv``: two agents play each other, one session per player, coordinated in-process.

Serve it with ``python -m env_servers.gomoku_env --two-agent`` or
``envhub serve env_servers.gomoku_env:GomokuMatchEnv`` (one worker: matches live in the process).
"""

from __future__ import annotations

import random
from typing import Annotated, Any, ClassVar

from env_servers.gomoku_env import prompts
from env_servers.gomoku_env.board import (
    Board,
    Move,
    OpeningConfig,
    coerce_move,
    opening_moves,
    other,
    parse_reply,
    random_opening,
)
from env_servers.gomoku_env.config import GomokuConfig
from env_servers.gomoku_env.coordinator import REGISTRY, Match, MatchRegistry, Report
from env_servers.gomoku_env.game import DRAW, STEP_LIMIT, VALID, WIN, TwoPlayerGame
from env_servers.gomoku_env.outcomes import outcome_of
from env_servers.gomoku_env.render import render_png
from envhub import Action, Env, Observation, StepResult, tool
from envhub.env import seeded_rng
from envhub.errors import ActionValidationError

PLAYED_EVENTS = frozenset({VALID, WIN, DRAW, STEP_LIMIT})


class GomokuMatchEnv(Env):
    """Gomoku between two agents: two sessions that reset with the same ``match_id`` play one match.

    ``reset(match_id="m1", seat="X")`` joins (or creates) match ``m1``; ``seat`` (alias ``player``)
    is ``"X"`` (moves first) or ``"O"``, or left out to take the free seat. ``match_id="auto"``
    pairs a session with the next one that asked for ``"auto"``; no ``match_id`` opens a new match
    whose id is in ``state()["match_id"]`` (and every step's ``info``). The O player's
    reset returns once X has made its first move; if that move ended the match (an invalid move
    that used X's last allowance, or X leaving), the reset's result is already ``done`` (or
    ``truncated``), with O's end in its reward and ``info``, and O never moves. Each ``step``
    returns after the opponent replied, so every result shows the opponent's move, and a game the
    opponent ends (its line, a full board) ends this player's episode too, with the loss on its own
    result: rewards are zero-sum for decisive games (``win`` to the winner, ``loss`` to the loser).
    An invalid move is penalised at once and the turn stays. If the opponent disconnects, or does
    not move within ``turn_timeout_s``, the episode ends with ``truncated=True``, reward 0 and
    ``info["end_reason"]`` ``"opponent_disconnected"`` / ``"opponent_timeout"``. Clients must wait
    longer than ``turn_timeout_s`` for a step reply (e.g. ``message_timeout_s``).

    Settings are ``GomokuConfig`` fields (the opponent settings are unused); the session that
    creates a match decides its board size and opening.
    """

    env_name = "gomoku_match"
    #: where matches are found; one per process, shared by every session
    registry: ClassVar[MatchRegistry[TwoPlayerGame]] = REGISTRY

    def __init__(self, **config: Any):
        self.config = GomokuConfig.build(config)
        self.rng = random.Random()
        self.match: Match[TwoPlayerGame] | None = None
        self.seat: str | None = None
        self.render_image = self.config.render_image

    async def reset(self, seed: int | None = None, match_id: str | None = None, seat: str | None = None,
                    player: str | None = None, board_size: int | None = None, opening: list[list[int]] | None = None,
                    render_image: bool | None = None) -> Observation | StepResult:
        """Join a match (see the class docstring); returns when it is this player's turn, or, when the
        match ended before it (the first player's invalid move, a disconnect), a ``done`` (or
        ``truncated``) result with this seat's end: its reward, ``end_reason`` and ``outcome``."""
        await self._leave()
        if seed is not None:
            self.rng = seeded_rng(seed)
        if seat is not None and player is not None and seat != player:
            raise ActionValidationError(f"Expected seat and player to agree (they are aliases), got {seat!r} and {player!r}.")
        if match_id is not None and not isinstance(match_id, (str, int)):
            raise ActionValidationError(f"Expected match_id to be a string, got {type(match_id).__name__}.")
        config = self._episode_config(board_size, render_image)
        self._check_joinable(None if match_id is None else str(match_id), board_size)

        def create(mid: str) -> Match[TwoPlayerGame]:
            moves = opening_moves(opening) if opening is not None else random_opening(
                self.rng, config.board_size, OpeningConfig(config.opening_max_stones, config.empty_board_prob),
                config.win_length)
            return Match(mid, TwoPlayerGame(config, moves), config.turn_timeout_s)

        try:
            self.match, self.seat, _ = self.registry.join(None if match_id is None else str(match_id),
                                                          seat or player, create)
        except (ValueError, TypeError) as exc:
            raise ActionValidationError(f"Cannot join the match: {exc}") from None
        self.render_image = config.render_image
        await self.match.wait_turn(self.seat)
        if self.match.over:  # ended before this seat's first turn: the episode ends here
            end = self.match.take_end(self.seat) or self.match.ends.get(self.seat)
            return self._result(Report("match_over", end.reward if end is not None else 0.0, end=end))
        return self._first_observation()

    async def step(self, action: Action) -> StepResult:
        """A text move (``<move>r,c</move>``, or ``<move>n</move>`` with ``move_format = "cell"``) or a
        ``place_stone`` call; anything else is a bad-format move."""
        if action.tool_name is None:
            if self.match is None:
                raise ActionValidationError("step before reset: call reset(match_id=...) to join a match.")
            config = self.match.game.config
            return await self._play(parse_reply(action.text, config.board_size, config.move_format))
        if action.tool_name != "place_stone" or set(action.arguments) != {"row", "col"}:
            return await self._play(None)
        return await self.place_stone(action.arguments["row"], action.arguments["col"])

    @tool
    async def place_stone(self, row: Annotated[int, "row, from 0 at the top"],
                          col: Annotated[int, "column, from 0 at the left"]) -> StepResult:
        """Place your stone on an empty cell of the board."""
        return await self._play(coerce_move(row, col))

    async def state(self) -> dict[str, Any]:
        # async: read on the event loop, where the coordinator mutates the match
        match = self.match
        if match is None:
            return {}
        return {"match_id": match.match_id, "seat": self.seat, "turn": match.turn, "agents": dict(match.status),
                "board": match.game.board.rows(), "over": match.over,
                "end_reason": match.ends[self.seat].reason if self.seat in match.ends else None}

    async def close(self) -> None:
        await self._leave()

    # -- internals ---------------------------------------------------------------------------
    def _episode_config(self, board_size: int | None, render_image: bool | None) -> GomokuConfig:
        changes = {k: v for k, v in (("board_size", board_size), ("render_image", render_image)) if v is not None}
        try:
            return self.config.replace(**changes)
        except ValueError as exc:
            raise ActionValidationError(f"Invalid gomoku reset: {exc}") from None

    def _check_joinable(self, match_id: str | None, board_size: int | None) -> None:
        existing = self.registry.get(match_id) if match_id is not None else None
        if existing is not None and not existing.over and board_size is not None \
                and board_size != existing.game.board.size:
            raise ActionValidationError(f"Expected board_size={existing.game.board.size} for match {match_id!r} "
                                        f"(set by the player who created it), got {board_size}; leave it out to join.")

    async def _leave(self) -> None:
        match, seat = self.match, self.seat
        self.match = self.seat = None
        if match is not None and seat is not None:
            await match.leave(seat)
            self.registry.discard(match)

    async def _play(self, move: Move | None) -> StepResult:
        if self.match is None or self.seat is None:
            raise ActionValidationError("step before reset: call reset(match_id=...) to join a match.")
        report = await self.match.play(self.seat, move)
        return self._result(report)

    def _first_observation(self) -> Observation:
        match, seat = self.match, self.seat
        assert match is not None and seat is not None
        board, cells = match.game.board, match.game.config.cells
        obs = self._observation(prompts.first_message(board, seat, match.last_move.get(other(seat)),
                                                      brief=match.game.config.brief_messages, cells=cells),
                                board, "start")
        obs.metadata["system_prompt"] = prompts.system_prompt(board.size, seat, first=seat == match.game.players[0],
                                                              win_length=board.win_length, cells=cells)
        return obs

    def _result(self, report: Report) -> StepResult:
        match, seat = self.match, self.seat
        assert match is not None and seat is not None
        board, game = match.game.board, match.game
        legal = report.event in PLAYED_EVENTS  # the move is on the board
        reply = _reply(board, seat) if legal or report.end is not None else None
        if report.end is not None:
            text = prompts.end_message(report.end.reason, board, seat, report.move if legal else None, reply,
                                       cells=game.config.cells)
        elif not legal:
            text = prompts.invalid_message(report.event, board, report.move, seat, game.invalid_streak[seat],
                                           game.config.max_invalid_moves, brief=game.config.brief_messages,
                                           cells=game.config.cells)
        else:
            text = prompts.move_message(board, seat, report.move, reply, brief=game.config.brief_messages,
                                        cells=game.config.cells)
        info: dict[str, Any] = {"event": report.event, "valid": legal, "seat": seat, "match_id": match.match_id,
                                "agents": dict(match.status), "invalid_streak": game.invalid_streak[seat],
                                "move": list(report.move) if report.move else None,
                                "opponent_move": list(reply) if reply else None, "stats": dict(report.stats)}
        if report.shaping:
            info["rewards"] = dict(report.shaping)
        end = report.end
        if end is not None:
            info["end_reason"], info["outcome"] = end.reason, outcome_of(end.reason)
        return StepResult(observation=self._observation(text, board, report.event), reward=report.reward,
                          done=end is not None and not end.truncated, truncated=end is not None and end.truncated,
                          info=info)

    def _observation(self, text: str, board: Board, event: str) -> Observation:
        obs = Observation(text=text, metadata={"board": board.rows(), "board_size": board.size, "stone": self.seat,
                                               "event": event})
        if self.render_image:
            obs.images = [render_png(board)]
        return obs


def _reply(board: Board, seat: str) -> Move | None:
    """The opponent's move if it is the last one on the board (it answered ours)."""
    if board.moves and board.moves[-1][2] != seat:
        r, c, _ = board.moves[-1]
        return r, c
    return None
