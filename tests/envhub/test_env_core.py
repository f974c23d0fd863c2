"""The env SDK core: Env/EnvRunner semantics, @tool schemas, @reward components, wire types and codec."""

import asyncio
import base64
import json
from typing import Annotated, Literal

import msgpack
import pytest
from pydantic import BaseModel, ConfigDict

from envhub import _wire
from envhub.env import Env, EnvRunner
from envhub.errors import (
    ActionValidationError,
    EnvDefinitionError,
    EnvExecutionError,
    EpisodeStateError,
    ErrorCode,
    MessageTooLargeError,
    ProtocolError,
    error_for_code,
)
from envhub.tools import reward, tool
from envhub.types import Action, Observation, StepResult, ToolCall, ToolSpec


class Counter(Env):
    """Count up to a target.

    Longer description for the readme.
    """

    max_steps = 3

    def reset(self, seed=None, target: int = 2):
        self.target, self.value = target, 0
        return f"count to {target}; roll {self.rng.randint(0, 10**6)}"

    @tool
    def add(self, amount: Annotated[int, "how much to add"], note: str = "") -> str:
        """Add to the counter.

        Args:
            note: free text, ignored
        """
        self.value += amount
        if self.value >= self.target:
            self.done = True
        return f"value={self.value}"

    @tool(name="explode")
    def _explode(self) -> str:
        """Raise."""
        raise ValueError("kaboom")

    @tool
    async def add_async(self, amount: int) -> str:
        """Async add."""
        await asyncio.sleep(0)
        self.value += amount
        return f"value={self.value}"

    @reward(weight=2.0)
    def reached(self) -> float:
        return float(self.value >= self.target)

    @reward(name="effort")
    def step_cost(self) -> float:
        return -0.1


def run(coro):
    return asyncio.run(coro)


async def started(env_cls=Counter, **reset_kwargs) -> EnvRunner:
    runner = EnvRunner(env_cls())
    await runner.reset(**reset_kwargs)
    return runner


# -- tools and rewards -----------------------------------------------------------------------------
def test_tool_schema_from_annotated_docstring_and_defaults():
    specs = {s.name: s for s in Counter.tools()}
    assert set(specs) == {"add", "explode", "add_async"}
    add = specs["add"]
    assert add.description == "Add to the counter."
    props = add.parameters["properties"]
    assert props["amount"] == {"type": "integer", "description": "how much to add"}
    assert props["note"]["description"] == "free text, ignored" and props["note"]["default"] == ""
    assert add.parameters["required"] == ["amount"] and add.parameters["additionalProperties"] is False
    assert Counter.reward_components() == {"reached": 2.0, "effort": 1.0}


@pytest.mark.parametrize("name", ["reset", "step", "state", "close"])
def test_reserved_names_cannot_be_tools(name):
    with pytest.raises(EnvDefinitionError, match="reserved"):
        tool(name=name)(lambda self: "x")


def test_reserved_method_decorated_as_tool_is_rejected():
    with pytest.raises(EnvDefinitionError):
        class Bad(Env):
            @tool(name="shutdown")  # a fine tool name, but the method is the reserved close()
            def close(self) -> None:
                """Nope."""


@pytest.mark.parametrize("make", [
    lambda: tool(lambda self, x: x),                         # no type hint
    lambda: tool(lambda self, *args: 1),                     # *args
    lambda: tool(name="has space")(lambda self: 1),          # invalid name
    lambda: reward(lambda self, x: 1.0),                     # reward with arguments
])
def test_malformed_definitions_raise(make):
    with pytest.raises(EnvDefinitionError):
        make()


def test_custom_action_model_must_be_pydantic():
    with pytest.raises(EnvDefinitionError, match="action_model"):
        class Bad(Env):
            action_model = dict  # type: ignore[assignment]


def test_metadata_from_docstring():
    meta = Counter.metadata()
    assert meta["name"] == "Counter" and meta["description"] == "Count up to a target."
    assert "Longer description" in meta["readme_content"]


# -- runner semantics ------------------------------------------------------------------------------
def test_seeding_is_reproducible_per_instance():
    async def first_text(seed):
        return (await EnvRunner(Counter()).reset(seed=seed)).observation.text
    assert run(first_text(5)) == run(first_text(5))
    assert run(first_text(5)) != run(first_text(6))
    assert run(first_text(-5)) == run(first_text(-5)) != run(first_text(5))  # random.Random(-5) is random.Random(5)


def test_step_rewards_components_and_episode_bookkeeping():
    async def go():
        r = await started(target=3)
        s1 = await r.step({"tool_name": "add", "arguments": {"amount": 1}})
        s2 = await r.step({"tool_name": "add", "arguments": {"amount": 2}})
        return r, s1, s2
    r, s1, s2 = run(go())
    assert s1.observation.text == "value=1" and s1.reward == pytest.approx(-0.1)
    assert s1.info["rewards"] == {"reached": 0.0, "effort": -0.1}
    assert s2.done and s2.reward == pytest.approx(2.0 - 0.1)
    assert s2.info["episode_reward"] == pytest.approx(1.8) and s2.info["step_count"] == 2
    state = run(r.state())
    assert state["step_count"] == 2 and state["done"] is True


def test_max_steps_truncates_without_terminating():
    async def go():
        r = await started(target=100)
        return [await r.step({"tool_name": "add", "arguments": {"amount": 1}}) for _ in range(3)]
    results = run(go())
    assert [(x.done, x.truncated) for x in results] == [(False, False), (False, False), (False, True)]


def test_step_before_reset_and_after_end():
    async def go():
        r = EnvRunner(Counter())
        with pytest.raises(EpisodeStateError) as before:
            await r.step({"tool_name": "add", "arguments": {"amount": 1}})
        await r.reset(target=1)
        await r.step({"tool_name": "add", "arguments": {"amount": 1}})
        with pytest.raises(EpisodeStateError) as after:
            await r.step({"tool_name": "add", "arguments": {"amount": 1}})
        return before.value.code, after.value.code
    assert run(go()) == (ErrorCode.EPISODE_NOT_STARTED, ErrorCode.EPISODE_ENDED)


def test_reset_unknown_kwargs_and_bad_seed():
    with pytest.raises(ActionValidationError, match="difficulty") as exc:
        run(started(difficulty="hard"))
    assert "target" in str(exc.value)  # names what it accepts
    with pytest.raises(ActionValidationError, match="seed"):
        run(started(seed="abc"))


@pytest.mark.parametrize("action,needle", [
    ({"tool_name": "add", "arguments": {"amount": "many"}}, "invalid arguments for tool 'add'"),
    ({"tool_name": "add", "arguments": {}}, "amount"),
    ({"tool_name": "nope", "arguments": {}}, "unknown tool 'nope'"),
    ({"tool_name": "explode", "arguments": {}}, "raised ValueError: kaboom"),
])
def test_tool_mistakes_are_observations_not_crashes(action, needle):
    async def go():
        r = await started()
        return await r.step(action), r
    result, runner = run(go())
    assert needle in result.observation.text and result.observation.text.startswith("Error")
    assert not result.ended and "tool_error" in result.info


@pytest.mark.parametrize("action", [[1, 2], {"bogus": 1}, {"text": "a", "tool_name": "add"}, {}])
def test_malformed_actions_are_validation_errors(action):
    async def go():
        r = await started()
        await r.step(action)
    with pytest.raises(ActionValidationError):
        run(go())


def test_free_text_to_a_tool_only_env_names_the_tools():
    async def go():
        r = await started()
        await r.step({"text": "hello"})
    with pytest.raises(ActionValidationError, match="add"):
        run(go())


def test_async_tool_and_async_reward_path():
    async def go():
        r = await started(target=5)
        return await r.step({"tool_name": "add_async", "arguments": {"amount": 2}})
    assert run(go()).observation.text == "value=2"


class Crashy(Env):
    def reset(self, seed=None):
        return Observation(text="hi")

    def step(self, action):
        raise RuntimeError("env bug")


def test_env_crash_is_execution_error():
    async def go():
        r = await started(Crashy)
        await r.step({"text": "x"})
    with pytest.raises(EnvExecutionError, match="env bug"):
        run(go())


class Move(BaseModel):
    model_config = ConfigDict(extra="forbid")
    row: int
    col: int
    kind: Literal["stone"] = "stone"


class Board(Env):
    action_model = Move

    def reset(self, seed=None):
        self.moves = []
        return {"text": "empty board", "metadata": {"size": 3}}

    def step(self, action: Move) -> StepResult:
        self.moves.append((action.row, action.col))
        return StepResult(Observation(text=f"{action.row},{action.col}"), reward=0.5, done=len(self.moves) == 2)


def test_custom_action_model():
    async def go():
        r = EnvRunner(Board())
        first = await r.reset()
        s = await r.step({"row": 1, "col": 2})
        with pytest.raises(ActionValidationError) as bad:
            await r.step({"row": "x", "col": 2, "extra": 1})
        return first, s, bad.value
    first, s, bad = run(go())
    assert first.observation.metadata == {"size": 3}
    assert s.observation.text == "1,2" and s.reward == 0.5
    assert {tuple(e["loc"]) for e in bad.details["errors"]} == {("row",), ("extra",)}


# -- wire types ------------------------------------------------------------------------------------
def test_step_result_json_round_trip_with_images():
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
    res = StepResult(Observation(text="t", images=[png], metadata={"k": 1}, extra_field=[1, 2]), reward=1.5,
                     truncated=True, info={"a": 1})
    wire = json.loads(_wire.encode({"type": "observation", "data": res.to_wire()}))
    assert wire["data"]["observation"]["images"] == [base64.b64encode(png).decode()]
    back = StepResult.from_wire(wire["data"])
    assert back.observation.images == [png] and back.observation.extra_field == [1, 2]
    assert (back.reward, back.done, back.truncated, back.info) == (1.5, False, True, {"a": 1})
    assert back.ended


def test_step_result_msgpack_round_trip_keeps_raw_bytes():
    png = bytes(range(256))
    frame = _wire.encode({"type": "observation", "data": StepResult(Observation(images=[png])).to_wire(binary=True)},
                         binary=True)
    data = _wire.decode(frame, binary_ok=True)["data"]
    assert data["observation"]["images"] == [png]
    assert StepResult.from_wire(data).observation.images == [png]


@pytest.mark.parametrize("payload,expected", [
    ({"observation": "plain", "reward": None, "done": True}, ("plain", 0.0, True)),
    ({"observation": {"echoed_message": "hi"}, "reward": 0.5, "done": False, "metadata": {"m": 1}}, ("", 0.5, False)),
    ({"observation": None}, ("", 0.0, False)),
    ({"observation": {"text": 5, "metadata": "odd", "images": "x"}}, ("5", 0.0, False)),
])
def test_step_result_reads_openenv_shapes(payload, expected):
    r = StepResult.from_wire(payload)
    assert (r.observation.text, r.reward, r.done) == expected


def test_openenv_top_level_metadata_is_kept():
    r = StepResult.from_wire({"observation": {"x": 1}, "metadata": {"m": 1}})
    assert r.observation.metadata == {"m": 1} and r.observation.x == 1


def test_action_needs_exactly_one_kind():
    assert Action(text="hi").is_tool_call is False
    with pytest.raises(ValueError):
        Action()
    with pytest.raises(ValueError):
        Action(text="a", tool_name="b")


def test_tool_spec_and_tool_call_shapes():
    spec = ToolSpec.from_openai({"name": "f", "inputSchema": {"type": "object", "properties": {"a": {}}}})
    assert spec.to_openai()["function"]["parameters"]["properties"] == {"a": {}}
    assert ToolSpec.from_openai(spec.to_openai()) == spec
    assert spec.to_mcp()["inputSchema"] == spec.parameters
    oa = ToolCall("f", {"a": "é"}).to_openai()
    assert json.loads(oa["function"]["arguments"]) == {"a": "é"} and oa["id"].startswith("call_")


# -- codec -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("frame,code", [
    ("not json", ErrorCode.INVALID_JSON),
    ("[1, 2]", ErrorCode.VALIDATION_ERROR),
    ('{"data": {}}', ErrorCode.UNKNOWN_TYPE),
    ('{"type": 3}', ErrorCode.UNKNOWN_TYPE),
    (b"\x81\xa4type\xa4step", ErrorCode.INVALID_JSON),  # binary without msgpack negotiated
])
def test_decode_errors_are_typed(frame, code):
    with pytest.raises(ProtocolError) as exc:
        _wire.decode(frame)
    assert exc.value.code == code


def test_decode_msgpack_and_size_limit():
    assert _wire.decode(msgpack.packb({"type": "step", "data": {"a": 1}}), binary_ok=True)["data"] == {"a": 1}
    with pytest.raises(ProtocolError):
        _wire.decode(b"\xc1", binary_ok=True)
    with pytest.raises(MessageTooLargeError):
        _wire.decode("x" * 2048, max_bytes=1024)


def test_error_frame_and_error_for_code():
    frame = _wire.error_frame(ErrorCode.CAPACITY_REACHED, "full", request_id=4, active_sessions=2, max_sessions=2)
    assert frame["id"] == 4
    err = error_for_code(frame["data"])
    assert type(err).__name__ == "CapacityError" and isinstance(err, ConnectionError)
    assert err.details == {"active_sessions": 2, "max_sessions": 2}
    assert type(error_for_code({"code": "SOMETHING_NEW"})).__name__ == "ServerError"


@pytest.mark.parametrize("base,expected", [
    ("http://h:1", "ws://h:1/ws"), ("https://h/x/", "wss://h/x/ws"), ("ws://h:1/ws", "ws://h:1/ws"), ("h:1", "ws://h:1/ws"),
])
def test_ws_url(base, expected):
    assert _wire.ws_url(base) == expected
    assert _wire.http_url(expected, "/health").endswith("/health")


class OverAtOnce(Env):
    """An episode that may be over before any step (a match the other seat already ended)."""

    def reset(self, seed=None, over: bool = False):
        if over:
            return StepResult(observation=Observation(text="already decided"), reward=2.0, done=True,
                              info={"outcome": "win"})
        return "play"

    def on_text(self, text: str):
        return StepResult(observation=Observation(text="ok"), reward=1.0, done=True)


def test_a_reset_that_returns_done_ends_the_episode_before_any_step():
    async def go():
        r = EnvRunner(OverAtOnce())
        first = await r.reset(over=True)
        state = await r.state()
        with pytest.raises(EpisodeStateError) as refused:
            await r.step({"text": "move"})
        again = await r.reset()  # a new episode is playable as usual
        played = await r.step({"text": "move"})
        return first, state, refused.value.code, again, played, await r.state()
    first, state, code, again, played, after = run(go())
    assert first.done and first.reward == 2.0 and first.info["outcome"] == "win" and first.info["episode_id"]
    assert state["done"] and state["episode_reward"] == 2.0 and state["step_count"] == 0
    assert code == ErrorCode.EPISODE_ENDED
    assert not again.ended and played.done and after["episode_reward"] == 1.0
