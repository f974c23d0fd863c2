"""Shared prompt prefixes computed once in a batched pass: the same log-probs, losses and gradients as one full
pass per row (fp32), for every loss the service takes, two LoRA tenants, padding and prefix-only rows."""

from __future__ import annotations

import pytest
import torch

from trainer.core import AdamParams, Datum, ModelHost, TrainingClient
from trainer.core.forward import pad, run_model
from trainer.core.prefix import plan_groups, shared_prefix_logits
from trainer.model import ModelConfig

TINY = dict(name="tiny", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
            dtype="fp32")


def rl_datum(prompt: list[int], completion: list[int], advantage: float, *, ref: bool = False) -> Datum:
    """A GRPO row: model input ``prompt + completion[:-1]``, the completion scored with one advantage."""
    ids = prompt + completion
    n = len(ids) - 1
    scored = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    inputs: dict[str, list[float] | list[int]] = {
        "target_tokens": ids[1:], "advantages": [advantage * s for s in scored],
        "logprobs": [-3.0 - 0.1 * (i % 5) for i in range(n)]}
    if ref:
        inputs["ref_logprobs"] = [-2.5 - 0.05 * (i % 7) for i in range(n)]
    return Datum(ids[:-1], inputs)


def prompt_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 200, (n,), generator=g).tolist()


@pytest.fixture
def host() -> ModelHost:
    host = ModelHost(ModelConfig(**TINY), max_tenants=2, max_pass_tokens=None)
    for name, seed in (("alice", 1), ("bob", 2)):  # adapters away from their zero start: distinct tenants
        client = host.create_lora_client(name, rank=4, seed=seed)
        client.forward_backward([Datum.from_sequence(prompt_of(seed, 12), weights=[1.0] * 12)])
        client.optim_step(AdamParams(learning_rate=2e-2))
        client.zero_grad()
    return host


def requests(host: ModelHost) -> list[tuple[TrainingClient, list[Datum], str, dict[str, float]]]:
    alice, bob = host.client("alice"), host.client("bob")
    p1, p2, p3 = prompt_of(10, 20), prompt_of(11, 24), prompt_of(12, 18)
    grpo = [rl_datum(p1, [30 + i, 31, 32 + i][: 1 + i % 3], (-1.0) ** i) for i in range(5)]
    grpo.append(Datum(p1, {"target_tokens": p1[1:] + [7], "advantages": [0.0] * 19 + [0.5],
                           "logprobs": [-3.0] * 20}))  # a prefix-only row: its one scored token follows the prompt
    grpo += [rl_datum(p2, [40 + i, 41, 42, 43][: 2 + i], 0.7 - 0.4 * i) for i in range(3)]
    cispo = [rl_datum(p2, [50 + i, 51, 52 + i], 1.0 - i, ref=True) for i in range(3)]
    sft = [Datum.from_sequence(p3 + [60 + i, 61, 62][: 1 + i], weights=[0.0] * 18 + [1.0] * (1 + i)) for i in range(3)]
    sft.append(Datum.from_sequence(prompt_of(13, 9), weights=[1.0] * 9))  # shares no prefix: a group of its own
    return [(alice, grpo, "ppo", {}), (bob, sft, "cross_entropy", {}), (alice, cispo, "cispo", {"kl_coef": 0.1}),
            (bob, grpo[:4], "importance_sampling", {})]


def test_plan_groups_rows_by_adapter_and_prefix():
    tokens = torch.tensor([[1] * 30 + [2, 3], [1] * 30 + [4, 0], [1] * 30 + [5, 6], [9] * 32, [1] * 30 + [2, 3]]
                          + [[1] * 30 + [7, 8]] * 3)
    plan = plan_groups(tokens, [32, 31, 32, 32, 32, 32, 32, 32], ["a", "a", "a", "a", "b", "a", "a", "a"])
    assert plan is not None
    assert len({plan.group_B[b] for b in (0, 1, 2, 5, 6, 7)}) == 1
    assert len({plan.group_B[0], plan.group_B[3], plan.group_B[4]}) == 3  # other tokens, other adapter
    assert sorted(plan.prefix_G) == [30, 32, 32]
    # short shared prefixes, or nothing shared, do not pay: the caller takes one full pass
    assert plan_groups(tokens[:, 26:], [6, 5, 6, 6, 6, 6, 6, 6], ["a"] * 8) is None
    assert plan_groups(tokens[[0, 3]], [32, 32], ["a", "a"]) is None
    # two prompts behind one system prompt: a group per prompt, not one behind the system prompt
    header = [3] * 20
    rows = [header + [4 + p] * 20 + [50 + i, 60 + i] for p in range(2) for i in range(4)]
    plan = plan_groups(torch.tensor(rows), [42] * 8, ["a"] * 8)
    assert plan is not None and plan.group_B == [0] * 4 + [1] * 4 and plan.prefix_G == [40, 40]


def test_shared_prefix_logits_equal_one_full_pass(host):
    reqs = requests(host)
    padded = pad([Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"]})
                  for _, rows, _, _ in reqs for d in rows], "cpu")
    adapters = [client.adapter for client, rows, _, _ in reqs for _ in rows]
    plan = plan_groups(padded.tokens_BT, padded.lengths, adapters)
    assert plan is not None
    shared = shared_prefix_logits(host.model, padded.tokens_BT, padded.lengths, adapters, plan).dense()
    full, _ = run_model(host.model, padded.tokens_BT, padded.attn_BT, adapters=adapters)
    for b, n in enumerate(padded.lengths):
        assert torch.allclose(shared[b, :n], full[b, :n], atol=1e-5)


def test_batched_pass_with_shared_prefixes_equals_the_full_pass(host):
    outs, grads = {}, {}
    for share in (False, True):
        host.share_prefixes = share
        reqs = requests(host)
        outs[share] = host.forward_backward_batch(reqs)
        grads[share] = [p.grad.clone() for name in ("alice", "bob") for p in host.client(name).params]
        for name in ("alice", "bob"):
            host.client(name).zero_grad()
    for full, shared in zip(outs[False], outs[True], strict=True):
        assert shared.metrics == pytest.approx(full.metrics, rel=1e-5, abs=1e-6)
        for s_row, f_row in zip(shared.loss_fn_outputs, full.loss_fn_outputs, strict=True):
            assert torch.allclose(s_row["logprobs"], f_row["logprobs"], atol=1e-5)
            assert torch.allclose(s_row["elementwise_loss"], f_row["elementwise_loss"], atol=1e-5)
    assert any(g.abs().max() > 1e-3 for g in grads[False])  # the comparison is not between zeros
    for s, f in zip(grads[True], grads[False], strict=True):
        assert torch.allclose(s, f, atol=1e-5)


@pytest.mark.parametrize("lora", [True, False])
def test_training_client_with_shared_prefixes_equals_the_full_pass(host, lora):
    """A lone request (the service runs it on its client) and the trainer's own updates share prefixes too:
    a LoRA tenant, and a full-parameter model (no adapters)."""
    client = host.client("alice") if lora else TrainingClient.from_config(ModelConfig(**TINY))
    rows = requests(host)[0][1]
    outs, grads = [], []
    for share in (False, True):
        client.share_prefixes = share
        outs.append(client.forward_backward(rows, "ppo"))
        grads.append([p.grad.clone() for p in client.params])
        client.zero_grad()
    assert outs[1].metrics == pytest.approx(outs[0].metrics, rel=1e-5, abs=1e-6)
    for s_row, f_row in zip(outs[1].loss_fn_outputs, outs[0].loss_fn_outputs, strict=True):
        assert torch.allclose(s_row["logprobs"], f_row["logprobs"], atol=1e-5)
    for s, f in zip(grads[1], grads[0], strict=True):
        assert torch.allclose(s, f, atol=1e-5)


def test_pass_bound_counts_the_tokens_a_shared_prefix_pass_computes(host):
    """Rows whose full padded tokens pass ``max_pass_tokens`` but whose prefix and suffix passes fit it run as
    one pass; a bound below that splits them, and every split gives the same results and gradients."""
    prompt = prompt_of(20, 40)
    reqs = [(host.client(name), [rl_datum(prompt, [30 + i, 31 + k, 32], 0.5 - 0.1 * i) for i in range(8)], "ppo", {})
            for k, name in enumerate(("alice", "bob"))]
    good = [(i, c.adapter, pad(rows, "cpu"), loss, cfg) for i, (c, rows, loss, cfg) in enumerate(reqs)]
    dense = 16 * 42
    host.max_pass_tokens = dense // 2  # the two prompts once and 16 short suffixes: well under half
    assert len(host._passes(good)) == 1
    host.max_pass_tokens = 60  # below even the shared cost: several passes
    assert len(host._passes(good)) > 1
    results = []
    for bound in (dense // 2, 60, None):
        host.max_pass_tokens = bound
        outs = host.forward_backward_batch(reqs)
        grads = [p.grad.clone() for name in ("alice", "bob") for p in host.client(name).params]
        for name in ("alice", "bob"):
            host.client(name).zero_grad()
        results.append((outs, grads))
    for outs, grads in results[1:]:
        for out, ref in zip(outs, results[0][0], strict=True):
            assert out.metrics == pytest.approx(ref.metrics, rel=1e-5, abs=1e-6)
        for g, ref in zip(grads, results[0][1], strict=True):
            assert torch.allclose(g, ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pass_logits_on_a_table_equal_the_expanded_logits(dtype):
    """Log-probs read through a table's row index (a shared-prefix pass) are those of the expanded [B, T, V]
    logits, at any temperature, in float32 and in a lower precision (upcast a slice at a time), with the same
    gradient."""
    from trainer.core.forward import PassLogits, target_logprobs

    g = torch.Generator().manual_seed(0)
    table = (3 * torch.randn(2500, 11, generator=g)).to(dtype).requires_grad_(True)
    index_BT = torch.randint(0, 2500, (4, 6), generator=g)
    targets_BT = torch.randint(0, 11, (4, 6), generator=g)
    for temperature in (1.0, 0.7):
        ours = PassLogits(table, index_BT).logprobs(targets_BT, temperature)
        (grad_ours,) = torch.autograd.grad(ours.sum(), table)
        full = target_logprobs(table[index_BT], targets_BT, temperature)
        (grad_full,) = torch.autograd.grad(full.sum(), table)
        assert ours.dtype == full.dtype == torch.float32
        torch.testing.assert_close(ours, full)
        torch.testing.assert_close(grad_ours, grad_full)
    assert torch.equal(PassLogits(table, index_BT).argmax(), table[index_BT].argmax(-1))
