"""``envhub-train serve``'s command line: help, and bad settings refused before any model loads."""

from __future__ import annotations

import pytest

from trainer.cli import main


def test_serve_help_lists_the_service_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--port", "--host", "--model", "--served-name", "--sampler", "--token", "--max-tenants",
                 "--full-parameter", "--idle-timeout-s", "--state-dir"):
        assert flag in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--token", "secret"], "start with 'tml-'"),
    (["--max-tenants", "0"], "--max-tenants >= 1"),
    (["--model-config", "no_such_field=1"], "--model-config KEY=VALUE"),
    (["--sampler", "vllm"], "--sampler vllm"),
])
def test_bad_settings_exit_2_with_the_fix(argv, message, capsys, tmp_path):
    assert main(["serve", "--port", "0", "--state-dir", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
