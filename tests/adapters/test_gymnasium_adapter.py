"""adapters.gymnasium both ways: Gymnasium envs served by envhub (text in, text out), envhub envs as gymnasium.Env."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

gymnasium = pytest.importorskip("gymnasium")

from adapters.gymnasium import EnvhubGymEnv, from_gymnasium, observation_to_text, parse_action, to_action  # noqa: E402
from env_servers.math_env import MathEnv  # noqa: E402
from envhub.client import EnvClient  # noqa: E402
from envhub.server import ServerThread, create_app  # noqa: E402
from envhub.settings import Settings  # noqa: E402
from envhub.testing import check_env  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.guess_env import GuessEnv  # noqa: E402

QUIET = Settings(log_level="warning")
spaces = gymnasium.spaces


def test_actions_parse_from_model_text_and_garbage_is_none() -> None:
    assert parse_action("I'll go right: 2", spaces.Discrete(4)) == 2
    assert parse_action("7", spaces.Discrete(4)) is None
    assert parse_action("left", spaces.Discrete(4)) is None
    box = spaces.Box(-1.0, 1.0, shape=(2,))
    assert parse_action("[0.5, -0.25]", box).tolist() == [0.5, -0.25]
    assert parse_action("[0.5]", box) is None and parse_action("[3, 0]", box) is None
    assert parse_action("[1, 0, 1]", spaces.MultiBinary(3)).tolist() == [1, 0, 1]
    assert parse_action(None, spaces.Discrete(2)) is None
    assert observation_to_text({"pos": (1, 2.123456)}) == '{"pos": [1, 2.1235]}'


def test_wire_actions_from_gymnasium_actions() -> None:
    assert to_action('{"name": "guess", "arguments": {"number": 5}}') == {"tool_name": "guess",
                                                                            "arguments": {"number": 5}}
    assert to_action('<tool_call>\n{"name": "guess", "arguments": {"number": 6}}\n</tool_call>') == \
        {"tool_name": "guess", "arguments": {"number": 6}}
    assert to_action("\\boxed{4}") == {"text": "\\boxed{4}"}
    assert to_action({"text": "x"}) == {"text": "x"}


def test_a_gymnasium_env_passes_check_env() -> None:
    cartpole = from_gymnasium("CartPole-v1")
    assert cartpole.tools()[0].parameters["properties"]["action"]["description"] == \
        "the action: an integer from 0 to 1"
    results = check_env(cartpole, raise_on_error=False, sample_action={"text": "1"})
    assert all(r.passed for r in results), [str(r) for r in results]


@pytest.mark.live
async def test_frozen_lake_over_websocket_reaches_the_goal_with_text_and_tool_actions() -> None:
    lake = from_gymnasium("FrozenLake-v1", is_slippery=False, render_mode="ansi")
    with ServerThread(create_app(lake, settings=QUIET)) as server:
        async with EnvClient(server.url) as env:
            first = await env.reset(seed=0)
            assert first.observation.text.splitlines()[:2] == ["0", "[S]FFF"]
            bad = await env.step({"text": "north"})
            assert bad.observation.text.startswith("Error: expected an integer from 0 to 3")
            assert bad.info["invalid_action"] and not bad.done
            result = None
            for move in (2, 2, 1, 1, 1):  # right, right, down, down, down
                result = await env.step({"text": str(move)})
            assert not result.done and result.observation.text.splitlines()[0] == "14"
            result = await env.step({"tool_name": "act", "arguments": {"action": "2"}})
            assert result.done and result.reward == 1.0 and result.observation.text.endswith("HFF[G]")


def test_a_local_envhub_env_is_a_checked_gymnasium_env() -> None:
    from gymnasium.utils.env_checker import check_env as gym_check_env

    env = EnvhubGymEnv(GuessEnv, render_mode="ansi")
    assert isinstance(env, gymnasium.Env) and isinstance(env.observation_space, spaces.Text)
    assert repr(env.action_space) == "Text(1, 65536, charset=TEXT_CHARSET)"  # not its ~12k characters
    gym_check_env(EnvhubGymEnv(GuessEnv), skip_render_check=True)
    obs, info = env.reset(seed=3, options={"low": 1, "high": 8})
    assert obs == "I picked a number between 1 and 8. Call guess(number)." and info["episode_id"]
    obs, reward, terminated, truncated, info = env.step("guess 4 please")
    assert obs.startswith("Error: GuessEnv expects a tool call") and reward == 0.0 and not terminated
    low, high = 1, 8
    while True:
        number = (low + high) // 2
        obs, reward, terminated, truncated, info = env.step({"tool_name": "guess", "arguments": {"number": number}})
        if terminated:
            break
        low, high = (number + 1, high) if obs == "Higher." else (low, number - 1)
    assert obs == "Correct!" and reward == 1.0 and info["episode_reward"] == 1.0 and env.render() == obs
    env.close()


@pytest.mark.parametrize("bad", [GuessEnv(), 8001, None])
def test_an_env_that_is_neither_a_url_nor_an_env_class_is_refused_by_name(bad) -> None:
    with pytest.raises(TypeError, match=r"Expected env to be a server URL or an envhub Env class .*got "):
        EnvhubGymEnv(bad)


@pytest.mark.live
def test_a_remote_envhub_server_is_a_gymnasium_env() -> None:
    task = {"problem": "What is 2 + 2?", "answer": "4"}
    with ServerThread(create_app(MathEnv, settings=QUIET)) as server:
        env = EnvhubGymEnv(server.url)
        obs, _ = env.reset(seed=0, options=task)
        assert "2 + 2" in obs
        obs, reward, terminated, truncated, info = env.step("The answer is \\boxed{4}.")
        assert terminated and reward > 0 and not truncated
        env.close()
