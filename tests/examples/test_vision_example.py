"""examples/vision_train.py, shortened: the shapes env served, both policies warmed up and trained a step, the
vision policy's prompts carry the picture (image tokens, mask 0) and the text-only one's do not."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from examples.shapes_env import COLOURS, LETTERS, ShapesEnv

ROOT = Path(__file__).resolve().parents[2]


def test_shapes_env_asks_what_only_the_picture_shows() -> None:
    env = ShapesEnv()
    colours = []
    for i in range(8):
        obs = env.reset(split="validation", index=i)
        assert obs.images[0][:8] == b"\x89PNG\r\n\x1a\n" and not any(c in obs.text.split(":")[0] for c in COLOURS)
        colours.append(env.colour)
        assert env.on_text(LETTERS[env.colour]).reward == 1.0
    assert colours == list(COLOURS) * 2  # balanced held-out split
    env.rng = random.Random(3)  # what EnvRunner does before reset(seed=3)
    env.reset(seed=3)
    wrong = next(c for c in COLOURS if c != env.colour)
    assert env.on_text(env.colour.upper() + ".").reward == 1.0 and env.on_text(wrong).reward == 0.0


def test_vision_example_trains_both_policies_a_step(tmp_path) -> None:
    out = tmp_path / "vision"
    proc = subprocess.run([sys.executable, "examples/vision_train.py", "--steps", "1", "--sft-steps", "1",
                           "--sft-demos", "8", "--batch", "2", "--eval-problems", "4", "--eval-every", "0",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"tiny-vl", "tiny"} and all(s["steps"] == 1 for s in summary.values())
    assert "tiny-vl" in proc.stdout and "rise" in proc.stdout
    for name, grid in (("tiny-vl", [[1, 12, 12]]), ("tiny", [])):
        recs = [json.loads(line) for line in (out / name / "trajectories.jsonl").read_text().splitlines()]
        assert recs and all(r["images"] == grid for r in recs)
        assert all(("<|image_pad|>" in r["text"]) == bool(grid) for r in recs)
