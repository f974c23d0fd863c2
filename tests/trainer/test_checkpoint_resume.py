"""Training N steps == training k steps, saving, loading into fresh objects, training N-k steps — bit for bit.

Everything saves through the training core's state (:mod:`trainer.core.state`), the one checkpoint format."""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import trainer.core.state as state  # noqa: E402
from trainer.core import (  # noqa: E402
    AdamParams,
    Datum,
    TrainingClient,
    has_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from trainer.export import export_hf  # noqa: E402

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


DATA = torch.randint(0, 64, (32, SEQ), generator=torch.Generator().manual_seed(0))


def train_step(client: TrainingClient, step: int) -> None:
    """One SFT step whose batch and loss draw from the python, numpy and torch RNGs; the learning rate is a
    function of the step (warm-up), as in the recipes."""
    batch_BT = DATA[step * BATCH: (step + 1) * BATCH].clone()
    noise_BT = torch.randint(0, 64, batch_BT.shape)  # torch RNG: token corruption
    corrupt_BT = torch.rand(batch_BT.shape) < 0.1
    batch_BT = torch.where(corrupt_BT, noise_BT, batch_BT)
    scale = 0.5 + random.random() + float(np.random.rand())  # python + numpy RNG
    data = [Datum.from_sequence(row.tolist(), weights=[scale / SEQ] * SEQ) for row in batch_BT]
    client.forward_backward(data)
    client.optim_step(AdamParams(learning_rate=1e-2 * min(1.0, (step + 1) / 3)))


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_straight(lora: bool) -> TrainingClient:
    client = TrainingClient(tiny_qwen2(1, lora=lora), None)
    seed_all(7)
    for step in range(N_STEPS):
        train_step(client, step)
    return client


def run_resumed(lora: bool, run_dir) -> TrainingClient:
    client = TrainingClient(tiny_qwen2(1, lora=lora), None)
    seed_all(7)
    for step in range(K_STEPS):
        train_step(client, step)
    save_checkpoint(client, run_dir, K_STEPS, metadata={"note": "halfway"})
    del client
    # a "new process": different initial weights (the base model is rebuilt identically, the adapter is
    # not) and a different RNG state — loading must restore all of it
    seed_all(12345)
    client = TrainingClient(tiny_qwen2(1 if lora else 99, lora=lora), None)
    meta = load_checkpoint(client, run_dir)
    assert meta["step"] == K_STEPS and meta["note"] == "halfway" and client.version == K_STEPS
    for step in range(meta["step"], N_STEPS):
        train_step(client, step)
    return client


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_is_bit_for_bit(tmp_path, lora):
    straight, resumed = run_straight(lora), run_resumed(lora, tmp_path)
    a, b = trainable(straight.model), trainable(resumed.model)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"
    # the Adam moments resumed too
    assert straight.optimizer is not None and resumed.optimizer is not None
    for sa, sb in zip(straight.optimizer.state.values(), resumed.optimizer.state.values()):
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_resume_without_restoring_rng_would_differ(tmp_path):
    """Guards the test above: the training step really depends on the RNG, so the check has teeth."""
    client = TrainingClient(tiny_qwen2(1), None)
    seed_all(7)
    train_step(client, 0)
    first = trainable(client.model)
    client = TrainingClient(tiny_qwen2(1), None)
    seed_all(8)
    train_step(client, 0)
    assert any(not torch.equal(first[n], p) for n, p in trainable(client.model).items())


def test_lora_checkpoint_holds_only_the_adapter(tmp_path):
    ckpt = save_checkpoint(TrainingClient(tiny_qwen2(1, lora=True), None), tmp_path, 3)
    keys = torch.load(ckpt / "weights.pt", weights_only=True).keys()
    assert keys and all("lora_" in k for k in keys)
    assert json.loads((ckpt / "meta.json").read_text())["lora_rank"] == 4


def linear_client(out_features: int = 2) -> TrainingClient:
    return TrainingClient(torch.nn.Linear(2, out_features), None)


def test_latest_pointer_atomic_layout_and_pruning(tmp_path):
    client = linear_client()
    assert not has_checkpoint(tmp_path)
    for step in (1, 2, 3):
        save_checkpoint(client, tmp_path, step, keep_last=2, metadata={"cursor": step * 10})
    assert has_checkpoint(tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000003"
    assert json.loads((tmp_path / "step_00000003" / "meta.json").read_text())["cursor"] == 30
    # an explicit older checkpoint directory loads too, and saving a step again replaces it whole
    assert load_checkpoint(client, tmp_path / "step_00000002")["step"] == 2
    save_checkpoint(client, tmp_path, 3, keep_last=2)
    assert "cursor" not in json.loads((tmp_path / "step_00000003" / "meta.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]


def test_a_rank_the_checkpoint_has_no_rng_state_for_keeps_its_own(tmp_path, monkeypatch):
    client = linear_client()
    torch.manual_seed(1)
    save_checkpoint(client, tmp_path, 1)  # one rank: rng_rank0.pt
    # resumed on two ranks: rank 1 must not take rank 0's streams (it would sample exactly what rank 0 samples)
    monkeypatch.setattr(state, "rank", lambda: 1)
    torch.manual_seed(2)
    own = torch.get_rng_state()
    load_checkpoint(client, tmp_path)
    assert torch.equal(torch.get_rng_state(), own)
    monkeypatch.setattr(state, "rank", lambda: 0)  # rank 0 restores its saved streams
    load_checkpoint(client, tmp_path)
    saved = torch.load(resolve_checkpoint(tmp_path) / "rng_rank0.pt", weights_only=True)["torch"]
    assert torch.equal(torch.get_rng_state(), saved) and not torch.equal(saved, own)


def test_bad_metadata_is_refused_before_anything_is_written_and_load_explains_a_missing_dir(tmp_path):
    client = linear_client()
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(client, tmp_path, 1, metadata={"cursor": object()})
    for reserved in ("step", "version", "world_size"):
        with pytest.raises(ValueError, match="metadata"):
            save_checkpoint(client, tmp_path, 1, metadata={reserved: 1})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="Expected a checkpoint directory"):
        load_checkpoint(client, tmp_path)
    weights_only = client.save_state(tmp_path / "weights_only", optimizer=False)
    with pytest.raises(FileNotFoundError, match="without RNG state"):
        client.load_state(weights_only, optimizer=False, rng=True)


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


def test_export_hf_merges_a_lora_output_layer_without_changing_the_tied_input_embedding(tmp_path):
    # lm_head tied to embed_tokens (the tiny policies are): folding the lm_head adapter into the shared
    # weight would change the input embedding too; the export unties them
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True)
    base = transformers.Qwen2ForCausalLM(config)
    embedding = base.get_input_embeddings().weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's note on an adapter over a tied layer: what this test covers
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    expected = _logits(model, DATA[:2])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export_hf(model, None, tmp_path / "hf"))
    assert torch.allclose(_logits(reloaded, DATA[:2]), expected, atol=1e-4)
    assert torch.equal(reloaded.get_input_embeddings().weight, embedding)
    assert model.get_base_model().get_output_embeddings().base_layer.weight is model.get_input_embeddings().weight


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
    for name in ("value_head.pt", "weights.pt"):
        a, b = saved("straight", 3, name), saved("resumed", 3, name)
        assert a.keys() == b.keys() and len(a) > 0
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key} differs after resume"

    def step_metrics(run: str, step: int) -> dict[str, float]:
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        record = next(r for r in records if r["step"] == step and "train/loss" in r)
        return {k: v for k, v in record.items() if k.startswith(("train/", "rollout/"))}

    # the resumed step's metrics are the uninterrupted run's, bit for bit (times aside)
    assert step_metrics("resumed", 3) == step_metrics("straight", 3) and "train/value_loss" in step_metrics("straight", 3)


def test_the_value_head_round_trips_and_a_checkpoint_without_one_is_explained(tmp_path):
    head = torch.nn.Linear(2, 1)
    with_head = TrainingClient(torch.nn.Linear(2, 2), None, value_head=head)
    with torch.no_grad():
        head.weight.fill_(0.5)
    save_checkpoint(with_head, tmp_path / "with", 1)
    fresh = TrainingClient(torch.nn.Linear(2, 2), None, value_head=torch.nn.Linear(2, 1))
    load_checkpoint(fresh, tmp_path / "with")
    assert fresh.value_head is not None
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), fresh.value_head.state_dict().values()))
    save_checkpoint(linear_client(), tmp_path / "without", 1)
    with pytest.raises(FileNotFoundError, match="value_head.pt"):
        load_checkpoint(fresh, tmp_path / "without")
