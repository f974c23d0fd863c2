"""Training N steps == training k steps, saving, loading into fresh objects, training N-k steps — bit for bit."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from trainer.core import token_logprobs  # noqa: E402
from trainer.checkpoint import export_hf, load_checkpoint, resolve_checkpoint, save_checkpoint  # noqa: E402

N_STEPS, K_STEPS, BATCH, SEQ = 4, 2, 2, 12


def tiny_qwen2(seed: int, *, lora: bool = False):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, attention_dropout=0.1,  # dropout makes the torch RNG matter
    )
    model = transformers.Qwen2ForCausalLM(config)
    if lora:
        lora_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(model, lora_config)
    model.train()
    return model


def make_optim(model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    return optimizer, scheduler


DATA = torch.randint(0, 64, (32, SEQ), generator=torch.Generator().manual_seed(0))


def train_step(model, optimizer, scheduler, cursor: int) -> int:
    """One SFT step whose batch and loss draw from the python, numpy and torch RNGs."""
    batch_BT = DATA[cursor: cursor + BATCH].clone()
    noise_BT = torch.randint(0, 64, batch_BT.shape)  # torch RNG: token corruption
    corrupt_BT = torch.rand(batch_BT.shape) < 0.1
    batch_BT = torch.where(corrupt_BT, noise_BT, batch_BT)
    scale = 0.5 + random.random() + float(np.random.rand())  # python + numpy RNG
    logits_BTV = model(input_ids=batch_BT).logits
    loss = -token_logprobs(logits_BTV[:, :-1], batch_BT[:, 1:]).mean()
    optimizer.zero_grad()
    (loss * scale).backward()
    optimizer.step()
    scheduler.step()
    return cursor + BATCH


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_straight(lora: bool):
    model = tiny_qwen2(1, lora=lora)
    optimizer, scheduler = make_optim(model)
    seed_all(7)
    cursor = 0
    for _ in range(N_STEPS):
        cursor = train_step(model, optimizer, scheduler, cursor)
    return model, optimizer


def run_resumed(lora: bool, run_dir):
    model = tiny_qwen2(1, lora=lora)
    optimizer, scheduler = make_optim(model)
    seed_all(7)
    cursor = 0
    for step in range(K_STEPS):
        cursor = train_step(model, optimizer, scheduler, cursor)
    save_checkpoint(run_dir, model=model, optimizer=optimizer, scheduler=scheduler, step=K_STEPS,
                    data_cursor=cursor, extra={"note": "halfway"})
    del model, optimizer, scheduler
    # a "new process": different initial weights (the base model is rebuilt identically, the adapter is
    # not) and a different RNG state — loading must restore all of it
    seed_all(12345)
    model = tiny_qwen2(1 if lora else 99, lora=lora)
    optimizer, scheduler = make_optim(model)
    state = load_checkpoint(run_dir, model=model, optimizer=optimizer, scheduler=scheduler)
    assert state == {"step": K_STEPS, "data_cursor": K_STEPS * BATCH, "extra": {"note": "halfway"}}
    cursor = state["data_cursor"]
    for _ in range(N_STEPS - K_STEPS):
        cursor = train_step(model, optimizer, scheduler, cursor)
    return model, optimizer


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_is_bit_for_bit(tmp_path, lora):
    straight, straight_opt = run_straight(lora)
    resumed, resumed_opt = run_resumed(lora, tmp_path)
    a, b = trainable(straight), trainable(resumed)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
    # the Adam moments resumed too
    for sa, sb in zip(straight_opt.state.values(), resumed_opt.state.values()):
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_resume_without_restoring_rng_would_differ(tmp_path):
    """Guards the test above: the training step really depends on the RNG, so the check has teeth."""
    model = tiny_qwen2(1)
    optimizer, scheduler = make_optim(model)
    seed_all(7)
    train_step(model, optimizer, scheduler, 0)
    first = trainable(model)
    model = tiny_qwen2(1)
    optimizer, scheduler = make_optim(model)
    seed_all(8)
    train_step(model, optimizer, scheduler, 0)
    assert any(not torch.equal(first[n], p) for n, p in trainable(model).items())


def test_lora_checkpoint_holds_only_the_adapter(tmp_path):
    model = tiny_qwen2(1, lora=True)
    optimizer, _ = make_optim(model)
    ckpt = save_checkpoint(tmp_path, model=model, optimizer=optimizer, step=3, data_cursor={"epoch": 0, "index": 6})
    keys = torch.load(ckpt / "model.pt", weights_only=True).keys()
    assert keys and all("lora_" in k for k in keys)
    assert not (ckpt / "scheduler.pt").exists()


def test_latest_pointer_atomic_layout_and_pruning(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, model=model, optimizer=optimizer, step=step, data_cursor=step * 10, keep_last=2)
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000003"
    assert json.loads((tmp_path / "step_00000003" / "meta.json").read_text())["data_cursor"] == 30
    # an explicit older checkpoint directory loads too
    assert load_checkpoint(tmp_path / "step_00000002", model=model, optimizer=optimizer)["step"] == 2


def test_a_rank_the_checkpoint_has_no_rng_state_for_keeps_its_own(tmp_path, monkeypatch):
    import trainer.checkpoint as checkpoint

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    save_checkpoint(tmp_path, model=model, optimizer=optimizer, step=1, data_cursor=0)  # one rank: rng_rank0.pt
    # resumed on two ranks: rank 1 must not take rank 0's streams (it would sample exactly what rank 0 samples)
    monkeypatch.setattr(checkpoint, "_rank_world", lambda: (1, 2))
    torch.manual_seed(2)
    own = torch.get_rng_state()
    load_checkpoint(tmp_path, model=model, optimizer=optimizer)
    assert torch.equal(torch.get_rng_state(), own)
    monkeypatch.setattr(checkpoint, "_rank_world", lambda: (0, 2))  # rank 0 restores its saved streams
    load_checkpoint(tmp_path, model=model, optimizer=optimizer)
    saved = torch.load(resolve_checkpoint(tmp_path) / "rng_rank0.pt", weights_only=True)["torch"]
    assert torch.equal(torch.get_rng_state(), saved) and not torch.equal(saved, own)


def test_save_rejects_unserialisable_cursor_and_load_explains_missing_dir(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, model=model, optimizer=optimizer, step=1, data_cursor=object())
    assert not (tmp_path / "latest").exists()
    with pytest.raises(FileNotFoundError, match="Expected a checkpoint directory"):
        load_checkpoint(tmp_path, model=model, optimizer=optimizer)


def _logits(model, ids_BT):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids_BT).logits


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter"])
def test_export_hf_lora_reloads_with_same_outputs(tmp_path, merge):
    model = tiny_qwen2(1, lora=True)
    with torch.no_grad():  # a non-trivial adapter (LoRA B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids_BT = DATA[:2]
    expected = _logits(model, ids_BT)
    out = export_hf(model, None, tmp_path / "hf", merge_lora=merge)
    if merge:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert not (out / "adapter_config.json").exists()
    else:
        assert (out / "adapter_config.json").exists()
        reloaded = peft.PeftModel.from_pretrained(tiny_qwen2(1), out)
    assert torch.allclose(_logits(reloaded, ids_BT), expected, atol=1e-4)
    assert any("lora_" in n for n, _ in model.named_parameters())  # the training model keeps its adapter


def test_export_hf_full_model_round_trips(tmp_path):
    model = tiny_qwen2(3)
    out = export_hf(model, None, tmp_path / "hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(_logits(reloaded, DATA[:1]), _logits(model, DATA[:1]))


# ---------------------------------------------------------------- the RL loop: ppo's value head resumes too

from envhub import Env, Observation, StepResult  # noqa: E402


class AsciiEnv(Env):
    """Reward: the share of ASCII characters in the answer (graded, so the value head has something to fit)."""

    def reset(self, seed=None):
        return Observation(text="Write plain text.")

    def on_text(self, text: str):
        return StepResult(reward=sum(ch.isascii() for ch in text) / max(len(text), 1), done=True)


def _ppo_config(out, *extra: str):
    from trainer.config import load_config

    return load_config(None, [
        f"env.env_class='{__name__}:AsciiEnv'", "env.train_task={}", "env.eval_task={}", "env.eval_key='seed'",
        "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "rollout.max_tokens_per_turn=6", "rollout.max_total_tokens=6",
        "algo.name='ppo'", "algo.filter_zero_variance=false", "run.batch_size=2", "run.group_size=2",
        "run.eval_problems=1", "optim.lr=1e-2", "optim.warmup_steps=2",
        # every episode of a step in one sampling batch, so the sampled tokens cannot depend on timing
        "sampling.batch_wait_s=10.0", f"run.output_dir='{out}'", *extra])


def test_ppo_resume_restores_the_value_head_and_continues_exactly(tmp_path):
    from trainer.recipes.rl import train

    quiet = {"log": lambda s: None}
    train(_ppo_config(tmp_path / "straight", "run.steps=3"), **quiet)
    train(_ppo_config(tmp_path / "resumed", "run.steps=2"), **quiet)
    summary = train(_ppo_config(tmp_path / "resumed", "run.steps=3", "run.resume=true"), **quiet)
    assert summary["steps"] == 1

    def saved(run: str, step: int, name: str) -> dict[str, torch.Tensor]:
        return torch.load(tmp_path / run / "checkpoints" / f"step_{step:08d}" / name, weights_only=True)

    halfway = saved("resumed", 2, "value_head.pt")
    assert any(v.abs().max() > 0 for v in halfway.values())  # trained away from its zero start: resuming matters
    for name in ("value_head.pt", "model.pt"):
        a, b = saved("straight", 3, name), saved("resumed", 3, name)
        assert a.keys() == b.keys() and len(a) > 0
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key} differs after resume"


def test_extra_modules_round_trip_and_a_missing_one_is_explained(tmp_path):
    model, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    save_checkpoint(tmp_path / "with", model=model, optimizer=optimizer, step=1, data_cursor=0,
                    modules={"value_head": head})
    fresh = torch.nn.Linear(2, 1)
    load_checkpoint(tmp_path / "with", model=model, optimizer=optimizer, modules={"value_head": fresh})
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), fresh.state_dict().values()))
    save_checkpoint(tmp_path / "without", model=model, optimizer=optimizer, step=1, data_cursor=0)
    with pytest.raises(FileNotFoundError, match="value_head.pt"):
        load_checkpoint(tmp_path / "without", model=model, optimizer=optimizer, modules={"value_head": fresh})
    with pytest.raises(ValueError, match="module names"):
        save_checkpoint(tmp_path / "bad", model=model, optimizer=optimizer, step=1, data_cursor=0,
                        modules={"model": head})
