"""``GomokuEnv``: the single-agent gomoku env, the agent (X) against a scripted opponent (O).

Serve it with ``envhub serve env_servers.gomoku_env:GomokuEnv`` or
``python -m env_servers.gomoku_env --port 8002``. Two agents playing each other use
``GomokuMatchEnv`` (``env_servers.gomoku_env.match_env``).
"""

from __future__ import annotations

import random
from typing import Annotated, Any

from env_servers.gomoku_env import prompts
from env_servers.gomoku_env.board import (
    Board,
    Move,
    OpeningConfig,
    X,
    coerce_move,
    opening_moves,
    parse_reply,
    random_opening,
)
from env_servers.gomoku_env.config import GomokuConfig
from env_servers.gomoku_env.game import INVALID_EVENTS, VALID, GomokuGame, Outcome
from env_servers.gomoku_env.outcomes import outcome_of
from env_servers.gomoku_env.render import render_png
from envhub import Action, Env, Observation, StepResult, tool
from envhub.env import seeded_rng
from envhub.errors import ActionValidationError

SPLITS = ("train", "validation")


class GomokuEnv(Env):
    """Gomoku (five in a row, or ``win_length``) on an N×N board against a scripted opponent.

    The agent plays X and moves first, as ``<move>row,col</move>`` text (the last tag counts) or
    the ``place_stone(row, col)`` tool. The first observation carries the board and the rules;
    ``metadata["system_prompt"]`` holds the system prompt. Rewards follow ``GomokuRewards``
    (win +10, loss -10, invalid move -1 and the game goes on, ...). Settings are ``GomokuConfig``
    fields, passed to the constructor (``GomokuEnv(board_size=7, opponent="mix")``); ``reset``
    can override ``board_size``, ``opponent`` and ``render_image`` per episode and take a fixed
    ``opening`` (a list of ``[row, col]``, X first, even length).

    >>> import asyncio
    >>> from envhub import EnvRunner
    >>> runner = EnvRunner(GomokuEnv(board_size=7))
    >>> first = asyncio.run(runner.reset(seed=1, opening=[]))
    >>> "Your turn (X)" in first.observation.text
    True
    """

    env_name = "gomoku"

    def __init__(self, **config: Any):
        self.config = GomokuConfig.build(config)
        self.rng = random.Random()
        self.game: GomokuGame | None = None
        self.render_image = self.config.render_image

    # -- episode -----------------------------------------------------------------------------
    def reset(self, seed: int | None = None, board_size: int | None = None, opponent: str | None = None,
              render_image: bool | None = None, opening: list[list[int]] | None = None,
              split: str = "train") -> Observation:
        """Start a game, from ``opening`` if given, else from a random legal opening drawn with the seed.

        ``split`` (``"train"`` or ``"validation"``) picks the stream the seed draws from: the same seed
        gives a different opening and opponent stream in each, so a trainer that validates on seeds 0..N-1
        of ``"validation"`` does not replay its training games (an empty opening, drawn with
        ``empty_board_prob``, is the same board in both: its opponent moves differ).
        """
        if split not in SPLITS:
            raise ActionValidationError(f"Invalid gomoku reset: expected split in {SPLITS}, got {split!r}.")
        if seed is not None:
            self.rng = seeded_rng(seed) if split == "train" else random.Random(f"{split}:{seed}")
        changes = {k: v for k, v in (("board_size", board_size), ("opponent", opponent),
                                     ("render_image", render_image)) if v is not None}
        try:
            config = self.config.replace(**changes)
            moves = random_opening(self.rng, config.board_size, OpeningConfig(
                config.opening_max_stones, config.empty_board_prob), config.win_length) \
                if opening is None else opening_moves(opening)
            self.game = GomokuGame(config, self.rng, moves)
        except ValueError as exc:
            raise ActionValidationError(f"Invalid gomoku reset: {exc}") from None
        self.render_image = config.render_image
        board = self.game.board
        obs = self._observation(prompts.first_message(board, X, brief=config.brief_messages, cells=config.cells),
                                board, event="start")
        obs.metadata["system_prompt"] = prompts.system_prompt(board.size, X, win_length=board.win_length,
                                                              cells=config.cells)
        return obs

    def step(self, action: Action) -> StepResult:
        """A text move (``<move>r,c</move>``, or ``<move>n</move>`` with ``move_format = "cell"``) or a
        ``place_stone`` call; anything else is a bad-format move."""
        if action.tool_name is None:
            if self.game is None:
                raise ActionValidationError("step before reset: call reset() to start a game.")
            return self._play(parse_reply(action.text, self.game.board.size, self.game.config.move_format))
        if action.tool_name != "place_stone":
            return self._play(None, note=f"Unknown tool {action.tool_name!r}; the only tool is place_stone.")
        args = action.arguments
        if not isinstance(args, dict) or set(args) != {"row", "col"}:
            return self._play(None, note="place_stone takes exactly the integer arguments row and col.")
        return self.place_stone(args["row"], args["col"])

    @tool
    def place_stone(self, row: Annotated[int, "row, from 0 at the top"],
                    col: Annotated[int, "column, from 0 at the left"]) -> StepResult:
        """Place your stone (X) on an empty cell of the board."""
        return self._play(coerce_move(row, col))

    def state(self) -> dict[str, Any]:
        if self.game is None:
            return {}
        game = self.game
        return {"board": game.board.rows(), "board_size": game.board.size, "opponent": game.config.opponent,
                "moves": [[r, c, s] for r, c, s in game.board.moves], "agent_moves": game.agent_moves,
                "invalid_streak": game.invalid_streak, "end_reason": game.end_reason}

    # -- internals ---------------------------------------------------------------------------
    def _play(self, move: Move | None, note: str = "") -> StepResult:
        if self.game is None:
            raise ActionValidationError("step before reset: call reset() to start a game.")
        game = self.game
        outcome = game.play(move)
        board = game.board
        if outcome.ended:
            text = prompts.end_message(outcome.event, board, X, outcome.move, outcome.opponent_move,
                                       cells=game.config.cells)
        elif outcome.event in INVALID_EVENTS:
            text = prompts.invalid_message(outcome.event, board, outcome.move, X, game.invalid_streak,
                                           game.config.max_invalid_moves, brief=game.config.brief_messages,
                                           cells=game.config.cells)
            if note:
                text = f"{note}\n{text}"
        else:
            assert outcome.move is not None  # a valid move was made
            text = prompts.move_message(board, X, outcome.move, outcome.opponent_move, brief=game.config.brief_messages,
                                        cells=game.config.cells)
        return StepResult(observation=self._observation(text, board, outcome.event), reward=outcome.reward,
                          done=outcome.done, truncated=outcome.truncated, info=self._info(outcome))

    def _info(self, outcome: Outcome) -> dict[str, Any]:
        game = self.game
        assert game is not None
        info: dict[str, Any] = {"event": outcome.event, "valid": outcome.legal,
                                "invalid_streak": game.invalid_streak, "agent_moves": game.agent_moves,
                                "move": list(outcome.move) if outcome.move else None,
                                "opponent_move": list(outcome.opponent_move) if outcome.opponent_move else None,
                                "stats": dict(outcome.stats)}
        if outcome.shaping:
            info["rewards"] = dict(outcome.shaping)
        if outcome.ended:
            info["end_reason"], info["outcome"] = outcome.event, outcome_of(outcome.event)
        return info

    def _observation(self, text: str, board: Board, event: str = VALID) -> Observation:
        obs = Observation(text=text, metadata={"board": board.rows(), "board_size": board.size, "stone": X,
                                               "event": event})
        if self.render_image:
            obs.images = [render_png(board)]
        return obs
