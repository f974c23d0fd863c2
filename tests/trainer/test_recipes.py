"""The RL loop and the SFT recipe, run for real on a tiny model against in-process fake envs."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from envhub import Env, Observation, StepResult
from trainer.config import load_config
from trainer.model import ModelConfig, load_policy
from trainer.recipes.rl import train
from trainer.recipes.sft import encode_demo, run_sft
from trainer.tokenizer import build_tiny_tokenizer

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64"]


class AsciiEnv(Env):
    """Reward: the share of ASCII characters in the answer (a random byte-level model scores about 0.5)."""

    def reset(self, seed=None):
        return Observation(text="Write plain text.", metadata={"system_prompt": "Be brief."})

    def on_text(self, text: str):
        return StepResult(reward=sum(ch.isascii() for ch in text) / max(len(text), 1), done=True)


class BrokenEnv(Env):
    def reset(self, seed=None):
        return Observation(text="hi")

    def on_text(self, text: str):
        raise RuntimeError("backend down")


def config(tmp_path, *extra: str):
    return load_config(None, [f"env.env_class='{__name__}:AsciiEnv'", "env.train_task={}", "env.eval_task={}",
                              "env.eval_key='seed'", *TINY, "rollout.max_tokens_per_turn=8",
                              "rollout.max_total_tokens=8", "run.batch_size=4", "run.group_size=4",
                              "run.eval_problems=4", "optim.lr=3e-3", "optim.micro_batch_size=6",
                              f"run.output_dir='{tmp_path}'", *extra])


@pytest.mark.parametrize("algo", ["grpo", "grpo_per_turn", "rloo", "reinforce_pp", "ppo"])
def test_every_algorithm_updates_the_policy_and_logs(tmp_path, algo) -> None:
    cfg = config(tmp_path, "run.steps=2", f"algo.name='{algo}'", "algo.filter_zero_variance=false",
                 *(["algo.kl_coef=0.05", "algo.epochs=2"] if algo == "rloo" else []))
    model, tok = load_policy(cfg.model)
    before = [p.detach().clone() for p in model.parameters()]
    summary = train(cfg, model=model, tokenizer=tok, log=lambda s: None)
    assert summary["steps"] == 2 and 0.0 <= summary["val_reward_after"] <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step_records = [r for r in records if "train/loss" in r]
    assert len(step_records) == 2 and all(r["rollout/groups_kept"] == 4 for r in step_records)
    if algo == "ppo":
        assert "train/value_loss" in step_records[0]
    if algo == "rloo":
        assert step_records[0]["train/kl"] >= 0.0
    traj = json.loads((tmp_path / "trajectories.jsonl").read_text().splitlines()[0])
    assert {"text", "tokens", "mask", "reward", "stop_reason", "policy_version"} <= set(traj)
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_grpo_raises_the_reward_of_a_random_policy(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = config(tmp_path, "run.steps=12", "run.batch_size=8", "optim.lr=1e-2")
    summary = train(cfg, log=lambda s: None)
    rewards = [json.loads(line)["train/reward_mean"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
               if "train/reward_mean" in line]
    # the 3-step means move by ~0.03 between seeds without learning; 12 steps of GRPO gain 0.13-0.23 (4 seeds)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert summary["val_reward_after"] >= 0.5


def test_infra_failures_are_excluded_not_trained_on(tmp_path) -> None:
    cfg = config(tmp_path, "run.steps=1", "run.eval_problems=0", f"env.env_class='{__name__}:BrokenEnv'")
    model, tok = load_policy(cfg.model)
    before = [p.detach().clone() for p in model.parameters()]
    messages: list[str] = []
    train(cfg, model=model, tokenizer=tok, log=messages.append)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    step = next(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
                if "rollout/infra_failures" in line)
    assert step["rollout/infra_failures"] == 16 and step["rollout/groups_kept"] == 0
    assert any("backend down" in m for m in messages)


def test_zero_steps_and_a_resumed_finished_run_validate_summarise_and_return(tmp_path) -> None:
    quiet = {"log": lambda s: None}
    summary = train(config(tmp_path / "zero", "run.steps=0"), **quiet)
    assert summary["steps"] == 0 and 0.0 <= summary["val_reward_after"] <= 1.0
    assert json.loads((tmp_path / "zero" / "summary.json").read_text()) == summary
    records = [json.loads(line) for line in (tmp_path / "zero" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 0] and all("eval/reward_mean" in r for r in records)
    assert not (tmp_path / "zero" / "checkpoints").exists()

    train(config(tmp_path / "done", "run.steps=1", "run.eval_problems=1"), **quiet)
    for steps in (1, 0):  # resumed at run.steps, or past it
        summary = train(config(tmp_path / "done", f"run.steps={steps}", "run.eval_problems=1", "run.resume=true"),
                        **quiet)
        assert summary["steps"] == 0
        assert json.loads((tmp_path / "done" / "summary.json").read_text())["steps"] == 0
    assert [p.name for p in (tmp_path / "done" / "checkpoints").glob("step_*")] == ["step_00000001"]


def test_sft_with_zero_steps_returns_at_once() -> None:
    model, tok = load_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                         intermediate_size=64))
    before = [p.detach().clone() for p in model.parameters()]
    out = run_sft(model, tok, [{"prompt": "q", "completion": "a"}], steps=0, batch_size=1, lr=1e-2)
    assert out == {"steps": 0.0, "epochs": 0.0}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_logged_loss_metrics_are_token_means_that_loss_free_padding_rows_leave_alone(tmp_path) -> None:
    import copy

    from trainer.core import TrainingClient
    from trainer.rollout.types import Task, Trajectory
    from trainer.update import PackedBatch, adam_params, pack, padding_row, policy_update

    # rows of 10, 7 and 4 tokens, the first 3 of each a prompt (mask 0); sampler log-probs off the policy's
    gen = torch.Generator().manual_seed(0)
    trajs, advs = [], []
    for n in [10, 7, 4]:
        mask = [0] * 3 + [1] * (n - 3)
        adv = float(torch.randn(1, generator=gen))
        trajs.append(Trajectory(task=Task(reset_kwargs={}), tokens=torch.randint(3, 200, (n,), generator=gen).tolist(),
                                mask=mask, logprobs=[-float(torch.rand(1, generator=gen)) * m for m in mask]))
        advs.append([adv * m for m in mask])
    model, tok = load_policy(config(tmp_path).model)

    def run(b: PackedBatch, micro_batch_size: int) -> dict[str, float]:
        # two epochs: the second sees ratios away from 1, so clip_frac/approx_kl/ratio_mean carry information
        cfg = config(tmp_path, "algo.epochs=2", "optim.lr=1e-1", f"optim.micro_batch_size={micro_batch_size}")
        policy = TrainingClient(copy.deepcopy(model), tok, micro_batch_size=cfg.optim.micro_batch_size)
        return policy_update(policy, b, adam_params(cfg.optim, 0, cfg.run.steps), cfg.algo,
                             temperature=cfg.sampling.temperature, seed=cfg.run.seed)

    whole = run(pack(trajs, advs, tok.pad_token_id), 16)
    # a torchrun rank that kept 3 rows while another kept 5 pads with 2 loss-free rows; micro-batches of 1
    pad_traj, pad_adv = padding_row(tok.pad_token_id)
    padded = run(pack([*trajs, pad_traj, pad_traj], [*advs, pad_adv, pad_adv], tok.pad_token_id), 1)
    assert whole["train/approx_kl"] > 0 and whole["train/ratio_mean"] != 1.0
    for key in ("train/loss", "train/clip_frac", "train/approx_kl", "train/ratio_mean", "train/kl",
                "train/logprob_mismatch"):
        assert padded[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key


def test_sft_masks_everything_but_assistant_turns_and_learns_them() -> None:
    tok = build_tiny_tokenizer()
    demo = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "2+3"},
                         {"role": "assistant", "content": "\\boxed{5}"}]}
    ids, mask = encode_demo(tok, demo)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "\\boxed{5}<|im_end|>"
    assert tok.decode(ids) == tok.apply_chat_template(demo["messages"], tokenize=False)
    torch.manual_seed(0)
    model, tok = load_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                         intermediate_size=64))
    first = run_sft(model, tok, [demo], steps=1, batch_size=1, lr=1e-2)
    last = run_sft(model, tok, [demo], steps=40, batch_size=1, lr=1e-2)
    assert last["sft_loss"] < first["sft_loss"] / 4 and last["token_acc"] == 1.0


def test_sft_trains_a_completion_alone_and_every_assistant_turn_of_messages() -> None:
    tok = build_tiny_tokenizer()
    context = [{"role": "user", "content": "2+3"}, {"role": "assistant", "content": "call"},
               {"role": "tool", "content": "5"}]
    ids, mask = encode_demo(tok, {"prompt": context, "completion": "5"})
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "5<|im_end|>"  # the call in the prompt is context
    ids, mask = encode_demo(tok, {"messages": [*context, {"role": "assistant", "content": "5"}]})
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "call<|im_end|>5<|im_end|>"


def test_sft_epochs_limit_ends_after_that_many_passes_whichever_comes_first(monkeypatch) -> None:
    import trainer.recipes.sft as sft

    tok = build_tiny_tokenizer()
    demos = [{"prompt": "q", "completion": str(i)} for i in range(5)]
    which = {tuple(encode_demo(tok, d)[0]): i for i, d in enumerate(demos)}
    batches: list[list[int]] = []

    def fake_step(client, batch, adam):
        batches.append([which[tuple(ids)] for ids, _ in batch])
        return {"sft_loss": 1.0, "token_acc": 0.0}

    monkeypatch.setattr(sft, "sft_step", fake_step)

    def run(steps: int, epochs_limit: int | None) -> tuple[dict[str, float], list[list[int]]]:
        batches.clear()
        out = run_sft(torch.nn.Linear(1, 1), tok, demos, steps=steps, batch_size=2, lr=1e-3, seed=3,
                      epochs_limit=epochs_limit)
        return out, list(batches)

    # 2 passes over 5 demos in batches of 2: 5 steps, each demo exactly twice, the last batch short
    out, got = run(100, 2)
    assert out["steps"] == 5 and out["epochs"] == 2.0 and [len(b) for b in got] == [2, 2, 2, 2, 2]
    assert sorted(i for b in got for i in b) == sorted(list(range(5)) * 2)
    out, got = run(100, 1)
    assert out["steps"] == 3 and out["epochs"] == 1.0 and [len(b) for b in got] == [2, 2, 1]
    assert sorted(i for b in got for i in b) == list(range(5))
    # steps first: the limit changes nothing, and the batches are those of an unlimited run
    limited, got_limited = run(3, 2)
    unlimited, got_unlimited = run(3, 0)
    assert limited["steps"] == unlimited["steps"] == 3 and got_limited == got_unlimited
    assert run(7, None)[0]["steps"] == 7  # None and 0: no limit, the data loops
    with pytest.raises(ValueError, match="epochs_limit"):
        load_config(None, ["sft.epochs_limit=-1"])


def test_negative_weight_reaches_every_algorithm_and_is_validated() -> None:
    from trainer.config import AlgoConfig
    from trainer.rollout.types import Task, Trajectory
    from trainer.update import compute_advantages

    def traj(reward: float, gid: int) -> Trajectory:
        # prompt token (mask 0) then two policy tokens, one turn ending at the last token
        return Trajectory(task=Task(reset_kwargs={}, group_id=gid), tokens=[1, 2, 3], mask=[0, 1, 1],
                          logprobs=[0.0, -1.0, -1.0], reward=reward, turn_rewards=[reward], turn_ends=[2])

    groups = [[traj(1.0, 0), traj(0.0, 0)]]
    for name in ("grpo", "grpo_per_turn", "rloo", "reinforce_pp"):
        full = compute_advantages(AlgoConfig(name=name), groups)
        none = compute_advantages(AlgoConfig(name=name, negative_weight=0.0), groups)
        assert full[1][1] < 0, name                       # the worse sample is pushed down by default
        assert none[1] == [0.0, 0.0, 0.0], name           # and not at all with weight 0
        assert none[0] == full[0] and none[0][1] > 0, name  # the better one keeps its full push
    with pytest.raises(ValueError, match="negative_weight"):
        load_config(None, ["algo.negative_weight=2.0"])


def test_entropy_coef_reaches_the_loss_config_and_is_checked() -> None:
    from trainer.config import AlgoConfig, load_config
    from trainer.update.policy import loss_config

    assert "entropy_coef" not in loss_config(AlgoConfig(), 1.0, kl=False, value=False)  # off by default
    assert loss_config(AlgoConfig(entropy_coef=0.05), 1.0, kl=False, value=False)["entropy_coef"] == 0.05
    for bad in ("-0.1", "nan"):
        with pytest.raises(ValueError, match="entropy_coef"):
            load_config(None, [f"algo.entropy_coef={bad}"])


def test_per_turn_grpo_pads_a_failed_turn_and_leaves_turnless_episodes_out() -> None:
    from trainer.config import AlgoConfig
    from trainer.rollout.types import Task, Trajectory
    from trainer.update import compute_advantages

    def traj(turn_rewards: list[float], turns: int) -> Trajectory:
        # a prompt token, then one policy token per generated turn
        n = 1 + turns
        return Trajectory(task=Task(reset_kwargs={}, group_id=0), tokens=list(range(n)), mask=[0] + [1] * turns,
                          logprobs=[0.0] * n, reward=sum(turn_rewards), turn_rewards=turn_rewards,
                          turn_ends=list(range(1, n)))

    algo = AlgoConfig(name="grpo_per_turn", normalize_std=False)
    played = [traj([1.0, 3.0], 2), traj([1.0, 1.0], 2)]
    # the second turn's step failed: it earned nothing and is compared at turn 1 on its own, not given turn 0's
    failed = traj([2.0], 2)
    advs = compute_advantages(algo, [[*played, failed]])
    # returns-to-go [4, 3], [2, 1], [2, 0]: turn 0 against the mean 8/3, turn 1 against 4/3
    assert advs[2] == pytest.approx([0.0, 2.0 - 8.0 / 3, 0.0 - 4.0 / 3])
    # an episode the env ended at its reset (no turn) trains nothing and leaves the others' advantages as they were
    over_at_reset = traj([], 0)
    with_it = compute_advantages(algo, [[*played, over_at_reset]])
    assert with_it[:2] == compute_advantages(algo, [played]) and with_it[2] == [0.0]


def test_lr_schedules_warm_up_then_decay_to_the_floor() -> None:
    from trainer.config import OptimConfig

    linear = OptimConfig(warmup_steps=2, lr_schedule="linear", min_lr_ratio=0.5)
    # warm-up 0.5, 1.0; then 1 - 0.5 * progress with progress 1/5 .. 4/5 over the 5 steps after the warm-up
    assert [round(linear.lr_factor(s, 6), 3) for s in range(6)] == [0.5, 1.0, 0.9, 0.8, 0.7, 0.6]
    cosine = OptimConfig(lr_schedule="cosine")
    factors = [cosine.lr_factor(s, 5) for s in range(5)]  # progress 0, 1/5, ... 4/5
    assert factors[0] == 1.0 and all(a > b for a, b in itertools.pairwise(factors)) and factors[-1] > 0
    assert OptimConfig(warmup_steps=3).lr_factor(10, 20) == 1.0  # constant after the warm-up
    with pytest.raises(ValueError, match="lr_schedule"):
        OptimConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        OptimConfig(min_lr_ratio=1.5)


def test_optim_eps_reaches_the_optimizer_and_scales_small_gradients_steps() -> None:
    import torch

    from trainer.config import OptimConfig
    from trainer.core import TrainingClient
    from trainer.update.policy import adam_params

    with pytest.raises(ValueError, match="optim.eps"):
        OptimConfig(eps=0.0)
    assert adam_params(OptimConfig(lr=1e-2, eps=1e-3), 0, 1).eps == 1e-3

    def first_step(eps: float) -> float:  # one Adam step on a gradient of 1e-5: about lr alone, lr * 1e-5 / eps with a large eps
        weight = torch.nn.Parameter(torch.zeros(1))
        client = TrainingClient(torch.nn.Linear(1, 1), None, params=[weight])
        weight.grad = torch.full((1,), 1e-5)
        client.optim_step(adam_params(OptimConfig(lr=1e-2, eps=eps, grad_clip=0.0), 0, 1))
        return abs(float(weight))

    assert first_step(1e-8) == pytest.approx(1e-2, rel=1e-2) and first_step(1e-3) == pytest.approx(1e-4, rel=2e-2)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batches_give_the_gradient_of_the_whole_batch_for_every_aggregation(tmp_path, aggregation) -> None:
    import copy

    from trainer.core import AdamParams, TrainingClient
    from trainer.update import PackedBatch, policy_update

    # rows of 10, 7 and 4 tokens (the first 3 a prompt): micro-batches of one row each must add up
    # to the loss of the whole batch, whether it averages over tokens or over sequences
    gen = torch.Generator().manual_seed(1)
    lengths, T = [10, 7, 4], 10
    tokens = torch.randint(3, 200, (3, T), generator=gen)
    attn = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    mask = torch.tensor([[0.0] * 3 + [1.0] * (n - 3) + [0.0] * (T - n) for n in lengths])
    adv = torch.randn(3, 1, generator=gen) * mask
    batch = PackedBatch(tokens, attn, mask[:, 1:], adv[:, 1:], torch.zeros(3, T - 1), torch.zeros(3, T - 1))
    model, tok = load_policy(config(tmp_path).model)

    def grads(micro_batch_size: int) -> torch.Tensor:
        cfg = config(tmp_path, f"algo.aggregation='{aggregation}'", f"optim.micro_batch_size={micro_batch_size}")
        policy = TrainingClient(copy.deepcopy(model), tok, micro_batch_size=micro_batch_size)
        seen: list[torch.Tensor] = []
        step = policy.optim_step

        def recording_step(adam: AdamParams) -> dict[str, float]:  # the gradient optim_step is about to apply
            seen.append(torch.cat([p.grad.flatten() for p in policy.params if p.grad is not None]))
            return step(adam)

        policy.optim_step = recording_step
        policy_update(policy, batch, AdamParams(learning_rate=0.0), cfg.algo, temperature=1.0, seed=0)
        return seen[0]

    whole, split = grads(16), grads(1)
    assert whole.abs().sum() > 0
    assert torch.allclose(split, whole, rtol=1e-4, atol=1e-7)


class WordsEnv(Env):
    """Three turns; each reply earns the share of its characters that are letters."""

    def reset(self, seed=None):
        self.turn = 0
        return Observation(text="Say a word.")

    def on_text(self, text: str):
        self.turn += 1
        return StepResult(observation=Observation(text=f"Turn {self.turn}: another word."),
                          reward=sum(ch.isalpha() for ch in text) / max(len(text), 1), done=self.turn == 3)


def test_a_history_window_trains_every_turn_as_its_own_sequence(tmp_path) -> None:
    cfg = config(tmp_path, "run.steps=1", "algo.name='grpo_per_turn'", "algo.filter_zero_variance=false",
                 f"env.env_class='{__name__}:WordsEnv'", "rollout.max_turns=3", "rollout.max_total_tokens=24",
                 "rollout.history_turns=0")
    model, tok = load_policy(cfg.model)
    before = [p.detach().clone() for p in model.parameters()]
    train(cfg, model=model, tokenizer=tok, log=lambda s: None)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    record = json.loads((tmp_path / "trajectories.jsonl").read_text().splitlines()[0])
    assert len(record["segment_starts"]) == 2  # three turns, each prompted with the newest observation alone
    assert record["text"].count("Say a word.") == 1 and record["text"].count("another word.") == 2


def test_ppo_is_refused_with_a_history_window() -> None:
    with pytest.raises(ValueError, match="PPO's GAE needs the whole episode"):
        load_config(None, ["algo.name='ppo'", "rollout.history_turns=0"])
