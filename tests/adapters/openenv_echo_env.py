"""An unmodified OpenEnv environment (openenv-core's template echo env), and the envhub Env wrapping it.

    cd tests/adapters && envhub serve openenv_echo_env:EchoAsEnvhub --port 8000
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from adapters.openenv import from_openenv


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str = ""
    message_length: int = 0


class EchoEnvironment(Environment[EchoAction, EchoObservation, State]):
    """OpenEnv's template echo env; ``boom`` raises, ``bye`` ends the episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="none", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id or "ep", step_count=0)
        return EchoObservation(echoed_message=f"ready:{kwargs.get('greeting', '')}", reward=0.0)

    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        if action.message == "boom":
            raise RuntimeError("boom")
        return EchoObservation(echoed_message=action.message, message_length=len(action.message),
                               reward=len(action.message) / 10, done=action.message == "bye")

    @property
    def state(self) -> State:
        return self._state


EchoAsEnvhub = from_openenv(EchoEnvironment)
