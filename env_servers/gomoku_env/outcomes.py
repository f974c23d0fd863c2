"""Every gomoku end reason (``info["end_reason"]``) as the envhub :class:`~envhub.types.Outcome` a trainer counts.

The one place that says which of gomoku's end reasons is a win, a loss, a draw or a match cut
short outside the game; ``env.py`` and ``match_env.py`` put the result in ``info["outcome"]``.
"""

from __future__ import annotations

from env_servers.gomoku_env.coordinator import DISCONNECTED, OPPONENT_DISCONNECTED, OPPONENT_TIMEOUT, TURN_TIMEOUT
from env_servers.gomoku_env.game import DRAW, LOSS, OPPONENT_FORFEIT, TOO_MANY_INVALID, WIN
from envhub.types import Outcome

OUTCOMES: dict[str, Outcome] = {
    WIN: Outcome.WIN, OPPONENT_FORFEIT: Outcome.WIN,
    LOSS: Outcome.LOSS, TOO_MANY_INVALID: Outcome.LOSS,
    DRAW: Outcome.DRAW,
    DISCONNECTED: Outcome.DISCONNECTED, OPPONENT_DISCONNECTED: Outcome.DISCONNECTED,
    OPPONENT_TIMEOUT: Outcome.TIMED_OUT, TURN_TIMEOUT: Outcome.TIMED_OUT,
}


def outcome_of(end_reason: str) -> str | None:
    """The wire value of the outcome for ``end_reason`` (None for ``step_limit``: cut short, no result).

    >>> outcome_of("opponent_forfeit"), outcome_of("step_limit")
    ('win', None)
    """
    outcome = OUTCOMES.get(end_reason)
    return outcome.value if outcome is not None else None


__all__ = ["OUTCOMES", "outcome_of"]
