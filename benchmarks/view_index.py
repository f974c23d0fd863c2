"""``envhub view``'s episode index against reading the whole file per request, on a large trajectories.jsonl.

Writes N trainer-shaped trajectory lines (ChatML text, token ids, mask, log-probs, segments; about
``--tokens`` tokens each), then measures, side by side:

1. one filtered page of 50 rows (reward >= 0.5, one stop reason): the index (built once, refreshed per
   request: a stat) against the naive way (parse every line, filter, slice);
2. a live run's next poll after 100 new lines: the index's refresh (parses the 100) against the naive re-read;
3. the index's one-off build, and the memory it holds per episode.

    .venv/bin/python benchmarks/view_index.py              # 10,000 episodes of 2,000 tokens (~300 MB)
    .venv/bin/python benchmarks/view_index.py --smoke      # 500 episodes, seconds

Figures are medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envhub.view._index import EpisodeFilter, EpisodeIndex


def record(i: int, tokens: int) -> dict[str, Any]:
    prompt, reply = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "\\boxed{4}<|im_end|>"
    body = ("x" * max(tokens - len(prompt) - len(reply), 0))
    text = prompt + body + reply
    mask = [0] * (len(prompt) + len(body)) + [1] * len(reply)
    return {"step": i // 8, "task": {"seed": i}, "reward": (i % 3) / 2, "stop_reason": "done" if i % 5 else "turn_limit",
            "failure": None, "num_turns": 1, "tokens": [ord(c) % 256 for c in text], "mask": mask,
            "logprobs": [-0.5 if m else 0.0 for m in mask], "text": text,
            "segments": [[prompt + body, 0, len(prompt) + len(body)], [reply, 1, len(reply)]]}


def naive_page(path: Path, flt: Callable[[dict[str, Any]], bool], offset: int, limit: int) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        rows = [r for r in (json.loads(line) for line in handle if line.strip()) if flt(r)]
    return rows[offset:offset + limit]


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=10_000)
    p.add_argument("--tokens", type=int, default=2_000, help="tokens per episode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="500 episodes of 200 tokens, one repeat")
    args = p.parse_args()
    if args.smoke:
        args.episodes, args.tokens, args.repeats = 500, 200, 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trajectories.jsonl"
        with open(path, "w") as handle:
            for i in range(args.episodes):
                handle.write(json.dumps(record(i, args.tokens)) + "\n")
        size_mb = path.stat().st_size / 1e6
        print(f"{args.episodes} episodes, {size_mb:.0f} MB")

        index = EpisodeIndex(path, eval_results=False)
        t0 = time.perf_counter()
        index.refresh()
        build_s = time.perf_counter() - t0
        tracemalloc.start()  # a second build, traced: tracing slows it, so it is not the one timed
        traced = EpisodeIndex(path, eval_results=False)
        traced.refresh()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del traced
        print(f"index build (once): {build_s:.2f} s ({size_mb / build_s:.0f} MB/s), "
              f"{held / len(index):.0f} bytes held per episode")

        flt = EpisodeFilter(reward_min=0.5, stop_reasons=frozenset({"done"}))
        index_page = median_s(lambda: index.page(flt, offset=100, limit=50), args.repeats)
        naive = median_s(lambda: naive_page(path, lambda r: r["reward"] >= 0.5 and r["stop_reason"] == "done", 100, 50),
                         args.repeats)
        assert [r["index"] for r in index.page(flt, offset=100, limit=50)[1]][:1]
        print(f"filtered page: index {index_page * 1e3:.1f} ms, whole-file read {naive * 1e3:.0f} ms: "
              f"{naive / index_page:.0f}x")

        polls = []
        for _ in range(args.repeats):
            with open(path, "a") as handle:
                for i in range(100):
                    handle.write(json.dumps(record(args.episodes + i, args.tokens)) + "\n")
            t0 = time.perf_counter()
            index.refresh()
            polls.append(time.perf_counter() - t0)
        poll = statistics.median(polls)
        naive_poll = median_s(lambda: naive_page(path, lambda r: True, 0, 50), args.repeats)
        print(f"next poll after 100 new lines: index {poll * 1e3:.1f} ms, whole-file read {naive_poll * 1e3:.0f} ms: "
              f"{naive_poll / poll:.0f}x")


if __name__ == "__main__":
    main()
