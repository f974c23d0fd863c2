"""MathToolEnv: the run_python / submit_answer loop, played through EnvRunner by scripted policies."""

import pytest

from env_servers.math_env import MathToolEnv
from env_servers.math_env.code_runner import LocalSubprocessRunner, make_runner
from envhub import EnvRunner

# Tests run model code through the plain local runner: they check the loop, not isolation.
LOCAL = {"python_runner": "local-subprocess"}


async def start(**config):
    runner = EnvRunner(MathToolEnv(**{**LOCAL, **config}))
    first = await runner.reset(problem="What is 123 * 456?", answer="56088")
    return runner, first


async def test_tools_are_published_and_the_prompt_mentions_them():
    names = [spec.name for spec in MathToolEnv.tools()]
    assert names == ["run_python", "submit_answer"]
    _, first = await start()
    assert "run_python" in first.observation.metadata["system_prompt"]


async def test_compute_then_submit_is_rewarded():
    runner, _ = await start()
    out = await runner.step({"tool_name": "run_python", "arguments": {"code": "print(123 * 456)"}})
    assert out.observation.text == "56088" and not out.done and out.reward == 0.0
    final = await runner.step({"tool_name": "submit_answer", "arguments": {"answer": out.observation.text}})
    assert final.done and final.reward == 1.0 and final.info["correct"] is True


async def test_compute_then_boxed_text_answer_and_a_wrong_one():
    runner, _ = await start()
    await runner.step({"text": "Let me compute.\n```python\nprint(123 * 456)\n```"})
    final = await runner.step({"text": r"So the product is \boxed{56088}."})
    assert final.done and final.reward == 1.0
    runner, _ = await start()
    final = await runner.step({"tool_name": "submit_answer", "arguments": {"answer": "56000"}})
    assert final.done and final.reward == 0.0 and final.info["ground_truth"] == "56088"


async def test_errors_and_timeouts_come_back_as_observations():
    runner, _ = await start(python_timeout_s=0.5)
    err = await runner.step({"tool_name": "run_python", "arguments": {"code": "1/0"}})
    assert "ZeroDivisionError" in err.observation.text and not err.done
    slow = await runner.step({"tool_name": "run_python", "arguments": {"code": "import time; time.sleep(5)"}})
    assert "timed out" in slow.observation.text


async def test_turn_limit_truncates_without_reward():
    runner, _ = await start(max_turns=2, turn_limit_reward=-0.5)
    first = await runner.step({"text": "hmm, no idea yet"})
    assert "run_python" in first.observation.text and not first.ended
    last = await runner.step({"tool_name": "run_python", "arguments": {"code": "print(1)"}})
    assert last.truncated and last.reward == -0.5 and last.info["correct"] is False


async def test_local_runner_caps_output():
    result = await LocalSubprocessRunner(max_output_bytes=100).run("print('x' * 10000)", 5.0)
    assert len(result.stdout) == 100


def test_runner_choice_is_validated():
    with pytest.raises(ValueError, match="local-subprocess"):
        make_runner("docker-magic")


@pytest.mark.sandbox
async def test_run_python_goes_through_the_code_sandbox():
    sandbox = pytest.importorskip("env_servers.sandbox")
    if not sandbox.available_backends():
        pytest.skip("no code sandbox backend works on this host")
    runner = EnvRunner(MathToolEnv(python_runner="sandbox"))
    await runner.reset(problem="What is 123 * 456?", answer="56088")
    out = await runner.step({"tool_name": "run_python", "arguments": {"code": "import os; print(123 * 456, os.getuid())"}})
    product, uid = out.observation.text.split()
    assert product == "56088" and uid != "0"
    assert (await runner.env.python_runner()).name.startswith("sandbox:")
    final = await runner.step({"tool_name": "submit_answer", "arguments": {"answer": product}})
    assert final.reward == 1.0
