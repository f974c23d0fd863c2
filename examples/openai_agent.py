"""An OpenAI-compatible agent loop against envhub env servers, through ``EnvTool``.

    python examples/openai_agent.py                  # offline: a scripted endpoint plays the guess env
    python examples/openai_agent.py --base-url http://localhost:8000/v1 --model Qwen/Qwen2.5-7B-Instruct \\
        --env-url ws://localhost:8002 --episodes 3   # a real model (vLLM, SGLang...) against gomoku

Any server answering ``POST /v1/chat/completions`` with OpenAI tool calls works; no ``openai``
package is needed. Without ``--base-url`` the script serves a stand-in "model" that bisects
the guess env (``examples/guess_env.py``), and without ``--env-url`` it serves that env too,
so the whole loop runs on a laptop.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from adapters.openai import ChatCompletionsClient, run_agent
from envhub import EnvTool, OpenEnv, ToolManager
from envhub.errors import EnvHubError
from envhub.server import ServerThread, create_app

sys.path.insert(0, str(Path(__file__).resolve().parent))
from guess_env import GuessEnv

SYSTEM = "You are playing a game through tools. Call exactly one tool per turn."


def scripted_model() -> FastAPI:
    """A stand-in chat-completions endpoint: reads the conversation and bisects the guessing game."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> dict[str, Any]:
        messages = (await request.json())["messages"]
        low, high, last = 1, 100, None
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                last = json.loads(m["tool_calls"][0]["function"]["arguments"])["number"]
            elif m["role"] == "tool" and last is not None:
                low, high = (last + 1, high) if m["content"] == "Higher." else (low, last - 1)
        call = {"id": f"call_{len(messages)}", "type": "function",
                "function": {"name": "guess", "arguments": json.dumps({"number": (low + high) // 2})}}
        return {"object": "chat.completion", "model": "scripted",
                "choices": [{"index": 0, "finish_reason": "tool_calls",
                             "message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}

    return app


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1")
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--env-url", help="env server URL (default: serve examples/guess_env.py here)")
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--max-turns", type=int, default=12)
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.max_turns < 1:
        parser.error(f"expected --episodes and --max-turns >= 1, got {args.episodes} and {args.max_turns}")
    summaries = []
    with ExitStack() as stack:
        base_url = args.base_url or stack.enter_context(ServerThread(scripted_model(), log_level="warning")).url + "/v1"
        env_url = args.env_url or stack.enter_context(ServerThread(create_app(GuessEnv), log_level="warning")).url
        client = ChatCompletionsClient(base_url, model=args.model, api_key=args.api_key, temperature=0.7)
        for seed in range(args.episodes):
            try:
                with OpenEnv(env_url) as env:
                    first = env.reset(seed=seed)
                    tools = ToolManager(EnvTool.from_env(env))
                    messages = [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": first.observation.text}]
                    result = run_agent(client, tools, messages, max_turns=args.max_turns)
            except EnvHubError as exc:  # the env server or the model endpoint failed (ChatModelError is one)
                sys.exit(f"openai_agent: error: {exc}")
            summary = {"seed": seed, "turns": result.turns, "tool_calls": result.tool_calls,
                       "stop": result.stop_reason, "reward": result.reward}
            print(json.dumps(summary))
            summaries.append(summary)
    return summaries


if __name__ == "__main__":
    main()
