"""A scripted agent plays gomoku through ``OpenEnv`` + ``EnvTool`` against servers it starts.

    python examples/gomoku_agent.py

1. Two games against the scripted opponent with the env's own ``place_stone`` tool.
2. One game with text moves: an ``action_mapper`` turns the agent's ``move(text=...)`` tool call
   into the ``<move>row,col</move>`` text action a chat model would write.
3. Two agents play each other on the two-agent server (one session each, same ``match_id``).

The agent's policy reads the board from ``observation.metadata["board"]`` and plays the
heuristic that the env's scripted opponent uses, so it blocks threats and takes wins.
"""

import random
import threading

from env_servers.gomoku_env import GomokuEnv, GomokuMatchEnv
from env_servers.gomoku_env.board import Board
from env_servers.gomoku_env.opponents import HeuristicOpponent
from envhub import EnvTool, OpenEnv
from envhub.server import ServerThread, create_app

MOVE_TOOL = {"name": "move", "description": "Reply with your analysis and your move as <move>row,col</move>.",
             "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}


def choose(observation, stone: str, rng: random.Random) -> tuple[int, int]:
    """The scripted policy: rebuild the board from the observation and pick the heuristic's move."""
    rows = observation.metadata["board"]
    board = Board(len(rows))
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            if cell != ".":
                board.place(r, c, cell)
    return HeuristicOpponent().choose(board, stone, rng)


def play_with_tool(url: str, seed: int) -> None:
    env = OpenEnv(url)
    (place_stone,) = EnvTool.from_env(env)  # the env's own tool, schema from the server
    result, rng = env.reset(seed=seed), random.Random(seed)
    while not place_stone.done:
        row, col = choose(result.observation, "X", rng)
        place_stone(row=row, col=col)
        result = env.last_result
    print(f"tool game {seed}: {result.info['end_reason']} after {result.info['agent_moves']} moves, "
          f"episode reward {place_stone.episode_reward:+.0f}")
    env.close()


def play_with_text(url: str, seed: int) -> None:
    env = OpenEnv(url, tool_schema=[MOVE_TOOL], action_mapper=lambda _name, args: {"text": args["text"]})
    (move,) = EnvTool.from_env(env)
    env.reset(seed=seed)
    rng = random.Random(seed)
    move(text="<thinking>I am not sure.</thinking> I pass.")  # a malformed move: penalty, the game goes on
    print(f"text game: a move without <move> tags costs {env.last_result.reward:+.0f}")
    while not move.done:
        row, col = choose(env.last_result.observation, "X", rng)
        move(text=f"<thinking>Block threats, extend my lines.</thinking><move>{row},{col}</move>")
    print(f"text game: {env.last_result.info['end_reason']}, episode reward {move.episode_reward:+.0f}")
    env.close()


def play_match(url: str) -> None:
    results = {}

    def player(seat: str) -> None:
        env = OpenEnv(url, env_kwargs={"message_timeout_s": 120})
        result, rng = env.reset(match_id="demo", seat=seat, seed=1), random.Random(seat)
        while not (result.done or result.truncated):
            row, col = choose(result.observation, seat, rng)
            result = env.step("place_stone", {"row": row, "col": col})
        results[seat] = (result.info["end_reason"], env.episode_reward)
        env.close()

    threads = [threading.Thread(target=player, args=(seat,)) for seat in ("X", "O")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"two-agent match: X {results['X'][0]} ({results['X'][1]:+.0f}), O {results['O'][0]} ({results['O'][1]:+.0f})")


def main() -> None:
    with ServerThread(create_app(GomokuEnv, opponent="mix")) as server:
        for seed in (0, 1):
            play_with_tool(server.url, seed)
        play_with_text(server.url, 2)
    with ServerThread(create_app(GomokuMatchEnv, board_size=9)) as server:
        play_match(server.url)


if __name__ == "__main__":
    main()
