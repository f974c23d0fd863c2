"""A scripted code agent: start the code env server, then solve tasks through ``OpenEnv`` + ``EnvTool``.

    .venv/bin/python examples/code_agent.py            # 3 tasks from the test split
    .venv/bin/python examples/code_agent.py --tasks 10

The "policy" is scripted (it looks up reference solutions) so that the example runs anywhere
without a model; swap ``scripted_policy`` for an LLM that emits tool calls. The server runs in a
subprocess exactly as in production: ``python -m env_servers.code_env --port P`` (its output in
``--server-log``). Needs a working sandbox (``apt-get install -y bubblewrap``, run as root).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

from env_servers.code_env.tasks import reference_solutions
from envhub import EnvTool, OpenEnv
from trainer.quickstart import env_server


def scripted_policy(task_id: str, step: int) -> tuple[str, dict]:
    """Explore once with run_python, then submit the reference solution."""
    solution = reference_solutions()[task_id]
    if step == 0:
        return "run_python", {"code": solution + "\nprint('compiles')"}
    return "submit", {"code": solution}


def run_episode(env: OpenEnv, index: int) -> float:
    first = env.reset(split="test", index=index)
    task_id = first.observation.metadata["task_id"]
    tools = {tool.name: tool for tool in EnvTool.from_env(env)}
    print(f"--- task {task_id}\n{first.observation.text}\n")
    step = 0
    while not env.done:
        name, arguments = scripted_policy(task_id, step)
        print(f"> {name}: {tools[name](**arguments)}")
        step += 1
    return env.episode_reward


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=3, help="how many test-split tasks to solve")
    parser.add_argument("--server-log", type=Path, default=Path("runs/code_agent/code_env.log"),
                        help="where the code env server's output goes")
    args = parser.parse_args(argv)
    with env_server("env_servers.code_env", [], args.server_log) as url:  # stopped on the way out, however it ends
        print("sandbox:", httpx.get(f"{url}/metadata").json()["sandbox"])
        with OpenEnv(url) as env:
            rewards = [run_episode(env, i) for i in range(args.tasks)]
        print(f"\nmean reward over {len(rewards)} tasks: {sum(rewards) / len(rewards):.2f}")


if __name__ == "__main__":
    main()
