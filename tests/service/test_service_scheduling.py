"""The scheduler through the SDK: two clients' concurrent samples share one engine batch and each gets its own
adapter's outputs; more sampler adapters than slots are swapped and still sample their own weights; past the
queue budget the service answers 429, which the SDK waits out and retries."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from test_service_sdk import TEXT, greedy, train  # noqa: E402
from tinker import types  # noqa: E402

pytestmark = pytest.mark.live

GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
PROMPTS = [TEXT[:4], TEXT[10:13], [3, 4, 5, 6, 7]]


def _block(server: Any) -> threading.Event:
    release = threading.Event()
    server.app.state.ops.queue.submit("block", lambda: (release.wait(30), (b"{}", "application/json"))[1],
                                      bounded=False)
    return release


def _wait_queued(server: Any, n: int) -> None:
    deadline = time.monotonic() + 30
    while server.app.state.ops.queue.pending() < n and time.monotonic() < deadline:
        time.sleep(0.02)


def _tenant(sdk: Any, url: str, key: str, ids: list[int]) -> tuple[Any, Any]:
    tc = sdk(url, api_key=key).create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    train(tc, 4, lr=5e-2, ids=ids)
    return tc, tc.save_weights_and_get_sampling_client().result()


def test_two_clients_samples_share_a_batch_and_each_gets_its_own_adapters_outputs(serve_training, sdk):
    server = serve_training()
    ops = server.app.state.ops
    (_, alice), (_, bob) = _tenant(sdk, server.url, "tml-alice", TEXT), _tenant(sdk, server.url, "tml-bob", TEXT[::-1])
    alone = {(who, i): greedy(s, p, 8) for who, s in (("a", alice), ("b", bob)) for i, p in enumerate(PROMPTS)}
    assert alone[("a", 0)] != alone[("b", 0)]  # the adapters differ
    before = ops.queue.stats.batched_jobs.get("sample", 0)
    release = _block(server)
    futures = {(who, i): s.sample(types.ModelInput.from_ints(p), 1, GREEDY)
               for who, s in (("a", alice), ("b", bob)) for i, p in enumerate(PROMPTS)}
    _wait_queued(server, len(futures))
    release.set()
    batched = {k: f.result().sequences[0].tokens for k, f in futures.items()}
    assert batched == alone
    assert ops.queue.stats.batched_jobs["sample"] - before == len(futures)  # all six in one batch
    stats = httpx.get(f"{server.url}/api/v1/service_stats", headers={"X-API-Key": "tml-alice"}).json()
    assert stats["queue"]["largest_batch"]["sample"] == len(futures)


def test_more_sampler_adapters_than_slots_are_swapped_and_sample_their_own_weights(serve_training, sdk):
    server = serve_training(sampler_slots=2)
    runs = [_tenant(sdk, server.url, "tml-test", ids) for ids in (TEXT, TEXT[::-1], TEXT[5:] + TEXT[:5])]
    sc = sdk(server.url)
    expected = [[greedy(live, p, 8) for p in PROMPTS[:2]] for _, live in runs]
    saved = [tc.save_weights_for_sampler(f"s{i}").result().path for i, (tc, _) in enumerate(runs)]
    samplers = [sc.create_sampling_client(model_path=path) for path in saved]
    for _ in range(2):  # round after round, each sampler evicts the least recently used
        got = [[greedy(s, p, 8) for p in PROMPTS[:2]] for s in samplers]
        assert got == expected
    # a run's newer weights: a new sampler of its own samples them, not the older copy still in a slot
    tc0 = runs[0][0]
    train(tc0, 3, lr=5e-2, ids=TEXT[::-1])
    newest = tc0.save_weights_and_get_sampling_client().result()
    fresh = sc.create_sampling_client(model_path=tc0.save_weights_for_sampler("s0-new").result().path)
    assert [greedy(fresh, p, 8) for p in PROMPTS[:2]] == [greedy(newest, p, 8) for p in PROMPTS[:2]]
    assert [greedy(samplers[0], p, 8) for p in PROMPTS[:2]] == expected[0]
    slots = server.app.state.ops.stats()["sampler_slots"]
    assert slots["slots"] == 2 and slots["swaps"] >= 5 and slots["loads"] >= slots["swaps"] + 2
    assert slots["load_s"] > 0 and slots["mean_swap_s"] > 0


def test_past_the_queue_budget_the_service_answers_429_and_the_sdk_retries(serve_training, sdk):
    server = serve_training(max_queued=3)
    _, sampler = _tenant(sdk, server.url, "tml-test", TEXT)
    release = _block(server)  # holds one of the 3 places
    futures = [sampler.sample(types.ModelInput.from_ints(p), 1, GREEDY) for p in PROMPTS * 2]
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 999, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT[:3]}]},
            "sampling_params": {"max_tokens": 4, "temperature": 0.0}}
    _wait_queued(server, 2)  # with the running block: 3 queued
    refused = httpx.post(f"{server.url}/api/v1/asample", json=body, headers={"X-API-Key": "tml-test"})
    assert refused.status_code == 429 and "overloaded" in refused.json()["detail"]
    assert refused.headers["retry-after"] == "1"
    release.set()
    results = [f.result(timeout=120).sequences[0].tokens for f in futures]  # the SDK waited out its 429s
    assert results == [greedy(sampler, p, 8) for p in PROMPTS * 2]
    assert server.app.state.ops.queue.stats.refused >= 2
