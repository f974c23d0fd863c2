"""The values that flow between an env, the wire and a client: observations, actions, step results, tools.

``Observation`` and ``Action`` are pydantic models so that envs can subclass them with typed
fields (published in ``/schema``, as OpenEnv envs do); ``StepResult``, ``ToolSpec`` and
``ToolCall`` are plain dataclasses because they are built on hot paths and never validated
from untrusted input directly.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Observation(BaseModel):
    """What an env shows the agent: text, optional PNG images, free-form metadata.

    Subclass it to add typed fields; unknown fields received from a server are kept as
    attributes, so ``obs.echoed_message`` works on a generic client.

    >>> Observation(text="Your move.").text
    'Your move.'
    """

    model_config = ConfigDict(extra="allow", ser_json_bytes="base64", val_json_bytes="base64")

    text: str = ""
    images: list[bytes] = Field(default_factory=list, description="PNG images, raw bytes")
    metadata: dict[str, Any] = Field(default_factory=dict)

    def to_wire(self, *, binary: bool = False) -> dict[str, Any]:
        """The ``observation`` object of a wire frame; images are base64 unless ``binary``."""
        data = self.model_dump(mode="python")
        if data.get("images") and not binary:
            data["images"] = [base64.b64encode(img).decode("ascii") for img in data["images"]]
        return data

    @classmethod
    def from_wire(cls, data: Any) -> Observation:
        """Read an observation from any server: envhub's, OpenEnv's typed ones, or a bare string."""
        if data is None:
            return cls()
        if isinstance(data, str):
            return cls(text=data)
        if not isinstance(data, dict):
            return cls(text=json.dumps(data, default=str))
        data = dict(data)
        images = data.get("images")
        if isinstance(images, list):
            data["images"] = [base64.b64decode(i) if isinstance(i, str) else bytes(i) for i in images]
        elif images is not None:
            data.pop("images")
        if not isinstance(data.get("metadata", {}), dict):
            data["metadata"] = {"value": data.pop("metadata")}
        if not isinstance(data.get("text", ""), str):
            data["text"] = str(data["text"])
        return cls.model_validate(data)


class Action(BaseModel):
    """The default action: free text, or one tool call.

    >>> Action(text="\\\\boxed{4}").is_tool_call
    False
    >>> Action(tool_name="guess", arguments={"number": 3}).is_tool_call
    True
    """

    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(default=None, description="free-text action (a whole assistant turn)")
    tool_name: str | None = Field(default=None, description="name of the tool to call")
    arguments: dict[str, Any] = Field(default_factory=dict, description="tool arguments")

    @model_validator(mode="after")
    def _one_kind(self) -> Action:
        if (self.text is None) == (self.tool_name is None):
            raise ValueError("Expected exactly one of 'text' or 'tool_name' in the action, "
                             f"got text={self.text!r}, tool_name={self.tool_name!r}")
        return self

    @property
    def is_tool_call(self) -> bool:
        return self.tool_name is not None


@dataclass
class StepResult:
    """The outcome of ``reset`` or ``step``.

    ``done`` means the episode ended on its own terms (terminated); ``truncated`` means a limit
    cut it short. ``info`` carries reward components (``info["rewards"]``), the running
    ``episode_reward`` and anything the env adds.
    """

    observation: Observation = field(default_factory=Observation)
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        """True when the episode is over for any reason."""
        return self.done or self.truncated

    def to_wire(self, *, binary: bool = False) -> dict[str, Any]:
        """The ``data`` of an ``observation`` frame (OpenEnv shape plus ``truncated`` and ``info``)."""
        return {
            "observation": self.observation.to_wire(binary=binary),
            "reward": self.reward,
            "done": self.done,
            "truncated": self.truncated,
            "info": self.info,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> StepResult:
        """Read the ``data`` of an observation frame from an envhub or OpenEnv server."""
        obs = Observation.from_wire(data.get("observation"))
        top_meta = data.get("metadata")
        if isinstance(top_meta, dict) and not obs.metadata:
            obs.metadata = top_meta
        info = data.get("info")
        return cls(
            observation=obs,
            reward=float(data.get("reward") or 0.0),
            done=bool(data.get("done", False)),
            truncated=bool(data.get("truncated", False)),
            info=dict(info) if isinstance(info, dict) else {},
        )


@dataclass(frozen=True)
class ToolSpec:
    """One tool as an OpenAI function: name, description, JSON-Schema parameters."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {...}}`` as the chat-completions API wants it."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def to_mcp(self) -> dict[str, Any]:
        """The MCP ``tools/list`` entry."""
        return {"name": self.name, "description": self.description, "inputSchema": self.parameters}

    @classmethod
    def from_openai(cls, spec: dict[str, Any]) -> ToolSpec:
        """Accept the OpenAI shape, the bare function object, or an MCP entry."""
        fn = spec.get("function", spec)
        params = fn.get("parameters") or fn.get("inputSchema") or fn.get("input_schema") \
            or {"type": "object", "properties": {}}
        return cls(name=str(fn.get("name", "env_action")), description=str(fn.get("description") or ""),
                   parameters=dict(params))


@dataclass
class ToolCall:
    """A parsed call: arguments are always a dict here; they become a JSON string only at the OpenAI boundary."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id or f"call_{abs(hash((self.name, json.dumps(self.arguments, sort_keys=True, default=str)))) % 10**12}",
                "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


class Outcome(str, Enum):
    """How a competitive episode ended for the seat that played it: ``info["outcome"]`` of the final step.

    An env keeps its own vocabulary in ``info["end_reason"]`` (gomoku's ``too_many_invalid``,
    ``opponent_forfeit``...) and maps it to one of these, so a trainer counts wins, losses and
    draws, and tells a match cut short by a disconnect or a timeout from a lost one, without
    knowing any env's end reasons. The values are plain strings on the wire.

    >>> Outcome("win") is Outcome.WIN, Outcome.TIMED_OUT.value
    (True, 'timed_out')
    """

    WIN = "win"
    LOSS = "loss"
    DRAW = "draw"
    #: ended outside the game: a player disconnected (not a policy outcome)
    DISCONNECTED = "disconnected"
    #: ended outside the game: a player did not move in time (not a policy outcome)
    TIMED_OUT = "timed_out"

    @classmethod
    def of(cls, info: dict[str, Any]) -> Outcome | None:
        """The outcome an ``info`` dict carries, or None (no outcome, or a value this version does not know)."""
        try:
            return cls(info.get("outcome"))
        except ValueError:
            return None


def add_named_numbers(into: dict[str, float], numbers: object, *, limit: int = 32, name_chars: int = 100) -> None:
    """Sum one step's named numbers (``info["rewards"]``: reward components; ``info["stats"]``: statistics an
    env reports for the logs) into an episode's ``into``. At most ``limit`` names and ``name_chars`` characters
    of each are kept, so an env sending unbounded names cannot grow a client's records without end; a value
    that is not a finite number (a string, a bool, NaN) is skipped, as is ``numbers`` when it is not a dict.

    >>> totals = {}
    >>> add_named_numbers(totals, {"win_chances": 1, "note": "x", "nan": float("nan")})
    >>> add_named_numbers(totals, {"win_chances": 1, "wins_missed": 1}, limit=2)
    >>> totals
    {'win_chances': 2.0, 'wins_missed': 1.0}
    """
    if not isinstance(numbers, dict):
        return
    for name, value in numbers.items():
        key = str(name)[:name_chars]
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                or (key not in into and len(into) >= limit)):
            continue
        into[key] = into.get(key, 0.0) + float(value)
