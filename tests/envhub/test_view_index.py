"""``envhub view``'s indexes: growing files, half-written and malformed lines, replaced files, filters."""

from __future__ import annotations

import json

import pytest
from view_fixtures import eval_result, run_record

from envhub.view._episodes import conversation, token_view
from envhub.view._index import EpisodeFilter, EpisodeIndex, MetricSeries
from envhub.view._tail import JsonlTail


def append(path, text: str) -> None:
    with open(path, "a") as handle:
        handle.write(text)


def test_tail_reads_only_complete_lines_and_counts_bad_ones(tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    tail = JsonlTail(path)
    assert list(tail.read_new()) == []  # no file yet
    append(path, '{"a": 1}\n{"a": 2')
    assert [line.record for line in tail.read_new()] == [{"a": 1}]
    assert list(tail.read_new()) == []  # the half-written line waits
    append(path, '}\nnot json\n[1, 2]\n\n{"a": 3}\n')
    lines = list(tail.read_new())
    assert [(line.number, line.record) for line in lines] == [(2, {"a": 2}), (6, {"a": 3})]
    assert tail.bad.count == 2 and [n for n, _ in tail.bad.examples] == [3, 4]
    assert "expected a JSON object" in tail.bad.examples[1][1]


def test_a_line_nested_too_deep_is_counted_and_a_lone_surrogate_is_replaced(tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    tail = JsonlTail(path)
    append(path, '{"reward": ' + "[" * 100_000 + "]" * 100_000 + "}\n" + '{"text": "\\ud800 lone"}\n{"a": 1}\n')
    records = [line.record for line in tail.read_new()]
    assert records == [{"text": "\ufffd\ufffd\ufffd lone"}, {"a": 1}]  # it encodes as UTF-8 now: servable
    assert tail.bad.count == 1 and tail.bad.examples[0] == (1, "not JSON: nested too deep")


def test_tail_skips_a_line_over_the_limit_without_holding_it(tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    tail = JsonlTail(path, max_line_bytes=32)
    append(path, '{"ok": 1}\n{"big": "' + "x" * 100)
    assert [line.record for line in tail.read_new()] == [{"ok": 1}]
    append(path, '"}\n{"ok": 2}\n')
    assert [line.record for line in tail.read_new()] == [{"ok": 2}]
    assert tail.bad.count == 1 and "longer than 32 bytes" in tail.bad.examples[0][1]


def test_index_grows_with_the_file_and_starts_over_when_it_is_replaced(tmp_path) -> None:
    path = tmp_path / "trajectories.jsonl"
    index = EpisodeIndex(path, eval_results=False)
    append(path, "".join(json.dumps(run_record(1, r)) + "\n" for r in (0.0, 1.0)))
    assert index.page(EpisodeFilter(), offset=0, limit=10)[0] == 2
    append(path, json.dumps(run_record(2, 1.0)) + "\n" + json.dumps(run_record(3, 0.5))[:40])
    total, rows = index.page(EpisodeFilter(), offset=0, limit=10)
    assert total == 3 and [r["step"] for r in rows] == [1, 1, 2]
    row, record = index.record(2)
    assert row["line"] == 3 and record["step"] == 2 and record["reward"] == 1.0
    path.write_text(json.dumps(run_record(9, 0.25)) + "\n")  # a new run in the same directory
    total, rows = index.page(EpisodeFilter(), offset=0, limit=10)
    assert total == 1 and rows[0]["step"] == 9 and index.record(0)[1]["reward"] == 0.25
    with pytest.raises(IndexError, match=r"\[0, 1\)"):
        index.record(1)


def test_filters_narrow_by_step_reward_stop_reason_failure_and_phase(tmp_path) -> None:
    path = tmp_path / "trajectories.jsonl"
    records = [run_record(1, 0.0), run_record(1, 1.0), run_record(2, 1.0, stop_reason="parse_error", failure="parse_error"),
               run_record(3, 0.5, phase="eval"), {"step": "bad", "reward": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    index = EpisodeIndex(path, eval_results=False)

    def indices(**kw):
        return [r["index"] for r in index.page(EpisodeFilter(**kw), offset=0, limit=50)[1]]

    assert indices() == [0, 1, 2, 3]
    assert indices(step_min=2) == [2, 3] and indices(step_max=1) == [0, 1]
    assert indices(reward_min=0.5) == [1, 2, 3] and indices(reward_min=0.4, reward_max=0.6) == [3]
    assert indices(stop_reasons=frozenset({"parse_error"})) == [2]
    assert indices(failures=frozenset({"none"})) == [0, 1, 3]
    assert indices(phase="eval") == [3] and indices(phase="train") == [0, 1, 2]
    total, rows = index.page(EpisodeFilter(), offset=1, limit=2, newest_first=True)
    assert total == 4 and [r["index"] for r in rows] == [2, 1]
    facets = index.facets()
    assert facets["stop_reason"] == {"done": 3, "parse_error": 1} and facets["steps"] == [1, 3]
    assert facets["bad_lines"] == 1 and "'step' to be an integer" in facets["bad_examples"][0]["why"]


def test_eval_results_filter_failures_and_rewards_without_a_reward(tmp_path) -> None:
    path = tmp_path / "results.jsonl"
    records = [eval_result(0), eval_result(1, reward=0.0),
               eval_result(2, reward=None, stop_reason="env_error", failure={"kind": "env_error", "message": "down"}),
               eval_result(3, reward=None, stop_reason="timeout", failure="timeout"),  # type: ignore[arg-type]
               {**eval_result(4), "failure": 7}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    index = EpisodeIndex(path, eval_results=True)
    assert [r["index"] for r in index.page(EpisodeFilter(reward_max=1.0), offset=0, limit=9)[1]] == [0, 1]
    assert [r["title"] for r in index.page(EpisodeFilter(failures=frozenset({"env_error"})), offset=0, limit=9)[1]] == [
        "task_index 2 · seed 1002 · sample 0"]
    assert index.facets()["failure"] == {"env_error": 1, "none": 2, "timeout": 1}
    assert index.facets()["bad_examples"] == [{"line": 5, "why": "expected 'failure' to be null or an object, got 7"}]


def test_metric_series_reads_growing_metrics_and_thins_long_curves(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    series = MetricSeries(path)
    assert series.keys() == []
    append(path, "".join(json.dumps({"step": s, "time": 1.0, "train/loss": 1 / s, "train/reward_mean": s / 100})
                         + "\n" for s in range(1, 101)))
    append(path, '{"step": "x"}\n{"step": 101, "train/reward_mean": NaN}\n{"step": 102')
    assert series.keys() == ["train/reward_mean", "train/loss"]  # reward keys first, no "time"
    points = series.points("train/reward_mean", max_points=10)
    assert len(points) == 10 and points[0] == [1.0, 0.01] and points[-1] == [100.0, 1.0]
    assert series.bad_lines() == 1 and series.points("nope", 10) == []


def test_a_training_record_reads_as_a_conversation_with_tool_calls_and_trained_turns() -> None:
    messages = conversation(run_record(1, 1.0))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert [m["trained"] for m in messages] == [False, False, True, False, True]
    assert messages[2]["tool_calls"] == [{"id": "", "name": "run_python", "arguments": '{"code": "print(2+2)"}'}]
    assert messages[3]["parts"] == [{"type": "text", "text": "4"}]
    view = token_view(run_record(1, 1.0))
    assert [s["mask"] for s in view["segments"]] == [0, 1, 0, 1] and view["decoded"]
    assert view["segments"][1]["text"].startswith("<tool_call>") and view["segments"][1]["logprob_mean"] == -0.5


def test_an_eval_record_keeps_inline_images_and_drops_remote_ones() -> None:
    record = eval_result(0)
    record["messages"][1]["content"].append({"type": "image_url", "image_url": {"url": "http://example.com/x.png"}})
    user = conversation(record)[1]
    assert user["parts"][1]["src"].startswith("data:image/png;base64,")
    assert "src" not in user["parts"][2] and "not inline" not in user["parts"][2]["label"]
    assert token_view(record) == {"available": False, "why": "eval results carry token counts, not token ids and masks"}


def test_image_placeholders_become_labels_and_old_records_show_token_ids() -> None:
    record = run_record(1, 1.0)
    image = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>"
    record["text"] = record["text"].replace("What is 2+2?", image + "What colour?")
    record["images"] = [[1, 6, 6]]
    del record["segments"]
    user = conversation(record)[1]
    assert user["parts"] == [{"type": "image", "label": "image 1 (grid 1×6×6; pixels not logged)"},
                             {"type": "text", "text": "What colour?"}]
    assert user["trained"] is None  # no segments: which text is trained is unknown
    view = token_view(record)
    assert not view["decoded"] and [s["mask"] for s in view["segments"]] == [0, 1, 0, 1]
    assert "text" not in view["segments"][0] and view["segments"][0]["ids"] == record["tokens"][:len(view["segments"][0]["ids"])]
    record["mask"] = record["mask"][:-1]  # a mask that does not fit the ids is refused, not guessed
    assert token_view(record)["available"] is False


def test_a_token_view_of_a_mask_that_is_not_0_and_1_or_logprobs_that_are_not_numbers() -> None:
    assert token_view({"tokens": [1, 2, 3], "mask": ["a", "b", "c"]}) == {
        "available": False, "why": "this record's mask holds values other than 0 and 1"}  # was drawn as trained
    view = token_view({"tokens": [1, 2, 3], "mask": [0, 1, 1], "logprobs": ["a", 1, 2]})
    assert view["available"] and "logprob_mean" not in view["segments"][1]  # was a 409 from float('a')
