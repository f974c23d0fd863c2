"""Two-agent rollouts: the engine drives both seats of every match, each seat sampled from its own agent's policy.

A match is two env sessions that ``reset`` with the same ``match_id`` (one per seat) against a
turn-based match env such as gomoku's ``GomokuMatchEnv``. The env's coordinator enforces turn
order: a seat's ``step`` returns once the opponent has replied, and rewards go to the seat that
earned them. Here each seat is an ordinary :class:`RolloutEngine` episode, run by the engine of the
agent sitting in that seat, so every trajectory holds only its own agent's sampled ids, log-probs and
rewards, and belongs to that agent alone (``traj.info["agent"]``).

Results come from the env's ``info["outcome"]`` (:class:`envhub.types.Outcome`), never from its own
end-reason vocabulary. Infrastructure ends are not policy outcomes: a match the env ends because a
player disconnected or timed out (an outcome in :data:`INFRA_OUTCOMES`) gives the seat a stop reason
that is an infra failure, so it is excluded from the loss like any env outage.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from envhub.errors import EnvConnectionError
from envhub.types import Outcome, StepResult
from trainer.rollout.engine import RolloutConfig, RolloutEngine
from trainer.rollout.envs import EnvPool, EnvSession
from trainer.rollout.types import EpisodeState, StopReason, Task, Trajectory
from trainer.sampling import Sampler

#: outcomes that say the match ended for a reason outside the game (not a loss), as a stop reason
INFRA_OUTCOMES: dict[Outcome, StopReason] = {Outcome.DISCONNECTED: StopReason.ENV_ERROR,
                                             Outcome.TIMED_OUT: StopReason.TIMEOUT}
#: seats in move order (the first one moves first)
SEATS = ("X", "O")


@dataclass
class MatchSpec:
    """One match: which agent sits in which seat, the reset arguments both seats share, and its group."""

    match_id: str
    seats: dict[str, str]  # seat -> agent name, e.g. {"X": "alice", "O": "bob"}
    reset_kwargs: dict[str, Any] = field(default_factory=dict)
    group_id: int = 0
    env_url: str | None = None

    def task(self, seat: str) -> Task:
        """The episode one seat runs: the shared reset arguments plus the match id and the seat."""
        return Task(reset_kwargs={**self.reset_kwargs, "match_id": self.match_id, "seat": seat},
                    group_id=self.group_id, env_url=self.env_url)


@dataclass
class MatchResult:
    """Both seats' trajectories of one match (seat -> trajectory)."""

    spec: MatchSpec
    trajectories: dict[str, Trajectory]

    @property
    def infra_failed(self) -> bool:
        return any(t.infra_failed for t in self.trajectories.values())

    @property
    def end_reasons(self) -> dict[str, str | None]:
        """Seat -> the env's own end reason (for logs; results come from :attr:`outcomes`)."""
        return {seat: t.info.get("end_reason") for seat, t in self.trajectories.items()}

    @property
    def outcomes(self) -> dict[str, Outcome | None]:
        return {seat: Outcome.of(t.info) for seat, t in self.trajectories.items()}

    @property
    def decisive(self) -> bool:
        """A game one seat won and the other lost (five in a row or a forfeit), not cut short."""
        return not self.infra_failed and sorted(o or "" for o in self.outcomes.values()) == ["loss", "win"]

    @property
    def winner(self) -> str | None:
        """The agent that won a decisive game, else None."""
        if not self.decisive:
            return None
        return str(next(self.trajectories[seat].info["agent"] for seat, o in self.outcomes.items() if o is Outcome.WIN))


class _SeatSession:
    """An env session that remembers the last result's ``info`` of its seat, and makes the first seat wait.

    The seat that moves first must not move before its opponent has joined: a first player that
    forfeits at once would end the match before the other seat took it. So it resets only after the
    other seat's reset went out and, where the session exposes ``state()`` (over WebSocket), makes
    its first move only once ``state()["agents"]`` shows both seats.
    """

    def __init__(self, inner: EnvSession, recorder: _MatchRecorder):
        self.inner, self.recorder = inner, recorder
        self.key: tuple[str, str] | None = None
        self.moved = False

    async def reset(self, **kwargs: Any) -> StepResult:
        self.key = (str(kwargs.get("match_id")), str(kwargs.get("seat")))
        await self.recorder.before_reset(self.key)
        result = await self.inner.reset(**kwargs)
        self.recorder.infos[self.key] = dict(result.info or {})
        return result

    async def step(self, action: dict[str, Any]) -> StepResult:
        if not self.moved and self.key is not None and self.key[1] == SEATS[0]:
            await self.recorder.wait_seated(self.inner)
        self.moved = True
        result = await self.inner.step(action)
        if self.key is not None:
            self.recorder.infos[self.key] = dict(result.info or {})
        return result

    async def tools(self) -> list[Any]:
        return await self.inner.tools()

    async def close(self) -> None:
        await self.inner.close()


class _MatchRecorder:
    """The pool the engines open sessions from: wraps each session in a :class:`_SeatSession`."""

    def __init__(self, pool: EnvPool, join_timeout_s: float):
        self.pool = pool
        self.join_timeout_s = join_timeout_s
        self.infos: dict[tuple[str, str], dict[str, Any]] = {}
        self._joining: dict[str, asyncio.Event] = {}
        self._abandoned: set[str] = set()

    async def open(self, url: str | None = None) -> _SeatSession:
        return _SeatSession(await self.pool.open(url), self)

    async def release(self, session: EnvSession, url: str | None = None) -> None:
        """A seat's episode ended: close its session, never keep it for reuse, so the seat leaves the
        match at once (an opponent still playing learns it is over instead of waiting for a timeout)."""
        await asyncio.wait_for(session.close(), 5.0)

    async def aclose(self) -> None:
        await self.pool.aclose()

    def _joined(self, match_id: str) -> asyncio.Event:
        return self._joining.setdefault(match_id, asyncio.Event())

    async def before_reset(self, key: tuple[str, str]) -> None:
        match_id, seat = key
        if seat == SEATS[0]:
            await self._joined(match_id).wait()
            if match_id in self._abandoned:
                raise EnvConnectionError(f"Match {match_id!r}: the other seat failed before it could join; "
                                         "not starting the match alone.")
        else:
            self._joined(match_id).set()

    async def wait_seated(self, session: EnvSession) -> None:
        """Poll the env's ``state()`` until both seats are taken (no-op for sessions without ``state``)."""
        state = getattr(session, "state", None)
        if state is None:
            return
        deadline = asyncio.get_running_loop().time() + self.join_timeout_s
        while asyncio.get_running_loop().time() < deadline:
            agents = (await state()).get("agents")
            if not isinstance(agents, dict) or all(seat in agents for seat in SEATS):
                return
            await asyncio.sleep(0.02)

    def abandon(self, match_id: str) -> None:
        """A seat failed: a first seat that has not joined yet must not start the match alone."""
        self._abandoned.add(match_id)
        self._joined(match_id).set()

    def forget(self, match_id: str) -> None:
        """The match is over: drop what was kept for it."""
        self._joining.pop(match_id, None)
        self._abandoned.discard(match_id)
        for seat in SEATS:
            self.infos.pop((match_id, seat), None)


class MatchRollout:
    """Plays matches between agents: ``await rollout.run(specs)`` -> one :class:`MatchResult` per spec.

    ``policies`` maps an agent name to its ``(sampler, tokenizer)``; each agent gets its own
    :class:`RolloutEngine`, so its seats are sampled from its policy only (batched with its other
    seats in flight). When one seat's episode fails on infrastructure, a first seat that has not
    joined yet gives up at once, and one already playing is cancelled after ``partner_grace_s``
    unless the env ends its episode sooner (it would otherwise wait for the env's turn timeout).
    A seat's session is closed as soon as its episode ends (never pooled for reuse), so the env
    learns at once that the seat left.

    >>> rollout = MatchRollout(EnvPool(["ws://localhost:8005"]), {"a": (s_a, tok), "b": (s_b, tok)},
    ...                        RolloutConfig(max_turns=20))                        # doctest: +SKIP
    >>> results = await rollout.run([MatchSpec("m1", {"X": "a", "O": "b"}, {"seed": 1})])  # doctest: +SKIP
    """

    def __init__(self, pool: EnvPool, policies: dict[str, tuple[Sampler, Any]], config: RolloutConfig | None = None,
                 *, max_matches_in_flight: int = 32, partner_grace_s: float = 5.0):
        if max_matches_in_flight < 1:
            raise ValueError(f"Expected max_matches_in_flight >= 1, got {max_matches_in_flight}.")
        self.recorder = _MatchRecorder(pool, partner_grace_s)
        self.config = config or RolloutConfig()
        self.engines = {name: RolloutEngine(self.recorder, sampler, tok, self.config)  # type: ignore[arg-type]
                        for name, (sampler, tok) in policies.items()}
        self.max_matches_in_flight = max_matches_in_flight
        self.partner_grace_s = partner_grace_s
        self._claim_samplers()

    def _claim_samplers(self) -> None:
        # A batching sampler waits for every live episode of its engine to ask for a turn; in a match
        # half of them wait for the opponent instead, so count only the seats whose request is out.
        for engine in self.engines.values():
            set_demand = getattr(engine.sampler, "set_demand", None)
            if set_demand is not None:
                set_demand(lambda e=engine: sum(s is EpisodeState.GENERATING for s in e.states.values()))

    async def run(self, specs: list[MatchSpec], *, greedy: bool = False) -> list[MatchResult]:
        """Play every match (at most ``max_matches_in_flight`` at once, both seats together), in spec order."""
        for spec in specs:
            unknown = sorted(set(spec.seats.values()) - set(self.engines))
            if set(spec.seats) != set(SEATS) or unknown:
                raise ValueError(f"Expected match {spec.match_id!r} to seat agents {sorted(self.engines)} in "
                                 f"seats {list(SEATS)}, got {spec.seats}.")
        self._claim_samplers()  # another rollout (validation) may have pointed them at its engines
        gate = asyncio.Semaphore(self.max_matches_in_flight)

        async def one(i: int, spec: MatchSpec) -> MatchResult:
            async with gate:
                return await self.play(spec, greedy=greedy, key=i)

        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(specs))))

    def run_sync(self, specs: list[MatchSpec], *, greedy: bool = False) -> list[MatchResult]:
        """``run`` from synchronous code."""
        return asyncio.run(self.run(specs, greedy=greedy))

    async def play(self, spec: MatchSpec, *, greedy: bool = False, key: int = 0) -> MatchResult:
        """One match: both seats' episodes concurrently, each by its agent's engine."""
        tasks = {seat: asyncio.create_task(self.engines[spec.seats[seat]].run_episode(
            spec.task(seat), greedy=greedy, key=2 * key + n)) for n, seat in enumerate(SEATS)}
        trajs: dict[str, Trajectory] = {}
        pending = set(tasks.values())
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for seat, task in tasks.items():
                    if task in done:
                        trajs[seat] = task.result()  # a sampler bug raises here: the match is abandoned
                if pending and any(t.infra_failed for t in trajs.values()):
                    await self._stop_partner(spec, trajs, tasks, pending)
                    pending = set()
        finally:
            # Never leave a seat playing on its own (an error above, or the run was cancelled).
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            if len(trajs) < len(SEATS):  # abandoned
                self.recorder.forget(spec.match_id)
        for seat, traj in trajs.items():
            self._annotate(spec, seat, traj)
        self.recorder.forget(spec.match_id)
        return MatchResult(spec, {seat: trajs[seat] for seat in SEATS})

    async def _stop_partner(self, spec: MatchSpec, trajs: dict[str, Trajectory],
                            tasks: dict[str, asyncio.Task[Any]], pending: set[asyncio.Task[Any]]) -> None:
        # The failed seat may never have joined: a first seat still waiting to join gives up, and one
        # already playing gets a grace period to see the env end the match before it is cancelled.
        self.recorder.abandon(spec.match_id)
        await asyncio.wait(pending, timeout=self.partner_grace_s)
        for seat, task in tasks.items():
            if seat in trajs:
                continue
            if task.done():
                trajs[seat] = task.result()
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            trajs[seat] = Trajectory(task=spec.task(seat), stop_reason=StopReason.CANCELLED,
                                     error="cancelled: the other seat of the match failed on infrastructure")

    def _annotate(self, spec: MatchSpec, seat: str, traj: Trajectory) -> None:
        info = self.recorder.infos.get((spec.match_id, seat), {})
        end_reason, outcome = info.get("end_reason"), Outcome.of(info)
        other = SEATS[1] if seat == SEATS[0] else SEATS[0]
        traj.info.update(agent=spec.seats[seat], seat=seat, match_id=spec.match_id, opponent=spec.seats[other],
                         end_reason=end_reason, outcome=outcome.value if outcome is not None else None)
        if outcome in INFRA_OUTCOMES and not traj.infra_failed:
            traj.stop_reason = INFRA_OUTCOMES[outcome]
            traj.error = f"the match ended outside the game: {end_reason or outcome.value}"


def by_agent(results: list[MatchResult]) -> dict[str, list[Trajectory]]:
    """Every trajectory of ``results``, filed under the agent that played it."""
    out: dict[str, list[Trajectory]] = {}
    for result in results:
        for traj in result.trajectories.values():
            out.setdefault(traj.info["agent"], []).append(traj)
    return out


__all__ = ["MatchSpec", "MatchResult", "MatchRollout", "by_agent", "INFRA_OUTCOMES", "SEATS"]
