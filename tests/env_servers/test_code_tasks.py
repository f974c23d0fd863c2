"""The code env's task set: built-in problems, seeded splits and the JSONL loader (pure, no sandbox)."""

from __future__ import annotations

import json
import random

import pytest

from env_servers.code_env.tasks import TaskSet, builtin_tasks, load_jsonl, reference_solutions


def test_builtin_set_has_at_least_50_tasks_of_both_kinds_with_references():
    tasks = builtin_tasks()
    assert len(tasks) >= 50
    assert {t.kind for t in tasks} == {"call", "io"}
    assert set(reference_solutions()) == {t.task_id for t in tasks}
    assert all(len(t.tests) >= 2 for t in tasks)


def test_splits_are_disjoint_cover_everything_and_depend_only_on_the_seed():
    tasks = list(builtin_tasks())
    a, b, c = TaskSet(tasks, seed=0), TaskSet(list(reversed(tasks)), seed=0), TaskSet(tasks, seed=1)
    ids = {name: [t.task_id for t in a.split(name)] for name in ("train", "validation", "test")}
    assert sum(map(len, ids.values())) == len(tasks) == len(set().union(*map(set, ids.values())))
    assert len(ids["validation"]) >= 5 and len(ids["test"]) >= 5
    assert ids["test"] == [t.task_id for t in b.split("test")]
    assert ids["test"] != [t.task_id for t in c.split("test")]
    assert a.split("val") == a.split("validation")


def test_pick_by_id_index_and_random():
    ts = TaskSet(list(builtin_tasks()))
    assert ts.pick(random.Random(0), task_id="fizzbuzz").task_id == "fizzbuzz"
    assert ts.pick(random.Random(0), "test", index=0) is ts.split("test")[0]
    assert ts.pick(random.Random(3), "train") is ts.pick(random.Random(3), "train")
    with pytest.raises(ValueError, match="index"):
        ts.pick(random.Random(0), "test", index=999)
    with pytest.raises(ValueError, match="split"):
        ts.pick(random.Random(0), "holdout")


def test_statement_shows_signature_and_one_example():
    task = TaskSet(list(builtin_tasks())).by_id["two_sum"]
    text = task.statement()
    assert "two_sum(nums, target)" in text and "== [0, 1]" in text


def test_jsonl_loader_reads_the_common_shapes(tmp_path):
    rows = [
        {"task_id": "add", "prompt": "Add.", "entry_point": "add", "tests": [{"input": [1, 2], "output": 3}]},
        {"question": "Echo.", "tests": [{"input": "hi\n", "output": "hi\n"}]},
        {"problem_id": 7, "question": "Double.",
         "input_output": json.dumps({"inputs": [[2], [5]], "outputs": [4, 10], "fn_name": "double"})},
        {"question": "Sum lines.", "input_output": {"inputs": [["1", "2"]], "outputs": [["3"]]}},
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tasks = load_jsonl(path)
    assert [(t.task_id, t.kind, t.entry_point) for t in tasks] == [
        ("add", "call", "add"), ("tasks-2", "io", None), ("7", "call", "double"), ("tasks-4", "io", None)]
    assert tasks[2].tests[1].input == [5] and tasks[3].tests[0].input == "1\n2\n"


def test_jsonl_errors_name_the_line_and_the_fix(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "x", "tests": [{"input": "1", "output": "1"}]}) + "\n"
                    + json.dumps({"prompt": "no tests"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: Expected 'tests' or 'input_output'"):
        load_jsonl(path)
