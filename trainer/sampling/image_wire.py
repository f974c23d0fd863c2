"""Processed images in a sampler server's JSON bodies: the exact patches the trainer's forward sees, both ways.

A request's ``images`` entry is one :class:`~trainer.vision.ImageFeatures` as
``{"grid_thw": [t, h, w], "pixel_values": <base64 of float32 little-endian [t*h*w, patch_dim]>}``: the
same numbers the in-process sampler and the training forward take (no second image processing that
could round differently). :func:`features_of` checks an entry against the server model's patch size
and a patch budget before a tensor is built.

>>> from trainer.vision import ImageFeatures
>>> f = ImageFeatures(torch.ones(4, 6), (1, 2, 2), 1)
>>> features_of(image_entry(f), patch_dim=6, merge_size=2, max_patches=16).num_tokens
1
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np
import torch

from trainer.vision import ImageFeatures


def image_entry(features: ImageFeatures) -> dict[str, Any]:
    """``features`` as an ``images`` entry of a ``/sample`` body."""
    pixels = features.pixel_values.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return {"grid_thw": list(features.grid_thw), "pixel_values": base64.b64encode(pixels.tobytes()).decode()}


def grid_of(entry: Any, merge_size: int) -> tuple[int, int, int]:
    """The checked ``grid_thw`` of one ``images`` entry (its patch count is ``t * h * w``); ``ValueError`` if bad."""
    if not isinstance(entry, dict) or set(entry) != {"grid_thw", "pixel_values"}:
        raise ValueError("Expected an image as {'grid_thw': [t, h, w], 'pixel_values': base64 float32 patches}.")
    grid = entry["grid_thw"]
    if not (isinstance(grid, list) and len(grid) == 3 and all(isinstance(g, int) and g > 0 for g in grid)):
        raise ValueError(f"Expected grid_thw as three positive ints, got {grid!r:.80}.")
    t, h, w = grid
    if h % merge_size or w % merge_size:
        raise ValueError(f"Expected grid_thw's h and w multiples of the model's merge size {merge_size}, got {grid}.")
    return t, h, w


def features_of(entry: Any, *, patch_dim: int, merge_size: int, max_patches: int) -> ImageFeatures:
    """The :class:`ImageFeatures` of one ``images`` entry of at most ``max_patches`` patches; ``ValueError`` saying
    what is wrong with a bad one (checked before its pixels are decoded)."""
    t, h, w = grid_of(entry, merge_size)
    patches, data = t * h * w, entry["pixel_values"]
    if patches > max_patches:
        raise ValueError(f"Expected at most {max_patches} image patches, got an image of {patches}.")
    if not isinstance(data, str) or len(data) != 4 * math.ceil(patches * patch_dim * 4 / 3):
        raise ValueError(f"Expected pixel_values as base64 of {patches} x {patch_dim} float32 values "
                         f"({patches * patch_dim * 4} bytes), got {len(data) if isinstance(data, str) else data!r:.40}"
                         " characters.")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("Expected pixel_values as base64 text, got other characters.") from None
    values = torch.from_numpy(np.frombuffer(raw, dtype="<f4").astype(np.float32)).view(patches, patch_dim)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("Expected finite pixel values, got NaN or infinity.")
    return ImageFeatures(values, (t, h, w), patches // merge_size ** 2)


__all__ = ["image_entry", "features_of", "grid_of"]
