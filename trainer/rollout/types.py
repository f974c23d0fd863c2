"""What a rollout produces: trajectories with exact token ids, masks, log-probs, rewards and a stop reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from envhub.types import add_named_numbers

MAX_REWARD_COMPONENTS = 32  # named reward components kept per episode
MAX_STATS = 32              # named env statistics (``info["stats"]``) kept per episode
MAX_INFO_TEXT = 100         # characters kept of an env's ``outcome``, ``end_reason`` and component names


class EpisodeState(str, enum.Enum):
    """The rollout state machine: PENDING -> GENERATING -> INTERACTING -> ... -> TERMINATED."""

    PENDING = "pending"          # not connected / not reset yet
    GENERATING = "generating"    # waiting for the sampler
    INTERACTING = "interacting"  # waiting for the env (a step or tool calls)
    TERMINATED = "terminated"


class StopReason(str, enum.Enum):
    """Why a trajectory stopped. The last three are infrastructure failures, excluded from the loss."""

    DONE = "done"                  # the env ended the episode
    TURN_LIMIT = "turn_limit"      # the engine's or the env's turn limit
    TOKEN_LIMIT = "token_limit"    # the trajectory's total token budget (or the context) ran out
    PARSE_ERROR = "parse_error"    # a malformed tool call / an action the env rejected, with stop_on_parse_error
    ENV_ERROR = "env_error"        # the env server was unreachable, dropped, or crashed
    TIMEOUT = "timeout"            # the episode ran past its deadline
    CANCELLED = "cancelled"        # the run was interrupted

    @property
    def is_infra_failure(self) -> bool:
        return self in (StopReason.ENV_ERROR, StopReason.TIMEOUT, StopReason.CANCELLED)


@dataclass
class Task:
    """One episode to run: the env's reset arguments and the group it belongs to."""

    reset_kwargs: dict[str, Any]
    group_id: int = 0
    env_url: str | None = None


@dataclass
class Trajectory:
    """One episode as the trainer sees it.

    ``tokens`` is the whole conversation as the policy saw it; ``mask[i] == 1`` exactly on the ids
    the sampler produced (whose sampler log-probs are ``logprobs[i]``; 0.0 elsewhere). ``turn_ends[t]``
    is the index of the last policy token of turn ``t``, where ``turn_rewards[t]`` belongs, and
    ``turn_versions[t]`` the policy version that sampled that turn (``policy_version``: the version when
    the episode started; asynchronous rollouts may see later versions in later turns).
    ``images`` are the :class:`~trainer.vision.ImageFeatures` behind the image placeholder ids of
    ``tokens`` (mask 0), in order; empty for a text-only policy.

    With a history window (``rollout.history_turns``) each turn after the first is prompted afresh, so
    ``tokens`` is a run of sequences, one per turn: ``segment_starts`` holds where each one after the
    first begins (in ``tokens``, and in ``images`` for the images it shows); empty, one sequence.
    :meth:`segments` lists them; each trains as a row of its own.
    """

    task: Task
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    stop_reason: StopReason | None = None
    policy_version: int = 0
    num_turns: int = 0
    parse_errors: int = 0
    tool_calls: int = 0
    error: str | None = None
    elapsed_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)
    failure: str | None = None          # the first failure: parse_error | validation_error | env_error | timeout
    failure_message: str | None = None  # ... and what it said
    failed_turns: int = 0               # turns whose reply was malformed or refused by the env
    reward_components: dict[str, float] = field(default_factory=dict)  # the env's named rewards, summed over steps
    stats: dict[str, float] = field(default_factory=dict)  # the env's ``info["stats"]``, summed over steps
    segment_starts: list[tuple[int, int]] = field(default_factory=list)  # (token, image) index of each later sequence

    @property
    def group_id(self) -> int:
        return self.task.group_id

    @property
    def infra_failed(self) -> bool:
        """True when the env side failed: the trajectory says nothing about the policy."""
        return self.stop_reason is not None and self.stop_reason.is_infra_failure

    @property
    def failed(self) -> bool:
        """True when the episode taught nothing about the task: it stopped on a parse, validation or env
        error, or every turn it played was a malformed or refused action."""
        if self.stop_reason in (StopReason.PARSE_ERROR, StopReason.ENV_ERROR, StopReason.TIMEOUT):
            return True
        return self.num_turns > 0 and self.failed_turns >= self.num_turns

    def note_failure(self, kind: str, message: str) -> None:
        """Record a failed turn (or a failed episode); the first failure's kind and message are kept."""
        if kind in ("parse_error", "validation_error"):
            self.failed_turns += 1
        if self.failure is None:
            self.failure, self.failure_message = kind, message

    def note_step(self, info: dict[str, Any]) -> None:
        """Keep what one env step's ``info`` says about the episode: its named reward components
        (``info["rewards"]``) and statistics (``info["stats"]``, numbers the env reports for the logs, such as
        gomoku's missed wins), each summed over the steps (a non-numeric value is skipped), and, once the
        episode ends, ``outcome`` / ``end_reason`` (:class:`envhub.types.Outcome`)."""
        add_named_numbers(self.reward_components, info.get("rewards"), limit=MAX_REWARD_COMPONENTS,
                          name_chars=MAX_INFO_TEXT)
        add_named_numbers(self.stats, info.get("stats"), limit=MAX_STATS, name_chars=MAX_INFO_TEXT)
        for key in ("outcome", "end_reason"):
            if isinstance(info.get(key), str):
                self.info[key] = info[key][:MAX_INFO_TEXT]

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.mask)

    def new_segment(self) -> None:
        """Start the next sequence here: what is appended from now on is prompted without what came before."""
        self.segment_starts.append((len(self.tokens), len(self.images)))

    def segments(self) -> list[tuple[slice, slice]]:
        """``(tokens slice, images slice)`` of each sequence, in order: one for a whole conversation.

        >>> t = Trajectory(task=Task({}), tokens=[1, 2, 3, 4, 5])
        >>> t.segment_starts = [(3, 0)]
        >>> [(s.start, s.stop) for s, _ in t.segments()]
        [(0, 3), (3, 5)]
        """
        starts = [(0, 0), *self.segment_starts]
        ends = [*self.segment_starts, (len(self.tokens), len(self.images))]
        return [(slice(a, b), slice(i, j)) for (a, i), (b, j) in zip(starts, ends)]

    @property
    def oldest_version(self) -> int:
        """The oldest policy version behind any of this trajectory's turns (what staleness is measured from)."""
        return min(self.turn_versions, default=self.policy_version)

    def append(self, ids: list[int], *, policy: bool, logprobs: list[float] | None = None,
               images: list[Any] | None = None) -> None:
        """Append ids: policy ids carry their sampler log-probs and mask 1; others mask 0 (with the
        images behind their placeholders, if any)."""
        if images and policy:
            raise ValueError("Expected images only with observation ids (mask 0), never with sampled ones.")
        self.images.extend(images or ())
        self.tokens.extend(ids)
        self.mask.extend([1 if policy else 0] * len(ids))
        if policy:
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError(f"Expected one log-prob per sampled id, got {None if logprobs is None else len(logprobs)} "
                                 f"for {len(ids)} ids.")
            self.logprobs.extend(float(x) for x in logprobs)
        else:
            self.logprobs.extend([0.0] * len(ids))

    def to_record(self, tokenizer: Any = None) -> dict[str, Any]:
        """A JSON-ready record for the trajectories log (decoded text when a tokenizer is given)."""
        rec = {"group_id": self.group_id, "task": self.task.reset_kwargs, "reward": self.reward,
               "turn_rewards": self.turn_rewards, "stop_reason": self.stop_reason.value if self.stop_reason else None,
               "policy_version": self.policy_version, "turn_versions": self.turn_versions,
               "num_turns": self.num_turns, "prompt_len": self.prompt_len,
               "parse_errors": self.parse_errors, "error": self.error, "failure": self.failure,
               "failure_message": self.failure_message, "tokens": self.tokens, "mask": self.mask,
               "logprobs": [round(x, 5) for x in self.logprobs],
               "images": [list(f.grid_thw) for f in self.images], "reward_components": self.reward_components,
               "stats": self.stats, "outcome": self.info.get("outcome")}
        if self.segment_starts:
            rec["segment_starts"] = [start for start, _ in self.segment_starts]
        if tokenizer is not None:
            rec["text"] = tokenizer.decode(self.tokens)
            rec["completion"] = tokenizer.decode([t for t, m in zip(self.tokens, self.mask) if m])
            rec["segments"] = self.mask_segments(tokenizer)
        return rec

    def mask_segments(self, tokenizer: Any) -> list[list[Any]]:
        """``[[text, mask, n_tokens], ...]``: each run of equal mask decoded on its own, so a reader (``envhub
        view``) shows which text the loss trains on without the tokenizer."""
        segments: list[list[Any]] = []
        start = 0
        for end in range(1, len(self.tokens) + 1):
            if end == len(self.tokens) or self.mask[end] != self.mask[start]:
                segments.append([tokenizer.decode(self.tokens[start:end]), self.mask[start], end - start])
                start = end
        return segments



__all__ = ["EpisodeState", "StopReason", "Task", "Trajectory"]
