"""What a win rate against the random player means: scripted gomoku players of growing tactics against it.

The gomoku scenarios validate a policy by its win rate against the scripted random player, seats
alternating. This script plays, on the env's own rules (``env_servers.gomoku_env``: ``TwoPlayerGame``,
the random and heuristic opponents), each of these players against the random one and prints the
win, loss and draw rates as X, as O and both seats together:

- ``random``: a uniformly random empty cell (the level of legal moves alone);
- ``wins``: completes its own line when it can, else random;
- ``wins+blocks``: that, else blocks a line the other side would complete next, else random;
- ``heuristic``: the env's heuristic opponent (wins, blocks, threats, the centre).

So a rise from the first row toward the second is strategy, not legality: on the scenarios' 3x3 board
a player that only takes the wins it is offered gains about a quarter over random legal play. Every
player here moves legally; a policy that loses games on invalid moves sits below its row.

    python benchmarks/gomoku_levels.py                      # 3x3, three in a row (the scenarios' board)
    python benchmarks/gomoku_levels.py --board-size 9 --win-length 5 --games 2000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from env_servers.gomoku_env.board import Board, Move, X, other
from env_servers.gomoku_env.config import GomokuConfig
from env_servers.gomoku_env.game import DRAW, LOSS, WIN, TwoPlayerGame
from env_servers.gomoku_env.opponents import HeuristicOpponent, RandomOpponent

Chooser = Callable[[Board, str, random.Random], Move]


def takes_wins(board: Board, stone: str, rng: random.Random) -> Move:
    """Completes its own line when it can, else a random empty cell."""
    wins = board.winning_cells(stone)
    return rng.choice(wins) if wins else rng.choice(board.empty_cells())


def takes_wins_and_blocks(board: Board, stone: str, rng: random.Random) -> Move:
    """Completes its own line, else blocks one the other side would complete next, else a random cell."""
    cells = board.winning_cells(stone) or board.winning_cells(other(stone)) or board.empty_cells()
    return rng.choice(cells)


PLAYERS: dict[str, Chooser] = {"random": RandomOpponent().choose, "wins": takes_wins,
                               "wins+blocks": takes_wins_and_blocks, "heuristic": HeuristicOpponent().choose}


def play(config: GomokuConfig, x: Chooser, o: Chooser, rng: random.Random) -> str:
    """One game from the empty board; the result for X (``win``, ``loss`` or ``draw``)."""
    game = TwoPlayerGame(config)
    stone = X
    while True:
        ruling = game.play(stone, (x if stone == X else o)(game.board, stone, rng))
        if ruling.ends is not None:
            return ruling.ends[X].reason
        stone = other(stone)


def levels(config: GomokuConfig, games: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per player, its rates against the random player over ``games`` games in each seat."""
    rng, rand = random.Random(seed), PLAYERS["random"]
    out: dict[str, dict[str, float]] = {}
    for name, player in PLAYERS.items():
        as_x = [play(config, player, rand, rng) for _ in range(games)]
        as_o = [{WIN: LOSS, LOSS: WIN}.get(r, r) for r in (play(config, rand, player, rng) for _ in range(games))]
        out[name] = {"x_win": as_x.count(WIN) / games, "o_win": as_o.count(WIN) / games,
                     "win": (as_x.count(WIN) + as_o.count(WIN)) / (2 * games),
                     "loss": (as_x.count(LOSS) + as_o.count(LOSS)) / (2 * games),
                     "draw": (as_x.count(DRAW) + as_o.count(DRAW)) / (2 * games)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--board-size", type=int, default=3)
    parser.add_argument("--win-length", type=int, default=3)
    parser.add_argument("--games", type=int, default=5000, help="games per player and seat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few games (CI)")
    args = parser.parse_args(argv)
    config = GomokuConfig(board_size=args.board_size, win_length=args.win_length)
    games = 20 if args.smoke else args.games
    start = time.monotonic()
    rows = levels(config, games, args.seed)
    print(f"against the random player, {args.board_size}x{args.board_size}, {args.win_length} in a row, "
          f"{games} games per seat ({time.monotonic() - start:.1f} s):")
    print(f"{'player':<12} {'as X':>6} {'as O':>6} {'win':>6} {'loss':>6} {'draw':>6}")
    for name, r in rows.items():
        print(f"{name:<12} {r['x_win']:>6.3f} {r['o_win']:>6.3f} {r['win']:>6.3f} {r['loss']:>6.3f} {r['draw']:>6.3f}")


if __name__ == "__main__":
    main()
