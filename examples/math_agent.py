"""A scripted agent plays the math env through ``OpenEnv`` + ``EnvTool`` against a server it starts.

    python examples/math_agent.py

The env takes free text; an ``action_mapper`` turns the agent's ``answer(text=...)`` tool call
into the text action, so the same loop would work with any chat model that calls tools.
"""

from env_servers.math_env import MathEnv
from envhub import EnvTool, OpenEnv
from envhub.server import ServerThread, create_app

ANSWER_TOOL = {"name": "answer", "description": "Reply with your full answer, final result in \\boxed{}.",
               "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}


def solve(prompt: str) -> int:
    """The scripted policy: read "What is a + b?" and compute it."""
    a, op, b = prompt.split("?")[0].removeprefix("What is ").split()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def main() -> None:
    with ServerThread(create_app(MathEnv)) as server:
        env = OpenEnv(server.url, tool_schema=[ANSWER_TOOL], action_mapper=lambda _name, args: {"text": args["text"]})
        (answer,) = EnvTool.from_env(env)
        total = 0.0
        for index in range(5):
            first = env.reset(split="validation", kind="add", difficulty=1, index=index)
            value = solve(first.observation.text) + (1 if index == 4 else 0)  # the last answer is wrong on purpose
            feedback = answer(text=f"Let me add. \\boxed{{{value}}}")
            print(f"{first.observation.text!r} -> {value}: {feedback} (reward {answer.episode_reward})")
            total += answer.episode_reward
        env.close()
        print(f"solved {total:.0f} of 5")


if __name__ == "__main__":
    main()
