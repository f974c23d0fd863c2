"""The global phase barrier of two-agent training: every agent finishes a phase before any agent starts the next.

Training alternates two phases, per step: ``rollout`` (both agents play the step's matches
together; the env's coordinator interleaves their moves) and ``update`` (each agent trains on its
own trajectories). Within a rollout, the match env's turn barriers keep the two seats of a match in
step; across phases, this barrier does: no agent starts step ``k+1``'s rollout while the other is
still updating on step ``k`` (its sampler would serve a half-updated policy), and no agent updates
before every match of the step is over (its trajectories would be incomplete).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
PHASES = ("rollout", "update")


@dataclass(frozen=True)
class PhaseRecord:
    """One agent's pass through one phase: when it started, finished its own work, and left the barrier."""

    phase: str
    step: int
    agent: str
    start: float
    finished: float
    released: float

    @property
    def wait_s(self) -> float:
        """How long the agent waited at the barrier for the others."""
        return self.released - self.finished


class PhaseBarrier:
    """Runs phases for a fixed set of agents and refuses a phase out of order.

    ``joint(phase, step, fn)`` runs one piece of work that serves every agent at once (the match
    rollout); ``each(phase, step, {agent: fn})`` runs one piece of work per agent, in parallel
    threads when ``parallel`` (the agents share no tensors), and returns when all are done.
    Either way every agent is released together, and ``records`` keeps the timings.

    >>> barrier = PhaseBarrier(["a", "b"])
    >>> barrier.joint("rollout", 0, lambda: "played")
    'played'
    >>> barrier.each("update", 0, {"a": lambda: 1, "b": lambda: 2})
    {'a': 1, 'b': 2}
    """

    def __init__(self, agents: list[str], *, parallel: bool = True):
        self.agents = list(agents)
        self.parallel = parallel
        self.records: list[PhaseRecord] = []
        self._done: dict[str, tuple[str, int] | None] = dict.fromkeys(self.agents)

    def expected(self) -> tuple[str, int]:
        """The next phase and step every agent must enter."""
        last = next(iter(self._done.values()))
        if last is None:
            return PHASES[0], 0
        phase, step = last
        i = PHASES.index(phase)
        return (PHASES[i + 1], step) if i + 1 < len(PHASES) else (PHASES[0], step + 1)

    def resume_at(self, step: int) -> None:
        """Continue a resumed run at ``step`` (every agent completed step ``step - 1``)."""
        for agent in self.agents:
            self._done[agent] = (PHASES[-1], step - 1) if step > 0 else None

    def joint(self, phase: str, step: int, fn: Callable[[], T]) -> T:
        """One phase all agents go through together."""
        self._enter(phase, step)
        start = time.monotonic()
        out = fn()
        end = time.monotonic()
        self._leave(phase, step, dict.fromkeys(self.agents, (start, end)), end)
        return out

    def each(self, phase: str, step: int, work: dict[str, Callable[[], T]]) -> dict[str, T]:
        """One phase in which each agent does its own work; returns each agent's result."""
        if set(work) != set(self.agents):
            raise ValueError(f"Expected work for every agent {self.agents}, got {sorted(work)}.")
        self._enter(phase, step)
        times: dict[str, tuple[float, float]] = {}

        def timed(agent: str) -> T:
            start = time.monotonic()
            try:
                return work[agent]()
            finally:
                times[agent] = (start, time.monotonic())

        if self.parallel:
            with ThreadPoolExecutor(max_workers=len(self.agents), thread_name_prefix=f"{phase}") as pool:
                futures = {a: pool.submit(timed, a) for a in self.agents}
                results = {a: f.result() for a, f in futures.items()}  # the barrier: wait for all
        else:
            results = {a: timed(a) for a in self.agents}
        self._leave(phase, step, times, time.monotonic())
        return results

    def wait_times(self, phase: str, step: int) -> dict[str, float]:
        """Seconds each agent waited at the barrier of ``phase`` in ``step``."""
        return {r.agent: r.wait_s for r in self.records if r.phase == phase and r.step == step}

    def _enter(self, phase: str, step: int) -> None:
        if phase not in PHASES:
            raise ValueError(f"Expected a phase in {PHASES}, got {phase!r}.")
        if len(set(self._done.values())) != 1:
            raise RuntimeError(f"Agents are out of step: {self._done}.")
        if (phase, step) != self.expected():
            raise RuntimeError(f"Expected phase {self.expected()} next, got {(phase, step)}: every agent finishes "
                               "the rollout before updating, and its update before the next rollout.")

    def _leave(self, phase: str, step: int, times: dict[str, tuple[float, float]], released: float) -> None:
        for agent in self.agents:
            start, finished = times[agent]
            self.records.append(PhaseRecord(phase, step, agent, start, finished, released))
            self._done[agent] = (phase, step)


__all__ = ["PhaseBarrier", "PhaseRecord", "PHASES"]
