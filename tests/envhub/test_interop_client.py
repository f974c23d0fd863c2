"""Unmodified OpenEnv clients against an envhub server: openenv-core 0.3 (this venv) and openenv 0.10 (own venv).

openenv 0.10 conflicts with openenv-core in one venv, so its client runs in a second venv
(``python3 -m venv .venv-openenv010 && .venv-openenv010/bin/pip install "openenv==0.10.*"``,
interpreter overridable with ``ENVHUB_OPENENV010_PYTHON``); those tests skip without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from envhub import Env, Observation, StepResult
from envhub.testing import EchoEnv

pytestmark = [pytest.mark.interop, pytest.mark.live]

generic_client = pytest.importorskip("openenv.core.generic_client")
GenericEnvClient = generic_client.GenericEnvClient

REPO = Path(__file__).resolve().parents[2]
OPENENV010_PYTHON = Path(os.environ.get("ENVHUB_OPENENV010_PYTHON", REPO / ".venv-openenv010" / "bin" / "python"))
# Present only once `pip install "openenv==0.10.*"` finished in that venv.
HAS_OPENENV010 = (OPENENV010_PYTHON.exists() and any(
    OPENENV010_PYTHON.parent.parent.glob("lib/python3*/site-packages/openenv/core/generic_client.py"))) \
    or (OPENENV010_PYTHON.exists() and "ENVHUB_OPENENV010_PYTHON" in os.environ)


class TextEnv(Env):
    """Default action model (text or tool call): counts characters."""

    def reset(self, seed=None, prefix: str = ""):
        self.total = 0
        return Observation(text=prefix + "start")

    def on_text(self, text: str):
        self.total += len(text)
        return StepResult(observation=Observation(text=f"{self.total}"), reward=float(len(text)),
                          done=self.total >= 10)

    def state(self):
        return {"total": self.total}


async def test_async_generic_client_echo(serve_env):
    srv = serve_env(EchoEnv)
    async with GenericEnvClient(base_url=srv.url) as client:
        first = await client.reset(seed=1)
        assert first.observation["echoed_message"] == "ready"
        result = await client.step({"message": "hello"})
        assert result.observation["echoed_message"] == "hello" and result.observation["message_length"] == 5
        assert result.reward == pytest.approx(0.5) and result.done is False
        state = await client.state()
        assert state["step_count"] == 1 and state["messages"] == 1


def test_sync_generic_client_default_action(serve_env):
    srv = serve_env(TextEnv)
    with GenericEnvClient(base_url=srv.url).sync() as client:
        assert client.reset(prefix="> ").observation["text"] == "> start"
        assert client.step({"text": "abcd"}).reward == 4.0
        last = client.step({"text": "abcdefg"})
        assert last.observation["text"] == "11" and last.done is True
        assert client.state()["total"] == 11


async def test_openenv_client_sees_errors_and_the_session_survives(serve_env):
    srv = serve_env(EchoEnv)
    async with GenericEnvClient(base_url=srv.url) as client:
        await client.reset()
        with pytest.raises(Exception, match="VALIDATION_ERROR|message"):
            await client.step({"msg": "typo"})
        assert (await client.step({"message": "fine"})).observation["echoed_message"] == "fine"


def test_openenv_runtime_validation_passes(serve_env):
    validation = pytest.importorskip("openenv.cli._validation")
    srv = serve_env(EchoEnv)
    report = validation.validate_running_environment(srv.url)
    assert report["passed"] is True, [c for c in report["criteria"] if not c["passed"]]
    assert report["mode"] == "simulation"


@pytest.mark.slow  # the openenv CLI takes ~20 s to import on a busy 2-core machine
def test_openenv_validate_cli_passes(serve_env):
    openenv_cli = shutil.which("openenv", path=str(Path(sys.executable).parent))
    if openenv_cli is None:
        pytest.skip("the openenv CLI is not installed in this venv")
    srv = serve_env(EchoEnv)
    proc = subprocess.run([openenv_cli, "validate", "--url", srv.url], capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout)
    assert report["passed"] is True, [c for c in report["criteria"] if not c["passed"]]


CLIENT_010 = textwrap.dedent('''
    import asyncio, json, sys
    from openenv.core.generic_client import GenericEnvClient

    async def main(url):
        async with GenericEnvClient(base_url=url) as c:
            first = await c.reset()
            step = await c.step({"message": "hi there"})
            state = await c.state()
        with GenericEnvClient(base_url=url).sync() as s:
            s.reset()
            sync_step = s.step({"message": "sync"})
        print(json.dumps({"first": first.observation, "step": step.observation, "reward": step.reward,
                          "state": state, "sync": sync_step.observation}))

    asyncio.run(main(sys.argv[1]))
''')


@pytest.mark.slow  # a second interpreter importing openenv: ~5 s
@pytest.mark.skipif(not HAS_OPENENV010, reason=f"no openenv 0.10 venv at {OPENENV010_PYTHON}")
def test_openenv_010_client_against_envhub(serve_env, tmp_path):
    srv = serve_env(EchoEnv)
    script = tmp_path / "client010.py"
    script.write_text(CLIENT_010)
    proc = subprocess.run([str(OPENENV010_PYTHON), str(script), srv.url], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"]["echoed_message"] == "ready"
    assert out["step"]["echoed_message"] == "hi there" and out["reward"] == pytest.approx(0.8)
    assert out["state"]["step_count"] == 1
    assert out["sync"]["echoed_message"] == "sync"
