"""A scaled env service behind the HAProxy service of compose/replicas.yml: sessions spread over the replicas,
a resume goes back to the replica holding the session (or is refused clearly once it is gone), and a
trainer's ``env.urls`` spreads its episodes over several servers."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import urllib.request

import pytest
from compose_project import COMPOSE, REPLICAS, ComposeProject, build_images, engine_problem, health, wait_for

from envhub.client import EnvClient
from envhub.errors import SessionLostError

pytestmark = [pytest.mark.docker, pytest.mark.slow]
SESSIONS = 6


@pytest.fixture(scope="module")
def replicas():
    problem = engine_problem()
    if problem:
        pytest.skip(problem)
    build_images()
    project = ComposeProject.create("envhub-replicas", [COMPOSE, REPLICAS], MATH_REPLICAS="2")
    try:
        project.up("math", "math-proxy")
        _wait_until_the_proxy_uses_both_replicas(project)
        yield project
    finally:
        project.down()


def _wait_until_the_proxy_uses_both_replicas(project: ComposeProject, timeout_s: float = 90) -> None:
    """`up --wait` sees containers healthy; the proxy needs a DNS refresh and a health check more."""
    async def spread() -> bool:
        clients = [EnvClient(project.url("math", "ws")) for _ in range(2)]
        try:
            for env in clients:
                await env.reset(seed=0)
            return sorted(_metric(u, "envhub_sessions_active") for u in _replica_urls(project)) == [1, 1]
        finally:
            for env in clients:
                await env.close()

    def both_used() -> bool:
        ok = asyncio.run(spread())
        wait_for(lambda: sum(_metric(u, "envhub_sessions_active") for u in _replica_urls(project)) == 0, 30,
                 "the probe sessions to close")
        return ok

    wait_for(both_used, timeout_s, "the proxy to spread sessions over both replicas", interval_s=1.0)


def _replica_urls(project: ComposeProject) -> list[str]:
    """Each math replica's own address on the compose network (reachable from the host)."""
    urls = []
    for c in project.containers("math"):
        [net] = c["NetworkSettings"]["Networks"].values()
        urls.append(f"http://{net['IPAddress']}:8001")
    return sorted(urls)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _server_pid(container: dict) -> int:
    init = container["State"]["Pid"]
    with open(f"/proc/{init}/task/{init}/children") as f:
        [child] = f.read().split()
    return int(child)


def test_two_replicas_serve_behind_the_proxy(replicas: ComposeProject) -> None:
    assert len(replicas.containers("math")) == 2
    [proxy] = replicas.containers("math-proxy")
    assert proxy["State"]["Health"]["Status"] == "healthy"
    assert proxy["HostConfig"]["ReadonlyRootfs"] and proxy["HostConfig"]["CapDrop"] == ["ALL"]
    assert all(health(url) for url in _replica_urls(replicas))


def test_sessions_spread_over_the_replicas_and_resume_on_the_one_holding_them(replicas: ComposeProject) -> None:
    replica_urls = _replica_urls(replicas)
    resumes_before = sum(_metric(u, "envhub_resumes_total") for u in replica_urls)

    async def run() -> list[dict]:
        clients = [EnvClient(replicas.url("math", "ws")) for _ in range(SESSIONS)]
        try:
            for i, env in enumerate(clients):
                await env.reset(seed=i)
            active = [_metric(u, "envhub_sessions_active") for u in replica_urls]
            assert sorted(active) == [SESSIONS // 2, SESSIONS // 2], active  # least connections: 3 and 3
            ids = [env.session_id for env in clients]
            for env in clients:
                env._ws.transport.abort()  # the network drops every connection
            states = [await env.state() for env in clients]  # each resumes through the proxy
            assert [env.session_id for env in clients] == ids
            return states
        finally:
            for env in clients:
                await env.close()

    states = asyncio.run(run())
    assert len(states) == SESSIONS and all(s for s in states)
    assert sum(_metric(u, "envhub_resumes_total") for u in replica_urls) - resumes_before == SESSIONS


def test_a_resume_after_its_replica_died_is_refused_with_a_clear_error(replicas: ComposeProject) -> None:
    async def run() -> None:
        async with EnvClient(replicas.url("math", "ws")) as env:
            await env.reset(seed=0)
            holder = next(c for c in replicas.containers("math")
                          if _metric(f"http://{next(iter(c['NetworkSettings']['Networks'].values()))['IPAddress']}:8001",
                                     "envhub_sessions_active") == 1)
            os.kill(_server_pid(holder), signal.SIGKILL)
            env._ws.transport.abort()
            with pytest.raises(SessionLostError, match="SESSION_EXPIRED.*start a new session"):
                await env.state()
            result = await env.reset(seed=1)  # a fresh session on a live replica
            assert result.observation.text

    asyncio.run(run())
    wait_for(lambda: len([c for c in replicas.containers("math") if c["State"]["Running"]]) == 2, 60,
             "the killed replica to restart")


def test_trainer_env_urls_spread_episodes_over_the_servers(replicas: ComposeProject) -> None:
    from trainer.config import load_config
    from trainer.rollout import EnvPool, RolloutConfig, RolloutEngine, StopReason, make_tasks
    from trainer.sampling import SampledSequence
    from trainer.tokenizer import build_tiny_tokenizer

    wait_for(lambda: all(health(u) for u in _replica_urls(replicas)), 120, "both replicas healthy")
    replica_urls = _replica_urls(replicas)
    ws_urls = [u.replace("http://", "ws://") for u in replica_urls]
    cfg = load_config(None, [f"env.urls={ws_urls!r}"])
    tok = build_tiny_tokenizer()

    class Answer:
        version = 0

        def update_weights(self, model, version: int) -> None:
            self.version = version

        async def generate(self, request):
            ids = tok.encode("\\boxed{3}", add_special_tokens=False) + [tok.eos_token_id]
            return SampledSequence(ids, [-0.5] * len(ids), "stop")

    before = [_metric(u, "envhub_sessions_total") for u in replica_urls]
    tasks = make_tasks([{"problem": "1 + 2", "answer": "3"}] * 4, 2, cfg.env.all_urls())
    engine = RolloutEngine(EnvPool(urls=cfg.env.all_urls()), Answer(), tok, RolloutConfig(max_turns=1))
    trajs = asyncio.run(engine.run(tasks))
    assert [t.stop_reason for t in trajs] == [StopReason.DONE] * 8 and {t.reward for t in trajs} == {1.0}
    opened = [_metric(u, "envhub_sessions_total") - b for u, b in zip(replica_urls, before)]
    assert all(n >= 1 for n in opened) and sum(opened) >= 2, opened
