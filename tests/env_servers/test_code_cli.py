"""``python -m env_servers.code_env`` flags: env options, sandbox selection, server settings."""

from __future__ import annotations

import pytest

from env_servers.code_env.__main__ import parse


def test_env_options_become_constructor_kwargs():
    sandbox, env_config, settings = parse(["--port", "8004", "--reward-mode", "all_or_nothing", "--stateful", "true",
                                           "--run-timeout-s", "2.5", "--max-sessions", "8"])
    assert sandbox is None
    assert env_config == {"reward_mode": "all_or_nothing", "stateful": True, "run_timeout_s": 2.5}
    assert settings == {"host": None, "port": 8004, "max_sessions": 8}


def test_backend_and_slots_select_the_sandbox():
    sandbox, _, _ = parse(["--backend", "local-bwrap", "--slots", "3"])
    assert sandbox is not None and (sandbox.backend, sandbox.slots) == ("local-bwrap", 3)


def test_bad_values_fail_before_serving(capsys):
    with pytest.raises(ValueError, match="reward_mode"):
        parse(["--reward-mode", "sometimes"])
    with pytest.raises(SystemExit):
        parse(["--backend", "chroot"])
    assert "invalid choice" in capsys.readouterr().err
