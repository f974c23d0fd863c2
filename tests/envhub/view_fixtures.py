"""Fixture directories for ``envhub view``: an ``envhub eval`` results directory and a trainer run directory.

The eval format (one JSON object per episode in ``results.jsonl``): ``task_index``, ``seed``, ``sample``,
``turns``, ``tool_calls`` (a count), ``reward`` (null for an infrastructure failure), ``rewards`` (named
components), ``stop_reason``, ``failure`` (null or ``{"kind", "message"}``), ``tokens``
(``{"prompt", "completion"}``), ``seconds`` and ``messages`` (OpenAI chat messages, images as data URLs).
The run format is what :class:`trainer.metrics.MetricsLogger` writes from ``Trajectory.to_record``.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from pathlib import Path
from typing import Any


def png_bytes(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A solid-colour PNG, built by hand (no imaging library needed)."""
    raw = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def eval_result(task_index: int, sample: int = 0, *, reward: float | None = 1.0, stop_reason: str = "done",
                failure: dict[str, str] | None = None, image: bool = True) -> dict[str, Any]:
    """One episode of an eval: a tool call to ``run_python`` with its result, then a boxed answer."""
    user: list[dict[str, Any]] = [{"type": "text", "text": f"What is {task_index} + {task_index}?"}]
    if image:
        user.append({"type": "image_url", "image_url": {"url": data_url(png_bytes(24, 24, (220, 60, 60)))}})
    messages = [
        {"role": "system", "content": "Put the answer in \\boxed{}."},
        {"role": "user", "content": user},
        {"role": "assistant", "content": "Let me compute.",
         "tool_calls": [{"id": f"call_{task_index}", "type": "function",
                         "function": {"name": "run_python", "arguments": json.dumps({"code": f"print({task_index}*2)"})}}]},
        {"role": "tool", "tool_call_id": f"call_{task_index}", "name": "run_python", "content": str(task_index * 2)},
        {"role": "assistant", "content": f"\\boxed{{{task_index * 2}}}"},
    ]
    components = None if reward is None else {"correct": reward, "format": 0.1}
    return {"task_index": task_index, "seed": 1000 + task_index, "sample": sample, "turns": 2, "tool_calls": 1,
            "reward": reward, "rewards": components or {}, "stop_reason": stop_reason, "failure": failure,
            "tokens": {"prompt": 40, "completion": 12}, "seconds": 0.5, "messages": messages}


def write_eval_dir(root: Path, n: int = 12) -> list[dict[str, Any]]:
    """``n`` eval results (every 4th wrong, the last one an env failure) and a summary.json; returns the records."""
    root.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        if i == n - 1:
            rec = eval_result(i, reward=None, stop_reason="env_error",
                              failure={"kind": "env_error", "message": "connection refused"}, image=False)
        else:
            rec = eval_result(i, reward=0.0 if i % 4 == 3 else 1.0, image=i % 2 == 0)
        records.append(rec)
    with open(root / "results.jsonl", "w") as handle:
        for rec in records:
            handle.write(json.dumps(rec) + "\n")
    (root / "summary.json").write_text(json.dumps({"episodes": n, "pass@1": 0.7}))
    return records


def run_record(step: int, reward: float, *, stop_reason: str = "done", phase: str | None = None,
               failure: str | None = None) -> dict[str, Any]:
    """One trajectory as the trainer logs it: ChatML text, token ids (one per char here), mask, segments."""
    prompt = "<|im_start|>system\nPut the answer in \\boxed{}.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n" \
             "<|im_start|>assistant\n"
    reply = '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(2+2)"}}\n</tool_call><|im_end|>'
    observation = "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    answer = "\\boxed{4}<|im_end|>"
    segments = [[prompt, 0, len(prompt)], [reply, 1, len(reply)], [observation, 0, len(observation)],
                [answer, 1, len(answer)]]
    tokens, mask = [], []
    for text, m, _ in segments:
        tokens += [ord(c) % 256 for c in text]
        mask += [m] * len(text)
    rec: dict[str, Any] = {
        "step": step, "group_id": 0, "task": {"split": "train", "seed": step}, "reward": reward,
        "turn_rewards": [0.0, reward], "stop_reason": stop_reason, "policy_version": step, "turn_versions": [step, step],
        "num_turns": 2, "prompt_len": len(prompt), "parse_errors": 0, "error": None, "failure": failure,
        "failure_message": None, "tokens": tokens, "mask": mask, "logprobs": [-0.5 if m else 0.0 for m in mask],
        "images": [], "text": "".join(s[0] for s in segments), "completion": reply + answer, "segments": segments}
    if phase:
        rec = {"phase": phase, **rec}
    return rec


def write_run_dir(root: Path, steps: int = 5, per_step: int = 4) -> None:
    """A run directory: ``steps`` steps of ``per_step`` trajectories, metrics with a rising reward, one failed
    step in failures.jsonl, a summary."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "trajectories.jsonl", "w") as traj, open(root / "metrics.jsonl", "w") as metrics:
        for step in range(1, steps + 1):
            for i in range(per_step):
                traj.write(json.dumps(run_record(step, 1.0 if i < step % per_step else 0.0)) + "\n")
            metrics.write(json.dumps({"step": step, "time": 1.0, "train/reward_mean": step / steps,
                                      "train/loss": 1.0 / step}) + "\n")
    (root / "failures.jsonl").write_text(json.dumps(
        {"step": 2, "failed": 3, "episodes": 4, "by_kind": {"parse_error": 3}, "reason": "parse_error",
         "example": "invalid JSON in tool call"}) + "\n")
    (root / "summary.json").write_text(json.dumps({"steps": steps}))
