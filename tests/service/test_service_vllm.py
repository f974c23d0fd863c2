"""``envhub-train serve --sampler vllm`` driven by the official ``tinker`` SDK: every sampling client samples
through the server's one vLLM engine (CPU build here), with the HF sampler's results contract.

Runs in ``.venv-vllm`` (``scripts/test.sh`` builds it with ``scripts/setup.sh envs,train,dev,vllm,tinker``);
skipped where vLLM or the SDK is missing. One server (one engine) serves the whole module.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.live]
pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test.sh runs these tests in .venv-vllm")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

BASE = "tiny"
TINY = ["hidden_size=32", "num_layers=1", "num_heads=2", "num_kv_heads=1", "intermediate_size=64"]  # as conftest's
TEXT = list(range(40, 72))
PROMPT = TEXT[:6]
TOL = 2e-3  # float32 on the CPU: vLLM's kernels and the trainer's forward differ by rounding only


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from envhub.server import ServerThread
    from trainer.service import ServiceSettings, build_app

    os.environ["TINKER_TELEMETRY"] = "0"
    settings = ServiceSettings(state_dir=tmp_path_factory.mktemp("state"), sampler="vllm", long_poll_s=5.0,
                               threads=1, max_lora_rank=16)
    app = build_app(settings, TINY)
    server = ServerThread(app).start()
    yield server, app
    server.stop()


@pytest.fixture
def sc(server):
    client = tinker.ServiceClient(base_url=server[0].url, api_key="tml-test")
    yield client
    client.close("success").result(timeout=30)


def sft_datum(ids: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def forward_logprobs(tc, ids: list[int]) -> list[float]:
    """The training run's own log-probs of ``ids[1:]`` (the loss's forward pass)."""
    return tc.forward([sft_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def check_samples_match_trainer(sampler, tc, seed: int) -> list[list[int]]:
    params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[], seed=seed)
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, params).result()
    assert len(out.sequences) == 3
    for seq in out.sequences:
        assert len(seq.tokens) == len(seq.logprobs) == 8 and seq.stop_reason == "length"
        expected = forward_logprobs(tc, PROMPT + seq.tokens)[len(PROMPT) - 1:]
        assert seq.logprobs == pytest.approx(expected, abs=TOL)
    return [seq.tokens for seq in out.sequences]


def test_base_sampling_then_lora_sft_samples_through_vllm_with_the_trainers_logprobs(server, sc):
    from trainer.core.vllm_samplers import VLLMView

    app = server[1]
    base = sc.create_sampling_client(base_model=BASE)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    # before any step the LoRA run equals the base (B = 0): base samples carry the trainer's log-probs
    base_ids = check_samples_match_trainer(base, tc, seed=1)
    assert check_samples_match_trainer(base, tc, seed=1) == base_ids  # seeded: reproducible
    base_prompt_lps = base.compute_logprobs(types.ModelInput.from_ints(TEXT)).result()
    assert base_prompt_lps[0] is None
    assert base_prompt_lps[1:] == pytest.approx(forward_logprobs(tc, TEXT), abs=TOL)

    losses = []
    for _ in range(8):
        fb = tc.forward_backward([sft_datum(TEXT)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0] - 2, losses  # slowly: the unembedding is not LoRA-trained under vLLM

    trained = tc.save_weights_and_get_sampling_client().result()
    check_samples_match_trainer(trained, tc, seed=2)
    trained_lps = trained.compute_logprobs(types.ModelInput.from_ints(TEXT)).result()[1:]
    assert trained_lps == pytest.approx(forward_logprobs(tc, TEXT), abs=TOL)
    assert sum(trained_lps) > sum(base_prompt_lps[1:]) + 2  # the adapter is applied, not the base

    # the snapshot is an adapter registered in the server's one engine, beside nothing else
    host = app.state.ops.host
    assert isinstance(host.vllm.base(), VLLMView) and len(host.vllm._requests) == 1

    # a named sampler checkpoint keeps the weights while the run moves on; stop ids end a sample
    path = tc.save_weights_for_sampler("after-8").result().path
    expected = forward_logprobs(tc, TEXT)
    tc.forward_backward([sft_datum(list(range(100, 132)))], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
    saved = sc.create_sampling_client(model_path=path)
    assert saved.compute_logprobs(types.ModelInput.from_ints(TEXT)).result()[1:] == pytest.approx(expected, abs=TOL)
    greedy = saved.sample(types.ModelInput.from_ints(TEXT[:8]), 1,
                          types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result().sequences[0]
    stop_id = greedy.tokens[2]
    stopped = saved.sample(types.ModelInput.from_ints(TEXT[:8]), 1,
                           types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop_id])).result().sequences[0]
    cut = greedy.tokens.index(stop_id) + 1
    assert stopped.stop_reason == "stop" and stopped.tokens == greedy.tokens[:cut]


def test_a_rank_over_the_engines_lora_slots_is_refused_clearly(sc):
    with pytest.raises(Exception, match="max-lora-rank"):
        sc.create_lora_training_client(base_model=BASE, rank=32).result()


def test_full_parameter_samplers_follow_the_run_through_in_memory_weight_sync(tmp_path):
    from envhub.server import ServerThread
    from trainer.service import ServiceSettings, build_app

    settings = ServiceSettings(state_dir=tmp_path / "state", sampler="vllm", full_parameter=True, long_poll_s=5.0,
                               threads=1)
    server = ServerThread(build_app(settings, TINY)).start()
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-test")
    try:
        tc = client.create_lora_training_client(base_model=BASE, rank=4).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        check_samples_match_trainer(sampler, tc, seed=3)
        for _ in range(3):
            tc.forward_backward([sft_datum(TEXT)], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        # the run stepped: the next sample streams its new weights into the engine first
        after = tc.save_weights_and_get_sampling_client().result()
        lps = after.compute_logprobs(types.ModelInput.from_ints(TEXT)).result()[1:]
        assert lps == pytest.approx(forward_logprobs(tc, TEXT), abs=TOL)
        check_samples_match_trainer(after, tc, seed=4)
    finally:
        client.close("success").result(timeout=30)
        server.stop()


def test_concurrent_samples_of_several_adapters_share_one_engine_call(server, sc):
    """Requests of two LoRA runs and the base, seeded or not, queued together: one vLLM generate call (multi-LoRA
    rows), each request answered exactly as alone."""
    import threading
    import time

    ops = server[1].state.ops
    runs = [sc.create_lora_training_client(base_model=BASE, rank=4, seed=s).result() for s in (0, 1)]
    for tc, ids in zip(runs, (TEXT, TEXT[::-1])):
        for _ in range(4):
            tc.forward_backward([sft_datum(ids)], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=0.1)).result()
    samplers = [tc.save_weights_and_get_sampling_client().result() for tc in runs]
    samplers.append(sc.create_sampling_client(base_model=BASE))
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    seeded = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[], seed=7)
    calls = [(s, p, n) for s in samplers for p, n in ((greedy, 1), (seeded, 2))]  # vLLM: greedy takes n = 1
    alone = [s.sample(types.ModelInput.from_ints(PROMPT), n, p).result().sequences for s, p, n in calls]
    assert alone[0][0].tokens != alone[2][0].tokens  # the two adapters differ
    release = threading.Event()
    ops.queue.submit("block", lambda: (release.wait(30), (b"{}", "application/json"))[1], bounded=False)
    futures = [s.sample(types.ModelInput.from_ints(PROMPT), n, p) for s, p, n in calls]
    deadline = time.monotonic() + 30
    while ops.queue.pending() < len(calls) and time.monotonic() < deadline:
        time.sleep(0.02)
    before = ops.queue.stats.batched_jobs.get("sample", 0)
    release.set()
    together = [f.result().sequences for f in futures]
    assert ops.queue.stats.batched_jobs["sample"] - before == len(calls)
    for got, want in zip(together, alone):
        assert [s.tokens for s in got] == [s.tokens for s in want]
        for g, w in zip(got, want):
            assert g.logprobs == pytest.approx(w.logprobs, abs=TOL)
