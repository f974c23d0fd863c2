"""Rollouts over real WebSocket servers on loopback ports: same trajectories as in process, and a dead server
costs only its episodes: the engine reconnects once the server is back."""

from __future__ import annotations

import threading
import time

import pytest
from rollout_fakes import AddEnv, CalcEnv, ScriptedSampler, add_answer

from envhub.server import create_app
from envhub.server.run import ServerThread
from trainer.rollout import EnvPool, RolloutConfig, RolloutEngine, StopReason, make_tasks
from trainer.tokenizer import build_tiny_tokenizer

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def remote_engine(urls, tok, respond, **pool_kw) -> RolloutEngine:
    return RolloutEngine(EnvPool(urls=urls, **pool_kw), ScriptedSampler(tok, respond), tok,
                         RolloutConfig(max_turns=3))


async def test_remote_episodes_match_in_process_ones_token_for_token(tok) -> None:
    tasks = make_tasks([{"a": a, "b": 9 - a} for a in range(4)], 2)
    local = await RolloutEngine(EnvPool(env_cls=AddEnv), ScriptedSampler(tok, add_answer), tok).run(tasks)
    with ServerThread(create_app(AddEnv)) as srv:
        remote = await remote_engine([srv.url], tok, add_answer).run(make_tasks([t.reset_kwargs for t in tasks[::2]], 2,
                                                                               urls=[srv.url]))
    assert [t.stop_reason for t in remote] == [StopReason.DONE] * 8
    assert [t.tokens for t in remote] == [t.tokens for t in local]
    assert [t.reward for t in remote] == [1.0] * 8


async def test_tool_env_over_websocket(tok) -> None:
    def respond(prompt: str) -> str:
        if "<tool_response>" not in prompt:
            return '<tool_call>\n{"name": "add", "arguments": {"x": 2, "y": 5}}\n</tool_call>'
        return "7"

    with ServerThread(create_app(CalcEnv)) as srv:
        [traj] = await remote_engine([srv.ws_url], tok, respond).run(make_tasks([{}], 1, urls=[srv.ws_url]))
    assert traj.stop_reason is StopReason.DONE and traj.reward == 1.0 and traj.tool_calls == 1
    assert "<tool_response>\n7\n</tool_response>" in tok.decode(traj.tokens)


async def test_dead_server_costs_its_episodes_and_the_engine_reconnects_when_it_is_back(tok) -> None:
    srv = ServerThread(create_app(AddEnv)).start()
    port, url = srv.port, srv.url
    srv.stop()
    engine = remote_engine([url], tok, add_answer, connect_retry_s=0.3, connect_timeout_s=0.5)
    lost = await engine.run(make_tasks([{"a": 1, "b": 1}], 3, urls=[url]))
    assert [t.stop_reason for t in lost] == [StopReason.ENV_ERROR] * 3 and all(t.infra_failed for t in lost)

    # Episodes started while the server is down wait in PENDING and connect once it is back.
    engine = remote_engine([url], tok, add_answer, connect_retry_s=20.0, connect_timeout_s=0.5)
    revived: list[ServerThread] = []
    restart = threading.Timer(0.5, lambda: revived.append(ServerThread(create_app(AddEnv), port=port).start()))
    restart.start()
    try:
        t0 = time.monotonic()
        back = await engine.run(make_tasks([{"a": 2, "b": 2}], 3, urls=[url]))
    finally:
        restart.join()
        for s in revived:
            s.stop()
    assert [t.stop_reason for t in back] == [StopReason.DONE] * 3 and [t.reward for t in back] == [1.0] * 3
    assert engine.pool.reconnects >= 1 and time.monotonic() - t0 >= 0.4
