"""The training core on a tiny model: losses, gradient accumulation, forward-only passes, AdamW, sampling, state."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from trainer.core import AdamParams, Datum, SamplingParams, TrainingClient
from trainer.core.losses import aggregation_units, aggregation_weights, weighted_loss
from trainer.core.sampling import SamplingClient, decode_logprobs_exact
from trainer.model import ModelConfig

LN = math.log
TINY = dict(name="tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def base_client() -> TrainingClient:
    torch.manual_seed(0)
    return TrainingClient.from_config(ModelConfig(**TINY))


@pytest.fixture
def client(base_client) -> TrainingClient:
    model = copy.deepcopy(base_client.model)
    return TrainingClient(model, base_client.tokenizer)


def ce_datum(text_ids: list[int], weights: list[float] | None = None) -> Datum:
    weights = weights if weights is not None else [1.0] * len(text_ids)
    return Datum.from_sequence(text_ids, weights=weights)


def grads(client: TrainingClient) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in client.params])


# -- losses, worked by hand -------------------------------------------------------------------------
def _four_tokens():
    """Ratios r = 1.5, 0.5, 0.5, 1.0 against sampler log-probs 0, advantages +1, +1, -1, +2."""
    lp_BT = torch.tensor([[LN(1.5), LN(0.5), LN(0.5), 0.0]], requires_grad=True)
    inputs = {"logprobs": torch.zeros(1, 4), "advantages": torch.tensor([[1.0, 1.0, -1.0, 2.0]]),
              "weights": torch.full((1, 4), 0.25)}
    return lp_BT, inputs


def test_ppo_clips_the_ratio_pessimistically_and_weights_make_it_a_mean():
    lp_BT, inputs = _four_tokens()
    loss, elementwise, metrics = weighted_loss("ppo", lp_BT, inputs, {})
    # per token -min(rA, clip(r, 0.8, 1.2)A): -1.2, -0.5, 0.8, -2 ; weights 1/4 -> -0.725
    assert float(loss.detach()) == pytest.approx(-0.725, abs=1e-6)
    assert elementwise.tolist()[0] == pytest.approx([-0.3, -0.125, 0.2, -0.5], abs=1e-6)
    assert float(metrics["clip_frac:mean"]) == pytest.approx(0.5)
    assert float(metrics["ratio:mean"]) == pytest.approx((1.5 + 0.5 + 0.5 + 1.0) / 4)
    # k3(old || new) = 1/r + ln r - 1: r=1.5 -> 0.072132, r=0.5 -> 0.306853
    assert float(metrics["approx_kl:mean"]) == pytest.approx((0.072132 + 2 * 0.306853) / 4, abs=1e-5)
    loss.backward()  # clipped tokens carry no gradient; the others -A r / 4
    assert lp_BT.grad.tolist()[0] == pytest.approx([0.0, -0.125, 0.0, -0.5], abs=1e-6)
    # the clip bounds come from the config: an upper bound of 1.6 no longer clips r = 1.5
    loss, _, metrics = weighted_loss("ppo", lp_BT, inputs, {"clip_high_threshold": 1.6})
    assert float(loss.detach()) == pytest.approx(-0.8, abs=1e-6) and float(metrics["clip_frac:mean"]) == 0.25


def test_importance_sampling_and_cispo_by_hand():
    lp_BT, inputs = _four_tokens()
    loss, _, _ = weighted_loss("importance_sampling", lp_BT, inputs, {})
    # -rA: -1.5, -0.5, 0.5, -2 -> mean -0.875 ; gradient -rA/4
    assert float(loss.detach()) == pytest.approx(-0.875, abs=1e-6)
    loss.backward()
    assert lp_BT.grad.tolist()[0] == pytest.approx([-0.375, -0.125, 0.125, -0.5], abs=1e-6)
    lp_BT.grad = None
    # cispo: -sg(clip(r, 0, 1.2)) lp A: weights 1.2, 0.5, 0.5, 1 -> gradient -clip(r) A / 4 on every token
    loss, _, metrics = weighted_loss("cispo", lp_BT, inputs, {"clip_high_threshold": 1.2})
    loss.backward()
    assert lp_BT.grad.tolist()[0] == pytest.approx([-0.3, -0.125, 0.125, -0.5], abs=1e-6)
    assert float(metrics["clip_frac:mean"]) == 0.25


def test_on_policy_ratio_kl_and_value_extensions():
    lp_BT = torch.full((1, 2), LN(0.5), requires_grad=True)
    inputs = {"advantages": torch.tensor([[2.0, 0.0]]), "ref_logprobs": torch.full((1, 2), LN(0.25)),
              "weights": torch.ones(1, 2)}
    loss, _, metrics = weighted_loss("ppo", lp_BT, inputs, {"kl_coef": 0.1})
    # no sampler log-probs: r = 1, loss -A; k3 with d = ln 0.5: e^d - d - 1 = 0.193147 per token
    assert float(metrics["kl:mean"]) == pytest.approx(0.193147, abs=1e-5)
    assert float(loss.detach()) == pytest.approx(-2.0 + 2 * 0.1 * 0.193147, abs=1e-5)
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    v_inputs = {**inputs, "returns": torch.tensor([[0.0, 1.0]]), "old_values": torch.tensor([[0.9, 0.0]])}
    loss, _, metrics = weighted_loss("ppo", lp_BT, v_inputs, {"value_coef": 1.0}, values_BT=values)
    # value errors: token 1 max((1-0)^2, (1.0 clipped to 0.9+0.1 -> 1.0)^2) = 1 ; token 2 (0-1)^2 = 1 -> 0.5 each
    assert float(metrics["value_loss:mean"]) == pytest.approx(0.5)


def test_aggregation_weights_reproduce_each_mean():
    loss_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the third sequence has no policy token

    def mean(aggregation: str) -> float:
        w = aggregation_weights(mask_BT, aggregation) / aggregation_units(mask_BT, aggregation)
        return float((w * loss_BT).sum())

    assert mean("token_mean") == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert mean("seq_mean_token_mean") == pytest.approx((2.0 + 4.0) / 2)
    assert mean("seq_mean_token_sum") == pytest.approx((6.0 + 4.0) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        aggregation_weights(mask_BT, "max")


# -- forward_backward / forward / optim_step ---------------------------------------------------------
def test_cross_entropy_is_a_weighted_sum_with_any_real_weights(client):
    datum = ce_datum([5, 6, 7, 8, 9], [0.0, 1.0, -0.5, 2.0, 1.0])
    out = client.forward_backward([datum], "cross_entropy")
    lp = out.loss_fn_outputs[0]["logprobs"]
    w = datum.loss_fn_inputs["weights"]
    assert lp.shape == (4,) and out.metrics["loss:sum"] == pytest.approx(float(-(w * lp).sum()), rel=1e-5)
    assert out.metrics["tokens:sum"] == 4.0
    assert out.loss_fn_outputs[0]["elementwise_loss"].sum().item() == pytest.approx(out.metrics["loss:sum"], rel=1e-5)
    assert all(k.count(":") == 1 for k in out.metrics)  # Tinker's name:reduction keys


def test_forward_only_never_touches_gradients_and_agrees_with_forward_backward(client):
    data = [ce_datum([5, 6, 7, 8]), ce_datum([9, 10, 11])]
    fwd = client.forward(data)
    assert all(p.grad is None for p in client.params)
    fb = client.forward_backward(data)
    accumulated = grads(client).clone()
    again = client.forward(data)
    assert torch.equal(grads(client), accumulated)
    assert fwd.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"]) == pytest.approx(again.metrics["loss:sum"])
    assert torch.allclose(fwd.loss_fn_outputs[1]["logprobs"], fb.loss_fn_outputs[1]["logprobs"])


def test_gradients_accumulate_across_calls_and_micro_batches_change_nothing(client, base_client):
    data = [ce_datum([5, 6, 7, 8, 9, 10]), ce_datum([11, 12, 13]), ce_datum([14, 15, 16, 17])]
    client.forward_backward(data)
    whole = grads(client).clone()
    client.zero_grad()
    client.forward_backward(data[:1])
    client.forward_backward(data[1:])
    assert torch.allclose(grads(client), whole, atol=1e-6)
    split = TrainingClient(copy.deepcopy(base_client.model), base_client.tokenizer, micro_batch_size=1)
    out = split.forward_backward(data)
    assert torch.allclose(grads(split), whole, atol=1e-6) and len(out.loss_fn_outputs) == 3


def test_optim_step_applies_adamw_with_clipping_and_clears_gradients(client):
    data = [ce_datum([5, 6, 7, 8, 9])]
    before = [p.detach().clone() for p in client.params]
    client.forward_backward(data)
    metrics = client.optim_step(AdamParams(learning_rate=1e-2, grad_clip_norm=1e-3))
    assert metrics["grad_norm"] > 1e-3 and client.version == 1
    assert all(p.grad is None for p in client.params)
    # Adam's first step moves every weight with a gradient by about lr, whatever the clipped scale
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(client.params, before))
    assert moved == pytest.approx(1e-2, rel=0.05)
    group = client.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-12


def test_sft_loss_falls_over_core_steps(client):
    data = [ce_datum([5, 6, 7, 8, 9, 10, 11, 12]), ce_datum([20, 21, 22, 23, 24])]
    losses = []
    for _ in range(15):
        losses.append(client.forward_backward(data).metrics["loss:sum"])
        client.optim_step(AdamParams(learning_rate=1e-2))
    assert losses[-1] < losses[0] / 3


def test_bad_input_is_refused_with_the_fix(client):
    with pytest.raises(ValueError, match="loss_fn in"):
        client.forward_backward([ce_datum([5, 6, 7])], "dpo")
    with pytest.raises(ValueError, match="3 entries"):
        Datum([1, 2, 3], {"target_tokens": [2, 3]})
    with pytest.raises(ValueError, match="advantages"):
        client.forward_backward([Datum([1, 2], {"target_tokens": [2, 3]})], "ppo")
    with pytest.raises(ValueError, match="vocabulary"):
        client.forward([ce_datum([5, 6, 10**6])])
    with pytest.raises(ValueError, match="loss_fn_config"):
        client.forward_backward([ce_datum([5, 6, 7])], "cross_entropy", {"clip": 1.0})
    with pytest.raises(ValueError, match="same loss_fn_inputs"):
        client.forward_backward([ce_datum([5, 6, 7]), Datum([1, 2], {"target_tokens": [2, 3], "weights": [1, 1],
                                                                       "advantages": [0, 0]})])
    assert all(p.grad is None for p in client.params)  # nothing ran


# -- sampling ------------------------------------------------------------------------------------------
def test_samples_carry_the_trainers_logprobs_and_honour_stops_and_seeds(client):
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=6, seed=3, stop=[])  # [] : not even EOS stops
    out = client.sample(prompt, 3, params, include_prompt_logprobs=True)
    assert len(out.sequences) == 3 and all(len(s.tokens) == 6 and s.stop_reason == "length" for s in out.sequences)
    again = client.sample(prompt, 3, params)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]  # same seed, same samples
    seq = out.sequences[0]
    trainer_lp = client.forward([ce_datum(prompt + seq.tokens)]).loss_fn_outputs[0]["logprobs"][len(prompt) - 1:]
    assert torch.allclose(torch.tensor(seq.logprobs), trainer_lp, atol=1e-5)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 3
    assert client.compute_logprobs(prompt)[1:] == pytest.approx(out.prompt_logprobs[1:], abs=1e-6)
    # a stop token ends a sequence on it
    stop_id = seq.tokens[2]
    stopped = client.sample(prompt, 3, SamplingParams(max_tokens=6, seed=3, stop=[stop_id])).sequences[0]
    assert stopped.tokens == seq.tokens[:seq.tokens.index(stop_id) + 1] and stopped.stop_reason == "stop"
    # a stop string ends it on the token that completes the string
    text = client.tokenizer.decode(seq.tokens[:2])
    by_string = client.sample(prompt, 3, SamplingParams(max_tokens=6, seed=3, stop=[text])).sequences[0]
    assert text in client.tokenizer.decode(by_string.tokens) and by_string.stop_reason == "stop"
    assert len(by_string.tokens) <= 2
    greedy = client.sample(prompt, 2, SamplingParams(max_tokens=4, temperature=0.0, stop=[]))
    assert greedy.sequences[0].tokens == greedy.sequences[1].tokens


def test_low_precision_samples_get_the_trainers_logprobs_recomputed(client):
    """In float32 the decode loop's log-probs are returned (the trainer's up to rounding, above); in bf16 the
    cached decode rounds apart from the trainer's forward, so they are recomputed by it."""
    assert decode_logprobs_exact(client.model)
    model = copy.deepcopy(client.model).to(torch.bfloat16)
    assert not decode_logprobs_exact(model)
    sampler = SamplingClient(model, client.tokenizer)
    prompt = [5, 6, 7]
    seq = sampler.sample(prompt, 1, SamplingParams(max_tokens=6, seed=3, stop=[])).sequences[0]
    assert seq.logprobs == sampler.compute_logprobs(prompt + seq.tokens)[len(prompt):]


def test_compute_logprobs_matches_the_forward_pass(client):
    tokens = [5, 6, 7, 8]
    lps = client.compute_logprobs(tokens)
    fwd = client.forward([ce_datum(tokens)]).loss_fn_outputs[0]["logprobs"]
    assert lps[0] is None and lps[1:] == pytest.approx(fwd.tolist(), abs=1e-5)


def test_sampler_reflects_the_trained_weights(client):
    prompt, target = [5, 6], [40, 41, 42]
    before = client.sample(prompt, 1, SamplingParams(max_tokens=3, temperature=0.0, stop=[])).sequences[0].tokens
    for _ in range(30):
        client.forward_backward([ce_datum(prompt + target, [0.0, 1.0, 1.0, 1.0, 1.0])])
        client.optim_step(AdamParams(learning_rate=2e-2))
    after = client.sample(prompt, 1, SamplingParams(max_tokens=3, temperature=0.0, stop=[])).sequences[0].tokens
    assert after == target and before != target


# -- state ---------------------------------------------------------------------------------------------
def test_save_and_load_state_continue_exactly(client, base_client, tmp_path):
    data = [ce_datum([5, 6, 7, 8, 9])]
    adam = AdamParams(learning_rate=1e-2)
    client.forward_backward(data)
    client.optim_step(adam)
    client.save_state(tmp_path / "state")
    client.save_state(tmp_path / "weights_only", optimizer=False)
    client.forward_backward(data)
    client.optim_step(adam)
    resumed = TrainingClient(copy.deepcopy(base_client.model), base_client.tokenizer)
    assert resumed.load_state(tmp_path / "state")["version"] == 1
    resumed.forward_backward(data)
    resumed.optim_step(adam)
    assert all(torch.equal(a, b) for a, b in zip(client.params, resumed.params))
    with pytest.raises(FileNotFoundError, match="optimizer=False"):
        resumed.load_state(tmp_path / "weights_only")
    with pytest.raises(FileNotFoundError, match="save_state"):
        resumed.load_state(tmp_path / "nowhere")


def test_a_forward_only_client_saves_and_loads_weights_without_an_optimizer(client, base_client, tmp_path):
    data = [ce_datum([5, 6, 7, 8, 9])]
    client.forward_backward(data)
    client.optim_step(AdamParams(learning_rate=1e-2))
    client.save_state(tmp_path / "trained")  # with optimizer.pt: a forward-only client has nothing to load it into
    frozen = TrainingClient(copy.deepcopy(base_client.model), base_client.tokenizer, params=[])
    frozen.save_state(tmp_path / "frozen")  # and without one, though optimizer=True is the default
    assert not (tmp_path / "frozen" / "optimizer.pt").exists()
    assert frozen.load_state(tmp_path / "trained")["version"] == 1
    trained = dict(client.model.named_parameters())
    assert all(torch.equal(p, trained[name]) for name, p in frozen.model.named_parameters())
    assert frozen.load_state(tmp_path / "frozen")["version"] == 0
