"""``envhub serve`` / ``envhub check`` as a user runs them, settings from ``ENVHUB_*``, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from envhub.cli import build_parser, main, parse_set
from envhub.settings import Settings

ENV_MODULE = textwrap.dedent('''
    import time
    from pathlib import Path
    from envhub import Env, Observation, StepResult

    class SlowEnv(Env):
        """Steps sleep; close() leaves a marker file."""

        def __init__(self, marker: str = "closed.txt", delay: float = 1.0):
            self.marker, self.delay = marker, delay

        def reset(self, seed=None):
            return Observation(text="ready")

        def on_text(self, text):
            time.sleep(self.delay)
            return StepResult(observation=Observation(text="slept " + text))

        def close(self):
            Path(self.marker).write_text("closed")
''')


def test_settings_from_env_with_overrides_and_validation():
    env = {"ENVHUB_PORT": "9001", "ENVHUB_STEP_TIMEOUT_S": "2.5", "ENVHUB_IDLE_TIMEOUT_S": "none",
           "ENVHUB_COMPRESSION": "true", "ENVHUB_TOKEN": "t"}
    s = Settings.from_env(env)
    assert (s.port, s.step_timeout_s, s.idle_timeout_s, s.compression, s.token) == (9001, 2.5, None, True, "t")
    assert Settings.from_env(env, port=9002, max_sessions=None).port == 9002
    with pytest.raises(ValueError, match="ENVHUB_PORT to be int"):
        Settings.from_env({"ENVHUB_PORT": "eighty"})
    with pytest.raises(ValueError, match="max_sessions"):
        Settings(max_sessions=0)
    with pytest.raises(TypeError, match="Unknown setting"):
        Settings.from_env({}, colour="blue")


def test_parse_set_reads_json_or_plain_strings():
    assert parse_set(["n=3", "name=hard", "flags=[1, 2]", "empty="]) == {"n": 3, "name": "hard", "flags": [1, 2],
                                                                        "empty": ""}


def test_help_lists_subcommands_and_serve_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--max-sessions", "--token", "--step-timeout", "--idle-timeout", "--set",
                 "--resume-grace", "--max-message-bytes", "--ping-interval", "--ping-timeout", "--threads"):
        assert flag in out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "check" in capsys.readouterr().out


def test_check_command_reports_results(capsys):
    assert main(["check", "envhub.testing:EchoEnv"]) == 0
    out = capsys.readouterr().out
    assert "[ok] reset returns an observation" in out and "7 passed, 0 failed" in out
    assert main(["check", "envhub.testing:NoSuchEnv"]) == 2
    assert "no attribute 'NoSuchEnv'" in capsys.readouterr().err
    # a --set the env refuses is one clear error before any check, as it is for serve (below)
    assert main(["check", "math", "--set", "nosuch=1"]) == 2
    assert "MathEnv(nosuch=1) failed: ConfigError: Unknown MathConfig option(s) ['nosuch']" in capsys.readouterr().err


def test_an_env_module_that_does_not_import_is_one_line(tmp_path: Path, monkeypatch, capsys):
    (tmp_path / "broken_env.py").write_text("from envhub import Env\n\nclass X(Env:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "broken_env:X"]) == 2
    err = capsys.readouterr().err  # file:line: the parser's message (it varies with the Python version): the line
    assert err.startswith(f"envhub check: error: {tmp_path / 'broken_env.py'}:3: ") and err.endswith(": class X(Env:\n")
    assert main(["serve", "no_such_env_module:X", "--port", "1"]) == 2
    assert capsys.readouterr().err == "envhub serve: error: No module named 'no_such_env_module'\n"


def test_serve_refuses_an_env_config_the_env_refuses_before_it_listens(capsys):
    assert main(["serve", "math", "--set", "nosuch=1", "--port", "1"]) == 2
    assert capsys.readouterr().err.startswith("envhub serve: error: MathEnv(nosuch=1) failed: ConfigError: Unknown")


@pytest.mark.slow
def test_serve_then_sigterm_finishes_the_in_flight_step_and_closes_envs(tmp_path: Path, serve_process):
    (tmp_path / "slow_env.py").write_text(ENV_MODULE)
    marker = tmp_path / "closed.txt"
    server = serve_process(
        [sys.executable, "-m", "envhub", "serve", "slow_env:SlowEnv",
         "--set", f"marker={json.dumps(str(marker))}", "--set", "delay=1.0", "--max-sessions", "4"],
        cwd=tmp_path, env={**os.environ, "ENVHUB_LOG_LEVEL": "warning"}, timeout_s=20)
    proc = server.proc
    assert httpx.get(f"{server.url}/metadata").json()["envhub"]["max_sessions"] == 4
    marker.unlink()  # the env serve built once at start-up to check its --set, and closed: the sessions' are next

    async def session() -> tuple[dict, int, float, float]:
        async with websockets.connect(server.ws_url) as ws, websockets.connect(server.ws_url) as idle:
            for conn in (ws, idle):
                await conn.send(json.dumps({"type": "reset"}))
                await conn.recv()
            await ws.send(json.dumps({"type": "step", "data": {"text": "zz"}}))
            await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(idle.recv(), 10)
            idle_closed_after = time.monotonic() - signalled
            reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
            reply_after = time.monotonic() - signalled
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 10)
            return reply, info.value.rcvd.code, idle_closed_after, reply_after

    reply, code, idle_closed_after, reply_after = asyncio.run(session())
    assert reply["data"]["observation"]["text"] == "slept zz"  # the in-flight step finished
    assert code == 1001
    assert idle_closed_after < reply_after  # idle sessions did not wait for the busy one
    # uvicorn re-raises the captured SIGTERM once shutdown completed, so -SIGTERM is a clean exit too
    assert proc.wait(15) in (0, -signal.SIGTERM)
    assert marker.read_text() == "closed"
