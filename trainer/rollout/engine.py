"""The async rollout engine: many multi-turn episodes in flight, exact token ids and masks, a stop reason each.

Per episode, the state machine PENDING -> GENERATING -> INTERACTING -> ... -> TERMINATED:

- PENDING: open a session (retrying a refused connection), ``reset`` with the task's arguments,
  render ``[system, user]`` (+ the env's tools) with the chat template: prompt ids, mask 0.
- GENERATING: ask the sampler for at most ``min(max_tokens_per_turn, budget left)`` tokens; its
  ids and log-probs are appended as they are, mask 1. Concurrent episodes share batched calls.
- INTERACTING: text envs get ``{"text": turn}``; tool envs get each Hermes ``<tool_call>`` as
  ``{"tool_name", "arguments"}`` and the results go back as ``<tool_response>`` blocks. The
  observation ids come from a fixed-base render (mask 0), never from re-tokenising the chat.
- TERMINATED with a :class:`StopReason`: done, turn limit, token limit, parse error (policy
  failures, trained on), or env error / timeout (infrastructure, excluded from the loss).

Observation images (``Observation.images``, PNG bytes) reach a vision-language policy: with a
:class:`~trainer.vision.VisionProcessor` the user or tool message becomes ``[image parts..., text]``,
the placeholders are expanded to each image's token count (mask 0) and the images travel with the
trajectory to the sampler and the loss. A text-only policy sees the text alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from envhub.errors import ActionValidationError, EnvHubError, EpisodeStateError, StepTimeoutError
from envhub.types import StepResult
from envhub.parsers import ParseStatus, parse_tool_calls
from trainer.rollout.envs import EnvPool, EnvSession
from trainer.rollout.render import ChatRenderer
from trainer.rollout.sampler import Sampler
from trainer.rollout.types import EpisodeState, GenRequest, GenResult, StopReason, Task, Trajectory
from trainer.vision import VisionProcessor


@dataclass
class RolloutConfig:
    """Limits and behaviour of one episode.

    ``max_tokens_per_turn`` goes to the sampler as its token cap; ``max_total_tokens`` is the
    trajectory's budget of sampled tokens over all turns; ``max_context_tokens`` bounds the whole
    sequence (prompt and observations included). ``tool_mode``: ``"auto"`` (tools when the env
    publishes any), ``"text"`` or ``"tools"``.
    """

    max_turns: int = 1
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 1024
    max_context_tokens: int = 4096
    max_in_flight: int = 64
    episode_timeout_s: float = 300.0
    tool_mode: str = "auto"
    stop_on_parse_error: bool = False
    max_tool_calls_per_turn: int = 4
    system_prompt: str | None = None   # used when the env sends none (or always, with use_env_system_prompt=false)
    use_env_system_prompt: bool = True

    def __post_init__(self) -> None:
        if self.tool_mode not in ("auto", "text", "tools"):
            raise ValueError(f"Expected rollout.tool_mode in auto|text|tools, got {self.tool_mode!r}.")
        for name in ("max_turns", "max_tokens_per_turn", "max_total_tokens", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"Expected rollout.{name} >= 1, got {getattr(self, name)}.")


class _Stop(Exception):
    def __init__(self, reason: StopReason, error: str | None = None):
        super().__init__(reason.value)
        self.reason, self.error = reason, error


class RolloutEngine:
    """Runs episodes against an :class:`EnvPool` with a :class:`Sampler`; ``await engine.run(tasks)``."""

    def __init__(self, pool: EnvPool, sampler: Sampler, tokenizer: Any, config: RolloutConfig | None = None, *,
                 vision: VisionProcessor | None = None):
        self.pool = pool
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.config = config or RolloutConfig()
        self.renderer = ChatRenderer(tokenizer, vision)
        self.states: dict[int, EpisodeState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        set_demand = getattr(sampler, "set_demand", None)
        if set_demand is not None:
            set_demand(self.live_episodes)

    def live_episodes(self) -> int:
        """Episodes started and not yet terminated (each will ask the sampler for a turn soon)."""
        return sum(s is not EpisodeState.TERMINATED for s in self.states.values())
    async def run(self, tasks: list[Task], *, greedy: bool = False) -> list[Trajectory]:
        """Run every task (at most ``max_in_flight`` at once); trajectories come back in task order."""
        gate = asyncio.Semaphore(self.config.max_in_flight)
        self.states = {}

        async def one(i: int, task: Task) -> Trajectory:
            async with gate:
                return await self.run_episode(task, greedy=greedy, key=i)

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    def run_sync(self, tasks: list[Task], *, greedy: bool = False) -> list[Trajectory]:
        """``run`` from synchronous code (the training loop), on the engine's own event loop so that
        env sessions stay open from one call to the next."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.run(tasks, greedy=greedy))

    def close(self) -> None:
        """Close idle env sessions and the engine's event loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self.pool.aclose())
            self._loop.close()
        self._loop = None

    async def run_episode(self, task: Task, *, greedy: bool = False, key: int = 0) -> Trajectory:
        """One episode, never raising for env trouble: the failure is the trajectory's stop reason."""
        traj = Trajectory(task=task, policy_version=self.sampler.version)
        start = time.monotonic()
        self.states[key] = EpisodeState.PENDING
        held: list[EnvSession] = []

        async def open_and_play() -> StopReason:
            held.append(await self.pool.open(task.env_url))
            return await self._play(held[0], traj, greedy, key)

        try:
            traj.stop_reason = await asyncio.wait_for(open_and_play(), self.config.episode_timeout_s)
        except _Stop as stop:
            traj.stop_reason, traj.error = stop.reason, stop.error
        except (TimeoutError, StepTimeoutError) as exc:
            traj.stop_reason, traj.error = StopReason.TIMEOUT, f"{type(exc).__name__}: {exc}"
        except (EnvHubError, ConnectionError, OSError) as exc:
            traj.stop_reason, traj.error = StopReason.ENV_ERROR, f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            traj.stop_reason = StopReason.CANCELLED
            raise
        finally:
            self.states[key] = EpisodeState.TERMINATED
            traj.elapsed_s = time.monotonic() - start
            for session in held:
                # The server may already be gone: closing its session is best effort. Anything else
                # (a bug in a custom pool) must surface, not leak sessions silently.
                with contextlib.suppress(EnvHubError, ConnectionError, OSError, TimeoutError):
                    if traj.stop_reason is not None and not traj.infra_failed:
                        await self.pool.release(session, task.env_url)
                    else:
                        await asyncio.wait_for(session.close(), 5.0)
        return traj

    async def _play(self, session: EnvSession, traj: Trajectory, greedy: bool, key: int) -> StopReason:
        cfg = self.config
        first = await session.reset(**traj.task.reset_kwargs)
        specs = await session.tools() if cfg.tool_mode != "text" else []
        use_tools = cfg.tool_mode == "tools" or (cfg.tool_mode == "auto" and bool(specs))
        tools = [s.to_openai() for s in specs] if use_tools else None
        ids, images = self.renderer.prompt(self._first_messages(first), tools)
        traj.append(ids, policy=False, images=images)
        traj.prompt_len = len(traj.tokens)
        if first.ended:
            return StopReason.DONE
        while True:
            if traj.num_turns >= cfg.max_turns:
                return StopReason.TURN_LIMIT
            budget = min(cfg.max_tokens_per_turn, cfg.max_total_tokens - traj.num_policy_tokens,
                         cfg.max_context_tokens - len(traj.tokens))
            if budget < 1:
                return StopReason.TOKEN_LIMIT
            self.states[key] = EpisodeState.GENERATING
            gen = await self.sampler.generate(GenRequest(list(traj.tokens), budget, greedy=greedy,
                                                         images=list(traj.images)))
            traj.append(gen.token_ids, policy=True, logprobs=gen.logprobs)
            traj.turn_ends.append(len(traj.tokens) - 1)
            traj.num_turns += 1
            self.states[key] = EpisodeState.INTERACTING
            result, new_messages = await self._interact(session, traj, gen, use_tools)
            traj.turn_rewards.append(result.reward)
            traj.reward += result.reward
            if result.done:
                return StopReason.DONE
            if result.truncated:
                return StopReason.TURN_LIMIT
            if gen.finish_reason == "length" and traj.num_policy_tokens >= cfg.max_total_tokens:
                return StopReason.TOKEN_LIMIT
            if traj.num_turns >= cfg.max_turns:
                return StopReason.TURN_LIMIT
            ids, images = self.renderer.observation(new_messages, tools, after_eos=gen.finish_reason == "stop")
            traj.append(ids, policy=False, images=images)

    def _first_messages(self, first: Any) -> list[dict[str, Any]]:
        obs = first.observation
        system = obs.metadata.get("system_prompt") if isinstance(obs.metadata, dict) else None
        if not self.config.use_env_system_prompt or not system:
            system = self.config.system_prompt
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": "user", "content": self._content(obs)}]

    def _content(self, obs: Any) -> Any:
        """A message content for ``obs``: its text, or its images then its text for a vision policy."""
        if not obs.images or self.renderer.vision is None:
            return obs.text
        return [*({"type": "image", "image": img} for img in obs.images), {"type": "text", "text": obs.text}]

    async def _interact(self, session: EnvSession, traj: Trajectory, gen: GenResult,
                        use_tools: bool) -> tuple[StepResult, list[dict[str, str]]]:
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        if not use_tools:
            result = await self._step(session, {"text": text}, traj)
            return result, [{"role": "user", "content": self._content(result.observation)}]
        parsed = parse_tool_calls(text, truncated=gen.finish_reason == "length")
        if parsed.status is ParseStatus.NO_CALL:
            result = await self._step(session, {"text": parsed.content}, traj)
            return result, [{"role": "user", "content": self._content(result.observation)}]
        return await self._run_tool_calls(session, traj, parsed)

    async def _run_tool_calls(self, session: EnvSession, traj: Trajectory,
                              parsed: Any) -> tuple[StepResult, list[dict[str, str]]]:
        responses: list[dict[str, str]] = []
        if parsed.status in (ParseStatus.MALFORMED, ParseStatus.TRUNCATED):
            traj.parse_errors += 1
            if self.config.stop_on_parse_error:
                raise _Stop(StopReason.PARSE_ERROR, "; ".join(parsed.errors))
            responses += [{"role": "tool", "content": f"Error: {e}"} for e in parsed.errors]
        calls = [] if parsed.status is ParseStatus.TRUNCATED else parsed.calls
        total, last = 0.0, None
        for call in calls[:self.config.max_tool_calls_per_turn]:
            traj.tool_calls += 1
            last = await self._step(session, {"tool_name": call.name, "arguments": call.arguments}, traj)
            total += last.reward
            responses.append({"role": "tool", "content": self._content(last.observation)})
            if last.ended:
                break
        last = last or StepResult()
        last.reward = total
        return last, responses

    async def _step(self, session: EnvSession, action: dict[str, Any], traj: Trajectory) -> StepResult:
        try:
            return await session.step(action)
        except (ActionValidationError, EpisodeStateError) as exc:
            # The env refused what the policy did: a policy failure, trained on with the reward so far.
            traj.parse_errors += 1
            raise _Stop(StopReason.PARSE_ERROR, str(exc)) from exc


__all__ = ["RolloutConfig", "RolloutEngine"]
