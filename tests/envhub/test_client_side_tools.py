"""Client-side tools: plain functions (sync or async) as FunctionTools next to env tools, and local Envs as EnvTools."""

from __future__ import annotations

import asyncio
import threading
from typing import Annotated

import pytest

from envhub import Env, EnvTool, FunctionTool, LocalEnv, Observation, ToolManager, reward, tool
from envhub.local_env import AsyncLocalEnv


class GuessEnv(Env):
    """Guess the number (7): a local env with one tool and a reward."""

    def reset(self, seed=None, target: int = 7):
        self.target, self.solved = target, False
        return Observation(text="Guess a number from 1 to 10.")

    @tool
    def guess(self, number: Annotated[int, "your guess"]) -> str:
        """Guess the number."""
        self.solved = number == self.target
        self.done = self.solved
        return "Correct!" if self.solved else ("Higher." if number < self.target else "Lower.")

    @reward
    def correct(self) -> float:
        return float(self.solved)


def convert(amount: float, rate: float = 1.0) -> dict:
    """Convert an amount of money.

    Args:
        amount: how much
        rate: the exchange rate
    """
    return {"converted": round(amount * rate, 2)}


async def slow_lookup(key: str) -> str:
    """Look something up slowly."""
    await asyncio.sleep(0.01)
    return key.upper()


def test_function_schema_follows_the_tool_rules_and_arguments_are_validated() -> None:
    t = FunctionTool(convert)
    fn = t.tool_info()["function"]
    assert fn["name"] == "convert" and fn["description"] == "Convert an amount of money."
    assert fn["parameters"]["required"] == ["amount"]
    assert fn["parameters"]["properties"]["rate"]["description"] == "the exchange rate"
    assert t(amount=10, rate=0.5) == '{"converted": 5.0}'
    with pytest.raises(ValueError, match="invalid arguments for tool 'convert': amount"):
        t(amount="lots")
    assert not hasattr(convert, "__envhub_tool__")  # the user's function is left as it was
    assert FunctionTool(convert, name="fx").name == "fx"


def test_async_functions_callable_objects_and_bad_definitions() -> None:
    t = FunctionTool(slow_lookup)
    assert t.is_async and asyncio.run(t.acall(key="pi")) == "PI"
    with pytest.raises(TypeError, match="async function"):
        t(key="pi")

    class Counter:
        def __call__(self, step: int = 1) -> int:
            """Count up."""
            return step + 1

    assert FunctionTool(Counter()).name == "Counter" and FunctionTool(Counter())(step=2) == "3"
    with pytest.raises(Exception, match="'<lambda>' is not a valid function name"):
        FunctionTool(lambda x: x)

    def untyped(x):
        """No hint."""

    with pytest.raises(Exception, match="parameter 'x' needs a type hint"):
        FunctionTool(untyped)
    with pytest.raises(TypeError, match="Expected a function"):
        FunctionTool(42)


def test_local_env_tools_step_the_env_and_keep_the_episode() -> None:
    tools = EnvTool.from_env(GuessEnv())
    assert [t.name for t in tools] == ["guess"] and isinstance(tools[0].env, LocalEnv)
    tools[0].env.reset(seed=0, target=3)
    manager = ToolManager(tools)
    assert manager({"name": "guess", "arguments": {"number": 5}})["content"] == "Lower."
    bad = manager({"name": "guess", "arguments": {"number": "three"}})
    assert bad["content"].startswith("Error") and "number" in bad["content"]
    assert manager({"name": "guess", "arguments": '{"number": 3}'})["content"] == "Correct!"
    assert tools[0].done and tools[0].episode_reward == 1.0


def test_a_local_env_never_reset_starts_an_episode_on_the_first_call() -> None:
    [guess] = EnvTool.from_env(GuessEnv())
    assert guess(number=7) == "Correct!" and guess.episode_reward == 1.0


async def test_functions_run_concurrently_next_to_env_tools_and_results_keep_call_order() -> None:
    barrier = threading.Barrier(2, timeout=2)
    arrived: list[str] = []

    def meet(name: str) -> str:
        """Returns only once a second call is running at the same time."""
        arrived.append(name)
        barrier.wait()
        return f"met {name}"

    env_tools = await EnvTool.afrom_env(GuessEnv())
    assert isinstance(env_tools[0].env, AsyncLocalEnv)
    await env_tools[0].env.reset(target=2)
    manager = ToolManager([*env_tools, meet, FunctionTool(slow_lookup)])
    assert [t["function"]["name"] for t in manager.tool_infos()] == ["guess", "meet", "slow_lookup"]
    out = await manager.execute_many([
        {"id": "1", "function": {"name": "meet", "arguments": '{"name": "a"}'}},
        {"id": "2", "function": {"name": "guess", "arguments": '{"number": 1}'}},
        {"id": "3", "function": {"name": "slow_lookup", "arguments": '{"key": "k"}'}},
        {"id": "4", "function": {"name": "meet", "arguments": '{"name": "b"}'}},
        {"id": "5", "function": {"name": "guess", "arguments": '{"number": 2}'}},
    ])
    assert [m["content"] for m in out] == ["met a", "Higher.", "K", "met b", "Correct!"]
    assert [m["tool_call_id"] for m in out] == ["1", "2", "3", "4", "5"]


def test_tool_names_must_be_unique_across_env_and_function_tools() -> None:
    def guess(number: int) -> str:
        """A clash."""
        return "x"

    with pytest.raises(ValueError, match="Two tools are named 'guess'"):
        ToolManager([*EnvTool.from_env(GuessEnv()), guess])
