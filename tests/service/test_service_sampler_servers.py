"""``envhub-train serve --sampler-servers``: the service trains, real ``envhub-train sampler`` processes sample.

Driven by the official ``tinker`` SDK: two LoRA tenants' samplers answer from their own adapters on the servers
(log-probs equal to the training run's own, fp32), training calls are answered while the servers sample, a
server killed mid-request has its requests re-sent to the other, a restarted one gets the adapters before it
takes work, and with every server gone a request fails with a message naming them, neither hanging nor a 500;
a full-parameter run's samplers read its pushed full weights; concurrent requests of two tenants reach the
servers as a few ``/sample/batch`` requests, each answered from its own tenant's adapter; with
``--sampler-weight-group gloo`` the pushes (LoRA and full) go through torch.distributed groups, and a server
that cannot join one gets them over its weight channel, with one log line; a server added to
``--sampler-servers-file`` while the service runs joins with the adapters and takes work, and one removed from it
leaves the pool (the last one stays).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from concurrent.futures import wait

import pytest

from tests.service.test_service_sdk import forward_logprobs, prompt_logprobs, sft_datum, train
from tests.trainer.sampler_servers import TINY, ServerProcess

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.live

PROMPT = [40, 41, 42, 43]


@pytest.fixture
def sampler_servers(tmp_path):
    servers = [ServerProcess(tmp_path, *TINY), ServerProcess(tmp_path, *TINY)]
    yield servers
    for server in servers:
        server.stop()


def health(server: ServerProcess) -> dict:
    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def stats(service) -> dict:
    """The service's ``sampler_servers`` stats (the SDK has no call for ``service_stats``)."""
    with urllib.request.urlopen(f"{service.url}/api/v1/service_stats", timeout=5) as resp:
        return dict(json.loads(resp.read())["sampler_servers"])


def sampled_logprobs_match_the_run(tc, sampler, seed: int) -> list[list[int]]:
    """Sample twice from ``sampler``; each sampled token's log-prob equals the training run's own (fp32)."""
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    for seq in out.sequences:
        ids = PROMPT + list(seq.tokens)
        expected = forward_logprobs(tc, ids)[len(PROMPT) - 1:]
        assert list(seq.logprobs) == pytest.approx(expected, abs=1e-4)
    return [list(seq.tokens) for seq in out.sequences]


def test_two_tenants_sample_their_own_adapters_on_the_servers(serve_training, sdk, sampler_servers):
    a, b = sampler_servers
    service = serve_training(sampler_servers=(a.url, b.url), sampler_slots=2)
    sc = sdk(service.url)
    alice = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    bob = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    train(alice, 4)
    train(bob, 4, ids=list(range(100, 132)))
    alice_sampler = alice.save_weights_and_get_sampling_client().result()
    bob_sampler = bob.save_weights_and_get_sampling_client().result()

    expected_alice, expected_bob = forward_logprobs(alice), forward_logprobs(bob)
    assert prompt_logprobs(alice_sampler) == pytest.approx(expected_alice, abs=1e-4)
    assert prompt_logprobs(bob_sampler) == pytest.approx(expected_bob, abs=1e-4)
    assert expected_alice != pytest.approx(expected_bob, abs=1e-2)  # two different adapters answered
    sampled_logprobs_match_the_run(alice, alice_sampler, seed=1)
    sampled_logprobs_match_the_run(bob, bob_sampler, seed=2)

    # a named sampler checkpoint is pushed when saved, and keeps its weights while the run trains on
    path = alice.save_weights_for_sampler("alice-4").result().path
    train(alice, 2, lr=0.1, ids=list(range(200, 232)))
    named = sc.create_sampling_client(model_path=path).result()
    assert prompt_logprobs(named) == pytest.approx(expected_alice, abs=1e-4)
    base = sc.create_sampling_client(base_model="tiny").result()
    assert prompt_logprobs(base) != pytest.approx(expected_alice, abs=1e-2)

    # two slots: saving the named one unloaded alice's ephemeral adapter (the least recently used) from the
    # servers; asking for it again pushes it again from its copy, and it still answers with alice's weights
    assert prompt_logprobs(alice_sampler) == pytest.approx(expected_alice, abs=1e-4)

    # the servers did the sampling, both of them, and each holds the two adapters, by name, with a version
    for server in (a, b):
        assert server.metric("requests_total") > 0
        adapters = health(server)["adapters"]
        assert adapters[path.removeprefix("tinker://").replace("/", ".")] == 4  # optimizer steps at the save
        assert len(adapters) == 2
    assert all(s["in_rotation"] for s in stats(service)["servers"].values())


@pytest.mark.slow
def test_a_killed_server_a_restarted_one_and_none_left(serve_training, sdk, sampler_servers, tmp_path):
    a, b = sampler_servers
    service = serve_training(sampler_servers=(a.url, b.url))
    sc = sdk(service.url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    train(tc, 3)
    sampler = tc.save_weights_and_get_sampling_client().result()
    expected = forward_logprobs(tc)

    # long requests on both servers; a dies while it holds some: they are answered by b, whole
    params = types.SamplingParams(max_tokens=300, temperature=1.0, stop=[])
    before = a.metric("requests_total")
    futures = [sampler.sample(types.ModelInput.from_ints(PROMPT + [i]), 1, params) for i in range(6)]
    # the servers sample apart from training: a training call is answered while they still work
    assert forward_logprobs(tc) == pytest.approx(expected, abs=1e-6)
    assert not all(f.done() for f in futures)
    deadline = time.monotonic() + 60
    while a.metric("requests_total") < before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    a.kill()
    wait(futures, timeout=300)
    for future in futures:
        [seq] = future.result().sequences
        assert len(seq.tokens) == 300 and len(seq.logprobs) == 300
    servers = stats(service)["servers"]
    assert not servers[a.url]["in_rotation"] and servers[b.url]["in_rotation"]
    assert prompt_logprobs(sampler) == pytest.approx(expected, abs=1e-4)

    # a restarted on its port gets the adapter before it takes work: its answers are the run's
    restarted = ServerProcess(tmp_path, *TINY, port=a.port)
    sampler_servers.append(restarted)
    deadline = time.monotonic() + 60
    while not health(restarted)["adapters"] and time.monotonic() < deadline:
        time.sleep(0.2)
    b.kill()
    assert prompt_logprobs(sampler) == pytest.approx(expected, abs=1e-4)
    assert restarted.metric("requests_total") > 0

    # every server gone: the request fails at once, naming the servers, and the service still trains
    restarted.kill()
    start = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="No sampler server can take work") as err:
        sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    assert a.url in str(err.value) and b.url in str(err.value)
    assert time.monotonic() - start < 30
    tc.forward_backward([sft_datum()], "cross_entropy").result()


def test_a_full_parameter_run_pushes_its_full_weights(serve_training, sdk, sampler_servers):
    a, b = sampler_servers
    sc = sdk(serve_training(sampler_servers=(a.url, b.url), full_parameter=True).url)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
    train(tc, 3, lr=1e-2)
    sampler = tc.save_weights_and_get_sampling_client().result()
    assert prompt_logprobs(sampler) == pytest.approx(forward_logprobs(tc), abs=1e-4)
    sampled_logprobs_match_the_run(tc, sampler, seed=3)
    assert health(a)["version"] == health(b)["version"] == 3 and not health(a)["adapters"]


def test_concurrent_requests_of_two_tenants_reach_the_servers_batched(serve_training, sdk, sampler_servers):
    a, b = sampler_servers
    # a window long enough that the SDK's 24 requests meet in it however loaded the machine (the 5 ms default
    # let a busy suite's requests trickle in one by one: 13 posts)
    service = serve_training(sampler_servers=(a.url, b.url), batch_window_s=0.5)
    sc = sdk(service.url)
    tenants = []
    for seed, ids in ((0, list(range(40, 72))), (1, list(range(100, 132)))):
        tc = sc.create_lora_training_client(base_model="tiny", rank=8, seed=seed).result()
        train(tc, 3, ids=ids)
        tenants.append((tc, tc.save_weights_and_get_sampling_client().result()))
    before, served_before = stats(service), a.metric("requests_total") + b.metric("requests_total")

    params = types.SamplingParams(max_tokens=16, temperature=1.0)
    asked = [(tc, PROMPT + [i], sampler.sample(types.ModelInput.from_ints(PROMPT + [i]), 2, params))
             for i in range(12) for tc, sampler in tenants]
    for tc, prompt, future in asked:  # each answered from its own tenant's adapter
        for seq in future.result().sequences:
            expected = forward_logprobs(tc, prompt + list(seq.tokens))[len(prompt) - 1:]
            assert list(seq.logprobs) == pytest.approx(expected, abs=1e-4)

    after = stats(service)
    sent, posts = (after[k] - before[k] for k in ("requests_sent", "batches_sent"))
    assert sent == len(asked) == a.metric("requests_total") + b.metric("requests_total") - served_before
    assert posts <= len(asked) // 3, (posts, sent)  # a few /sample/batch requests carried them all


@pytest.mark.parametrize("full_parameter", [False, True], ids=["lora", "full"])
def test_pushes_go_through_the_weight_group_or_over_the_channel(serve_training, sdk, tmp_path, caplog,
                                                                 full_parameter):
    grouped, refusing = ServerProcess(tmp_path, *TINY), ServerProcess(tmp_path, *TINY, "--no-weight-group")
    try:
        service = serve_training(sampler_servers=(grouped.url, refusing.url), sampler_weight_group="gloo",
                                 full_parameter=full_parameter)
        sc = sdk(service.url)
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        with caplog.at_level(logging.WARNING, logger="envhub.service"):
            for _ in range(2):  # two pushes: the second goes the same way, and logs nothing new
                train(tc, 2, lr=1e-2)
                sampler = tc.save_weights_and_get_sampling_client().result()
                expected = forward_logprobs(tc)
                served = [s.metric("requests_total") for s in (grouped, refusing)]
                for _ in range(2):  # the least loaded server, ties to the one picked least: one request each
                    assert prompt_logprobs(sampler) == pytest.approx(expected, abs=1e-4)
                assert [s.metric("requests_total") for s in (grouped, refusing)] == [n + 1 for n in served]
        servers = stats(service)["servers"]
        assert servers[grouped.url]["weight_group"] and not servers[refusing.url]["weight_group"]
        assert all(s["in_rotation"] for s in servers.values())
        failures = [r.getMessage() for r in caplog.records if "weight group failed" in r.getMessage()]
        assert len(failures) == 1 and refusing.url in failures[0], failures
        if full_parameter:
            assert health(grouped)["version"] == health(refusing)["version"] == 4
    finally:
        grouped.stop()
        refusing.stop()


def test_a_server_added_to_the_servers_file_joins_the_running_service(serve_training, sdk, tmp_path, caplog):
    first = ServerProcess(tmp_path, *TINY)
    listed = tmp_path / "sampler-servers.txt"
    listed.write_text(f"# the service's sampler servers\n{first.url}\n")
    late = None
    try:
        service = serve_training(sampler_servers_file=listed)
        sc = sdk(service.url)
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        train(tc, 2)
        sampler = tc.save_weights_and_get_sampling_client().result()
        expected = forward_logprobs(tc)
        assert prompt_logprobs(sampler) == pytest.approx(expected, abs=1e-4)

        late = ServerProcess(tmp_path, *TINY)
        with caplog.at_level(logging.WARNING, logger="envhub.service"):
            listed.write_text(listed.read_text() + f"not-a-url\n{late.url}\n")
            deadline = time.monotonic() + 60
            while not stats(service)["servers"].get(late.url, {}).get("in_rotation") and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(2.5)  # one more pass of the prober: the bad line is not logged again
        assert stats(service)["servers"][late.url]["in_rotation"]
        assert len(health(late)["adapters"]) == 1  # caught up before it took work
        assert len([r for r in caplog.records if "not-a-url" in r.getMessage()]) == 1

        # the first server leaves the file: it leaves the pool, and the joiner answers alone, from the adapter
        with caplog.at_level(logging.WARNING, logger="envhub.service"):
            listed.write_text(f"{late.url}\n")
            deadline = time.monotonic() + 30
            while first.url in stats(service)["servers"] and time.monotonic() < deadline:
                time.sleep(0.2)
        assert first.url not in stats(service)["servers"]
        assert any(first.url in r.getMessage() and "removed" in r.getMessage() for r in caplog.records)
        before = first.metric("requests_total"), late.metric("requests_total")
        for _ in range(3):
            assert prompt_logprobs(sampler) == pytest.approx(expected, abs=1e-4)
        assert first.metric("requests_total") == before[0]
        assert late.metric("requests_total") >= before[1] + 3

        # the last server stays even when the file lists none: it is kept, with one log line
        with caplog.at_level(logging.WARNING, logger="envhub.service"):
            listed.write_text("# none\n")
            time.sleep(4.5)  # two passes of the prober
        assert list(stats(service)["servers"]) == [late.url]
        assert len([r for r in caplog.records if "last sampler server" in r.getMessage()]) == 1
        assert prompt_logprobs(sampler) == pytest.approx(expected, abs=1e-4)
    finally:
        for server in (first, late):
            if server is not None:
                server.stop()
