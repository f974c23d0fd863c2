"""Several tenants on one base model: LoRA adapters that never interfere, batched passes, a full-parameter tenant."""

from __future__ import annotations

import pytest
import torch

from trainer.core import AdamParams, Datum, ModelHost, SamplingParams, TenantError
from trainer.core.host import plan_passes
from trainer.model import ModelConfig

TINY = dict(name="tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, stop=[])


def datum(ids: list[int], first_weight: float = 0.0) -> Datum:
    return Datum.from_sequence(ids, weights=[first_weight] + [1.0] * (len(ids) - 1))


@pytest.fixture
def host() -> ModelHost:
    return ModelHost(ModelConfig(**TINY), max_tenants=2)


def test_two_lora_tenants_learn_apart_on_one_base(host):
    alice = host.create_lora_client("alice", rank=4, seed=1)
    bob = host.create_lora_client("bob", rank=4, seed=2)
    base_params = {n: p.detach().clone() for n, p in host.base.named_parameters() if "lora_" not in n}
    probe = [datum([5, 6, 40, 41, 42])]
    alice_before = alice.forward(probe).metrics["loss:sum"]
    bob_before = bob.forward(probe).loss_fn_outputs[0]["logprobs"]
    base_before = host.base_sampler().compute_logprobs([5, 6, 40, 41, 42])
    for _ in range(20):
        alice.forward_backward(probe)
        alice.optim_step(AdamParams(learning_rate=5e-3))
    # (a rank-4 adapter on the tiny model cannot reach the tied embeddings, so its loss falls by nats, not to 0)
    assert alice.forward(probe).metrics["loss:sum"] < alice_before - 1.5
    # bob, the base sampler and the base weights saw none of it
    assert torch.equal(bob.forward(probe).loss_fn_outputs[0]["logprobs"], bob_before)
    assert host.base_sampler().compute_logprobs([5, 6, 40, 41, 42]) == base_before
    assert all(torch.equal(base_params[n], p) for n, p in host.base.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("max_pass_tokens", [None, 5])
def test_one_batched_pass_equals_one_pass_per_tenant(host, max_pass_tokens):
    """Also when the token budget cuts the merged work into passes (5: alice's two rows in two passes, her
    second with bob's row): the same losses, metrics, per-token log-probs and gradients."""
    host.max_pass_tokens = max_pass_tokens
    alice = host.create_lora_client("alice", rank=4, seed=1)
    bob = host.create_lora_client("bob", rank=4, seed=2)
    for client in (alice, bob):  # adapters away from their zero start, so the gradients differ per tenant
        client.forward_backward([datum([7, 8, 9, 10])])
        client.optim_step(AdamParams(learning_rate=1e-2))
    a_data = [datum([5, 6, 7, 8]), datum([9, 10, 11])]
    ppo = [Datum([3, 4], {"target_tokens": [4, 5], "advantages": [1.0, -1.0]})]
    seq = [alice.forward_backward(a_data), bob.forward_backward(ppo, "ppo")]
    seq_grads = [[p.grad.clone() for p in c.params] for c in (alice, bob)]
    alice.zero_grad()
    bob.zero_grad()
    batched = host.forward_backward_batch([(alice, a_data, "cross_entropy", {}), (bob, ppo, "ppo", {}),
                                           (alice, a_data, "no_such_loss", {})])
    assert isinstance(batched[2], ValueError)  # the bad request fails alone
    for s, b in zip(seq, batched[:2]):
        assert b.metrics == pytest.approx(s.metrics, rel=1e-5)
        for b_out, s_out in zip(b.loss_fn_outputs, s.loss_fn_outputs, strict=True):
            assert torch.allclose(b_out["logprobs"], s_out["logprobs"], atol=1e-6)
    for client, expected in zip((alice, bob), seq_grads):
        for p, g in zip(client.params, expected):
            assert torch.allclose(p.grad, g, atol=1e-6)


def test_passes_keep_rows_in_order_within_the_token_budget():
    assert plan_passes([[4, 4], [4, 4, 4]], None) == [[(0, 0, 2), (1, 0, 3)]]
    # rows x the pass's longest row <= 12: a request may span two passes
    assert plan_passes([[4, 4], [4, 4, 4]], 12) == [[(0, 0, 2), (1, 0, 1)], [(1, 1, 3)]]
    # a long row raises the padded width: it goes alone, and a row over the budget gets a pass of its own
    assert plan_passes([[2, 2, 9], [20], [3]], 12) == [[(0, 0, 2)], [(0, 2, 3)], [(1, 0, 1)], [(2, 0, 1)]]


def test_snapshots_stay_frozen_while_training_goes_on(host, tmp_path):
    alice = host.create_lora_client("alice", rank=4, seed=1)
    alice.forward_backward([datum([5, 6, 7])])
    alice.optim_step(AdamParams(learning_rate=1e-2))
    snap = host.snapshot(alice, "alice-v1")
    frozen = snap.compute_logprobs([5, 6, 7, 8])
    assert frozen == pytest.approx(alice.compute_logprobs([5, 6, 7, 8]))
    alice.forward_backward([datum([5, 6, 7, 8])])
    alice.optim_step(AdamParams(learning_rate=1e-2))
    assert snap.compute_logprobs([5, 6, 7, 8]) == frozen != alice.compute_logprobs([5, 6, 7, 8])
    # saved state becomes a sampler too, and a tenant again
    alice.save_state(tmp_path / "alice")
    loaded = host.sampler_from_state("alice-saved", tmp_path / "alice")
    assert loaded.compute_logprobs([5, 6, 7, 8]) == pytest.approx(alice.compute_logprobs([5, 6, 7, 8]))
    host.remove("alice")
    again = host.create_lora_client("alice2", rank=4)
    again.load_state(tmp_path / "alice")
    assert again.compute_logprobs([5, 6, 7, 8]) == pytest.approx(loaded.compute_logprobs([5, 6, 7, 8]))


def test_tenant_limits_and_full_parameter_exclusivity(host):
    host.create_lora_client("a", rank=2)
    with pytest.raises(TenantError, match="exists"):
        host.create_lora_client("a", rank=2)
    host.create_lora_client("b", rank=2)
    with pytest.raises(TenantError, match="max_tenants"):
        host.create_lora_client("c", rank=2)
    host.remove("b")
    with pytest.raises(TenantError, match="no other tenants"):
        host.create_full_client("full")
    host.remove("a")
    full = host.create_full_client("full")
    assert len(full.params) == len(list(host.base.parameters())) and host.model is host.base
    with pytest.raises(TenantError, match="full model"):
        host.create_lora_client("d", rank=2)
    with pytest.raises(TenantError, match="base"):  # refused while the base weights train
        host.base_sampler()
    full.forward_backward([datum([5, 6, 7])])
    full.optim_step(AdamParams(learning_rate=1e-2))
    host.remove("full")  # the base comes back untouched
    fresh = ModelHost(ModelConfig(**TINY))
    restored = host.base_sampler().compute_logprobs([5, 6, 7])
    assert restored == pytest.approx(fresh.base_sampler().compute_logprobs([5, 6, 7]))
    with pytest.raises(TenantError, match="Unknown tenant"):
        host.remove("nobody")
