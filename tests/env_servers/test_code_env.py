"""CodeEnv driven by scripted policies through EnvRunner: tools, rewards, cheating attempts, stateful mode."""

from __future__ import annotations

import os
import re

import pytest

from env_servers.code_env import CodeEnv
from env_servers.code_env.tasks import builtin_tasks, reference_solutions
from env_servers.sandbox import available_backends
from envhub import EnvRunner

pytestmark = [pytest.mark.sandbox,
              pytest.mark.skipif(os.geteuid() != 0 or "local-zygote" not in available_backends(),
                                 reason="needs root and a working bubblewrap (apt-get install -y bubblewrap)")]

PRIME_WRONG = "def is_prime(n):\n    return n % 2 == 1"  # right on 3 of the 7 hidden tests


def call(name: str, **args) -> dict:
    return {"tool_name": name, "arguments": args}


async def start(task_id: str, **config) -> EnvRunner:
    runner = EnvRunner(CodeEnv(**config))
    await runner.reset(task_id=task_id)
    return runner


async def test_first_observation_is_the_problem_with_the_system_prompt_in_metadata():
    runner = EnvRunner(CodeEnv())
    first = await runner.reset(seed=3, split="test", index=0)
    meta = first.observation.metadata
    assert meta["split"] == "test" and meta["num_tests"] >= 2 and "submit" in meta["system_prompt"]
    assert "submit(code)" in first.observation.text


async def test_correct_submission_earns_1_and_ends_the_episode():
    runner = await start("fizzbuzz")
    result = await runner.step(call("submit", code=reference_solutions()["fizzbuzz"]))
    assert result.reward == 1.0 and result.done
    assert result.observation.text.startswith("Passed 4/4")


async def test_partially_correct_submission_earns_the_fraction():
    runner = await start("is_prime")
    result = await runner.step(call("submit", code=PRIME_WRONG))
    assert result.reward == pytest.approx(3 / 7)
    assert result.info["tests"].count("pass") == 3 and result.done


async def test_all_or_nothing_mode_and_several_submissions():
    runner = await start("is_prime", reward_mode="all_or_nothing", max_submissions=2)
    first = await runner.step(call("submit", code=PRIME_WRONG))
    assert first.reward == 0.0 and not first.done and "1 submission(s) left" in first.observation.text
    second = await runner.step(call("submit", code=reference_solutions()["is_prime"]))
    assert second.reward == 1.0 and second.done


@pytest.mark.parametrize("cheat", [
    "import sys\nsys.exit(0)",
    "import os\nos._exit(0)",
    "class Yes(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
    "def fizzbuzz(n):\n    return Yes(0)",
    "class Yes(list):\n    def __eq__(self, other):\n        return True\ndef fizzbuzz(n):\n    return Yes()",
    "import json\njson.dumps = lambda *a, **k: '{\"list\": []}'\ndef fizzbuzz(n):\n    return None",
    "import unittest, builtins\nunittest.TestCase.assertEqual = lambda *a: None\nbuiltins.AssertionError = Exception\n"
    "def fizzbuzz(n):\n    assert False",
])
async def test_cheating_submissions_earn_nothing(cheat):
    runner = await start("fizzbuzz")
    result = await runner.step(call("submit", code=cheat))
    assert result.reward == 0.0, result.info


async def test_debug_prints_in_a_correct_solution_do_not_cost_reward():
    runner = await start("gcd")
    chatty = "def gcd(a, b):\n    print('x' * 50_000)\n    while b:\n        a, b = b, a % b\n    return a"
    result = await runner.step(call("submit", code=chatty))
    assert result.reward == 1.0, result.info


async def test_io_task_is_graded_on_stdout_not_on_the_exit_code():
    runner = await start("io_sum_two")
    silent = await runner.step(call("submit", code="import sys\nsys.exit(0)"))
    assert silent.reward == 0.0
    runner = await start("io_sum_two")
    good = await runner.step(call("submit", code=reference_solutions()["io_sum_two"]))
    assert good.reward == 1.0


async def test_run_python_reports_output_status_and_kills():
    runner = await start("fizzbuzz", run_timeout_s=1.0)
    r = await runner.step(call("run_python", code="import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(2)"))
    assert r.observation.text.startswith("[exit 2 in ") and "--- stdout ---\nout" in r.observation.text
    assert "--- stderr ---\nerr" in r.observation.text
    assert r.info["exec"]["exit_code"] == 2 and r.reward == 0.0 and not r.done
    r = await runner.step(call("run_python", code="while True: pass"))
    assert r.observation.text.startswith("[timed out after") and r.info["exec"]["timed_out"]
    assert re.match(r"\[timed out after \d+\.\d\ds\]", r.observation.text)  # once, as the README shows it
    r = await runner.step(call("run_python", code="x = bytearray(10 ** 10)"))
    assert "MemoryError" in r.observation.text
    r = await runner.step(call("run_python", code="pass"))
    assert r.observation.text.endswith("(no output)")


async def test_stateful_mode_keeps_variables_between_calls():
    runner = await start("fizzbuzz", stateful=True)
    await runner.step(call("run_python", code="import math\nx = 41\nprint('set')"))
    await runner.step(call("run_python", code="raise ValueError('not kept')"))
    r = await runner.step(call("run_python", code="print(x + 1, math.pi > 3)"))
    assert "--- stdout ---\n42 True" in r.observation.text and "set" not in r.observation.text
    fresh = await start("fizzbuzz")
    r = await fresh.step(call("run_python", code="print(x)"))
    assert "NameError" in r.observation.text


async def test_every_reference_solution_scores_1():
    refs = reference_solutions()
    for task in builtin_tasks():
        runner = await start(task.task_id)
        result = await runner.step(call("submit", code=refs[task.task_id]))
        assert result.reward == 1.0, (task.task_id, result.info)


def test_metadata_reports_the_sandbox_backend():
    meta = CodeEnv.metadata()
    assert meta["name"] == "code" and meta["sandbox"]["backend"] == "local-zygote"


@pytest.mark.parametrize("task", [{"task_id": "nope"}, {"index": 10**9}, {"index": -1}, {"split": "nope"},
                                  {"task_id": 5}])
async def test_bad_task_arguments_are_the_clients_validation_error(task):
    from envhub.errors import ActionValidationError

    runner = EnvRunner(CodeEnv())
    with pytest.raises(ActionValidationError, match="reset\\(\\): "):
        await runner.reset(**task)
    await runner.close()
