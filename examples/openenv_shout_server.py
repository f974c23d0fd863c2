"""An unmodified OpenEnv environment served by openenv-core's own server: the trainer meets it as it is.

Its action and observation are typed models without ``text`` (``ShoutAction(message)``,
``ShoutObservation(echoed_message, message_length)``), the shape of OpenEnv's echo env; the reward
is the share of upper-case letters in the message, so a policy can learn to shout. Nothing of
envhub runs on the server side (openenv-core is in the ``dev`` extra):

    python examples/openenv_shout_server.py --port 8000
    envhub-train --config examples/configs/openenv_shout_grpo.toml env.url=ws://localhost:8000

The trainer reads the observation with the ``OpenEnv`` client's extraction (its typed fields as
JSON) and maps each reply to ``{"message": reply}`` with the action mapper it builds from the
server's ``/schema`` (``env.action_mapper = "auto"``; ``"message"`` says the same explicitly).
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class ShoutAction(Action):
    message: str


class ShoutObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0


class ShoutEnvironment(Environment):
    """OpenEnv's echo env with a reward: the share of the message's characters in A-Z; one step per episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="none", step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> ShoutObservation:
        self._state = State(episode_id=episode_id or "ep", step_count=0)
        return ShoutObservation(echoed_message="SHOUT SOMETHING", reward=0.0)

    def step(self, action: ShoutAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ShoutObservation:
        self._state.step_count += 1
        text = action.message
        return ShoutObservation(echoed_message=text, message_length=len(text), done=True,
                                reward=sum("A" <= ch <= "Z" for ch in text) / max(len(text), 1))

    @property
    def state(self) -> State:
        return self._state


def build_app(max_concurrent_envs: int = 64) -> Any:
    """openenv-core's FastAPI app for the env (``/ws``, ``/schema``, ``/health``...)."""
    return create_app(ShoutEnvironment, ShoutAction, ShoutObservation, max_concurrent_envs=max_concurrent_envs)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-envs", type=int, default=64, help="concurrent sessions")
    args = parser.parse_args(argv)
    uvicorn.run(build_app(args.max_envs), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
