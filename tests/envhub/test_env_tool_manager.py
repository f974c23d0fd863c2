"""EnvTool and ToolManager: schemas, shared sessions, model-facing errors, infra errors, parallel execution."""

import asyncio
import json
import time

import pytest

from envhub.env_tool import EnvTool, ToolManager
from envhub.errors import ActionValidationError, EnvConnectionError, SessionLostError
from envhub.types import Observation, StepResult, ToolCall, ToolSpec

GUESS = ToolSpec("guess", "Guess the number.", {"type": "object", "properties": {"n": {"type": "integer"}},
                                                 "required": ["n"]})
HINT = ToolSpec("hint", "Ask for a hint.")


class FakeEnv:
    """A sync env in the OpenEnv shape: step(tool_name, arguments) -> StepResult."""

    def __init__(self, specs=(GUESS, HINT), secret=7):
        self.specs, self.secret, self.total, self.calls = list(specs), secret, 0.0, []

    def tools(self):
        return self.specs

    def step(self, tool_name, arguments):
        self.calls.append((tool_name, arguments))
        if tool_name == "explode":
            raise ValueError("bad move")
        if tool_name == "outage":
            raise SessionLostError("connection dropped")
        if tool_name == "hint":
            return StepResult(Observation(text="odd"))
        n = arguments.get("n")
        won = n == self.secret
        self.total += float(won)
        return StepResult(Observation(text="Correct!" if won else "Wrong."), reward=float(won), done=won,
                          info={"episode_reward": self.total})


class AsyncFakeEnv:
    """An async env whose steps take 0.1 s and record how many ran at once."""

    overlap = {"active": 0, "peak": 0}  # across every instance: do different sessions run together?

    def __init__(self):
        self.active = self.peak = 0

    async def tools(self):
        return [GUESS.to_openai()]

    async def step(self, tool_name, arguments):
        self.active += 1
        self.overlap["active"] += 1
        self.peak = max(self.peak, self.active)
        self.overlap["peak"] = max(self.overlap["peak"], self.overlap["active"])
        await asyncio.sleep(0.1)
        self.active -= 1
        self.overlap["active"] -= 1
        return StepResult(Observation(text=f"{tool_name}:{arguments.get('n')}"), reward=1.0)


def call(name, args, cid="c1"):
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


def test_from_env_one_tool_per_schema_sharing_the_session():
    env = FakeEnv()
    guess, hint = EnvTool.from_env(env)
    assert guess.tool_info() == GUESS.to_openai() and hint.name == "hint"
    assert (guess.done, guess.episode_reward, guess.last_result) == (False, 0.0, None)
    assert hint() == "odd"
    assert guess(n=7) == "Correct!"
    assert hint.done and hint.episode_reward == 1.0  # the latest step through any tool of the env
    assert env.calls == [("hint", {}), ("guess", {"n": 7})]


def test_env_without_tools_gets_one_text_tool_whose_calls_are_text_actions():
    env = FakeEnv(specs=[])
    (tool,) = EnvTool.from_env(env)
    assert tool.name == "env_action" and tool.tool_info()["function"]["parameters"]["required"] == ["text"]
    tool(text="42")
    assert env.calls == [(None, {"text": "42"})]  # step(None, ...): a text action, not a tool call


def test_the_text_tool_answers_a_text_env_served_and_in_process():
    from envhub import Env, Observation, OpenEnv, StepResult, create_app
    from envhub.server import ServerThread

    class Sums(Env):  # takes free text (on_text), lists no tools: the math env's shape
        def reset(self, seed=None, **task):
            return Observation(text="2 + 3?")

        def on_text(self, text):
            self.done = True
            return StepResult(Observation(text="right" if "5" in text else "wrong"), reward=float("5" in text))

    with ServerThread(create_app(Sums)) as server, OpenEnv(server.url) as remote:
        remote.reset(seed=0)
        manager = ToolManager(EnvTool.from_env(remote))
        call = {"id": "c1", "type": "function", "function": {"name": "env_action", "arguments": '{"text": "5"}'}}
        assert manager(call)["content"] == "right"
        assert manager.tools["env_action"].episode_reward == 1.0
    (local,) = EnvTool.from_env(Sums())
    assert local(text="4") == "wrong" and local.done and local.episode_reward == 0.0


def test_episode_reward_falls_back_to_step_reward():
    class NoInfo(FakeEnv):
        def step(self, tool_name, arguments):
            return StepResult(Observation(text="x"), reward=0.5)
    tool = EnvTool(NoInfo())
    tool()
    assert tool.episode_reward == 0.5


def test_tool_rejects_non_env():
    with pytest.raises(TypeError, match="step"):
        EnvTool(object())


def test_manager_executes_openai_calls_with_string_or_dict_arguments():
    m = ToolManager(EnvTool.from_env(FakeEnv()))
    assert m(call("guess", {"n": 3})) == {"role": "tool", "tool_call_id": "c1", "name": "guess", "content": "Wrong."}
    assert m({"name": "guess", "arguments": {"n": 7}})["content"] == "Correct!"
    assert m(ToolCall("hint", {}, id="t9")) == {"role": "tool", "tool_call_id": "t9", "name": "hint", "content": "odd"}
    assert m(call("guess", json.dumps(json.dumps({"n": 1}))))["content"] == "Wrong."  # double-encoded
    assert [t["function"]["name"] for t in m.tool_infos()] == ["guess", "hint"]


@pytest.mark.parametrize("tool_call,expected", [
    (call("nope", {}), "Error: unknown tool 'nope'. Available: guess, hint, explode, outage."),
    (call("guess", "{n: 3"), "Error: invalid JSON in arguments: "),
    (call("guess", "[1, 2]"), "Error: expected the arguments to be a JSON object, got list."),
    (call("explode", {}), "Error: tool 'explode' raised ValueError: bad move"),
    ("garbage", "Error: expected a tool call object, got str."),
    ({"id": "x", "function": "not an object"}, "Error: expected a tool call object, got dict."),
    ({"id": "x", "function": {"arguments": "{}"}}, "Error: unknown tool ''."),
])
def test_model_mistakes_become_tool_messages(tool_call, expected):
    env = FakeEnv(specs=[GUESS, HINT, ToolSpec("explode"), ToolSpec("outage")])
    msg = ToolManager(EnvTool.from_env(env))(tool_call)
    assert msg["role"] == "tool" and msg["content"].startswith(expected)


def test_infrastructure_errors_propagate_unless_configured():
    tools = EnvTool.from_env(FakeEnv(specs=[ToolSpec("outage")]))
    with pytest.raises(SessionLostError):
        ToolManager(tools)(call("outage", {}))
    msg = ToolManager(tools, infra_errors="message")(call("outage", {}))
    assert msg["content"].startswith("Error: tool 'outage' raised SessionLostError")


def test_validation_error_from_env_is_model_facing():
    class Strict(FakeEnv):
        def step(self, tool_name, arguments):
            raise ActionValidationError("n: Field required")
    assert "Field required" in ToolManager([EnvTool(Strict(), "guess")])(call("guess", {}))["content"]


def test_duplicate_tool_names_rejected():
    env = FakeEnv()
    with pytest.raises(ValueError, match="unique"):
        ToolManager([EnvTool(env, "a"), EnvTool(env, "a")])
    with pytest.raises(ValueError):
        ToolManager([], infra_errors="ignore")


async def test_execute_many_serialises_one_session_and_parallelises_sessions():
    env_a, env_b = AsyncFakeEnv(), AsyncFakeEnv()
    (a,) = await EnvTool.afrom_env(env_a)
    b = EnvTool(env_b, "guess_b")
    m = ToolManager([a, b])
    AsyncFakeEnv.overlap.update(active=0, peak=0)
    t0 = time.perf_counter()
    out = await m.execute_many([call("guess", {"n": 1}, "1"), call("guess", {"n": 2}, "2"),
                                call("guess_b", {"n": 3}, "3")])
    elapsed = time.perf_counter() - t0
    assert [o["content"] for o in out] == ["guess:1", "guess:2", "guess_b:3"]
    assert [o["tool_call_id"] for o in out] == ["1", "2", "3"]
    assert env_a.peak == 1 and env_b.peak == 1  # one session's calls never overlap
    assert AsyncFakeEnv.overlap["peak"] == 2    # different sessions do
    assert elapsed >= 0.2


async def test_async_env_tool_refuses_sync_call_and_sync_env_runs_in_thread():
    (a,) = await EnvTool.afrom_env(AsyncFakeEnv())
    with pytest.raises(TypeError, match="acall"):
        a(n=1)
    guess, _ = EnvTool.from_env(FakeEnv())
    assert await guess.acall(n=7) == "Correct!"
    with pytest.raises(EnvConnectionError):
        await ToolManager(EnvTool.from_env(FakeEnv(specs=[ToolSpec("outage")]))).acall(call("outage", {}))
