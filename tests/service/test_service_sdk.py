"""``envhub-train serve`` driven by the official ``tinker`` SDK (0.38), unmodified, on a loopback port."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.live

TEXT = list(range(40, 72))  # a fixed "sentence" of token ids the tiny model learns


def sft_datum(ids: list[int] = TEXT) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def train(tc, steps: int, lr: float = 2e-2, ids: list[int] = TEXT) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward([sft_datum(ids)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def greedy(sampler, prompt: list[int], n_tokens: int) -> list[int]:
    params = types.SamplingParams(max_tokens=n_tokens, temperature=0.0, stop=[])
    return sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0].tokens


def forward_logprobs(tc, ids: list[int] = TEXT) -> list[float]:
    return tc.forward([sft_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def test_sft_loss_falls_and_the_sampler_reflects_the_trained_weights(serve_training, sdk):
    sc = sdk(serve_training().url)
    assert sc.get_server_capabilities().supported_models[0].model_name == "tiny"
    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    base = sc.create_sampling_client(base_model="tiny")
    losses = train(tc, 20)
    assert losses[-1] < 0.5 * losses[0], losses

    trained = tc.save_weights_and_get_sampling_client().result()
    # the sampler scores with the trained weights, exactly as the training run does, and not as the base
    expected = forward_logprobs(tc)
    assert prompt_logprobs(trained) == pytest.approx(expected, abs=1e-4)
    assert sum(prompt_logprobs(base)) < sum(expected) - 20
    assert greedy(trained, TEXT[:4], 8) != greedy(base, TEXT[:4], 8)

    # a named sampler checkpoint keeps these weights through more training, in a new sampling client;
    # so does the ephemeral snapshot, while the run itself moves on
    path = tc.save_weights_for_sampler("after-20").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/after-20")
    train(tc, 2, lr=0.1, ids=list(range(100, 132)))
    assert forward_logprobs(tc) != pytest.approx(expected, abs=1e-3)
    assert prompt_logprobs(sc.create_sampling_client(model_path=path)) == pytest.approx(expected, abs=1e-4)
    assert prompt_logprobs(trained) == pytest.approx(expected, abs=1e-4)


def prompt_logprobs(sampler, ids: list[int] = TEXT) -> list[float]:
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert lps[0] is None
    return lps[1:]


def test_forward_only_passes_change_nothing(serve_training, sdk):
    sc = sdk(serve_training().url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    train(tc, 2)  # non-zero LoRA B, so a stray gradient would move the outputs
    before = forward_logprobs(tc)
    for _ in range(3):
        assert forward_logprobs(tc) == before
    step = tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
    assert step.metrics["grad_norm:mean"] == 0.0  # no gradient was kept by the forward passes
    assert forward_logprobs(tc) == before

    # the SDK's client-side custom losses are a forward-only pass then a weighted cross_entropy one
    def neg_mean_logprob(data, logprobs_list):
        loss = -sum(lp.sum() for lp in logprobs_list) / sum(len(lp) for lp in logprobs_list)
        return loss, {"custom:mean": float(loss)}

    custom = tc.forward_backward_custom([sft_datum()], neg_mean_logprob).result()
    assert custom.metrics["custom:mean"] == pytest.approx(-sum(before) / len(before), rel=1e-4)
    assert tc.optim_step(types.AdamParams(learning_rate=0.1)).result().metrics["grad_norm:mean"] > 0
    assert forward_logprobs(tc) != before


def test_two_tenants_do_not_interfere(serve_training, sdk):
    sc = sdk(serve_training().url)
    alice = sc.create_lora_training_client(base_model="tiny", rank=8, seed=3).result()
    bob = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    bob_before = forward_logprobs(bob)
    alice_losses = train(alice, 10)
    assert alice_losses[-1] < alice_losses[0]
    assert forward_logprobs(bob) == pytest.approx(bob_before, abs=1e-6)
    # bob's forward_backward between alice's calls adds nothing to alice's gradient, and vice versa
    bob.forward_backward([sft_datum(list(range(200, 232)))], "cross_entropy").result()
    alice_step = alice.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert alice_step.metrics["grad_norm:mean"] == 0.0
    info = {alice.get_info().model_id: alice.get_info().lora_rank, bob.get_info().model_id: bob.get_info().lora_rank}
    assert sorted(info.values()) == [4, 8]


def test_save_state_and_training_clients_from_it(serve_training, sdk):
    server = serve_training()
    sc = sdk(server.url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0,
                                        user_metadata={"renderer_name": "x"}).result()
    train(tc, 5)
    state = tc.save_state("step-5").result().path
    expected = forward_logprobs(tc)
    again = train(tc, 1)[0]  # the loss the next step would see

    resumed = sc.create_training_client_from_state_with_optimizer(state).result()
    assert forward_logprobs(resumed) == pytest.approx(expected, abs=1e-5)
    assert train(resumed, 1)[0] == pytest.approx(again, rel=1e-4)
    fresh_opt = sc.create_training_client_from_state(state).result()
    assert forward_logprobs(fresh_opt) == pytest.approx(expected, abs=1e-5)
    tc.load_state(state).result()  # back to step 5 in place
    assert forward_logprobs(tc) == pytest.approx(expected, abs=1e-5)

    rest = tinker.RestClient(base_url=server.url, api_key="tml-test")
    run = rest.get_training_run_by_tinker_path(state).result()
    assert run.training_run_id == tc.model_id and run.lora_rank == 8 and run.user_metadata == {"renderer_name": "x"}
    assert run.last_checkpoint.tinker_path == state
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [state] and listed[0].checkpoint_type == "training"
    runs = rest.list_training_runs().result()
    assert runs.cursor.total_count == 3
    assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 8
