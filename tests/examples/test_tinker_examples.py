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


def test_a_base_url_with_no_service_is_one_line_not_minutes_of_sdk_retries(service_url: str, tmp_path: Path) -> None:
    from examples import tinker_rl, tinker_sft
    from trainer.local_server import free_port
    from trainer.service.serve import check_service

    check_service(service_url)  # a live service answers
    dead = f"http://127.0.0.1:{free_port()}"
    for example in (tinker_sft, tinker_rl):
        with pytest.raises(SystemExit, match=rf"^{example.__name__.rsplit('.', 1)[1]}: error: no training service "
                                             rf"answers at {dead} \(ConnectError: .*or leave out --base-url$"):
            example.main(["--base-url", dead, "--out", str(tmp_path)])
