"""envhub.testing: check_env catches real defects; FunctionEnv and EchoEnv behave as documented."""

from __future__ import annotations

import asyncio
import random
from typing import Annotated

import pytest

from envhub import Env, EnvRunner, Observation, tool
from envhub.errors import ActionValidationError
from envhub.testing import CheckResult, EchoEnv, FunctionEnv, check_env


class GoodEnv(Env):
    """A seeded env with a tool."""

    def reset(self, seed=None):
        self.target = self.rng.randint(0, 100)
        return Observation(text=f"target {self.target}")

    @tool
    def poke(self) -> str:
        """Poke the env."""
        return "poked"


class UnseededEnv(Env):
    """Ignores its seed: a determinism bug check_env must report."""

    def reset(self, seed=None):
        return Observation(text=str(random.random()))


class CrashingStepEnv(Env):
    def reset(self, seed=None):
        return "ready"

    def on_text(self, text):
        raise ZeroDivisionError("boom")


class UnserialisableEnv(Env):
    def reset(self, seed=None):
        return Observation(text="x", metadata={"when": {1, 2}})


def by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def test_good_env_passes_every_check():
    results = check_env(GoodEnv)
    assert all(r.passed for r in results) and len(results) == 7
    assert by_name(results)["a sample action steps without crashing"].passed


def test_seeding_bug_is_reported():
    with pytest.raises(AssertionError, match="same seed gives the same first observation"):
        check_env(UnseededEnv)
    results = by_name(check_env(UnseededEnv, raise_on_error=False))
    assert not results["same seed gives the same first observation"].passed
    assert results["reset returns an observation"].passed


def test_crashing_step_is_reported_with_the_exception():
    results = by_name(check_env(CrashingStepEnv, raise_on_error=False))
    failed = results["a sample action steps without crashing"]
    assert not failed.passed and "ZeroDivisionError" in failed.detail


def test_sample_action_is_used_and_unserialisable_observations_fail_the_roundtrip():
    assert check_env(EchoEnv, sample_action={"message": "hey"})
    results = by_name(check_env(UnserialisableEnv, raise_on_error=False))
    assert not results["observation survives the wire codec (JSON and msgpack)"].passed


def test_check_env_refuses_non_env_classes():
    with pytest.raises(TypeError, match="envhub.Env subclass"):
        check_env(dict)


def test_function_env_from_two_functions():
    def reset_fn(state, rng, goal: int = 3):
        state["goal"], state["n"] = goal, 0
        return f"reach {goal}"

    def step_fn(state, action):
        state["n"] += 1
        return {"text": str(state["n"])} if state["n"] < state["goal"] else \
            __import__("envhub").StepResult(observation=Observation(text="done"), reward=1.0, done=True)

    Counter = FunctionEnv.from_functions(reset_fn, step_fn, name="Counter", max_steps=10)
    assert Counter.__name__ == "Counter" and issubclass(Counter, Env)

    async def episode() -> list:
        runner = EnvRunner(Counter())
        first = await runner.reset(goal=2)
        a = await runner.step({"text": "go"})
        b = await runner.step({"text": "go"})
        return [first.observation.text, a.observation.text, b.done, b.reward, (await runner.state())["goal"]]

    assert asyncio.run(episode()) == ["reach 2", "1", True, 1.0, 2]
    assert check_env(Counter)


def test_echo_env_matches_the_openenv_echo_shape():
    async def episode():
        runner = EnvRunner(EchoEnv())
        await runner.reset()
        return await runner.step({"message": "hello"})

    result = asyncio.run(episode())
    assert result.observation.echoed_message == "hello" and result.observation.message_length == 5
    assert result.reward == pytest.approx(0.5)
    runner = EnvRunner(EchoEnv())
    with pytest.raises(ActionValidationError, match="message"):
        runner.parse_action({"message": 1})


def test_tool_env_with_required_arguments_is_stepped_with_arguments_from_its_schema():
    seen: list[int] = []

    class NeedsArgs(Env):
        def reset(self, seed=None):
            return "go"

        @tool
        def move(self, square: Annotated[int, "where"]) -> str:
            """Move."""
            seen.append(square)
            return "moved"

    results = by_name(check_env(NeedsArgs))
    assert results["a sample action steps without crashing"].detail.startswith("reward=")
    assert seen and isinstance(seen[0], int)
    step = by_name(check_env(NeedsArgs, sample_action={"tool_name": "move", "arguments": {"square": 4}}))
    assert step["a sample action steps without crashing"].passed
    assert seen[-1] == 4


async def test_check_env_works_inside_a_running_event_loop():
    assert all(r.passed for r in check_env(EchoEnv))
