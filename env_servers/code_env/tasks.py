"""Programming tasks with hidden tests: the built-in set, a JSONL loader, and seeded train/validation/test splits.

Two kinds of task. ``call``: the submission defines ``entry_point``; each test is an argument
list and the expected return value (kept in the typed encoding of :mod:`.grading`). ``io``: the
submission is a program; each test is a stdin text and the expected stdout.

JSONL rows (one task per line) may use any of these shapes::

    {"task_id": "add", "prompt": "...", "entry_point": "add", "tests": [{"input": [1, 2], "output": 3}]}
    {"question": "...", "tests": [{"input": "1 2\\n", "output": "3\\n"}]}                    # stdin/stdout
    {"problem_id": 7, "question": "...", "input_output": "{\\"inputs\\": [...], \\"outputs\\": [...], \\"fn_name\\": \\"f\\"}"}
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from env_servers.code_env import grading, problems

SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {"val": "validation", "valid": "validation", "dev": "validation", "eval": "test"}


@dataclass(frozen=True)
class TestCase:
    """One hidden test: an argument list (call) or stdin (io), and the expected typed value or stdout."""

    input: Any
    output: Any


@dataclass(frozen=True)
class CodeTask:
    """A problem statement with hidden tests."""

    task_id: str
    prompt: str
    kind: str
    tests: tuple[TestCase, ...]
    entry_point: str | None = None
    signature: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("call", "io"):
            raise ValueError(f"Expected task kind 'call' or 'io', got {self.kind!r} for task {self.task_id!r}.")
        if self.kind == "call" and not self.entry_point:
            raise ValueError(f"Task {self.task_id!r} is call-based and needs an entry_point.")
        if not self.tests:
            raise ValueError(f"Task {self.task_id!r} has no tests; every task needs at least one.")

    def statement(self) -> str:
        """The problem as the model sees it: the prompt, what to submit, and one worked example."""
        first = self.tests[0]
        if self.kind == "call":
            call = f"{self.entry_point}({', '.join(repr(a) for a in first.input)})"
            return (f"{self.prompt}\n\nWrite a Python function `{self.signature or f'{self.entry_point}(...)'}`.\n"
                    f"Example: {call} == {grading.decode_value(first.output)!r}\n\n"
                    "Submit the whole function definition (with any imports it needs) with submit(code).")
        return (f"{self.prompt}\n\nWrite a complete Python program that reads standard input and writes standard "
                f"output.\nExample input:\n{first.input}\nExample output:\n{first.output}\n"
                "Submit the whole program with submit(code).")


class TaskSet:
    """Tasks split into train/validation/test by a seeded shuffle of their ids (stable across runs)."""

    def __init__(self, tasks: list[CodeTask], *, seed: int = 0, fractions: tuple[float, float] = (0.7, 0.15)):
        if not tasks:
            raise ValueError("Expected at least one task, got none.")
        ids = [t.task_id for t in tasks]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"Expected unique task ids, got duplicates: {dup[:5]}.")
        self.by_id = {t.task_id: t for t in tasks}
        order = sorted(ids)
        random.Random(seed).shuffle(order)
        n_train = max(1, round(len(order) * fractions[0]))
        n_val = round(len(order) * fractions[1])
        cut = [order[:n_train], order[n_train:n_train + n_val], order[n_train + n_val:]]
        self.splits = {name: [self.by_id[i] for i in chunk] for name, chunk in zip(SPLITS, cut)}

    def split(self, name: str) -> list[CodeTask]:
        key = SPLIT_ALIASES.get(name, name)
        if key not in self.splits:
            raise ValueError(f"Expected split to be one of {', '.join(SPLITS)}, got {name!r}.")
        if not self.splits[key]:
            raise ValueError(f"Split {key!r} is empty ({len(self.by_id)} tasks in all); use another split.")
        return self.splits[key]

    def pick(self, rng: random.Random, split: str = "train", index: int | None = None,
             task_id: str | None = None) -> CodeTask:
        """By ``task_id``, by ``index`` within the split, or at random from the split."""
        if task_id is not None:
            if task_id not in self.by_id:
                raise ValueError(f"Unknown task_id {task_id!r}; e.g. {', '.join(sorted(self.by_id)[:5])}.")
            return self.by_id[task_id]
        tasks = self.split(split)
        if index is not None:
            if not 0 <= index < len(tasks):
                raise ValueError(f"Expected 0 <= index < {len(tasks)} for split {split!r}, got {index}.")
            return tasks[index]
        return rng.choice(tasks)


# -- built-in tasks -------------------------------------------------------------------------------
def _signature(reference: str, entry_point: str) -> str | None:
    m = re.search(rf"def ({re.escape(entry_point)}\([^)]*\))", reference)
    return m.group(1) if m else None


def _run_reference_io(reference: str, stdin: str) -> str:
    out = io.StringIO()
    saved = sys.stdin
    try:
        sys.stdin = io.StringIO(stdin)
        with contextlib.redirect_stdout(out):
            exec(compile(reference, "<reference>", "exec"), {"__name__": "__main__"})
    finally:
        sys.stdin = saved
    return out.getvalue()


@functools.lru_cache(maxsize=1)
def builtin_tasks() -> tuple[CodeTask, ...]:
    """The problems of :mod:`.problems`, with expected outputs computed from their (trusted) references."""
    tasks = []
    for task_id, prompt, entry, reference, inputs in problems.CALL:
        ns: dict[str, Any] = {}
        exec(compile(reference, f"<reference {task_id}>", "exec"), ns)
        tests = tuple(TestCase(list(args), grading.encode_value(ns[entry](*json.loads(json.dumps(list(args))))))
                      for args in inputs)
        tasks.append(CodeTask(task_id, prompt, "call", tests, entry, _signature(reference, entry)))
    for task_id, prompt, reference, stdins in problems.IO:
        tests = tuple(TestCase(s, _run_reference_io(reference, s)) for s in stdins)
        tasks.append(CodeTask(task_id, prompt, "io", tests))
    return tuple(tasks)


def reference_solutions() -> dict[str, str]:
    """Reference source by task id (for tests and examples; never shown to the model)."""
    refs = {task_id: ref for task_id, _, _, ref, _ in problems.CALL}
    refs.update({task_id: ref for task_id, _, ref, _ in problems.IO})
    return refs


# -- JSONL ----------------------------------------------------------------------------------------
def load_jsonl(path: str | Path) -> list[CodeTask]:
    """Tasks from a JSONL file (see the module docstring for the accepted row shapes)."""
    tasks = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                tasks.append(parse_row(row, default_id=f"{Path(path).stem}-{line_no}"))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{line_no}: {exc}") from None
    return tasks


def parse_row(row: object, *, default_id: str) -> CodeTask:
    """One JSONL row as a :class:`CodeTask`."""
    if not isinstance(row, dict):
        raise ValueError(f"Expected a JSON object per line, got {type(row).__name__}.")
    prompt = next((row[k] for k in ("prompt", "question", "problem", "description") if row.get(k)), None)
    if not isinstance(prompt, str):
        raise ValueError("Expected a 'prompt' or 'question' string.")
    task_id = str(row.get("task_id", row.get("id", row.get("problem_id", default_id))))
    entry = row.get("entry_point") or row.get("fn_name")
    if "input_output" in row:
        spec = row["input_output"]
        spec = json.loads(spec) if isinstance(spec, str) else spec
        entry = entry or spec.get("fn_name")
        pairs = list(zip(spec["inputs"], spec["outputs"]))
    elif "tests" in row:
        tests = row["tests"]
        if isinstance(tests, dict):
            pairs = list(zip(tests["inputs"], tests["outputs"]))
        else:
            pairs = [(t["input"], t["output"]) for t in tests]
    else:
        raise ValueError("Expected 'tests' or 'input_output' with the hidden tests.")
    if entry:
        cases = tuple(TestCase(list(i) if isinstance(i, list) else [i], grading.encode_value(o)) for i, o in pairs)
        return CodeTask(task_id, prompt, "call", cases, str(entry), row.get("signature"))
    cases = tuple(TestCase(_text(i), _text(o)) for i, o in pairs)
    return CodeTask(task_id, prompt, "io", cases)


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(map(str, value)) + "\n"
    if not isinstance(value, str):
        raise ValueError(f"Expected stdin/stdout tests to be strings, got {type(value).__name__}.")
    return value
