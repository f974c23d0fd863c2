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
                 "--full-parameter", "--idle-timeout-s", "--state-dir", "--max-lora-rank", "--sampler-servers",
                 "--max-pass-tokens"):
        assert flag in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--token", "secret"], "start with 'tml-'"),
    (["--max-tenants", "0"], "--max-tenants >= 1"),
    (["--model-config", "no_such_field=1"], "--model-config KEY=VALUE"),
    (["--model-config", "hidden_size=abc"], "Expected --model-config.hidden_size to be an integer, got 'abc'."),
    (["--max-lora-rank", "0"], "--max-lora-rank >= 1"),
    (["--max-pass-tokens", "0"], "--max-pass-tokens >= 1"),
    (["--sampler-servers", "127.0.0.1:8100"], "URLs like http://host:8100"),
    (["--sampler-servers", "http://127.0.0.1:8100", "--sampler", "vllm"], "no --sampler vllm with --sampler-servers"),
])
def test_bad_settings_exit_2_with_the_fix(argv, message, capsys, tmp_path):
    assert main(["serve", "--port", "0", "--state-dir", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_sampler_vllm_without_vllm_names_the_setup_command(capsys, tmp_path):
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here: tests/service/test_service_vllm.py serves with it")
    assert main(["serve", "--port", "0", "--state-dir", str(tmp_path), "--sampler", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "--sampler vllm" in err and "scripts/setup.sh envs,train,vllm" in err


def test_a_port_in_use_is_one_line_and_status_2(capsys, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"envhub-train serve: Could not listen on 127.0.0.1:{port}: Address already in use (another "
                   "process listens there: stop it or pick another --port).\n")
