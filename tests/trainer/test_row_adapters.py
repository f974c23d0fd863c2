"""Per-row LoRA adapters (RowAdapters): the same outputs and gradients as peft's mixed batches, in any row order."""

from __future__ import annotations

import threading

import pytest
import torch

from trainer.core import AdamParams, Datum, ModelHost
from trainer.model import ModelConfig
from trainer.sampling.row_adapters import BASE_ADAPTER, RowAdapters, runs_of

TINY = dict(name="tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture
def host() -> ModelHost:
    host = ModelHost(ModelConfig(**TINY), max_tenants=3)
    for i, name in enumerate(["alice", "bob", "carol"]):
        client = host.create_lora_client(name, rank=2 + 2 * i, seed=i)
        probe = [Datum.from_sequence([5, 6, 7, 8 + i], weights=[0.0, 1.0, 1.0, 1.0])]
        client.forward_backward(probe)  # move B off its zero init, so every adapter changes the output
        client.optim_step(AdamParams(learning_rate=0.05))
    return host


def test_runs_group_consecutive_rows():
    assert runs_of(["a", "a", "b", BASE_ADAPTER, "a"]) == [(0, 2, "a"), (2, 3, "b"), (3, 4, None), (4, 5, "a")]


def _ours_and_peft(host: ModelHost, tenants: list[str], adapters: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of RowAdapters' pass and of peft's mixed batch over the same rows; their tenants' gradients agree."""
    ids_BT = torch.randint(3, 200, (len(adapters), 7), generator=torch.Generator().manual_seed(0))
    params = [p for n in tenants for p in host.client(n).params]

    def pass_(rows: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in params:
            p.grad = None
        if rows:
            with RowAdapters(host.model, adapters):
                logits = host.model(input_ids=ids_BT).logits
        else:
            logits = host.model(input_ids=ids_BT, adapter_names=adapters).logits
        (logits.square().mean()).backward()
        return logits.detach(), [p.grad.clone() for p in params]

    ours, grads = pass_(True)
    peft, peft_grads = pass_(False)
    for g, h in zip(grads, peft_grads, strict=True):
        torch.testing.assert_close(g, h)
    return ours, peft


def test_rows_match_peft_mixed_batches_forward_and_backward(host):
    names = [host.client(n).adapter for n in ("alice", "bob", "carol")]
    # interleaved runs and a base row: RowAdapters is exact in any order, only faster when rows are grouped
    adapters = [names[0], names[1], names[1], BASE_ADAPTER, names[2], names[0]]
    ours, peft = _ours_and_peft(host, ["alice", "bob", "carol"], adapters)
    torch.testing.assert_close(ours, peft)
    # the base row is the base model's; after the block the layers are peft's own again
    assert all("forward" not in vars(m) for m in host.model.modules())
    with host.model.disable_adapter():
        ids_BT = torch.randint(3, 200, (len(adapters), 7), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(ours[3], host.model(input_ids=ids_BT[3:4]).logits[0])


def test_equal_runs_of_one_rank_batch_their_adapters_exactly():
    """Every tenant the same number of rows at one rank (a GRPO batch): the runs' LoRA terms are batched matmuls
    over stacked weights, with peft's outputs and gradients."""
    host = ModelHost(ModelConfig(**TINY), max_tenants=3)
    for i, name in enumerate(["dave", "erin", "fay"]):
        client = host.create_lora_client(name, rank=4, seed=10 + i)
        client.forward_backward([Datum.from_sequence([5, 6, 7, 8 + i], weights=[0.0, 1.0, 1.0, 1.0])])
        client.optim_step(AdamParams(learning_rate=0.05))
    names = [host.client(n).adapter for n in ("dave", "erin", "fay")]
    ours, peft = _ours_and_peft(host, ["dave", "erin", "fay"], [names[0]] * 2 + [names[1]] * 2 + [names[2]] * 2)
    torch.testing.assert_close(ours, peft)


def test_stacked_weights_without_autograd_last_one_block():
    """Without autograd (a decode loop) a block stacks each layer's adapter weights once for all its passes; the
    next block stacks them anew, so it sees an optimizer step taken in between."""
    host = ModelHost(ModelConfig(**TINY), max_tenants=2)
    clients = [host.create_lora_client(name, rank=4, seed=20 + i) for i, name in enumerate(["gus", "hal"])]
    probe = [Datum.from_sequence([5, 6, 7, 9], weights=[0.0, 1.0, 1.0, 1.0])]
    names = [c.adapter for c in clients for _ in range(2)]
    ids_BT = torch.randint(3, 200, (4, 5), generator=torch.Generator().manual_seed(1))
    outs = []
    for _ in range(2):
        for c in clients:  # new weights for both tenants between the blocks
            c.forward_backward(probe)
            c.optim_step(AdamParams(learning_rate=0.05))
        with torch.no_grad():
            with RowAdapters(host.model, names) as rows:
                first, second = (host.model(input_ids=ids_BT).logits for _ in range(2))
                assert rows.stacked  # kept for the block's second pass
            peft = host.model(input_ids=ids_BT, adapter_names=names).logits
        assert not rows.stacked
        torch.testing.assert_close(first, peft)
        torch.testing.assert_close(second, peft)
        outs.append(first)
    assert not torch.allclose(outs[0], outs[1])


def test_rows_of_the_decode_kernel_layout(host):
    """[B * T, features] inputs (the decode kernel's rows) take each row's adapter for all its positions."""
    names = [host.client(n).adapter for n in ("alice", "bob")]
    layer = next(m for m in host.model.modules() if hasattr(m, "lora_A") and names[0] in m.lora_A)
    x = torch.randn(2 * 3, layer.in_features)
    with RowAdapters(host.model, names):
        both = layer(x)
        with pytest.raises(ValueError, match="rows"):
            layer(torch.randn(5, layer.in_features))
    for b, name in enumerate(names):
        alone = layer(x[3 * b:3 * b + 3], adapter_names=[name] * 3)
        torch.testing.assert_close(both[3 * b:3 * b + 3], alone)


def test_a_block_is_its_threads_alone(host):
    """Another thread's pass on the same model, while a block is open, runs peft's own forward (its active
    adapter), not the block's rows; a nested block on one thread is refused."""
    names = [host.client(n).adapter for n in ("alice", "bob")]
    layer = next(m for m in host.model.modules() if hasattr(m, "lora_A") and names[0] in m.lora_A)
    x = torch.randn(3, layer.in_features)
    own = layer(x)
    seen: list[torch.Tensor] = []
    with RowAdapters(host.model, [names[1]] * 3):
        worker = threading.Thread(target=lambda: seen.append(layer(x)))
        worker.start()
        worker.join()
        mine = layer(x)
        with pytest.raises(RuntimeError, match="nested"):
            RowAdapters(host.model, names).__enter__()
    torch.testing.assert_close(seen[0], own)
    torch.testing.assert_close(mine, layer(x, adapter_names=[names[1]] * 3))
    assert not torch.allclose(mine, own)
