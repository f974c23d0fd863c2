"""The tinker SDK examples, shortened, against one local ``envhub-train serve`` (LoRA on the tiny model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("tinker")

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def service_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from trainer.service.serve import local_service

    state = tmp_path_factory.mktemp("service")
    with local_service(["--threads", "1", "--state-dir", str(state)], state / "service.log") as url:
        yield url


def test_sft_example_lowers_the_reply_nll(service_url: str, tmp_path: Path) -> None:
    from examples import tinker_sft

    summary = tinker_sft.main(["--base-url", service_url, "--steps", "20", "--out", str(tmp_path)])
    assert summary["nll_last"] < 0.7 * summary["nll_first"]
    assert summary["state"].startswith("tinker://") and summary["state"].endswith("/weights/final")
    assert set(summary["replies"]) == {p for p, _ in tinker_sft.PAIRS}
    assert (tmp_path / "summary.json").exists()


def test_rl_example_runs_warmup_validation_and_grpo_steps(service_url: str, tmp_path: Path) -> None:
    from examples import tinker_rl

    summary = tinker_rl.main(["--base-url", service_url, "--steps", "2", "--sft-steps", "10", "--batch", "8",
                              "--group", "4", "--check-problems", "16", "--out", str(tmp_path)])
    assert summary["grpo_steps"] == 2 and summary["sft_steps"] == 10
    for key in ("val_reward_before", "val_reward_after", "train_reward_first", "train_reward_last"):
        assert 0.0 <= summary[key] <= 1.0
    assert (tmp_path / "summary.json").exists() and (tmp_path / "math_server.log").exists()
