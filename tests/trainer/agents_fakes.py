"""User-written agents and client-side tools for the agent tests, named by path as a config would name them."""

from __future__ import annotations

import asyncio
from typing import Annotated

from trainer.rollout.agents import Agent, Decision

BARRIER: asyncio.Barrier | None = None


class LastWordAgent(Agent):
    """Puts a fixed instruction before the task; the last word of a reply is the answer; sees its history."""

    def initial_messages(self, observation):
        prefix = self.options.get("prefix", "Answer with one word.")
        return [{"role": "user", "content": f"{prefix} {self.text_of(observation)}"}]

    def observation_messages(self, observation):
        turns = sum(m["role"] == "assistant" for m in self.history)
        return [{"role": "user", "content": f"[turn {turns}] {self.text_of(observation)}"}]

    def decide(self, reply, *, truncated):
        words = reply.split()
        return Decision(text=words[-1] if words else "")


def lookup(key: Annotated[str, "what to look up"]) -> str:
    """Look a constant up."""
    return {"pi": "3.14", "e": "2.72"}.get(key, "unknown")


async def rendezvous(name: str) -> str:
    """Wait until a second call arrives (only concurrent calls can both finish)."""
    await asyncio.wait_for(BARRIER.wait(), 2.0)
    return f"met {name}"
