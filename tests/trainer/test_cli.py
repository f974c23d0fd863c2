"""``envhub-train``: TOML + overrides, config printing, clear errors, the SFT mode end to end."""

from __future__ import annotations

import json

import pytest

from trainer.cli import main
from trainer.config import load_config


def test_toml_then_overrides_then_print(tmp_path, capsys) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[algo]\nname = "ppo"\n[run]\nsteps = 7\n[env]\nurl = "ws://a:1"\n')
    assert main(["--config", str(path), "run.steps=9", "rollout.max_turns=3", "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["algo"]["name"] == "ppo" and cfg["run"]["steps"] == 9 and cfg["rollout"]["max_turns"] == 3
    assert cfg["env"]["url"] == "ws://a:1"


def test_example_configs_load() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples" / "configs"
    for name in ("math_grpo", "gomoku_grpo", "geometry_ppo", "code_rloo", "openenv_shout_grpo", "geometry_vision_grpo",
                 "shapes_vision_grpo"):  # one per env, and the vision ones
        path = root / f"{name}.toml"
        cfg = load_config(path)
        assert cfg.env.all_urls(), path


def test_bad_key_and_missing_env_are_clear_errors(capsys) -> None:
    assert main(["algo.nmae=grpo"]) == 2
    assert "Unknown key(s) ['nmae'] in [algo]" in capsys.readouterr().err
    assert main(["run.steps=1"]) == 2
    assert "env.url=ws://host:port" in capsys.readouterr().err
    assert main(["algo.name=dpo"]) == 2
    assert "Expected algo.name in" in capsys.readouterr().err


@pytest.mark.parametrize("override, expected", [
    ("run.steps=abc", "Expected run.steps to be an integer, got 'abc'."),
    ("run.batch_size=1.5", "Expected run.batch_size to be an integer, got 1.5."),
    ("run.eval_every=true", "Expected run.eval_every to be an integer, got True."),
    ("optim.lr=abc", "Expected optim.lr to be a number, got 'abc'."),
    ("sampling.temperature=hot", "Expected sampling.temperature to be a number, got 'hot'."),
    ("rollout.max_turns=[1]", "Expected rollout.max_turns to be an integer, got [1]."),
    ("env.urls=[1, 2]", "Expected env.urls to be a list of strings, got [1, 2]."),
    ("algo.filter_zero_variance=1", "Expected algo.filter_zero_variance to be true or false, got 1."),
    ("model.name=7", "Expected model.name to be a string, got 7."),
    ("env.url=[1]", "Expected env.url to be a string or none (left out), got [1]."),
])
def test_a_value_of_the_wrong_type_is_refused_with_the_key_and_the_type(override: str, expected: str, capsys) -> None:
    assert main([override, "model.name=tiny", "--print-config"] if not override.startswith("model.name")
                else [override, "--print-config"]) == 2
    assert expected in capsys.readouterr().err
    # an int where a number goes is a number; TOML's own types pass through
    cfg = load_config(None, ["optim.lr=1", "algo.kl_coef=0", "env.train_task={split='train'}", "optim.betas=[0.9, 0.95]"])
    assert cfg.optim.lr == 1 and cfg.env.train_task == {"split": "train"}


def test_optimizer_betas_must_be_two_numbers() -> None:
    assert load_config(None, ["optim.betas=[0.9, 0.95]"]).optim.betas == (0.9, 0.95)
    with pytest.raises(ValueError, match=r"optim\.betas"):  # torch's AdamW would fail only at the first step
        load_config(None, ["optim.betas=[0.9, 0.95, 0.99]"])


def test_aggregation_is_checked_when_the_config_loads(capsys) -> None:
    from trainer.core import AGGREGATIONS

    for name in AGGREGATIONS:  # every value the loss accepts loads
        assert load_config(None, [f"algo.aggregation='{name}'"]).algo.aggregation == name
    # a typo fails at start-up with the accepted values, not at the first loss computation
    assert main(["algo.aggregation=token_sum", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "Expected algo.aggregation in" in err and "seq_mean_token_mean" in err


def test_sft_mode_trains_and_exports(tmp_path, capsys) -> None:
    data = tmp_path / "demos.jsonl"
    demo = {"prompt": [{"role": "user", "content": "1+1?"}], "completion": "\\boxed{2}"}
    data.write_text("\n".join(json.dumps(demo) for _ in range(4)))
    rc = main(["sft", f"sft.data='{data}'", "sft.steps=3", "sft.batch_size=2", f"run.output_dir='{tmp_path / 'out'}'",
               "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1"])
    assert rc == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_loss"] > 0
    assert (tmp_path / "out" / "model" / "config.json").exists()
    # sft.epochs_limit=1 ends the run after one pass over the 4 demonstrations: 2 steps, not 3
    rc = main(["sft", f"sft.data='{data}'", "sft.steps=3", "sft.batch_size=2", "sft.epochs_limit=1",
               f"run.output_dir='{tmp_path / 'one_pass'}'", "model.hidden_size=32", "model.num_layers=1",
               "model.num_heads=2", "model.num_kv_heads=1"])
    assert rc == 0
    summary = json.loads((tmp_path / "one_pass" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["epochs"] == 1.0


@pytest.mark.slow
def test_envhub_train_submits_itself_through_the_scheduler(tmp_path):
    """``envhub-train --scheduler URL`` runs as a scheduler job and streams the job's output back."""
    import os
    import signal
    import subprocess
    import sys

    py = sys.executable
    sched = subprocess.Popen([py, "-m", "trainer.scheduler.cli", "serve", "--port", "0", "--db",
                              str(tmp_path / "s.db"), "--gpus", "0,1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url = None
        for line in sched.stdout:
            if "serving on" in line:
                url = line.rsplit(" ", 1)[1].strip()
                break
        assert url, "the scheduler did not start"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENVHUB_SCHEDULER")}
        run = subprocess.run([py, "-m", "trainer.cli", "--scheduler", url, "--gpus", "1", "--print-config",
                              "algo.name=rloo"], capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr
        assert "submitted to" in run.stderr
        assert '"name": "rloo"' in run.stdout  # the job's own output, streamed back
        jobs = subprocess.run([py, "-m", "trainer.scheduler.cli", "list", "--json", "--url", url],
                              capture_output=True, text=True, timeout=60, env=env)
        (job,) = json.loads(jobs.stdout)
        assert job["state"] == "succeeded" and len(job["gpus"]) == 1
    finally:
        os.killpg(sched.pid, signal.SIGTERM)
        sched.wait(timeout=30)


def test_a_run_whose_episodes_all_fail_exits_1_naming_the_reason(tmp_path, capsys) -> None:
    # no validation (it would stop the run before training: the next test), so the steps' watch stops it
    rc = main(["env.env_class='test_recipes:BrokenEnv'", "env.train_task={}", "env.eval_task={}", "env.eval_key='seed'",
               "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
               "model.intermediate_size=64", "rollout.max_tokens_per_turn=4", "run.batch_size=2", "run.group_size=2",
               "run.eval_problems=0", "run.steps=5", "run.max_failed_steps=2", f"run.output_dir='{tmp_path}'"])
    err = capsys.readouterr().err
    assert rc == 1 and "envhub-train rl: Every episode failed in the last 2 steps" in err
    assert "4/4 episodes failed (4 with env_error)" in err and "backend down" in err


def test_a_subcommand_is_a_few_lines_and_every_mode_shares_the_config_shape(capsys, monkeypatch) -> None:
    from trainer import cli

    ports: list[int] = []
    echo = cli.Command("echo", "records its port", lambda p: p.add_argument("--port", type=int, required=True),
                       lambda args: ports.append(args.port) or 0)
    monkeypatch.setitem(cli.COMMANDS, "echo", echo)
    assert main(["echo", "--port", "5"]) == 0 and ports == [5]
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("rl", "sft", "two-agent", "echo"))
    # every training mode: overrides, --print-config, and load errors as exit status 2 naming the mode
    assert main(["sft", "sft.steps=3", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["sft"]["steps"] == 3
    assert main(["two-agent", "agents.carol.optim.lr=0.1"]) == 2
    assert "envhub-train two-agent: " in capsys.readouterr().err


def test_an_unknown_command_is_an_error_that_lists_the_commands(capsys) -> None:
    assert main(["inference", "--help"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'inference'" in err and all(name in err for name in ("rl", "sft", "two-agent", "serve",
                                                                                   "sampler"))
    # a first word that is an override still goes to the default command (rl): a config error, not a command one
    assert main(["no_such.key=1"]) == 2 and "unknown command" not in capsys.readouterr().err


def test_a_model_that_is_not_there_is_one_clear_line_and_status_2(capsys) -> None:
    # offline (model.local_files_only is on by default): Hugging Face's chained tracebacks stay out of it
    assert main(["model.name=no-such-org/no-such-model", "env.url=ws://127.0.0.1:9", "run.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("envhub-train rl: Could not load the tokenizer of 'no-such-org/no-such-model' offline")
    assert "huggingface-cli download no-such-org/no-such-model" in line and "model.local_files_only=false" in line


def test_a_dead_env_stops_the_run_at_the_first_validation_which_has_no_score(tmp_path, capsys) -> None:
    from trainer.local_server import free_port

    out = tmp_path / "run"
    assert main(["model.name=tiny", f"env.url='ws://127.0.0.1:{free_port()}'", "env.connect_retry_s=1", "run.steps=2",
                 "run.eval_problems=2", "run.batch_size=2", "run.group_size=2", f"run.output_dir='{out}'"]) == 1
    captured = capsys.readouterr()
    assert "Every validation episode before training failed (2)" in captured.err and "Traceback" not in captured.err
    assert "no episode completed: 2/2 episodes failed (2 with env_error)" in captured.out
    assert "Is the server running?" in captured.out
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["eval/episodes"] == 0 and first["eval/infra_failures"] == 2 and "eval/reward_mean" not in first


def test_sft_demonstrations_that_cannot_be_read_are_one_line_and_status_2(tmp_path, capsys) -> None:
    bad = tmp_path / "demos.jsonl"
    bad.write_text('{"prompt": "1+1", "completion": "2"}\n\nnot json\n')
    for data, expected in [(tmp_path / "missing.jsonl", "Could not read the demonstrations file"),
                           (bad, f"{bad}:3: expected a JSON object a line, got invalid JSON")]:
        assert main(["sft", "model.name=tiny", f"sft.data='{data}'", f"run.output_dir='{tmp_path / 'out'}'"]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err
    bad.write_text('["a list"]\n')
    assert main(["sft", "model.name=tiny", f"sft.data='{bad}'"]) == 2
    assert f"{bad}:1: expected a JSON object a line, got list." in capsys.readouterr().err


@pytest.mark.parametrize("overrides, expected", [
    (["env.env_class='no_such_module:Env'"], "env.env_class='no_such_module:Env': No module named 'no_such_module'"),
    (["env.env_class='env_servers.math_env:MathEnv'", "env.env_kwargs={nosuch=1}"],
     "MathEnv(nosuch=1) failed: ConfigError: Unknown MathConfig option(s) ['nosuch']"),
])
def test_an_in_process_env_that_cannot_be_built_is_refused_before_the_model_loads(overrides, expected, capsys) -> None:
    for mode in ("rl", "two-agent"):
        assert main([mode, "model.name=tiny", *overrides] if mode == "rl" else [mode, *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"envhub-train {mode}: ") and expected in err


def test_a_dead_match_env_stops_a_two_agent_run_at_the_first_validation(tmp_path, capsys) -> None:
    from trainer.local_server import free_port

    assert main(["two-agent", f"env.url='ws://127.0.0.1:{free_port()}'", "env.connect_retry_s=1", "run.eval_problems=2",
                 f"run.output_dir='{tmp_path}'"]) == 1
    captured = capsys.readouterr()
    assert "Every validation game before training failed on the env side" in captured.err
    assert "validation (eval0) of a: no game completed: 2/2 episodes failed (2 with env_error)" in captured.out
    assert "a=none (no game completed, 2 failed), b=none" in captured.out
