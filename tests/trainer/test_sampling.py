"""trainer.sampling's interface: batched answers in one result type, stamped with the weights' version."""

from __future__ import annotations

import asyncio

import torch

from trainer.model import ModelConfig, load_policy
from trainer.sampling import BatchingSampler, GenRequest, HFSampler, SampledSequence, SamplingConfig


class CountdownSampler(BatchingSampler):
    """A backend in a few lines, as a remote sampler's client would be: row i answers ``prompt[-1] - 1, ...``."""

    def __init__(self) -> None:
        super().__init__(SamplingConfig(batch_wait_s=5.0))
        self.batches: list[int] = []

    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]:
        self.batches.append(len(requests))
        out = []
        for r in requests:
            ids = [r.prompt_ids[-1] - k for k in range(1, r.max_new_tokens + 1)]
            out.append(SampledSequence(ids, [-1.0] * len(ids), "length"))
        return out

    def update_weights(self, model: object, version: int) -> None:
        with self.weights_lock:
            self.version = version


def test_concurrent_requests_share_one_batch_and_get_their_own_answer_and_version() -> None:
    sampler = CountdownSampler()
    sampler.set_demand(lambda: 5)
    sampler.update_weights(None, 7)

    async def ask() -> list[SampledSequence]:
        return await asyncio.gather(*(sampler.generate(GenRequest([10 * i], i)) for i in range(1, 6)))

    results = asyncio.run(ask())
    assert sampler.batches == [5] and (sampler.calls, sampler.sequences) == (1, 5)
    assert [r.tokens for r in results] == [[10 * i - k for k in range(1, i + 1)] for i in range(1, 6)]
    assert all(r.version == 7 and r.stop_reason == "length" for r in results)
    assert results[1].token_ids is results[1].tokens and results[1].finish_reason == "length"


def test_the_hf_sampler_answers_in_sampled_sequences_and_follows_weight_updates() -> None:
    torch.manual_seed(0)
    model, tok = load_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1))
    sampler = HFSampler(model, tok, own_copy=True)
    request = GenRequest([1, 2, 3], 5, greedy=True)
    [before] = sampler.generate_batch([request])
    assert len(before.tokens) == len(before.logprobs) <= 5 and before.stop_reason in ("stop", "length")
    assert all(lp <= 0.0 for lp in before.logprobs)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)  # the copy keeps the old weights until the update
    assert sampler.generate_batch([request])[0].tokens == before.tokens
    sampler.update_weights(model, 2)
    after = asyncio.run(sampler.generate(request))
    assert after.version == 2 and after.tokens != before.tokens
    sampler.close()
    sampler.close()  # nothing held: closing twice is fine
