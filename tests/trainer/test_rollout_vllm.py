"""The vLLM sampler on a GPU: greedy agreement with HF generate, and weights pushed after an optimizer step."""

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
    from trainer.model import ModelConfig, load_policy

    torch.manual_seed(0)
    return load_policy(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, dtype="bf16"), "cuda")


def test_vllm_greedy_matches_hf_and_follows_weight_updates(policy) -> None:
    from trainer.rollout.sampler import HFSampler
    from trainer.rollout.types import GenRequest
    from trainer.rollout.vllm_sampler import VLLMSampler

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
    assert asyncio.run(vllm.generate(req)).token_ids == asyncio.run(hf.generate(req)).token_ids
