"""The async rollout engine: many multi-turn episodes in flight, exact token ids and masks, a stop reason each.

Per episode, the state machine PENDING -> GENERATING -> INTERACTING -> ... -> TERMINATED:

- PENDING: open a session (retrying a refused connection), ``reset`` with the task's arguments,
  render the agent's first messages (+ the env's and the client-side tools) with the chat
  template: prompt ids, mask 0.
- GENERATING: ask the sampler for at most ``min(max_tokens_per_turn, budget left)`` tokens; its
  ids and log-probs are appended as they are, mask 1. Concurrent episodes share batched calls.
- INTERACTING: the agent (:mod:`trainer.rollout.agents`) decides what the turn means: a text
  action ``{"text": turn}``, or tool calls (parsed by the agent's tool-call parser) run against
  the env one after another and client-side tools concurrently; the agent says how the results
  are shown. Their ids come from a fixed-base render (mask 0), never from re-tokenising the chat.
  Observations are read with the ``OpenEnv`` client's extraction (typed fields, dicts, text) and
  actions reach a third-party env through the pool's action mapper.
- TERMINATED with a :class:`StopReason`: done, turn limit, token limit, parse error (policy
  failures, trained on), or env error / timeout (infrastructure, excluded from the loss).

Observation images (``Observation.images``, PNG bytes) reach a vision-language policy: with a
:class:`~trainer.vision.VisionProcessor` the user or tool message becomes ``[image parts..., text]``,
the placeholders are expanded to each image's token count (mask 0) and the images travel with the
trajectory to the sampler and the loss. A text-only policy sees the text alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from envhub.errors import ActionValidationError, EnvHubError, EpisodeStateError, StepTimeoutError
from envhub.function_tool import FunctionTool
from envhub.registry import import_target
from envhub.tool_parsers import get_tool_parser
from envhub.types import StepResult, ToolCall
from trainer.rollout.agents import Agent, Decision, ToolResult, load_agent_class
from trainer.rollout.envs import EnvPool, EnvSession
from trainer.rollout.render import ChatRenderer
from trainer.rollout.types import EpisodeState, StopReason, Task, Trajectory
from trainer.sampling import GenRequest, Sampler
from trainer.vision import VisionProcessor

_T = TypeVar("_T")


@dataclass
class RolloutConfig:
    """Limits and behaviour of one episode.

    ``max_tokens_per_turn`` goes to the sampler as its token cap; ``max_total_tokens`` is the
    trajectory's budget of sampled tokens over all turns; ``max_context_tokens`` bounds the whole
    sequence (prompt and observations included). ``tool_mode``: ``"auto"`` (tools when the env
    publishes any), ``"text"`` or ``"tools"``. ``agent``: ``auto`` | ``answer`` | ``tools`` |
    ``"package.module:Class"`` (see :mod:`trainer.rollout.agents`), built with ``agent_kwargs``;
    ``tool_parser``: a registered parser name, ``auto`` (from the model's name) or ``module:function``;
    ``client_tools``: ``"module:function"`` names of Python functions run as tools next to the env's.
    From Python, ``agent`` may be an :class:`~trainer.rollout.agents.Agent` subclass and
    ``client_tools`` may hold the functions themselves.
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
    agent: str = "auto"
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_parser: str = "auto"
    client_tools: list[str] = field(default_factory=list)
    # asynchronous rollouts (trainer.rollout.stream): how many policy versions a batch's generation may
    # run ahead of training (0: synchronous, each batch sampled by the newest weights), and how many
    # groups may be in flight at once (0: every group of the batches the staleness bound allows)
    max_staleness: int = 0
    max_open_groups: int = 0
    # None: every turn sees the whole conversation (one growing sequence); k >= 0: each turn after the first
    # is prompted afresh with the system messages, the last k turns and the newest observation (Agent.window),
    # for envs whose observation holds the state (a board): a short context, and the policy reads the state
    # alone; each turn then trains as a sequence of its own
    history_turns: int | None = None

    def __post_init__(self) -> None:
        if self.tool_mode not in ("auto", "text", "tools"):
            raise ValueError(f"Expected rollout.tool_mode in auto|text|tools, got {self.tool_mode!r}.")
        load_agent_class(self.agent)  # fail at load time, with the fix, not in the first episode
        get_tool_parser(self.tool_parser)
        for name in ("max_turns", "max_tokens_per_turn", "max_total_tokens", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"Expected rollout.{name} >= 1, got {getattr(self, name)}.")
        for name in ("max_staleness", "max_open_groups"):
            if getattr(self, name) < 0:
                raise ValueError(f"Expected rollout.{name} >= 0, got {getattr(self, name)}.")
        if self.history_turns is not None and (isinstance(self.history_turns, bool)
                                               or not isinstance(self.history_turns, int) or self.history_turns < 0):
            raise ValueError(f"Expected rollout.history_turns to be unset (the whole conversation) or an integer "
                             f">= 0, got {self.history_turns!r}.")


class _Stop(Exception):
    def __init__(self, reason: StopReason, error: str | None = None):
        super().__init__(reason.value)
        self.reason, self.error = reason, error


class RolloutEngine:
    """Runs episodes against an :class:`EnvPool` with a :class:`Sampler`; ``await engine.run(tasks)``.

    ``agent``: an :class:`Agent` subclass or a factory of agents (default: ``config.agent``), one per
    episode. ``client_tools``: Python functions (or :class:`FunctionTool` s) run as tools next to the
    env's, added to ``config.client_tools``. ``model_name`` picks the tool parser when
    ``config.tool_parser == "auto"``. ``renderer``: a :class:`ChatRenderer`-like object (a
    vision-language one sets ``supports_images`` and agents then send image parts).
    """

    def __init__(self, pool: EnvPool, sampler: Sampler, tokenizer: Any, config: RolloutConfig | None = None, *,
                 agent: type[Agent] | Callable[[], Agent] | None = None,
                 client_tools: list[Callable[..., Any] | FunctionTool] | None = None,
                 model_name: str | None = None, renderer: Any = None, vision: VisionProcessor | None = None):
        self.pool = pool
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.config = config or RolloutConfig()
        self.renderer = renderer or ChatRenderer(tokenizer, vision)
        self.model_name = model_name
        self.agent_factory = agent or load_agent_class(self.config.agent)
        tools = [*(load_function(n) if isinstance(n, str) else n for n in self.config.client_tools),
                 *(client_tools or [])]
        self.client_tools: dict[str, FunctionTool] = {}
        for t in (t if isinstance(t, FunctionTool) else FunctionTool(t) for t in tools):
            if t.name in self.client_tools:
                raise ValueError(f"Two client-side tools are named {t.name!r}; tool names must be unique.")
            self.client_tools[t.name] = t
        self.states: dict[int, EpisodeState] = {}
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._gate: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None  # run_bounded's, per loop
        set_demand = getattr(sampler, "set_demand", None)
        if set_demand is not None:
            set_demand(self.live_episodes)

    def live_episodes(self) -> int:
        """Episodes started and not yet terminated (each will ask the sampler for a turn soon)."""
        return sum(s is not EpisodeState.TERMINATED for s in self.states.values())
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop episodes run on (None before the first run)."""
        return self._loop

    def new_key(self) -> int:
        """A fresh episode key (the live-episode count of concurrent ``run`` calls stays right)."""
        return next(self._keys)

    async def run(self, tasks: list[Task], *, greedy: bool = False) -> list[Trajectory]:
        """Run every task (at most ``max_in_flight`` at once); trajectories come back in task order."""
        keys = [self.new_key() for _ in tasks]
        try:
            return list(await asyncio.gather(*(self.run_bounded(t, greedy=greedy, key=k) for k, t in zip(keys, tasks))))
        finally:
            for k in keys:
                self.states.pop(k, None)

    async def run_bounded(self, task: Task, *, greedy: bool = False, key: int | None = None) -> Trajectory:
        """``run_episode`` under the engine's one episode bound: at most ``config.max_in_flight`` episodes run at
        once over every caller (``run``, an evaluation, a :class:`RolloutStream` sampling batches ahead), so
        env sessions never outnumber it, whatever overlaps."""
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate[0] is not loop:
            self._gate = (loop, asyncio.Semaphore(self.config.max_in_flight))
        async with self._gate[1]:
            return await self.run_episode(task, greedy=greedy, key=key)

    def run_sync(self, tasks: list[Task], *, greedy: bool = False) -> list[Trajectory]:
        """``run`` from synchronous code (the training loop), on the engine's own event loop so that
        env sessions stay open from one call to the next (in the background thread once one runs it)."""
        if self._thread is not None:
            return self.submit(self.run(tasks, greedy=greedy)).result()
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.run(tasks, greedy=greedy))

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Run ``coro`` on the engine's event loop in a background thread (started on first use), so
        episodes go on while the caller trains (asynchronous rollouts)."""
        loop = self._loop
        if self._thread is None:
            if loop is None or loop.is_closed():
                loop = self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=loop.run_forever, name="envhub-rollouts", daemon=True)
            self._thread.start()
        assert loop is not None  # the background thread runs this loop until close()
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def close(self) -> None:
        """Close idle env sessions and the engine's event loop (stopping its background thread)."""
        if self._loop is not None and not self._loop.is_closed():
            if self._thread is not None:
                with contextlib.suppress(Exception):
                    self.submit(self.pool.aclose()).result(timeout=30)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
                self._thread = None
            else:
                self._loop.run_until_complete(self.pool.aclose())
            self._loop.close()
        self._loop = None

    async def run_episode(self, task: Task, *, greedy: bool = False, key: int | None = None) -> Trajectory:
        """One episode, never raising for env trouble: the failure is the trajectory's stop reason.

        ``key`` names the episode in :attr:`states` (the caller forgets it); without one the episode
        takes a fresh key, forgotten when it ends, so concurrent keyless episodes each count as live.
        """
        own_key = key is None
        if key is None:
            key = self.new_key()
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
            traj.note_failure("timeout", traj.error)
        except (EnvHubError, ConnectionError, OSError) as exc:
            traj.stop_reason, traj.error = StopReason.ENV_ERROR, f"{type(exc).__name__}: {exc}"
            traj.note_failure("env_error", traj.error)
        except asyncio.CancelledError:
            traj.stop_reason = StopReason.CANCELLED
            raise
        finally:
            if own_key:
                self.states.pop(key, None)
            else:
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

    def new_agent(self) -> Agent:
        """A fresh agent for one episode (``rollout.agent``, or the ``agent`` given to the engine)."""
        cfg, factory = self.config, self.agent_factory
        if isinstance(factory, type) and issubclass(factory, Agent):
            return factory(system_prompt=cfg.system_prompt, use_env_system_prompt=cfg.use_env_system_prompt,
                           tool_mode=cfg.tool_mode, tool_parser=cfg.tool_parser, model_name=self.model_name,
                           images=bool(getattr(self.renderer, "supports_images", False)), **cfg.agent_kwargs)
        agent = factory()
        if not isinstance(agent, Agent):
            raise TypeError(f"Expected the agent factory to return an Agent, got {type(agent).__name__}.")
        return agent

    async def _play(self, session: EnvSession, traj: Trajectory, greedy: bool, key: int) -> StopReason:
        cfg = self.config
        agent = self.new_agent()
        first = await session.reset(**traj.task.reset_kwargs)
        specs = await session.tools() if cfg.tool_mode != "text" else []
        clashes = sorted({s.name for s in specs} & set(self.client_tools))
        if clashes:
            raise ValueError(f"Client-side tools {clashes} have the names of env tools; rename them.")
        agent.tools = tools = agent.tool_schemas([*specs, *(t.spec for t in self.client_tools.values())])
        messages = agent.initial_messages(first.observation)
        if not messages:
            raise ValueError(f"{type(agent).__name__}.initial_messages() returned no messages: the model "
                             "would be prompted with nothing.")
        agent.history.extend(messages)
        ids, images = self.renderer.prompt(messages, tools)
        traj.append(ids, policy=False, images=images)
        traj.prompt_len = len(traj.tokens)
        traj.reward += first.reward  # the reset's reward: an episode over before its first turn has its end here
        traj.note_step(first.info or {})
        if first.ended:
            return StopReason.TURN_LIMIT if first.truncated and not first.done else StopReason.DONE
        while True:
            if traj.num_turns >= cfg.max_turns:
                return StopReason.TURN_LIMIT
            context, context_images = traj.segments()[-1]  # the whole conversation, or this turn's window
            budget = min(cfg.max_tokens_per_turn, cfg.max_total_tokens - traj.num_policy_tokens,
                         cfg.max_context_tokens - (len(traj.tokens) - context.start))
            if budget < 1:
                return StopReason.TOKEN_LIMIT
            self.states[key] = EpisodeState.GENERATING
            gen = await self.sampler.generate(GenRequest(traj.tokens[context], budget, greedy=greedy,
                                                         images=traj.images[context_images]))
            traj.append(gen.tokens, policy=True, logprobs=gen.logprobs)
            traj.turn_ends.append(len(traj.tokens) - 1)
            traj.turn_versions.append(gen.version)
            traj.num_turns += 1
            self.states[key] = EpisodeState.INTERACTING
            reply = self._decode(gen.tokens, getattr(agent.parse_tool_calls, "markers", ()))
            agent.history.append({"role": "assistant", "content": reply})
            decision = agent.decide(reply, truncated=gen.stop_reason == "length")
            if not isinstance(decision, Decision):
                raise TypeError(f"Expected {type(agent).__name__}.decide() to return a Decision, got "
                                f"{type(decision).__name__}.")
            result, new_messages = await self._interact(session, traj, agent, decision)
            agent.history.extend(new_messages)
            traj.turn_rewards.append(result.reward)
            traj.reward += result.reward
            if result.done:
                return StopReason.DONE
            if result.truncated:
                return StopReason.TURN_LIMIT
            if gen.stop_reason == "length" and traj.num_policy_tokens >= cfg.max_total_tokens:
                return StopReason.TOKEN_LIMIT
            if traj.num_turns >= cfg.max_turns:
                return StopReason.TURN_LIMIT
            if cfg.history_turns is None:
                ids, images = self.renderer.observation(new_messages, tools, after_eos=gen.stop_reason == "stop")
            else:  # the next turn is prompted afresh with the agent's window of the conversation
                window = agent.window(cfg.history_turns)
                if not window:
                    raise ValueError(f"{type(agent).__name__}.window() returned no messages: the model would be "
                                     "prompted with nothing.")
                ids, images = self.renderer.prompt(window, tools)
                traj.new_segment()
            traj.append(ids, policy=False, images=images)

    def _decode(self, ids: list[int], markers: tuple[str, ...]) -> str:
        """The reply's text without special tokens, except the tool-call format's own markers."""
        tok = self.tokenizer
        if not markers:
            text: str = tok.decode(ids, skip_special_tokens=True)
            return text
        keep = {tok.convert_tokens_to_ids(m) for m in markers} - {tok.unk_token_id, None}
        special = set(tok.all_special_ids) - keep
        text = tok.decode([i for i in ids if i not in special], skip_special_tokens=False)
        return text

    async def _interact(self, session: EnvSession, traj: Trajectory, agent: Agent,
                        decision: Decision) -> tuple[StepResult, list[dict[str, Any]]]:
        if decision.errors:
            traj.parse_errors += 1
            traj.note_failure("parse_error", decision.errors[0])
            if self.config.stop_on_parse_error:
                raise _Stop(StopReason.PARSE_ERROR, "; ".join(decision.errors))
        if decision.text is not None and not decision.tool_calls and not decision.errors:
            result = await self._step(session, {"text": decision.text}, traj)
            return result, agent.observation_messages(result.observation)
        errors = [ToolResult("", f"Error: {e}", error=True) for e in decision.errors]
        results, steps = await self._run_tool_calls(session, traj, decision.tool_calls)
        last = steps[-1] if steps else StepResult()
        last.reward = sum(r.reward for r in steps)
        return last, agent.tool_messages(errors + results)

    async def _run_tool_calls(self, session: EnvSession, traj: Trajectory,
                              calls: list[ToolCall]) -> tuple[list[ToolResult], list[StepResult]]:
        """Env calls one after another in call order (they share the session; none after the episode
        ends), client-side calls concurrently with them; results in call order."""
        env_turn = asyncio.Lock()
        steps: list[StepResult] = []
        failed: list[BaseException] = []  # an env call that raised ends the turn for the calls queued after it

        async def run(call: ToolCall) -> ToolResult:
            traj.tool_calls += 1
            local = self.client_tools.get(call.name)
            if local is not None:
                try:
                    return ToolResult(call.name, await local.acall(**call.arguments))
                except Exception as exc:  # the model's mistake or the tool's bug: the model reads it
                    return ToolResult(call.name, f"Error: tool {call.name!r} raised {type(exc).__name__}: {exc}",
                                      error=True)
            async with env_turn:
                if failed or (steps and steps[-1].ended):
                    return ToolResult(call.name, "Error: the episode ended before this call.", error=True)
                try:
                    result = await self._step(session, {"tool_name": call.name, "arguments": call.arguments}, traj)
                except BaseException as exc:
                    failed.append(exc)
                    raise
                steps.append(result)
                obs = result.observation
                return ToolResult(call.name, Agent.text_of(obs), list(getattr(obs, "images", None) or []))

        results = await asyncio.gather(*(run(c) for c in calls[:self.config.max_tool_calls_per_turn]))
        return list(results), steps

    async def _step(self, session: EnvSession, action: dict[str, Any], traj: Trajectory) -> StepResult:
        try:
            result = await session.step(action)
        except (ActionValidationError, EpisodeStateError) as exc:
            # The env refused what the policy did: a policy failure, trained on with the reward so far.
            traj.parse_errors += 1
            traj.note_failure("validation_error", str(exc))
            raise _Stop(StopReason.PARSE_ERROR, str(exc)) from exc
        traj.note_step(result.info or {})
        return result


def load_function(path: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (client-side tools named in a config)."""
    fn: object = import_target(path, expected="a client-side tool like 'my_pkg.tools:lookup'")
    if not callable(fn):
        raise ValueError(f"Expected {path!r} to name a function, got {fn!r}.")
    return fn


__all__ = ["RolloutConfig", "RolloutEngine", "load_function"]
