"""Two-agent training: two independent policies learn by playing each other through a match env's coordinator.

Per step, between phase barriers (:class:`PhaseBarrier`):

1. **rollout** (both agents together): ``run.batch_size`` openings (a fresh ``seed`` each, plus
   ``env.train_task``), ``run.group_size`` matches of each. In every match one agent sits at X and
   the other at O (which one alternates from opening to opening); the engine drives both seats
   concurrently, each seat sampled from its own agent's policy, and the env's coordinator keeps
   the moves in turn. Each seat's trajectory holds its own tokens and the rewards its own moves
   earned (zero-sum for decisive games). With ``match.reference_groups = k`` the last k openings are
   played by each agent against a scripted random player instead (the validation reference), which
   keeps showing each agent boards the other's narrow play never reaches; their outcomes are logged
   as ``train_reference/...``, the head-to-head's as ``train/...`` and ``match/...``. With
   ``match.past_groups = k``, k openings before those are played by each agent against an earlier
   version of the other (:mod:`trainer.recipes.past_opponents`), logged as ``train_past/...``.
2. **update** (each agent on its own): an agent's trajectories of one opening form its GRPO
   group; groups with an infrastructure end (a disconnected or timed-out opponent, an env outage)
   are left out; then the agent's own loss and optimizer step (:meth:`Player.update`). The two
   updates may run in parallel threads; neither agent starts the next rollout before both are done.

Validation, before and after training (and every ``run.eval_every`` steps): matches on held-out
seeds (greedy unless ``match.eval_greedy=false``) against the other agent (both frozen), or against
a scripted random player (``match.eval_opponent``); each agent's ``eval/reward_mean`` (and
win/loss/draw rates) is logged in its own ``metrics.jsonl`` under ``run.output_dir/<agent>/``.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from trainer.recipes.matches import SEATS, MatchResult, MatchRollout, MatchSpec, by_agent
from trainer.recipes.opponents import RandomMoveSampler
from trainer.recipes.past_opponents import PastOpponents, is_past
from trainer.recipes.phases import PhaseBarrier
from trainer.recipes.players import Player, outcome_metrics
from trainer.recipes.setup import in_process_env, start_run
from trainer.recipes.two_agent_config import RANDOM_OPPONENT, TwoAgentConfig
from trainer.rollout import EnvPool
from trainer.rollout.failures import FailureWatch, RolloutFailureError, failure_summary


def build_pool(cfg: TwoAgentConfig) -> EnvPool:
    """Sessions to the match env: its server URLs, or the env class in process."""
    urls = cfg.env.all_urls()
    if not urls and not cfg.env.env_class:
        raise ValueError("Expected a match env: set env.url=ws://host:port (e.g. a GomokuMatchEnv server) or "
                         "env.env_class='env_servers.gomoku_env:GomokuMatchEnv' to run it in process.")
    return EnvPool(urls or None, in_process_env(cfg.env), connect_retry_s=cfg.env.connect_retry_s,
                   message_timeout_s=cfg.env.message_timeout_s, token=cfg.env.token)


def train_matches(cfg: TwoAgentConfig, names: list[str], step: int, run_id: str,
                  past: PastOpponents | None = None) -> list[MatchSpec]:
    """This step's matches: ``batch_size`` openings x ``group_size`` matches, seats alternating per opening. After
    the head-to-head openings come ``match.past_groups`` played by each agent against a snapshot of the other
    (``past`` draws it), then ``match.reference_groups`` against its reference player (:func:`reference_name`),
    so each agent still has ``batch_size`` groups."""
    urls = cfg.env.all_urls()
    head_to_head = cfg.run.batch_size - cfg.match.reference_groups - cfg.match.past_groups
    if cfg.match.past_groups and past is None:
        raise ValueError("Expected the pool of past opponents that match.past_groups plays against, got none.")
    specs = []
    for g in range(cfg.run.batch_size):
        if g < head_to_head:
            pairs = [names]
        elif g < head_to_head + cfg.match.past_groups:
            assert past is not None
            pairs = [[n, past.draw(other, step, g)] for n, other in zip(names, names[::-1])]
        else:
            pairs = [[n, reference_name(n)] for n in names]
        for p, pair in enumerate(pairs):
            first, second = pair if not (cfg.match.swap_seats and (g + p) % 2) else pair[::-1]
            reset = {**cfg.env.train_task, "seed": cfg.run.seed * 1_000_003 + step * cfg.run.batch_size + g}
            specs += [MatchSpec(f"{run_id}-s{step}-g{g}-{p}-{k}", {SEATS[0]: first, SEATS[1]: second}, reset,
                                group_id=g, env_url=urls[g % len(urls)] if urls else None)
                      for k in range(cfg.run.group_size)]
    return specs


def reference_name(agent: str) -> str:
    """The seat name of ``agent``'s scripted reference player in training matches (``match.reference_groups``)."""
    return f"{RANDOM_OPPONENT}-{agent}"


def is_head_to_head(result: MatchResult, names: list[str]) -> bool:
    """Whether both seats of ``result`` were agents (not a reference player or a past snapshot)."""
    return set(result.spec.seats.values()) <= set(names)


def against_the_past(result: MatchResult, names: list[str]) -> bool:
    """Whether one seat of ``result`` was a past snapshot of an agent (``match.past_groups``)."""
    return any(seat not in names and is_past(seat) for seat in result.spec.seats.values())


def eval_matches(cfg: TwoAgentConfig, pairs: list[tuple[str, str]], run_id: str, tag: str) -> list[MatchSpec]:
    """Held-out validation matches: ``run.eval_problems`` seeds per pairing, seats alternating."""
    urls = cfg.env.all_urls()
    specs = []
    for p, (a, b) in enumerate(pairs):
        for i in range(cfg.run.eval_problems):
            seats = (a, b) if i % 2 == 0 else (b, a)
            reset = {**cfg.env.eval_task, "seed": cfg.match.eval_seed_offset + i}
            specs.append(MatchSpec(f"{run_id}-{tag}-p{p}-{i}", dict(zip(SEATS, seats)), reset, group_id=i,
                                   env_url=urls[i % len(urls)] if urls else None))
    return specs


def evaluate(cfg: TwoAgentConfig, agents: dict[str, Player], pool: EnvPool, run_id: str, tag: str,
             log: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
    """Each agent's validation metrics (``eval/reward_mean``, win/loss/draw rates) on held-out seeds; ``log``
    gets why when none of an agent's games completed."""
    names = list(agents)
    policies: dict[str, tuple[Any, Any]] = {n: (a.sampler, a.tokenizer) for n, a in agents.items()}
    if cfg.match.eval_opponent == RANDOM_OPPONENT:
        results = []
        for n, agent in agents.items():  # the scripted player renders with the agent's own tokenizer
            opponent = RandomMoveSampler(agent.tokenizer, seed=cfg.run.seed)
            rollout = _rollout(cfg, pool, {n: policies[n], RANDOM_OPPONENT: (opponent, agent.tokenizer)})
            results += rollout.run_sync(eval_matches(cfg, [(n, RANDOM_OPPONENT)], run_id, f"{tag}-{n}"),
                                        greedy=cfg.match.eval_greedy)
    else:
        results = _rollout(cfg, pool, policies).run_sync(eval_matches(cfg, [(names[0], names[1])], run_id, tag),
                                                         greedy=cfg.match.eval_greedy)
    trajs = by_agent(results)
    for n in names:
        games = trajs.get(n, [])
        if log is not None and games and all(t.infra_failed for t in games):
            log(f"validation ({tag}) of {n}: no game completed: {failure_summary(games).describe()}")
    return {n: outcome_metrics(trajs.get(n, []), "eval") for n in names}


def match_metrics(results: list[MatchResult]) -> dict[str, float]:
    """What both agents share: how the step's matches ended."""
    n = max(len(results), 1)
    decisive = [r for r in results if r.decisive]
    first_wins = sum(r.winner == r.spec.seats[SEATS[0]] for r in decisive)
    return {"match/matches": float(len(results)), "match/decisive_rate": len(decisive) / n,
            "match/infra_rate": sum(r.infra_failed for r in results) / n,
            "match/first_player_win_rate": first_wins / max(len(decisive), 1)}


def _rollout(cfg: TwoAgentConfig, pool: EnvPool, policies: dict[str, tuple[Any, Any]]) -> MatchRollout:
    return MatchRollout(pool, policies, cfg.rollout, max_matches_in_flight=cfg.match.max_matches_in_flight,
                        partner_grace_s=cfg.match.partner_grace_s)


def train_two_agents(cfg: TwoAgentConfig, *, agents: dict[str, Player] | None = None,
                     on_step: Callable[[int, dict[str, dict[str, float]]], None] | None = None,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``cfg``; returns ``{"agents": {name: {"val_reward_before", "val_reward_after", ...}}, "steps", ...}``.

    Pass ``agents`` to train agents built in memory (e.g. warmed-up models); ``on_step(step, metrics)``
    gets each agent's metrics after every step.
    """
    start = time.monotonic()
    out = start_run(cfg.run.seed, cfg.run.output_dir, cfg.to_json())
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if cfg.run.device == "auto" else cfg.run.device)
    agents = agents or {name: Player(name, a, cfg, out / name, device=device) for name, a in cfg.agents.items()}
    names = list(agents)
    pool = build_pool(cfg)
    players: dict[str, tuple[Any, Any]] = {n: (a.sampler, a.tokenizer) for n, a in agents.items()}
    if cfg.match.reference_groups:  # scripted, rendering with the agent's own tokenizer, as in validation
        players.update({reference_name(n): (RandomMoveSampler(a.tokenizer, seed=cfg.run.seed + k), a.tokenizer)
                        for k, (n, a) in enumerate(agents.items())})
    # snapshots of each agent, from its policy before this run's first step (a resumed run: the resumed one)
    past = PastOpponents({n: (a.model, a.tokenizer) for n, a in agents.items()}, cfg.match.past_keep,
                         seed=cfg.run.seed) if cfg.match.past_groups else None
    if past is not None:
        players.update(past.players())
    rollout = _rollout(cfg, pool, players)
    barrier = PhaseBarrier(names, parallel=cfg.match.parallel_updates)
    run_id = uuid.uuid4().hex[:8]  # match ids unique even when several runs share one env server
    first_step = _maybe_resume(cfg, agents, barrier, log)

    before = evaluate(cfg, agents, pool, run_id, f"eval{first_step}", log)
    for n, agent in agents.items():
        agent.logger.log(first_step, before[n])
    log("validation reward before: " + _fmt_rewards(before))
    if all(not m["eval/episodes"] and m["eval/infra_failures"] for m in before.values()):  # a dead match env
        for agent in agents.values():
            agent.close()
        raise RolloutFailureError("Every validation game before training failed on the env side, so the run stops "
                                  "here; the reason is above.")
    watch = FailureWatch(cfg.run.max_failed_steps, log, out / "failures.jsonl")  # both seats' episodes
    for step in range(first_step, cfg.run.steps):
        t0 = time.monotonic()
        results = barrier.joint("rollout", step, lambda: rollout.run_sync(
            train_matches(cfg, names, step, run_id, past)))  # noqa: B023
        t1 = time.monotonic()
        trajs = by_agent(results)
        head_to_head = [r for r in results if is_head_to_head(r, names)]
        versus = by_agent(head_to_head)
        earlier = by_agent([r for r in results if against_the_past(r, names)])
        reference = by_agent([r for r in results if not is_head_to_head(r, names) and not against_the_past(r, names)])
        try:
            failures = watch.check(step + 1, [t for seats in trajs.values() for t in seats])
        except RolloutFailureError:
            for agent in agents.values():
                agent.close()
            if past is not None:
                past.close()
            raise
        # train/ outcome rates: the head-to-head games (None: every game was one)
        outcomes = {n: versus.get(n, []) for n in names} if len(head_to_head) < len(results) else {}
        # each() calls these before the loop moves on, so trajs and step are this iteration's
        updates = barrier.each("update", step, {n: functools.partial(a.update, trajs.get(a.name, []), step,
                                                                     outcomes=outcomes.get(n))
                                                for n, a in agents.items()})
        for n in names:
            if cfg.match.reference_groups:
                updates[n].update(outcome_metrics(reference.get(n, []), "train_reference"))
            if cfg.match.past_groups:
                updates[n].update(outcome_metrics(earlier.get(n, []), "train_past"))
        if past is not None and (step + 1) % cfg.match.past_every == 0:
            past.take({n: a.model for n, a in agents.items()}, step + 1)
        shared = {**match_metrics(head_to_head), **failures, "time/rollout_s": t1 - t0,
                  "time/step_s": time.monotonic() - t0}
        waits = barrier.wait_times("update", step)
        if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0 and step + 1 < cfg.run.steps:
            evals = evaluate(cfg, agents, pool, run_id, f"eval{step + 1}", log)
            for n in names:
                updates[n].update(evals[n])
        for n, agent in agents.items():
            updates[n].update(shared, **{"time/update_wait_s": waits[n]})
            agent.logger.log(step + 1, updates[n])
            agent.logger.log_trajectories(step + 1, [t.to_record(agent.tokenizer)
                                                     for t in trajs.get(n, [])[:cfg.run.log_trajectories]])
        log(f"step {step + 1}/{cfg.run.steps}: " + ", ".join(
            f"{n} reward={updates[n]['train/reward_mean']:.2f} v{agents[n].version}" for n in names)
            + f", decisive={shared['match/decisive_rate']:.2f}")
        if cfg.run.save_every and (step + 1) % cfg.run.save_every == 0:
            for agent in agents.values():
                agent.save(step + 1, cfg.run.keep_last)
        if on_step is not None:
            on_step(step + 1, updates)

    if past is not None:
        past.close()
    after = evaluate(cfg, agents, pool, run_id, "final", log)
    last_step = max(cfg.run.steps, first_step)  # a resumed run may already be at (or past) run.steps
    for n, agent in agents.items():
        agent.logger.log(last_step, after[n])
        if cfg.run.steps > first_step:
            agent.save(cfg.run.steps, cfg.run.keep_last)
        agent.close()
    log("validation reward after: " + _fmt_rewards(after))
    summary = {"agents": {n: {"val_reward_before": before[n].get("eval/reward_mean"),
                              "val_reward_after": after[n].get("eval/reward_mean"),
                              "val_win_rate_after": after[n]["eval/win_rate"] if "eval/reward_mean" in after[n] else None,
                              "eval_episodes": int(after[n]["eval/episodes"]),
                              "policy_version": agents[n].version} for n in names},
               "eval_opponent": cfg.match.eval_opponent, "steps": last_step - first_step,
               "seconds": round(time.monotonic() - start, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _maybe_resume(cfg: TwoAgentConfig, agents: dict[str, Player], barrier: PhaseBarrier,
                  log: Callable[[str], None]) -> int:
    if not cfg.run.resume:
        return 0
    steps = {n: a.load() for n, a in agents.items()}
    if len(set(steps.values())) != 1:
        raise RuntimeError(f"Expected both agents' latest checkpoints at the same step, got {steps}; "
                           "remove the newer one or start afresh with run.resume=false.")
    step = next(iter(steps.values())) or 0
    if step:
        log(f"resumed both agents from step {step}")
    barrier.resume_at(step)
    return step


def _fmt_rewards(evals: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{n}={m['eval/reward_mean']:.3f} (win {m['eval/win_rate']:.2f}, {m['eval/episodes']:.0f} games)"
                     if "eval/reward_mean" in m else
                     f"{n}=none (no game completed, {m['eval/infra_failures']:.0f} failed)" for n, m in evals.items())


__all__ = ["train_two_agents", "evaluate", "train_matches", "eval_matches", "match_metrics", "build_pool"]
