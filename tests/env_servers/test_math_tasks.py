"""The built-in math task generator and the dataset loaders."""

import json
import random

import pytest

from env_servers.math_env import loaders
from env_servers.math_env.tasks import DIFFICULTIES, KINDS, SPLITS, add_tasks, generate, split_of, task_at
from env_servers.math_grading.grading import is_equiv


@pytest.mark.parametrize("kind", KINDS)
def test_every_family_produces_self_consistent_tasks_in_the_requested_split(kind):
    rng = random.Random(7)
    for difficulty in DIFFICULTIES:
        for split in SPLITS:
            task = generate(rng, split=split, kind=kind, difficulty=difficulty)
            assert (task.kind, task.difficulty, task.split) == (kind, difficulty, split)
            assert split_of(task.problem) == split
            assert is_equiv(task.answer, task.answer), task


def test_generator_answers_are_right():
    rng = random.Random(3)
    for _ in range(50):
        task = generate(rng, kind="add", difficulty=2)
        a, op, b = task.problem.removeprefix("What is ").rstrip("?").split()
        assert int(task.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    for _ in range(50):
        task = generate(rng, kind="linear", difficulty=1)  # "Solve for $x$: $x + a = b$."
        a, b = [int(s) for s in task.problem.split("$x + ")[1].rstrip("$.").split(" = ")]
        assert int(task.answer) == b - a


def test_splits_are_disjoint():
    by_split = {s: {t.problem for t in add_tasks(s, 2)} for s in SPLITS}
    assert not by_split["train"] & by_split["validation"]
    assert not by_split["train"] & by_split["test"]
    assert not by_split["validation"] & by_split["test"]
    sampled = {generate(random.Random(i), split="validation", kind="fraction").problem for i in range(200)}
    assert not sampled & {generate(random.Random(i), split="train", kind="fraction").problem for i in range(400)}


def test_tiny_model_family_is_short_and_big_enough():
    train, validation = add_tasks("train", 1), add_tasks("validation", 1)
    assert len(train) >= 100 and len(validation) >= 10
    assert max(len(t.problem) for t in train + validation) <= 20
    assert {t.problem for t in train}.isdisjoint(t.problem for t in validation)


def test_task_at_is_deterministic_and_seeding_reproduces():
    assert task_at(5, split="test", kind="word") == task_at(5, split="test", kind="word")
    assert task_at(5, split="test") != task_at(6, split="test")
    assert generate(random.Random(1)) == generate(random.Random(1))


@pytest.mark.parametrize("bad", [dict(kind="calculus"), dict(difficulty=4), dict(split="dev")])
def test_bad_choices_name_the_valid_ones(bad):
    with pytest.raises(ValueError, match="Expected"):
        generate(random.Random(0), **bad)


def test_math_style_records_take_the_last_boxed_answer(tmp_path):
    path = tmp_path / "math.jsonl"
    records = [{"problem": "What is 1+1?", "solution": r"Clearly \boxed{1}... no, \boxed{2}.", "type": "Algebra",
                "level": "Level 2"},
               {"problem": "No answer", "solution": "none"}]
    path.write_text("\n".join(json.dumps(r) for r in records))
    tasks = loaders.to_tasks(loaders.read_records(path), split="test")
    assert len(tasks) == 1
    assert (tasks[0].answer, tasks[0].kind, tasks[0].difficulty) == ("2", "Algebra", 2)


def test_gsm8k_style_records_take_the_answer_after_hashes(tmp_path):
    path = tmp_path / "gsm8k.json"
    path.write_text(json.dumps([{"question": "Sum?", "answer": "3 + 4 = 7\n#### 1,007"}]))
    (task,) = loaders.load_file(str(path), "train")
    assert task.answer == "1007" and task.kind == "gsm8k"


def test_parquet_records_are_read_when_pandas_is_available(tmp_path):
    pandas = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "train.parquet"
    pandas.DataFrame([{"problem": "2+2?", "solution": r"\boxed{4}"}]).to_parquet(path)
    assert loaders.read_records(path)[0]["problem"] == "2+2?"


def test_missing_file_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        loaders.read_records(tmp_path / "nope.jsonl")


def test_column_problems_never_carry_or_borrow_and_keep_their_split():
    import random as _random

    from env_servers.math_env.tasks import _column, split_of, task_at

    rng = _random.Random(0)
    for difficulty in (1, 2, 3):
        for _ in range(300):
            problem, answer = _column(rng, difficulty)
            a, op, b = problem.removeprefix("What is ").removesuffix("?").split()
            for da, db in zip(reversed(a), reversed(b)):
                assert (int(da) + int(db) <= 9) if op == "+" else (int(da) >= int(db)), problem
            assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    for split in ("train", "validation"):
        task = task_at(3, split=split, kind="column", difficulty=1)
        assert split_of(task.problem) == split and task.kind == "column"


def test_index_walks_every_small_add_split_once_then_wraps():
    for difficulty in (1, 2):
        pool = add_tasks("validation", difficulty)
        walked = [task_at(i, split="validation", kind="add", difficulty=difficulty) for i in range(len(pool))]
        assert walked == pool  # each validation problem exactly once, in the stable order
        assert task_at(len(pool), split="validation", kind="add", difficulty=difficulty) == pool[0]


@pytest.mark.parametrize("difficulty", [1, 2])
def test_no_validation_sum_is_a_train_sum_mirrored(difficulty):
    train = {t.problem for t in add_tasks("train", difficulty)}
    for task in add_tasks("validation", difficulty) + add_tasks("test", difficulty):
        a, op, b = task.problem.removeprefix("What is ").removesuffix("?").split()
        assert op == "-" or f"What is {b} + {a}?" not in train, task.problem


def test_no_validation_word_problem_is_a_train_one_with_another_name_or_item():
    from env_servers.math_env.tasks import _ITEMS, _NAMES

    def shape(problem: str) -> str:  # the template and the numbers
        for word in _NAMES + _ITEMS:
            problem = problem.replace(word, "_")
        return problem

    train = {shape(task_at(i, split="train", kind="word", difficulty=1).problem) for i in range(3000)}
    held_out = [task_at(i, split=split, kind="word", difficulty=1).problem for split in ("validation", "test")
                for i in range(300)]
    assert not [p for p in held_out if shape(p) in train]  # was 120 of 300 validation problems
