"""A scripted agent plays the geometry env's tool flow through ``OpenEnv`` + ``EnvTool`` against a server it starts.

    python examples/geometry_agent.py

The tools (``law_of_cosines``, ``calculate``, ``submit_answer``...) come from the server as
OpenAI function schemas; the first observation also carries the diagram as a PNG.
"""

import re

from env_servers.geometry_env import GeometryEnv
from envhub import EnvTool, OpenEnv
from envhub.server import ServerThread, create_app


def main() -> None:
    with ServerThread(create_app(GeometryEnv)) as server:
        env = OpenEnv(server.url)
        tools = {tool.spec.name: tool for tool in EnvTool.from_env(env)}
        print("tools:", ", ".join(tools))
        for seed in range(3):
            first = env.reset(seed=seed, kind="law_of_cosines")
            text = first.observation.text
            print(f"\n{text}\n(diagram: {len(first.observation.images[0])} bytes of PNG)")
            ab, ac, angle = (int(n) for n in re.findall(r"\d+", text.split("Find")[0]))
            side = tools["law_of_cosines"](a=ab, b=ac, angle_deg=angle)
            print("law_of_cosines ->", side)
            if seed == 2:  # one wrong guess first, to see the verifier's feedback and penalty
                print("submit 1 ->", tools["submit_answer"](answer="1"))
            exact = side.split(" ≈ ")[0]
            print("submit ->", tools["submit_answer"](answer=exact),
                  f"| done={tools['submit_answer'].done} return={tools['submit_answer'].episode_reward:g}")
        env.close()


if __name__ == "__main__":
    main()
