"""A training service as a scheduler job: started on a free GPU, its URL reported, ended with the client's block."""

from __future__ import annotations

import pytest
from sched_helpers import alive

from trainer.scheduler import SchedulerClient

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.live

SMALL = ["--model-config", "hidden_size=32", "--model-config", "num_layers=1", "--model-config", "num_heads=2",
         "--model-config", "num_kv_heads=1", "--model-config", "intermediate_size=64", "--threads", "1"]


def test_training_service_job_serves_the_sdk_and_ends_with_the_block(live, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    args = ["--host", "127.0.0.1", "--state-dir", str(tmp_path / "svc"), *SMALL]
    with SchedulerClient(live.url) as client:
        with client.training_service(gpus=1, args=args, heartbeat_timeout_s=30, start_timeout_s=120) as svc:
            job = svc.status()
            assert job["kind"] == "service" and len(job["gpus"]) == 1 and svc.url == job["endpoints"][0]
            sc = tinker.ServiceClient(base_url=svc.url, api_key="tml-sched")
            tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
            datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                                       loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
            assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
            sc.close("success").result(timeout=30)
            pid = job["pid"]
        final = client.status(svc.id)
    assert final["state"] == "cancelled" and not alive(pid)
