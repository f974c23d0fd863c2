"""The scenario suite (``benchmarks/scenarios.py``): each scenario's config trains a step; the summary and figure are right."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import scenarios  # noqa: E402
from benchmarks._scenarios.common import RunResult, metric_curve  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.recipes.two_agent_config import load_two_agent_config  # noqa: E402


@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=[s.name for s in scenarios.SCENARIOS])
def test_each_scenario_config_loads_as_envhub_train_reads_it(scenario: scenarios.Scenario) -> None:
    path = ROOT / "examples" / "configs" / scenario.config
    command = "envhub-train" if scenario.command == "rl" else f"envhub-train {scenario.command}"  # rl: the default
    assert f"{command} --config examples/configs/{scenario.config}" in path.read_text()  # as its comment says
    if scenario.command == "two-agent":  # validation seeds are held out by the recipe's seed offset
        two = load_two_agent_config(path)
        assert len(two.agents) == 2 and two.match.eval_opponent == "random" and two.env.env_class
        return
    cfg = load_config(path)
    assert cfg.env.eval_task["split"] == "validation" != cfg.env.train_task["split"]
    task = cfg.env.eval_task
    if task.get("kind") == "add":  # a listed split: validation is all of it, each problem once
        from env_servers.math_env.tasks import listed_size

        assert cfg.run.eval_problems == listed_size("validation", "add", task["difficulty"]), scenario.config


@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=[s.name for s in scenarios.SCENARIOS])
def test_each_scenario_starts_and_trains_a_step(scenario: scenarios.Scenario, tmp_path: Path) -> None:
    result = scenario.run(scenario.config, 0, tmp_path, smoke=True, sets=("run.eval_problems=1",))  # a --set wins over --smoke's
    assert [step for step, _ in result.curve] == [0, 1]  # validated before training and after its one step
    assert all(0.0 <= value <= 1.0 for _, value in result.curve)
    runs = sorted(tmp_path.glob("**/metrics.jsonl"))  # one per policy: two agents, or vision and its text-only twin
    assert len(runs) == scenario.policies
    for path in runs:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert any("train/reward_mean" in r for r in records)
        assert [r["eval/episodes"] for r in records if "eval/episodes" in r] == [1, 1], path


IN_PROCESS = [s for s in scenarios.SCENARIOS if "env_class" in (ROOT / "examples" / "configs" / s.config).read_text()]


@pytest.mark.parametrize("scenario", IN_PROCESS, ids=[s.name for s in IN_PROCESS])
def test_a_scenario_config_with_its_env_in_process_trains_alone_with_envhub_train(scenario: scenarios.Scenario,
                                                                                   tmp_path: Path) -> None:
    from trainer.cli import main

    # two agents: room for the config's 3 groups against the random player and 2 against past versions beside
    # one head-to-head
    batch_size = 6 if scenario.command == "two-agent" else 2
    code = main([scenario.command, "--config", str(ROOT / "examples" / "configs" / scenario.config), "run.steps=1",
                 f"run.batch_size={batch_size}", "run.group_size=2", "run.eval_problems=2", "run.eval_every=0",
                 "rollout.max_turns=2", f"run.output_dir='{tmp_path}'"])
    assert code == 0
    runs = sorted(tmp_path.glob("**/metrics.jsonl"))
    assert len(runs) == (2 if scenario.command == "two-agent" else 1)
    assert all('"step": 1' in path.read_text() for path in runs)


def test_gomoku_logs_its_outcome_metrics_and_warms_up_on_legal_games(tmp_path: Path) -> None:
    from benchmarks._scenarios.gomoku import random_games
    from trainer.recipes.setup import in_process_env

    result = scenarios.pick("gomoku")[0].run("scenario_gomoku.toml", 0, tmp_path, smoke=True)
    assert [step for step, _ in result.extra["games lost on an invalid move"]] == [0, 1]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all({"eval/penalised_turn_frac", "eval/tool_call_rate"} <= set(r) for r in records if "eval/episodes" in r)
    assert any("train/penalised_turn_frac" in r for r in records)
    cfg = load_config(ROOT / "examples" / "configs" / "scenario_gomoku.toml")
    demos = random_games(in_process_env(cfg.env), "sys", 3, cfg.rollout.max_turns, seed=0)
    moves = [m for d in demos for m in d["messages"] if m["role"] == "assistant"]
    replies = [m["content"] for d in demos for m in d["messages"][3::2]]
    assert len(moves) >= 3 * 3 and not any("Invalid" in r for r in replies)  # every demo move was a legal one


def test_summary_counts_the_seeds_that_met_the_target_and_means_the_rest() -> None:
    scenario = scenarios.Scenario("s", "x.toml", "accuracy", 0.3, lambda *a: RunResult([], 0.0))
    runs = [RunResult([(0, 0.2), (10, 0.6)], 5.0), RunResult([(0, 0.3), (10, 0.4)], 7.0)]
    entry = scenarios.summarise(scenario, runs)
    assert entry["before"] == 0.25 and entry["after"] == 0.5 and entry["rise"] == 0.25
    assert entry["seeds_met"] == 1 and entry["seeds"] == 2 and entry["rise_per_seed"] == [0.4, 0.1]
    assert entry["steps"] == 10 and entry["seconds"] == 12.0


def test_the_figure_has_one_panel_per_scenario(tmp_path: Path) -> None:
    scenario = scenarios.Scenario("s", "x.toml", "accuracy", 0.3, lambda *a: RunResult([], 0.0))
    runs = [RunResult([(0, 0.2), (5, 0.4), (10, 0.6)], 1.0, extra={"invalid": [(0, 0.9), (10, 0.1)]}),
            RunResult([(0, 0.3), (5, 0.3), (10, 0.4)], 1.0, extra={"invalid": [(0, 0.7), (5, 0.5)]})]
    path = scenarios.plot([(scenario, runs), (scenario, runs[:1])], tmp_path / "scenarios.png")
    from PIL import Image

    width, height = Image.open(path).size
    assert width > 1.8 * height  # two panels side by side


def _two_agent_run(alice_h2h: list[float], bob_h2h: list[float]) -> RunResult:
    return RunResult([(0, 0.3), (10, 0.4), (20, 0.35)], 1.0, extra={
        "alice vs random": [(0, 0.4), (10, 0.6), (20, 0.5)], "bob vs random": [(0, 0.3), (10, 0.4), (20, 0.35)],
        "alice vs bob (head-to-head)": list(enumerate(alice_h2h, start=1)),
        "bob vs alice (head-to-head)": list(enumerate(bob_h2h, start=1))})


def test_two_agent_facts_read_the_rise_at_first_and_the_zero_sum_head_to_head() -> None:
    from benchmarks._scenarios.two_agent import two_agent_facts

    facts = two_agent_facts(_two_agent_run([0.5, 0.6, 0.4, 0.7], [0.5, 0.4, 0.6, 0.3]))
    assert facts["alice_first_rise"] == pytest.approx(0.2) and facts["bob_first_rise"] == pytest.approx(0.1)
    assert facts["alice_rise"] == pytest.approx(0.1) and facts["bob_rise"] == pytest.approx(0.05)
    assert facts["head_to_head_change_corr"] == pytest.approx(-1.0)
    assert facts["head_to_head_draw_rate"] == pytest.approx(0.0, abs=1e-9)
    drawn = two_agent_facts(_two_agent_run([0.5, 0.6, 0.3, 0.5], [0.5, 0.3, 0.5, 0.4]))  # draws break the mirror
    assert -1.0 < drawn["head_to_head_change_corr"] < 0 and drawn["head_to_head_draw_rate"] == pytest.approx(0.1)
    flat = two_agent_facts(_two_agent_run([0.5, 0.5], [0.5, 0.5]))  # no change to correlate: left out
    assert "head_to_head_change_corr" not in flat and flat["head_to_head_draw_rate"] == pytest.approx(0.0, abs=1e-9)
    assert two_agent_facts(RunResult([(0, 0.1), (5, 0.2)], 1.0)) == {}


def test_the_two_agent_summary_and_figure_show_the_head_to_head_per_seed(tmp_path: Path) -> None:
    [scenario] = scenarios.pick("gomoku-two-agent")
    runs = [_two_agent_run([0.5, 0.6, 0.4, 0.7], [0.5, 0.4, 0.6, 0.3]),
            _two_agent_run([0.4, 0.3, 0.5, 0.2], [0.6, 0.7, 0.5, 0.8])]
    entry = scenarios.summarise(scenario, runs)
    assert [f["alice_first_rise"] for f in entry["facts_per_seed"]] == [0.2, 0.2]
    assert all(f["head_to_head_change_corr"] == -1.0 for f in entry["facts_per_seed"])
    alone = scenarios.plot([(scenario, runs)], tmp_path / "own.png")  # the head-to-head gets a panel of its own
    without = scenarios.plot([(dataclasses.replace(scenario, own_panel=None), runs)], tmp_path / "one.png")
    from PIL import Image

    (w_own, h_own), (w_one, h_one) = Image.open(alone).size, Image.open(without).size
    assert w_own > 1.8 * h_own and w_one < 1.5 * h_one
    assert scenarios.running_mean([0.0, 1.0, 0.5, 0.5], 2) == [0.0, 0.5, 0.75, 0.5]
    assert "facts_per_seed" not in scenarios.summarise(scenarios.pick("gomoku")[0], [RunResult([(0, 0.0)], 1.0)])


def test_replot_builds_figure_and_summary_from_runs_kept_at_different_times(tmp_path: Path) -> None:
    for name, seed, curve in [("math", 0, [[0, 0.3], [10, 0.7]]), ("math", 1, [[0, 0.3], [10, 0.5]]),
                              ("gomoku", 0, [[0, 0.0], [5, 0.1]])]:
        run_dir = tmp_path / name / f"seed{seed}"
        run_dir.mkdir(parents=True)
        (run_dir / "result.json").write_text(json.dumps({"curve": curve, "seconds": 2.0,
                                                         "extra": {"invalid": [[0, 0.5], [5, 0.2]]}}))
    summary = scenarios.main(["--replot", "--out", str(tmp_path)])
    by_name = {entry["name"]: entry for entry in summary}
    assert set(by_name) == {"math", "gomoku"}  # scenarios never run there are left out, not failed
    assert by_name["math"]["seeds"] == 2 and by_name["math"]["seeds_met"] == 1 and by_name["math"]["after"] == 0.6
    assert by_name["gomoku"]["rise"] == 0.1 and (tmp_path / "scenarios.png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match="No result.json"):
        scenarios.main(["--replot", "--out", str(tmp_path / "empty")])


def test_the_documented_figure_replots_from_the_runs_kept_beside_it(tmp_path: Path) -> None:
    """docs/scenarios/ holds each run's result.json: --replot there gives back the committed summary."""
    import shutil

    kept = ROOT / "docs" / "scenarios"
    shutil.copytree(kept, tmp_path / "scenarios")
    summary = scenarios.main(["--replot", "--out", str(tmp_path / "scenarios")])
    assert summary == json.loads((kept / "summary.json").read_text())
    assert [entry["name"] for entry in summary] == [s.name for s in scenarios.SCENARIOS]  # every scenario, in order
    assert all(entry["seeds"] == 3 for entry in summary)


def test_keep_done_trains_only_the_seeds_not_yet_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[int] = []

    def run(config: str, seed: int, out: Path, smoke: bool, sets: Sequence[str]) -> RunResult:
        trained.append(seed)
        return RunResult([(0, 0.1), (10, 0.1 + 0.2 * seed)], 1.0)

    monkeypatch.setattr(scenarios, "SCENARIOS", [scenarios.Scenario("s", "x.toml", "accuracy", 0.3, run)])
    scenarios.main(["--only", "s", "--out", str(tmp_path)])
    summary = scenarios.main(["--only", "s", "--seeds", "3", "--keep-done", "--out", str(tmp_path)])
    assert trained == [0, 1, 2]  # seed 0 once, read back the second time
    assert summary[0]["seeds"] == 3 and summary[0]["seeds_met"] == 1 and summary[0]["rise_per_seed"] == [0.0, 0.2, 0.4]
    scenarios.main(["--only", "s", "--seeds", "2", "--out", str(tmp_path)])
    assert trained == [0, 1, 2, 0, 1]  # without --keep-done every seed trains again


def test_set_overrides_every_run_is_recorded_and_keep_done_refuses_a_seed_run_under_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, ...]] = []

    def run(config: str, seed: int, out: Path, smoke: bool, sets: Sequence[str]) -> RunResult:
        seen.append(tuple(sets))
        return RunResult([(0, 0.1), (10, 0.5)], 1.0)

    monkeypatch.setattr(scenarios, "SCENARIOS", [scenarios.Scenario("s", "x.toml", "accuracy", 0.3, run)])
    sets = ["--set", "match.past_groups=2", "--set", "run.steps=30"]
    summary = scenarios.main(["--only", "s", "--seeds", "2", "--out", str(tmp_path), *sets])
    assert seen == [("match.past_groups=2", "run.steps=30")] * 2
    assert summary[0]["overrides"] == ["match.past_groups=2", "run.steps=30"]
    kept = json.loads((tmp_path / "s" / "seed0" / "result.json").read_text())
    assert kept["overrides"] == ["match.past_groups=2", "run.steps=30"]
    assert scenarios.main(["--replot", "--out", str(tmp_path)])[0]["overrides"] == kept["overrides"]
    scenarios.main(["--only", "s", "--seeds", "3", "--keep-done", "--out", str(tmp_path), *sets])
    assert len(seen) == 3  # seeds 0 and 1 kept: they ran under the same overrides
    with pytest.raises(SystemExit, match="ran under --set"):
        scenarios.main(["--only", "s", "--seeds", "1", "--keep-done", "--out", str(tmp_path)])
    scenarios.main(["--only", "s", "--seeds", "1", "--out", str(tmp_path)])  # seed 0 again, without the overrides
    with pytest.raises(SystemExit, match="different --set"):  # beside seeds 1 and 2 that ran under them
        scenarios.main(["--replot", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        scenarios.parse_args(["--set", "past_groups"])
    assert "overrides" not in scenarios.summarise(scenarios.SCENARIOS[0], [RunResult([(0, 0.0)], 1.0)])


def test_an_unknown_scenario_name_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(SystemExit, match="math-lora"):
        scenarios.pick("math,nope")
    assert [s.name for s in scenarios.pick("math-lora")] == ["math-lora"]


def test_metric_curve_keeps_one_value_per_step_and_refuses_a_run_that_never_evaluated(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "eval/reward_mean": 0.1}\n{"step": 3, "train/reward_mean": 0.5}\n'
                    '{"step": 3, "eval/reward_mean": 0.4}\n')
    assert metric_curve(path, "eval/reward_mean") == [(0, 0.1), (3, 0.4)]
    with pytest.raises(ValueError, match="holds no"):
        metric_curve(path, "eval/win_rate")
    path.write_text('{"step": 0, "eval/episodes": 4, "eval/win_rate": 0.25}\n{"step": 2, "train/reward_mean": 1}\n'
                    '{"step": 5, "eval/episodes": 4}\n')
    assert metric_curve(path, "eval/win_rate", absent=0.0) == [(0, 0.25), (5, 0.0)]  # no outcome: no win


def test_geometry_vision_plots_the_text_only_policy_beside_it_and_warms_up_on_every_letter(tmp_path: Path) -> None:
    from benchmarks._scenarios.geometry import _train_problems, figure_demos

    result = scenarios.pick("geometry-vision")[0].run("scenario_geometry_vision.toml", 0, tmp_path, smoke=True)
    assert [step for step, _ in result.extra["text-only policy (tiny)"]] == [0, 1]
    assert (tmp_path / "text_only" / "metrics.jsonl").is_file()
    cfg = load_config(ROOT / "examples" / "configs" / "scenario_geometry_vision.toml")
    demos = figure_demos(cfg, 20, seed=0)
    assert len(demos) == 60
    for i, (env, prompt) in enumerate(_train_problems(cfg, 20, seed=0)):
        answered = demos[3 * i: 3 * i + 3]
        assert all(d["prompt"] == prompt for d in answered)  # each diagram answered by all three letters:
        assert sorted(d["completion"] for d in answered) == ["c", "q", "t"]  # the format, not which is right
        assert env.current_problem().split == "train"


def test_geometry_tools_warm_up_reads_the_ruler_and_calls_it_on_a_few_questions_only(tmp_path: Path) -> None:
    from benchmarks._scenarios.geometry import CALL_FRACTION, TOOL_PHASES, _train_problems, measure_phases
    from env_servers.geometry_env.figures import MEASURE_LENGTHS
    from envhub.tool_parsers import hermes

    result = scenarios.pick("geometry-tools")[0].run("scenario_geometry_tools.toml", 0, tmp_path, smoke=True)
    assert [step for step, _ in result.extra["tool-call rate"]] == [0, 1]
    cfg = load_config(ROOT / "examples" / "configs" / "scenario_geometry_tools.toml")
    assert cfg.env.env_kwargs["answer_format"] == "number" and not cfg.env.env_kwargs.get("measure_reward")
    read, mix = measure_phases(cfg, 40, seed=0)
    assert (read.steps, read.lr, mix.steps, mix.lr) == tuple(x for _, *p in TOOL_PHASES for x in p)
    problems = list(_train_problems(cfg, 40, seed=0))
    assert all(env.current_problem().split == "train" for env, _ in problems)
    truths = [env.current_problem().answer for env, _ in problems]
    assert len(read.demos) == 40 and mix.demos[40:] == read.demos
    for demo, truth, (_, messages) in zip(read.demos, truths, problems):
        call, reading = demo["prompt"][-2:]  # the call and the ruler's real reading: context, not trained
        asked = messages[-1]["content"][-1]["text"].split()[3].rstrip("?")
        assert demo["prompt"][:-2] == messages and reading == {"role": "tool", "name": "measure", "content": truth}
        assert [(c.name, c.arguments) for c in hermes(call["content"]).calls] == [("measure", {"segment": asked})]
        assert demo["completion"] == truth  # answered with the reading: the copy
    first_turns = mix.demos[:40]
    assert [d["prompt"] for d in first_turns] == [m for _, m in problems]
    calls = [d for d in first_turns if d["completion"].startswith("<tool_call>")]
    assert len(calls) == round(CALL_FRACTION * 40) == 4 and all(d["completion"] == read.demos[0]["prompt"][-2]["content"]
                                                                for d in calls)
    at_once = [d["completion"] for d in first_turns if d not in calls]
    assert set(at_once) <= set(MEASURE_LENGTHS)  # answered at once with a length, at random:
    assert sum(a == t for a, t in zip(at_once, truths[4:])) < 15 and len(set(at_once)) > 4  # not the readings


def test_two_agent_warm_up_targets_the_empty_cells_and_moves_probability_onto_them() -> None:
    import asyncio

    import torch

    from benchmarks._scenarios.cell_warmup import _loss, cell_targets, legal_cell_warmup
    from trainer.model import load_policy
    from trainer.recipes.opponents import empty_cell_numbers
    from trainer.recipes.two_agent import build_pool
    from trainer.recipes.two_agent_warmup import demos_from, scripted_games

    cfg = load_two_agent_config(ROOT / "examples" / "configs" / scenarios.pick("gomoku-two-agent")[0].config)
    model, tok = load_policy(cfg.agents["alice"].model)
    seats = asyncio.run(scripted_games(build_pool(cfg), tok, cfg.rollout, matches=8, seed=3))
    demos = demos_from(seats, max_turns=cfg.rollout.max_turns)
    encoded = [(ids, mask, cell_targets(tok, ids, mask)) for ids, mask in demos]
    for ids, _mask, targets in encoded:
        assert len(targets) == tok.decode(ids).count("<move>") - 1  # every reply's number (the prompt names one)
        for pos, cells in targets:
            board = tok.decode(ids[:pos], skip_special_tokens=True)
            assert tok.decode(cells) == "".join(map(str, empty_cell_numbers(board)))
            assert ids[pos] in cells and tok.decode(ids[pos - 6:pos]) == "<move>"  # the played cell was empty
    with torch.no_grad():
        before = _loss(model, encoded, int(tok.pad_token_id), 1.0)[1]["legal_mass"]
    legal_cell_warmup(model, tok, demos, steps=30, seed=0)
    with torch.no_grad():
        after = _loss(model, encoded, int(tok.pad_token_id), 1.0)[1]["legal_mass"]
    assert after > before + 0.2, (before, after)
    # with a target it stops once the window's mean mass reaches it, and otherwise runs every step
    assert legal_cell_warmup(model, tok, demos, steps=50, until_mass=0.0, window=5)["steps"] == 5
    assert legal_cell_warmup(model, tok, demos, steps=7, until_mass=1.01, window=5)["steps"] == 7


def test_two_agent_players_start_from_each_agents_own_warm_up(tmp_path: Path) -> None:
    import torch

    from benchmarks._scenarios.two_agent import warm_up_agent, warmed_up_players
    from trainer.model import load_policy

    cfg, agents = warmed_up_players(scenarios.pick("gomoku-two-agent")[0].config, 0, tmp_path, smoke=True)
    assert cfg.rollout.history_turns == 0  # the warm-up's moves are prompted as the run prompts them
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the warm-up's processes: other thread counts sum in other orders
    try:
        here_by_agent = {name: warm_up_agent(cfg, name, k, 0, games=4, steps=2)[0] for k, name in enumerate(agents)}
    finally:
        torch.set_num_threads(threads)
    for name, agent in agents.items():
        # each agent warmed up in its own process: the weights a warm-up here gives
        here = here_by_agent[name]
        assert all(torch.equal(here[key], p) for key, p in agent.model.state_dict().items())
        # a KL would anchor where RL starts (the players are built after the warm-up); the scenario runs none
        assert (agent.reference is None) == (cfg.agents[name].algo.kl_coef == 0)
        fresh = dict(load_policy(cfg.agents[name].model)[0].named_parameters())
        assert any(not torch.equal(fresh[k], p) for k, p in agent.model.named_parameters())  # warmed up
