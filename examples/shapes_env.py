"""A visual question only the picture answers: what colour is the shape? (one text turn, reward 1 or 0).

    envhub serve examples.shapes_env:ShapesEnv --port 8010     # from the repository root
    python examples/shapes_env.py --port 8010                  # the same, from this file

Each episode draws one shape (circle, square or triangle) of one of four colours at a random place
and size on a white picture, sent as a PNG in ``Observation.images``. The text never names the
colour, so a text-only policy can do no better than guessing (1/4 on the balanced validation
split). ``reset(split="validation", index=i)`` gives the fixed held-out picture ``i`` (colour
``COLOURS[i % 4]``); ``split="train"`` draws from the seed. Reward 1.0 when the reply's first
word is the colour or its letter (``r``, ``g``, ``b``, ``k`` for black, as in CMYK).
``examples/vision_train.py`` trains the tiny vision policy on it.
"""

from __future__ import annotations

import argparse
import io
import random
import re

from envhub import Env, Observation, StepResult

# far apart in RGB (and from the white background's), so a tiny vision tower tells them apart early
COLOURS = {"red": (230, 30, 30), "green": (30, 190, 50), "blue": (40, 70, 230), "black": (25, 25, 25)}
LETTERS = {"red": "r", "green": "g", "blue": "b", "black": "k"}
SHAPES = ("circle", "square", "triangle")
QUESTION = "Colour? r, g, b or k"  # short: with a byte-level tokenizer every character is a token
VALIDATION_SEED = 1_000_000  # validation pictures come from seeds no training seed of a run reaches first


def draw(colour: str, shape: str, rng: random.Random, size_px: int = 168) -> bytes:
    """A PNG of one ``shape`` in ``colour`` at a random place and size on white."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size_px, size_px), (255, 255, 255))
    r = rng.randint(size_px * 3 // 8, size_px // 2 - 1)
    cx, cy = rng.randint(r, size_px - r), rng.randint(r, size_px - r)
    pen, fill = ImageDraw.Draw(img), COLOURS[colour]
    if shape == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        pen.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class ShapesEnv(Env):
    """What colour is the shape? One answer per episode, graded on its first word (the colour or its letter)."""

    max_steps = 1

    def reset(self, seed: int | None = None, split: str = "train", index: int | None = None,
              size_px: int = 168) -> Observation:
        if split not in ("train", "validation"):
            raise ValueError(f"Expected split 'train' or 'validation', got {split!r}.")
        if split == "validation":
            if index is None or index < 0:
                raise ValueError(f"Expected a validation index >= 0, got {index!r}.")
            rng = random.Random(VALIDATION_SEED + index)
            self.colour = list(COLOURS)[index % len(COLOURS)]
        else:
            rng = self.rng
            self.colour = rng.choice(list(COLOURS))
        shape = rng.choice(SHAPES)
        return Observation(text=QUESTION, images=[draw(self.colour, shape, rng, size_px)],
                           metadata={"shape": shape})

    def on_text(self, text: str) -> StepResult:
        words = re.findall(r"[a-z]+", text.lower())
        correct = bool(words) and words[0] in (self.colour, LETTERS[self.colour])
        return StepResult(Observation(text="correct" if correct else f"it was {self.colour}"),
                          reward=float(correct), done=True, info={"colour": self.colour})


if __name__ == "__main__":
    from envhub import serve

    parser = argparse.ArgumentParser(description=ShapesEnv.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    args = parser.parse_args()
    serve(ShapesEnv, host=args.host, port=args.port)
