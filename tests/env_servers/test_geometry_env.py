"""GeometryEnv played by scripted policies: the tool flow, single mode, images, and over the wire."""

import asyncio
import io
from pathlib import Path

import pytest
from PIL import Image

from env_servers.geometry_env import GeometryEnv
from envhub import EnvRunner
from envhub.client import EnvClient
from envhub.errors import ActionValidationError, EpisodeStateError
from envhub.server import ServerThread, create_app
from envhub.settings import Settings

TRIANGLE = dict(problem="In triangle ABC, AB = 5, AC = 8 and angle A is 60 degrees. Find BC.", answer="7")


async def start(**config):
    runner = EnvRunner(GeometryEnv(**config))
    return runner, await runner.reset(**TRIANGLE)


def call(name, **arguments):
    return {"tool_name": name, "arguments": arguments}


def test_stepping_an_env_used_directly_before_reset_says_to_reset():
    # an env driven without EnvRunner (an adapter, a test) gets the reason, not an AttributeError on None
    with pytest.raises(EpisodeStateError, match="reset"):
        GeometryEnv(mode="single").on_text("\\boxed{7}")
    with pytest.raises(EpisodeStateError, match="reset"):
        GeometryEnv(mode="tools").submit_answer("7")


async def test_first_observation_has_prompt_image_and_system_prompt():
    first = (await EnvRunner(GeometryEnv()).reset(seed=1, kind="circle_arc")).observation
    assert "radius" in first.text and "submit_answer" in first.text
    image = Image.open(io.BytesIO(first.images[0]))
    assert image.format == "PNG" and image.size == (384, 384)
    assert "geometry expert" in first.metadata["system_prompt"]
    assert first.metadata["kind"] == "circle_arc" and first.metadata["mode"] == "tools"


async def test_tool_flow_to_a_correct_answer():
    runner, _ = await start()
    side = await runner.step(call("law_of_cosines", a=5, b=8, angle_deg=60))
    assert side.observation.text == "7" and side.reward == 0.0 and not side.done
    calc = await runner.step(call("calculate", expression="sqrt(5^2 + 8^2 - 2*5*8*cosd(60))"))
    assert calc.observation.text == "7"
    final = await runner.step(call("submit_answer", answer=side.observation.text))
    assert final.done and final.reward == 1.0
    assert final.observation.text == "Current parsed answer=7 reward=1"
    assert final.info["ground_truth"] == "7" and final.info["episode_reward"] == 1.0


async def test_tool_flow_to_an_incorrect_final_answer():
    runner, _ = await start()
    rewards = []
    for guess in ["8", r"\sqrt{50}", "6.9"]:
        result = await runner.step(call("submit_answer", answer=guess))
        rewards.append(result.reward)
        assert f"Current parsed answer={guess} reward=0" in result.observation.text
    assert rewards == [-0.05, -0.05, 0.0] and result.done
    assert result.info["episode_reward"] == pytest.approx(-0.1) and result.info["ground_truth"] == "7"
    assert "ground_truth" not in (await EnvRunner(GeometryEnv()).reset(**TRIANGLE)).info


async def test_second_attempt_right_and_boxed_text_counts_as_a_submission():
    runner, _ = await start()
    wrong = await runner.step({"text": r"I think \boxed{6}"})
    assert wrong.reward == -0.05 and not wrong.done and "ground_truth" not in wrong.info
    right = await runner.step({"text": r"Let me redo it: \boxed{7}"})
    assert right.done and right.reward == 1.0 and right.info["episode_reward"] == pytest.approx(0.95)


async def test_calculator_refuses_malicious_input_inside_an_episode():
    runner, _ = await start()
    result = await runner.step(call("calculate", expression="__import__('os').system('touch /tmp/pwned')"))
    assert result.observation.text.startswith("Error: cannot evaluate") and not result.ended
    result = await runner.step(call("calculate", expression="9^9^9^9"))
    assert "bits" in result.observation.text


async def test_bad_tool_arguments_come_back_as_messages():
    runner, _ = await start()
    result = await runner.step(call("triangle_area", a=1, b=2))
    assert result.observation.text.startswith("Error:") and result.info.get("tool_error") == "invalid_arguments"
    result = await runner.step(call("triangle_area", a=1, b=2, c=10))
    assert "triangle inequality" in result.observation.text


@pytest.mark.parametrize("response, reward", [
    (r"<think>cosine rule</think> BC = \boxed{7}", 1.0), (r"BC = \boxed{7}", 0.9),
    (r"<think>guess</think> \boxed{6}", 0.1), ("seven", 0.0),
])
async def test_single_mode_rewards_accuracy_and_format(response, reward):
    runner = EnvRunner(GeometryEnv(mode="single"))
    first = await runner.reset(**TRIANGLE)
    assert "<think>" in first.observation.text
    result = await runner.step({"text": response})
    assert result.done and result.reward == pytest.approx(reward)


async def test_single_mode_refuses_tool_calls():
    runner = EnvRunner(GeometryEnv(mode="single"))
    await runner.reset(**TRIANGLE)
    with pytest.raises(ActionValidationError, match="mode='tools'"):
        await runner.step(call("submit_answer", answer="7"))


async def test_turn_limit_truncates():
    runner, _ = await start(max_turns=3)
    for i in range(3):
        result = await runner.step(call("calculate", expression=f"{i}+1"))
    assert result.truncated and result.info["correct"] is False


@pytest.mark.live
def test_256_concurrent_sessions_over_websocket():
    app = create_app(GeometryEnv, settings=Settings(max_sessions=300, idle_timeout_s=60))

    async def episode(url, i):
        async with EnvClient(url) as env:
            first = await env.reset(seed=i, kind="triangle_angle")
            assert first.observation.images and first.observation.images[0][:4] == b"\x89PNG"
            angles = [int(w) for w in first.observation.text.split("Find")[0].split() if w.isdigit()]
            answer = 180 - sum(angles) + (i % 2)  # odd sessions answer wrong once, then right
            result = await env.step(call("submit_answer", answer=str(answer)))
            if not result.done:
                result = await env.step(call("submit_answer", answer=str(answer - 1)))
            return result.info["episode_reward"]

    async def run_all(url):
        return await asyncio.gather(*(episode(url, i) for i in range(256)))

    with ServerThread(app) as server:
        returns = asyncio.run(run_all(server.url))
    assert returns == [pytest.approx(1.0 if i % 2 == 0 else 0.95) for i in range(256)]


@pytest.mark.live
def test_geometry_agent_example_runs(capsys):
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "geometry_agent.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("reward=1 | done=True") == 3 and "return=0.95" in out


@pytest.mark.live
def test_python_dash_m_serves_single_mode(tmp_path, serve_process):
    import sys

    server = serve_process([sys.executable, "-m", "env_servers.geometry_env", "--mode", "single",
                            "--max-sessions", "4"])

    async def play():
        async with EnvClient(server.url) as env:
            first = await env.reset(**TRIANGLE)
            assert "<think>" in first.observation.text
            return (await env.step({"text": r"<think>cosine rule</think>\boxed{7}"})).reward

    assert asyncio.run(play()) == pytest.approx(1.0)


async def test_geometry3k_data_is_served_with_its_own_image_and_rounded_answers(tmp_path):
    import base64
    import json

    buf = io.BytesIO()
    Image.new("RGB", (20, 10), "white").save(buf, format="PNG")
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"problem": "<image>Find x.", "answer": "7.8",
                                "images": [{"bytes": base64.b64encode(buf.getvalue()).decode()}]}))
    runner = EnvRunner(GeometryEnv(data_files={"test": str(path)}))
    first = await runner.reset(split="test", index=0)
    assert first.observation.text.startswith("Find x.") and first.observation.images == [buf.getvalue()]
    assert first.observation.metadata["kind"] == "geometry3k"
    wrong = await runner.step(call("submit_answer", answer="8"))
    assert wrong.reward == -0.05
    right = await runner.step(call("submit_answer", answer=r"\sqrt{61}"))  # 7.81: within the 1% tolerance
    assert right.done and right.reward == 1.0


@pytest.mark.live
@pytest.mark.interop
@pytest.mark.slow
def test_unmodified_openenv_generic_client_gets_the_diagram_and_uses_tools():
    import base64
    import re

    generic = pytest.importorskip("openenv.core.generic_client")
    with ServerThread(create_app(GeometryEnv)) as server:
        with generic.GenericEnvClient(base_url=server.url).sync() as env:
            first = env.reset(seed=3, kind="law_of_cosines")
            assert base64.b64decode(first.observation["images"][0])[:4] == b"\x89PNG"
            ab, ac, angle = (int(n) for n in re.findall(r"\d+", first.observation["text"].split("Find")[0]))
            side = env.step(call("law_of_cosines", a=ab, b=ac, angle_deg=angle))
            assert not side.done
            final = env.step(call("submit_answer", answer=side.observation["text"].split(" ≈ ")[0]))
            assert final.reward == 1.0 and final.done


@pytest.mark.parametrize("expression, expected", [
    ("1e3", "1000"), ("2.5e-3", "1/400 ≈ 0.0025"), ("1.5E2*2", "300"), ("2e", "2*E ≈ 5.436563657"),
])
def test_the_calculator_reads_scientific_notation(expression: str, expected: str) -> None:
    from env_servers.geometry_env.calculator import calculate

    assert calculate(expression) == expected  # '1e3' was 3*E: the letter e, not an exponent


@pytest.mark.parametrize("expression, message", [
    ("factorial(100000)", "unknown function or name 'factorial'"), ("foo(3)", "unknown function or name 'foo'"),
    ("5 mod 2", "unknown function or name 'mod'"), ("1e999", "out of range"),
])
def test_the_calculator_refuses_unknown_words_instead_of_splitting_them_into_symbols(expression: str,
                                                                                    message: str) -> None:
    from env_servers.geometry_env.calculator import CalculatorError, calculate

    with pytest.raises(CalculatorError, match=message):  # 'foo(3)' was 3*f*o**2
        calculate(expression)


def test_math_grading_reads_scientific_notation_too() -> None:
    from env_servers.math_grading.grading import is_equiv

    assert is_equiv("1e3", "1000") and is_equiv("2.5e-3", "1/400") and not is_equiv("1e3", "3e")
