"""Gomoku served for real: concurrent WebSocket sessions, two-agent matches across sockets, OpenEnv clients, the CLI."""

import asyncio
import random
import subprocess
import sys
import time
from io import BytesIO

import pytest

from env_servers.gomoku_env import GomokuEnv, GomokuMatchEnv
from envhub.client import EnvClient
from envhub.server import ServerThread, create_app
from envhub.settings import Settings

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def gomoku_server():
    app = create_app(GomokuEnv, settings=Settings(max_sessions=300, idle_timeout_s=60), opponent="random")
    with ServerThread(app) as server:
        yield server


@pytest.fixture(scope="module")
def match_server():
    app = create_app(GomokuMatchEnv, settings=Settings(max_sessions=300, idle_timeout_s=60), turn_timeout_s=10.0)
    with ServerThread(app) as server:
        yield server


def free_cell(result, rng):
    rows = result.observation.metadata["board"]
    return rng.choice([(r, c) for r, row in enumerate(rows) for c, cell in enumerate(row) if cell == "."])


async def test_256_concurrent_sessions_play_to_the_end(gomoku_server):
    async def episode(i):
        rng = random.Random(i)
        async with EnvClient(gomoku_server.url) as env:
            result = await env.reset(seed=i)
            moves = 0
            while not (result.done or result.truncated) and moves < 4:
                r, c = free_cell(result, rng)
                result = await env.step({"text": f"<move>{r},{c}</move>"})
                moves += 1
            return moves, result.info["event"]

    start = time.monotonic()
    results = await asyncio.gather(*(episode(i) for i in range(256)))
    elapsed = time.monotonic() - start
    assert all(moves >= 1 and event in {"valid", "win", "loss", "draw"} for moves, event in results)
    assert elapsed < 60, f"256 sessions took {elapsed:.1f}s"


async def test_a_game_over_the_wire_with_images_and_tools(gomoku_server):
    from PIL import Image

    async with EnvClient(gomoku_server.url) as env:
        assert [t.name for t in await env.tools()] == ["place_stone"]
        first = await env.reset(seed=4, render_image=True, opening=[])
        assert "system_prompt" in first.observation.metadata
        assert Image.open(BytesIO(first.observation.images[0])).format == "PNG"
        bad = await env.step({"text": "no move"})
        assert bad.reward == -1.0 and not bad.done and bad.info["event"] == "bad_format"
        ok = await env.step({"tool_name": "place_stone", "arguments": {"row": 4, "col": 4}})
        assert ok.info["event"] == "valid" and ok.info["episode_reward"] == -1.0
        assert ok.observation.metadata["board"][4][4] == "X"
        state = await env.state()
        assert state["agent_moves"] == 1 and state["step_count"] == 2


async def test_two_agents_over_websockets_zero_sum(match_server):
    async def seat(name, moves):
        async with EnvClient(match_server.url, message_timeout_s=30) as env:
            result = await env.reset(match_id="ws-1", seat=name, opening=[])
            for r, c in moves:
                result = await env.step({"text": f"<move>{r},{c}</move>"})
                if result.done or result.truncated:
                    break
            return result

    x, o = await asyncio.gather(seat("X", [(0, c) for c in range(5)]), seat("O", [(8, c) for c in range(5)]))
    assert (x.info["end_reason"], x.reward) == ("win", 10.0)
    assert (o.info["end_reason"], o.reward) == ("loss", -10.0)
    assert x.info["episode_reward"] + o.info["episode_reward"] == 0.0


async def test_a_closed_socket_ends_the_match_for_the_other_player(match_server):
    x_env = EnvClient(match_server.url, message_timeout_s=30)
    o_env = EnvClient(match_server.url, message_timeout_s=30)
    await x_env.reset(match_id="ws-2", seat="X", opening=[])
    x_step = asyncio.create_task(x_env.step({"text": "<move>4,4</move>"}))
    first = await o_env.reset(match_id="ws-2", seat="O")
    assert first.observation.metadata["board"][4][4] == "X"
    await o_env.close()
    result = await asyncio.wait_for(x_step, 10)
    assert result.truncated and result.reward == 0.0 and result.info["end_reason"] == "opponent_disconnected"
    await x_env.close()


@pytest.mark.interop
@pytest.mark.slow
def test_unmodified_openenv_generic_client_plays(gomoku_server):
    generic = pytest.importorskip("openenv.core.generic_client")
    with generic.GenericEnvClient(base_url=gomoku_server.url).sync() as env:
        first = env.reset(seed=1, opening=[])
        assert "Your turn (X)" in first.observation["text"]
        result = env.step({"text": "<move>4,4</move>"})
        assert result.reward == 0.0 and not result.done
        result = env.step({"tool_name": "place_stone", "arguments": {"row": 4, "col": 4}})
        assert result.reward == -1.0  # occupied


def test_openenv_wrapper_and_envtool_play_a_game(gomoku_server):
    from envhub import EnvTool, OpenEnv

    env = OpenEnv(gomoku_server.url)
    try:
        env.reset(seed=2, opening=[])
        (place,) = EnvTool.from_env(env)
        assert place.tool_info()["function"]["name"] == "place_stone"
        rng = random.Random(0)
        while not place.done:
            result = env.last_result
            r, c = free_cell(result, rng)
            text = place(row=r, col=c)
            assert "Opponent placed" in text or place.done
        assert env.last_result.info["end_reason"] in {"win", "loss", "draw"}
        assert place.episode_reward == env.last_result.info["episode_reward"]
    finally:
        env.close()


@pytest.mark.slow
def test_python_dash_m_serves_on_the_given_port(serve_process):
    server = serve_process([sys.executable, "-m", "env_servers.gomoku_env", "--host", "127.0.0.1",
                            "--board-size", "7", "--max-sessions", "4", "--opponent", "random",
                            "--reward", "valid=2", "--reward", "occupied=-3"])

    async def play():
        async with EnvClient(server.url) as env:
            first = await env.reset(seed=0, opening=[])
            legal = await env.step({"text": "<move>3,3</move>"})
            occupied = await env.step({"text": "<move>3,3</move>"})
            return first.observation.metadata["board_size"], legal.reward, occupied.reward

    assert asyncio.run(play()) == (7, 2.0, -3.0)  # the reward table from --reward


@pytest.mark.parametrize("bad", ["bogus=1", "win", "win=x", "win=nan", "valid=inf"])
def test_the_reward_flag_refuses_unknown_names_and_non_finite_values(bad, capsys):
    from env_servers.gomoku_env.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--reward", bad])
    assert "--reward" in capsys.readouterr().err


def test_every_gomoku_config_field_has_a_flag():
    import dataclasses

    from env_servers.gomoku_env.__main__ import env_config, parse_args
    from env_servers.gomoku_env.config import GomokuConfig

    assert env_config(parse_args([])) == {}  # unset flags leave the defaults to GomokuConfig
    argv = ["--board-size", "7", "--win-length", "4", "--opponent", "random", "--opponent-random-prob", "0.5",
            "--max-invalid-moves", "2", "--max-moves", "30", "--opening-max-stones", "0", "--empty-board-prob", "1",
            "--render-image", "--brief-messages", "--move-format", "cell", "--turn-timeout-s", "9",
            "--reward", "missed_win=-5"]
    config = env_config(parse_args(argv))
    assert set(config) == {f.name for f in dataclasses.fields(GomokuConfig)}  # a new field needs its flag
    built = GomokuConfig(**config)
    assert (built.board_size, built.move_format, built.render_image, built.rewards.missed_win) == (7, "cell", True, -5.0)


@pytest.mark.slow
def test_example_agent_runs():
    out = subprocess.run([sys.executable, "examples/gomoku_agent.py"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tool game") == 2 and "two-agent match" in out.stdout
    assert "costs -1" in out.stdout
