"""Batched sampling and the scheduler: rows of several LoRA tenants in one decode pass each get their own adapter's
outputs; the work queue batches, is fair across clients, and refuses work past its budget with a 429."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from tests.service.conftest import TINY
from trainer import core
from trainer.core.batch_sampling import SampleRequest, batch_key, sample_batch
from trainer.service.serve import model_config


def _perturbed(host: core.ModelHost, name: str, seed: int) -> core.TrainingClient:
    """A LoRA tenant whose adapter is random (both factors), so it samples differently from the base and others."""
    client = host.create_lora_client(name, rank=4, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in client.params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return client


@pytest.fixture(scope="module")
def host() -> core.ModelHost:
    host = core.ModelHost(model_config("tiny", TINY), max_tenants=4)
    _perturbed(host, "alice", 1)
    _perturbed(host, "bob", 2)
    return host


def test_rows_of_two_tenants_in_one_pass_get_their_own_adapters_outputs(host: core.ModelHost) -> None:
    greedy = core.SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    alice, bob = host.client("alice").sampling_client(), host.client("bob").sampling_client()
    requests = [SampleRequest(alice, [5, 6, 7], 2, greedy), SampleRequest(bob, [5, 6, 7], 1, greedy),
                SampleRequest(alice, [9, 10, 11, 12, 13], 1, core.SamplingParams(max_tokens=4, temperature=0.0, stop=[])),
                SampleRequest(host.base_sampler(), [5, 6, 7], 1, greedy)]
    assert len({batch_key(r.client, greedy) for r in requests}) == 1
    batched = sample_batch(requests)
    alone = [r.client.sample(r.prompt, r.num_samples, r.params) for r in requests]
    for got, want in zip(batched, alone):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        for g, w in zip(got.sequences, want.sequences):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    # the tenants really differ: the same prompt gives each its own continuation
    assert batched[0].sequences[0].tokens != batched[1].sequences[0].tokens
    assert batched[1].sequences[0].tokens != batched[3].sequences[0].tokens
    assert len(batched[2].sequences[0].tokens) == 4


def test_sampled_rows_follow_their_tenants_distribution(host: core.ModelHost) -> None:
    """Sampled (not greedy) rows in a mixed batch carry the log-probs of their own adapter."""
    params = core.SamplingParams(max_tokens=6, temperature=1.0, stop=[])
    alice, bob = host.client("alice").sampling_client(), host.client("bob").sampling_client()
    out = sample_batch([SampleRequest(alice, [3, 4], 3, params), SampleRequest(bob, [3, 4], 3, params)])
    for client, response in zip([alice, bob], out):
        for seq in response.sequences:
            own = client.compute_logprobs([3, 4, *seq.tokens])[2:]
            assert seq.logprobs == pytest.approx(own, abs=1e-4)


def test_seeded_requests_never_share_a_pass(host: core.ModelHost) -> None:
    alice = host.client("alice").sampling_client()
    assert batch_key(alice, core.SamplingParams(seed=3)) is None
    assert batch_key(alice, core.SamplingParams(temperature=0.5)) != batch_key(alice, core.SamplingParams())
    with pytest.raises(ValueError, match="one batch key"):
        sample_batch([SampleRequest(alice, [1], 1, core.SamplingParams(seed=1))])


# -- the scheduler (WorkQueue) ------------------------------------------------------------------

def _queue(tmp_path: Any, **kwargs: Any) -> Any:
    from trainer.service._queue import WorkQueue
    from trainer.service._store import Store

    return WorkQueue(Store(tmp_path / "q.sqlite"), **kwargs)


def _blocked(work: Any) -> threading.Event:
    """Hold the worker until the returned event is set, so what is submitted meanwhile queues up."""
    release = threading.Event()
    work.submit("block", lambda: (release.wait(30), (b"{}", "application/json"))[1], bounded=False)
    return release


def _drain(work: Any) -> None:
    deadline = time.monotonic() + 30
    while (work.pending() or work._queued) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_clients_are_served_round_robin(tmp_path: Any) -> None:
    """A client with a long queue does not hold back another's step: lanes alternate, one job each."""
    work = _queue(tmp_path)
    order: list[str] = []

    def job(name: str) -> Any:
        return lambda: (order.append(name), (b"{}", "application/json"))[1]
    release = _blocked(work)
    for i in range(5):
        work.submit("forward_backward", job(f"a{i}"), owner="a")
    work.submit("optim_step", job("b0"), owner="b")
    work.submit("optim_step", job("b1"), owner="b")
    release.set()
    _drain(work)
    work.close()
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]


def test_a_batch_takes_one_job_per_client_per_round_within_its_budget(tmp_path: Any) -> None:
    from trainer.service._queue import Batchable

    batches: list[list[str]] = []

    def runner(payloads: list[str]) -> list[Any]:
        batches.append(payloads)
        return [(b"{}", "application/json")] * len(payloads)
    work = _queue(tmp_path, batch_runners={"sample": runner})
    release = _blocked(work)
    for owner, n in (("a", 5), ("b", 2)):
        for i in range(n):
            name = f"{owner}{i}"
            work.submit("sample", lambda: (b"{}", "application/json"), owner=owner,
                        batch=Batchable(name, key="greedy", cost=10, budget=40))
    work.submit("sample", lambda: (b"{}", "application/json"), owner="c",
                batch=Batchable("c0", key="other settings", cost=10, budget=40))
    release.set()
    _drain(work)
    work.close()
    # round-robin inside the batch (a, b, a, b), capped by the budget; other settings run in their own batch
    assert batches[0] == ["a0", "b0", "a1", "b1"]
    assert ["a2", "a3", "a4"] in batches
    assert work.stats.batched_jobs["sample"] == 7 and work.stats.largest_batch["sample"] == 4


def test_past_the_queue_budget_submissions_are_refused_with_429(tmp_path: Any) -> None:
    from trainer.service._errors import TooManyRequests

    work = _queue(tmp_path, max_queued=3)
    release = _blocked(work)  # the service's own work counts but is never refused
    for _ in range(2):
        work.submit("sample", lambda: (b"{}", "application/json"), owner="a")
    with pytest.raises(TooManyRequests, match="overloaded") as refused:
        work.submit("sample", lambda: (b"{}", "application/json"), owner="b")
    assert refused.value.status == 429 and work.stats.refused == 1
    release.set()
    _drain(work)
    work.submit("sample", lambda: (b"{}", "application/json"), owner="b")  # room again once the queue drained
    work.close()
