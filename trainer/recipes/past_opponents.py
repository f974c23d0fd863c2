"""Earlier versions of each agent as training opponents (``match.past_groups``): a pool of frozen snapshots.

Two policies trained only against each other can settle into lines that beat the other's current play
and nothing else: each stops seeing the boards the other used to reach, and forgets how to play them.
Playing some of each step's games against earlier versions of the other agent keeps those positions in
the data, the way league and fictitious self-play keep past selves among the opponents.

A pool holds ``match.past_keep`` slots per agent, each a frozen copy of that agent's weights sampled in
process (:class:`~trainer.sampling.HFSampler` on a copy of its own). At the start every slot holds the
agent's policy before training; every ``match.past_every`` steps the agent's current weights replace the
oldest snapshot, so the slots hold its last ``past_keep`` versions once that many were taken. A past
group's opponent is a slot drawn at random (seeded by the run's seed, the step and the group).
"""

from __future__ import annotations

import random
from typing import Any

from trainer.sampling import HFSampler

PAST = "@past"  # agent names may not hold "@" (TwoAgentConfig), so no agent's name looks like a snapshot's


def past_name(agent: str, slot: int) -> str:
    """The seat name of snapshot ``slot`` of ``agent`` (an opponent of the other agent)."""
    return f"{agent}{PAST}{slot}"


def is_past(seat: str) -> bool:
    """Whether ``seat`` names a snapshot (:func:`past_name`)."""
    return PAST in seat


class PastOpponents:
    """``keep`` frozen snapshots of each agent's policy; :meth:`take` refreshes them, :meth:`draw` picks one."""

    def __init__(self, models: dict[str, tuple[Any, Any]], keep: int, seed: int = 0):
        if keep < 1:
            raise ValueError(f"Expected at least one snapshot slot per agent, got {keep}.")
        self.keep, self.seed = keep, seed
        self.samplers = {name: [HFSampler(model, tok, own_copy=True) for _ in range(keep)]
                         for name, (model, tok) in models.items()}
        self.tokenizers = {name: tok for name, (_, tok) in models.items()}
        self.versions = {name: [0] * keep for name in models}  # the policy version each slot holds
        self.taken = 0

    def players(self) -> dict[str, tuple[Any, Any]]:
        """``{seat name: (sampler, tokenizer)}`` of every slot, for a :class:`~trainer.recipes.matches.MatchRollout`."""
        return {past_name(name, s): (sampler, self.tokenizers[name])
                for name, slots in self.samplers.items() for s, sampler in enumerate(slots)}

    def take(self, models: dict[str, Any], version: int) -> None:
        """Each agent's current weights (``models[name]``, at policy ``version``) replace its oldest snapshot."""
        self.taken += 1
        slot = self.taken % self.keep  # slot 0 holds the policy before training until the pool wraps around
        for name, model in models.items():
            self.samplers[name][slot].update_weights(model, version)
            self.versions[name][slot] = version

    def draw(self, agent: str, step: int, group: int) -> str:
        """The seat name of a snapshot of ``agent`` for ``group`` of ``step`` (uniform over the slots, seeded)."""
        rng = random.Random(f"{self.seed}-{step}-{group}-{agent}")
        return past_name(agent, rng.randrange(self.keep))

    def close(self) -> None:
        for slots in self.samplers.values():
            for sampler in slots:
                sampler.close()


__all__ = ["PastOpponents", "is_past", "past_name"]
