"""vLLM as the sampler, for real, on the CPU (vLLM's CPU build) or a GPU: generation, log-prob agreement with
the trainer, weight sync after full-parameter and LoRA optimizer steps, GRPO and two-agent runs with it,
and the error a user gets when the engine cannot start.

These run in the venv ``scripts/test.sh`` builds with ``scripts/setup.sh envs,train,dev,vllm`` (``.venv-vllm``);
elsewhere (no vLLM importable) they are skipped. Each engine is built once per module.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these tests in .venv-vllm")

from trainer.config import load_config  # noqa: E402
from trainer.core.forward import run_model, target_logprobs  # noqa: E402
from trainer.model import ModelConfig, for_vllm, load_policy  # noqa: E402
from trainer.recipes.rl import train  # noqa: E402
from trainer.sampling import GenRequest, HFSampler, SamplingConfig  # noqa: E402
from trainer.sampling.vllm_engine import VLLMSampler, VLLMUnavailable  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
TEMPERATURE = 0.8
PROMPTS = ["<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"]


def forward_logprobs(model, ids_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T-1] log-probs of each next token, as the training core's loss computes them."""
    logits, _ = run_model(model, ids_BT, torch.ones_like(ids_BT))
    return target_logprobs(logits[:, :-1], ids_BT[:, 1:], temperature)


def trainer_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """The trainer's own log-probs of ``completion`` after ``prompt`` (the loss's forward pass)."""
    ids = torch.tensor([prompt + completion], device=DEVICE)
    with torch.no_grad():
        lp = forward_logprobs(model, ids, temperature)
    return lp[0, len(prompt) - 1:].float().cpu().tolist()


def max_gap(model, sampler, tok, temperature: float = TEMPERATURE, n: int = 3) -> float:
    """Largest |vLLM log-prob - trainer log-prob| over the sampled ids of a few completions."""
    async def sample():
        reqs = [GenRequest(tok.encode(p, add_special_tokens=False), 12) for p in PROMPTS for _ in range(n)]
        return reqs, await asyncio.gather(*(sampler.generate(r) for r in reqs))
    reqs, results = asyncio.run(sample())
    gap = 0.0
    for req, res in zip(reqs, results):
        assert len(res.logprobs) == len(res.token_ids) > 0
        ours = trainer_logprobs(model, req.prompt_ids, res.token_ids, temperature)
        sampled = [lp for lp, tid in zip(res.logprobs, res.token_ids)
                   if not (tid == tok.eos_token_id and lp == 0.0)]  # an appended stop token carries no log-prob
        gap = max(gap, *(abs(a - b) for a, b in zip(ours, sampled)))
    return gap


def sgd_step(model, tok, lr: float = 0.05) -> None:
    """One real optimizer step on a next-token loss, so the weights move the way training moves them."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    ids = torch.tensor([tok.encode(PROMPTS[0] + "5<|im_end|>", add_special_tokens=False)], device=DEVICE)
    loss = -forward_logprobs(model, ids).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def gaps_over_syncs(model, tok, sampler, syncs: int = 2, lr: float = 0.5) -> list[float]:
    """max_gap before any step, then after each of ``syncs`` optimizer steps and weight syncs."""
    gaps = [max_gap(model, sampler, tok, n=2)]
    for version in range(1, syncs + 1):
        sgd_step(model, tok, lr=lr)
        sampler.update_weights(model, version)
        gaps.append(max_gap(model, sampler, tok, n=2))
    return gaps


@pytest.fixture(scope="module")
def full():
    torch.manual_seed(0)
    model, tok = load_policy(for_vllm(ModelConfig(**SHAPE)), DEVICE)
    sampler = VLLMSampler(model, tok, SamplingConfig(backend="vllm", temperature=TEMPERATURE), max_model_len=512)
    yield model, tok, sampler
    sampler.close()


@pytest.fixture(scope="module")
def lora():
    torch.manual_seed(0)
    model, tok = load_policy(for_vllm(ModelConfig(**SHAPE, lora_rank=8)), DEVICE)
    sampler = VLLMSampler(model, tok, SamplingConfig(backend="vllm", temperature=TEMPERATURE), lora=True,
                          max_model_len=512)
    yield model, tok, sampler
    sampler.close()


def test_the_tiny_model_gets_a_head_size_vllm_accepts_with_its_hidden_size() -> None:
    cfg = for_vllm(ModelConfig(**SHAPE))
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (64, 2, 2)
    assert load_config(None, ["sampling.backend='vllm'"]).model.num_heads == 2
    assert load_config(None, []).model.num_heads == 4  # the HF sampler keeps the default shape


def test_greedy_generation_matches_hf_generate_and_stops_at_the_stop_token(full) -> None:
    model, tok, sampler = full
    hf = HFSampler(model, tok)
    for text in PROMPTS:
        req = GenRequest(tok.encode(text, add_special_tokens=False), 16, greedy=True)
        got, want = asyncio.run(sampler.generate(req)), asyncio.run(hf.generate(req))
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-3)
    # stop tokens: make the third greedy id the stop id; the turn ends there, the stop id kept in the record
    req = GenRequest(tok.encode(PROMPTS[0], add_special_tokens=False), 16, greedy=True)
    ids = asyncio.run(sampler.generate(req)).token_ids
    stop_id, eos_id = ids[2], sampler.eos_id
    sampler.eos_id = stop_id
    try:
        got = asyncio.run(sampler.generate(req))
    finally:
        sampler.eos_id = eos_id
    assert got.finish_reason == "stop" and got.token_ids == ids[:ids.index(stop_id) + 1]


def test_sampled_logprobs_equal_the_trainers_after_temperature(full) -> None:
    model, tok, sampler = full
    gap = max_gap(model, sampler, tok)
    print(f"max |vLLM - trainer| log-prob before any sync: {gap:.2e}")
    assert gap < 1e-3


def test_full_parameter_sync_after_each_optimizer_step_keeps_logprobs_equal(full) -> None:
    model, tok, sampler = full
    gaps = []
    for version in (1, 2, 3):
        sgd_step(model, tok)
        sampler.update_weights(model, version)
        gaps.append(max_gap(model, sampler, tok, n=2))
    print(f"full-parameter sync, max |vLLM - trainer| log-prob per step: {gaps}")
    assert sampler.version == 3 and max(gaps) < 1e-3
    res = asyncio.run(sampler.generate(GenRequest([1, 2, 3], 2)))
    assert res.version == 3


def test_lora_sync_after_each_optimizer_step_keeps_logprobs_equal(lora) -> None:
    model, tok, sampler = lora
    gaps = gaps_over_syncs(model, tok, sampler)
    print(f"LoRA sync, max |vLLM - trainer| log-prob per step: {gaps}")
    assert max(gaps) < 1e-3


def test_a_bfloat16_engine_follows_the_fp32_trainer_through_syncs() -> None:
    """sampling.vllm_dtype = "bfloat16": the engine holds bf16 copies of the fp32 trainer's weights; its
    log-probs stay within bf16 rounding of the trainer's after every sync (not the old weights')."""
    torch.manual_seed(0)
    model, tok = load_policy(for_vllm(ModelConfig(**SHAPE)), DEVICE)
    sampler = VLLMSampler(model, tok, SamplingConfig(backend="vllm", temperature=TEMPERATURE, vllm_dtype="bfloat16"),
                          max_model_len=512)
    try:
        assert str(sampler.llm.llm_engine.model_config.dtype) == "torch.bfloat16"
        gaps = gaps_over_syncs(model, tok, sampler)
        print(f"bf16 engine, max |vLLM - trainer| log-prob per sync: {gaps}")
        assert max(gaps) < 0.1
    finally:
        sampler.close()


# (before the recipe tests: an engine a run closes tears down vLLM's process-wide parallel state, which
# the module's `full` engine still needs)
def test_vllm_stands_where_the_cores_sampling_client_does(full) -> None:
    """The training core's ``sample``: n samples, stop ids and strings, seeds, prompt log-probs."""
    from trainer.core import SamplingParams

    model, tok, sampler = full
    prompt = tok.encode(PROMPTS[0], add_special_tokens=False)
    out = sampler.sample(prompt, 3, SamplingParams(max_tokens=10, temperature=1.0, seed=7),
                         include_prompt_logprobs=True)
    again = sampler.sample(prompt, 3, SamplingParams(max_tokens=10, temperature=1.0, seed=7))
    assert len(out.sequences) == 3 and [s.tokens for s in out.sequences] == [s.tokens for s in again.sequences]
    for seq in out.sequences:
        ours = trainer_logprobs(model, prompt, seq.tokens, 1.0)
        assert max(abs(a - b) for a, b in zip(ours, seq.logprobs)) < 1e-3
    ours = [None] + forward_logprobs(model, torch.tensor([prompt], device=DEVICE))[0].tolist()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert max(abs(a - b) for a, b in zip(ours[1:], out.prompt_logprobs[1:])) < 1e-3
    greedy = sampler.sample(prompt, 1, SamplingParams(max_tokens=10, temperature=0.0)).sequences[0].tokens
    stop_id = greedy[3]
    cut = sampler.sample(prompt, 1, SamplingParams(max_tokens=10, temperature=0.0, stop=[stop_id])).sequences[0]
    assert cut.stop_reason == "stop" and cut.tokens == greedy[:greedy.index(stop_id) + 1]


def test_an_unsupported_head_size_is_refused_with_the_fix_before_vllm_starts() -> None:
    if DEVICE == "cuda":
        pytest.skip("the head-size limit is the CPU kernel's")
    model, tok = load_policy(ModelConfig(**SHAPE))  # 4 heads of 16
    with pytest.raises(VLLMUnavailable, match="model.num_heads"):
        VLLMSampler(model, tok)


def test_an_engine_that_cannot_start_says_what_to_change(monkeypatch) -> None:
    model, tok = load_policy(for_vllm(ModelConfig(**SHAPE)))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "100000")  # 100 TB of KV cache cannot be had
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "") if DEVICE == "cpu" else None
    with pytest.raises(VLLMUnavailable, match="could not start.*VLLM_CPU_KVCACHE_SPACE" if DEVICE == "cpu"
                       else "could not start"):
        VLLMSampler(model, tok, max_model_len=512, gpu_memory_utilization=5.0)


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.live
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_grpo_with_vllm_against_the_math_env_server(serve_process, tmp_path, max_staleness) -> None:
    """Full-parameter GRPO sampled by vLLM: weights synced every step, the trainer and vLLM agree throughout."""
    server = serve_process([sys.executable, "-m", "env_servers.math_env"])
    cfg = load_config(None, [
        f"env.url='{server.ws_url}'", "env.train_task={ split = 'train', kind = 'add', difficulty = 1 }",
        "env.eval_task={ split = 'validation', kind = 'add', difficulty = 1 }", "env.eval_key='index'",
        *[f"model.{k}={v}" for k, v in SHAPE.items()], "sampling.backend='vllm'", "rollout.max_tokens_per_turn=8",
        "rollout.max_total_tokens=8", "run.batch_size=4", "run.group_size=4", "run.eval_problems=4",
        # a random policy rarely answers right: weight decay makes every step change the weights regardless
        "run.steps=3", "optim.lr=1e-2", "optim.weight_decay=0.5", "algo.filter_zero_variance=false",
        f"run.output_dir='{tmp_path}'",
        f"rollout.max_staleness={max_staleness}", f"run.device='{DEVICE}'"])
    model, tok = load_policy(cfg.model, DEVICE)
    before = [p.detach().clone() for p in model.parameters()]
    summary = train(cfg, model=model, tokenizer=tok, log=lambda s: None)
    assert summary["steps"] == 3 and summary["eval_episodes"] == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 3
    mismatch = [r["train/logprob_mismatch"] for r in steps]
    print(f"max_staleness={max_staleness}: logprob_mismatch per step {mismatch}")
    # synchronous: vLLM sampled with exactly the trainer's weights; asynchronous: the newest batch may be one
    # version old, which the behaviour-policy ratio accounts for (the mismatch is then the policy's change)
    assert max(mismatch[:1] if max_staleness else mismatch) < 1e-3
    if max_staleness:
        assert [r["rollout/staleness_max"] for r in steps][1] == 1.0
        assert all(r["rollout/staleness_max"] <= 1 for r in steps)
    trajs = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert all(len(t["turn_versions"]) == t["num_turns"] for t in trajs)


@pytest.mark.live
def test_two_agents_train_with_vllm_samplers(serve_env, tmp_path) -> None:
    """Each agent gets its own vLLM engine (full parameters and LoRA) and its weights after every update."""
    from env_servers.gomoku_env import GomokuMatchEnv
    from trainer.recipes.players import Player
    from trainer.recipes.two_agent import train_two_agents
    from trainer.recipes.two_agent_config import load_two_agent_config

    server = serve_env(GomokuMatchEnv, board_size=5, max_invalid_moves=2, turn_timeout_s=60.0)
    overrides = ["rollout.max_turns=4", "rollout.max_tokens_per_turn=12", "rollout.max_total_tokens=48",
                 "run.batch_size=2", "run.group_size=2", "run.eval_problems=2", "run.steps=1",
                 f"run.output_dir='{tmp_path}'", f"env.url='{server.url}'", "match.eval_opponent='random'",
                 "sampling.backend='vllm'", f"run.device='{DEVICE}'"]
    for name, seed in (("a", 0), ("b", 1)):
        overrides += [f"agents.{name}.model.{k}={v}" for k, v in SHAPE.items()]
        overrides.append(f"agents.{name}.model.max_position_embeddings=4096")  # gomoku's prompt is ~2100 tokens
        overrides += [f"agents.{name}.model.init_seed={seed}", f"agents.{name}.algo.name='reinforce_pp'",
                      f"agents.{name}.optim.lr=1e-2", f"agents.{name}.algo.filter_zero_variance=false"]
    overrides.append("agents.b.model.lora_rank=8")
    cfg = load_two_agent_config(None, overrides)
    agents = {n: Player(n, a, cfg, tmp_path / n) for n, a in cfg.agents.items()}
    assert all(type(a.sampler).__name__ == "VLLMSampler" for a in agents.values())
    summary = train_two_agents(cfg, agents=agents, log=lambda line: None)
    assert summary["steps"] == 1
    for name, agent in agents.items():
        assert agent.version == 1 and agent.sampler.version == 1
        trains = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "train/loss" in r]
        assert len(trains) == 1 and max(r["train/logprob_mismatch"] for r in trains) < 1e-3
