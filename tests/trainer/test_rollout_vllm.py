"""The vLLM sampler on a GPU (its CUDA build): greedy agreement with HF generate, log-probs equal to the
trainer's in bf16 tolerance, and weights pushed after an optimizer step. The CPU build's tests, which CI
runs, are in test_vllm_cpu.py (they use the GPU too when there is one)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def policy():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")
    from trainer.model import ModelConfig, for_vllm, load_policy

    torch.manual_seed(0)
    cfg = for_vllm(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, dtype="bf16"))
    return load_policy(cfg, "cuda")


def test_vllm_greedy_matches_hf_and_follows_weight_updates(policy) -> None:
    from trainer.sampling import GenRequest, HFSampler
    from trainer.sampling.vllm_engine import VLLMSampler

    model, tok = policy
    prompt = tok.encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    req = GenRequest(prompt, 8, greedy=True)
    vllm = VLLMSampler(model, tok, gpu_memory_utilization=0.2, max_model_len=512)
    hf = HFSampler(model, tok)
    got = asyncio.run(vllm.generate(req))
    assert got.token_ids == asyncio.run(hf.generate(req)).token_ids
    assert len(got.logprobs) == len(got.token_ids)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    vllm.update_weights(model, 1)
    after = asyncio.run(vllm.generate(req))
    assert after.token_ids == asyncio.run(hf.generate(req)).token_ids and after.version == 1
    vllm.close()
