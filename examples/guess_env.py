"""A new env in one file: subclass ``Env``, add a ``@tool`` and a ``@reward``, serve it.

    envhub serve examples.guess_env:GuessEnv --port 8000      # from the repository root
    python examples/guess_env.py --port 8000                   # the same, from this file

Then any client reaches it: ``OpenEnv("ws://localhost:8000")``, OpenEnv's own clients, the
OpenAI agent loop (``examples/openai_agent.py``) or the trainer.
"""

from __future__ import annotations

import argparse
from typing import Annotated

from envhub import Env, Observation, reward, tool


class GuessEnv(Env):
    """Guess a secret integer between 1 and 100 in at most 10 guesses."""

    max_steps = 10

    def reset(self, seed: int | None = None, low: int = 1, high: int = 100) -> Observation:
        self.low, self.high = low, high
        self.secret, self.last = self.rng.randint(low, high), None
        return Observation(text=f"I picked a number between {low} and {high}. Call guess(number).")

    @tool
    def guess(self, number: Annotated[int, "your guess"]) -> str:
        """Guess the secret number; the reply says Higher, Lower or Correct."""
        self.last = number
        if number == self.secret:
            self.done = True
            return "Correct!"
        return "Higher." if number < self.secret else "Lower."

    @reward(weight=1.0)
    def solved(self) -> float:
        return float(self.last == self.secret)


if __name__ == "__main__":
    from envhub import serve

    parser = argparse.ArgumentParser(description=GuessEnv.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    serve(GuessEnv, host=args.host, port=args.port)
