"""Images into a vision-language policy (Qwen2-VL / Qwen2.5-VL): pixel patches, grid sizes, placeholder ids.

The chat template renders each image part of a message as ``<|vision_start|><|image_pad|><|vision_end|>``;
the image processor resizes the picture to a multiple of ``patch_size * merge_size`` pixels and
cuts it into patches on a ``(t, h, w)`` grid; the model puts ``t * h * w / merge_size**2``
embeddings where the ``<|image_pad|>`` tokens are. :class:`VisionProcessor` expands each
placeholder to that many ids after tokenisation, so the rollout's token-exact rendering carries
over unchanged: placeholder ids are prompt (mask 0) like any other observation token, and the same
ids and :class:`ImageFeatures` go to the sampler and to the training forward pass.

Only the PIL image processor is used (``Qwen2VLImageProcessorPil``: numpy, no torchvision); both
Qwen2-VL and Qwen2.5-VL use it. ``ModelConfig(name="tiny-vl")`` builds a random
``Qwen2VLForConditionalGeneration`` with the shipped tokenizer plus the vision tokens, nothing
downloaded (:func:`build_tiny_vl_model`).

>>> from trainer.tokenizer import build_tiny_tokenizer
>>> vp = VisionProcessor(build_image_processor(56 * 56, 56 * 56), build_tiny_tokenizer(vision=True))
>>> [f.num_tokens for f in vp.features([_solid_png()])]
[4]
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage
    from transformers import PreTrainedModel

VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
TINY_VL = "tiny-vl"
TINY_MIN_PIXELS = 56 * 56     # 4x4 patches of 14 px: 4 image tokens
TINY_MAX_PIXELS = 100 * 100   # larger squares shrink to 84x84 px: 6x6 patches, 9 image tokens
SUPPRESSED_LOGIT = -1e4       # finite, so masked (prompt) positions never turn a loss into NaN


@dataclass(frozen=True)
class ImageFeatures:
    """One processed image: its patches, its patch grid and how many placeholder ids it takes."""

    pixel_values: Tensor  # [t*h*w patches, channels * temporal_patch * patch * patch], float32
    grid_thw: tuple[int, int, int]
    num_tokens: int       # t*h*w / merge_size**2 embeddings in the language model's sequence


def load_image(image: Any) -> PILImage:
    """A PIL RGB image from PNG/JPEG bytes, a base64 string or data URL, or a PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, str):
        data = image.split(",", 1)[1] if image.startswith("data:") else image
        try:
            image = base64.b64decode(data, validate=True)
        except ValueError as exc:
            raise ValueError(f"Expected an image as bytes, a PIL image or base64 text, got a string that is "
                             f"not base64 ({exc}): {image[:40]!r}...") from None
    if isinstance(image, (bytes, bytearray, memoryview)):
        try:
            return Image.open(io.BytesIO(bytes(image))).convert("RGB")
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"Could not decode an image of {len(image)} bytes ({exc}); expected PNG or JPEG "
                             "bytes.") from None
    raise ValueError(f"Expected an image as bytes, a PIL image or base64 text, got {type(image).__name__}.")


def images_in(messages: list[dict[str, Any]]) -> list[Any]:
    """The image parts of ``messages``, in the order the chat template renders their placeholders."""
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            out += [_image_of(p) for p in content if _is_image_part(p)]
    return out


def text_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with list contents joined to their text parts: what a text-only policy sees (no images)."""
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            msg = {**msg, "content": "".join(str(p.get("text", "")) for p in content
                                             if isinstance(p, dict) and not _is_image_part(p))}
        out.append(msg)
    return out


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in ("image", "image_url") or "image" in part)


def _image_of(part: dict[str, Any]) -> Any:
    if "image" in part:
        return part["image"]
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


class VisionProcessor:
    """Turns images into :class:`ImageFeatures` and expands ``<|image_pad|>`` placeholders in token ids."""

    def __init__(self, image_processor: Any, tokenizer: Any):
        self.image_processor = image_processor
        self.merge_size = int(image_processor.merge_size)
        image_token_id = _token_id(tokenizer, "<|image_pad|>")
        if image_token_id is None:
            raise ValueError("Expected the tokenizer to have the vision token '<|image_pad|>' (a Qwen2-VL tokenizer, "
                             "or build_tiny_tokenizer(vision=True)); it has none.")
        self.image_token_id = image_token_id
        self.vision_token_ids = vision_token_ids(tokenizer)

    def features(self, images: list[Any]) -> list[ImageFeatures]:
        """Patches and grid of each image (bytes, base64 or PIL), one :class:`ImageFeatures` each."""
        if not images:
            return []
        out = self.image_processor(images=[load_image(i) for i in images], return_tensors="pt")
        grids = out["image_grid_thw"].tolist()
        sizes = [t * h * w for t, h, w in grids]
        pixels = torch.split(out["pixel_values"].float(), sizes)
        return [ImageFeatures(p, (t, h, w), t * h * w // self.merge_size ** 2)
                for p, (t, h, w) in zip(pixels, grids)]

    def expand(self, ids: list[int], images: list[ImageFeatures], aligned: list[Any] | None = None) -> list[Any]:
        """``ids`` with the k-th ``<|image_pad|>`` repeated ``images[k].num_tokens`` times.

        With ``aligned`` (one value per id, such as a loss mask) that list is expanded the same way instead.
        """
        found = ids.count(self.image_token_id)
        if found != len(images):
            raise ValueError(f"Expected one <|image_pad|> placeholder per image, got {found} placeholders for "
                             f"{len(images)} images (does the text itself contain '<|image_pad|>'?).")
        values = ids if aligned is None else aligned
        out: list[Any] = []
        k = 0
        for i, v in zip(ids, values):
            if i == self.image_token_id:
                out += [v] * images[k].num_tokens
                k += 1
            else:
                out.append(v)
        return out


def vision_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the Qwen2-VL vision tokens the tokenizer has (placeholders and their delimiters)."""
    names = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
    return [i for i in (_token_id(tokenizer, n) for n in names) if i is not None]


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token``, or None where the tokenizer does not have it."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(tid) != token:
        return None
    return int(tid)


def vision_inputs(images_B: list[list[ImageFeatures]], tokens_BT: Tensor, image_token_id: int) -> dict[str, Tensor]:
    """The model's image inputs for a batch whose row b holds ``images_B[b]`` (row order = placeholder order).

    ``pixel_values`` [patches, D] and ``image_grid_thw`` [images, 3] concatenated over rows;
    ``mm_token_type_ids`` [B, T] (1 on image placeholders) for the 3-D rotary positions.
    Empty when no row has an image (the model then takes its text-only path).
    """
    flat = [f for row in images_B for f in row]
    if not flat:
        return {}
    device = tokens_BT.device
    return {"pixel_values": torch.cat([f.pixel_values for f in flat]).to(device),
            "image_grid_thw": torch.tensor([f.grid_thw for f in flat], dtype=torch.long, device=device),
            "mm_token_type_ids": (tokens_BT == image_token_id).to(torch.int32)}


def suppress_tokens(model: PreTrainedModel, token_ids: list[int]) -> RemovableHandle:
    """Give ``token_ids`` a logit of -1e4 wherever the model's output layer runs (sampling and training alike).

    A sampled ``<|image_pad|>`` would break the next forward pass (placeholders without an image), so
    the policy must never produce one; doing it in the output layer keeps the sampler's log-probs and
    the trainer's equal. Returns the hook handle.
    """
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long)

    def hook(_module: nn.Module, _inputs: Any, logits: Tensor) -> Tensor:
        # in place: no second [B, T, V] tensor (a linear layer's backward does not need its output)
        return logits.index_fill_(-1, ids.to(logits.device), SUPPRESSED_LOGIT)

    head = model.get_output_embeddings()
    if not isinstance(head, nn.Module):  # a base model without an LM head
        raise ValueError(f"Expected a model with an output layer to suppress tokens in, got {type(model).__name__} "
                         "without one (load it as a causal LM / image-text-to-text model).")
    return head.register_forward_hook(hook)


def build_image_processor(min_pixels: int = TINY_MIN_PIXELS, max_pixels: int = TINY_MAX_PIXELS) -> Any:
    """A Qwen2-VL image processor (PIL backend) built locally: 14 px patches, 2x2 merge, CLIP normalisation."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if not 0 < min_pixels <= max_pixels:
        raise ValueError(f"Expected 0 < image_min_pixels <= image_max_pixels, got {min_pixels} and {max_pixels}.")
    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def build_tiny_vl_model(cfg: Any, tokenizer: Any) -> PreTrainedModel:
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` shaped by ``cfg`` (a ``ModelConfig``).

    The language model takes the tiny text shape (``hidden_size``, ``num_layers``, ...); the vision
    tower has ``vision_depth`` blocks of width ``vision_embed_dim`` and merges 2x2 patches into
    one embedding of the language model's width. Seeded by ``cfg.init_seed``.
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    head_dim = cfg.hidden_size // cfg.num_heads
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"Expected hidden_size / num_heads even and >= 6 for tiny-vl's 3-D rotary positions, got "
                         f"{head_dim}.")
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]  # temporal, height, width (sums to head_dim / 2)
    text = dict(vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    vision = dict(depth=cfg.vision_depth, embed_dim=cfg.vision_embed_dim, hidden_size=cfg.hidden_size,
                  num_heads=cfg.vision_heads, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        return Qwen2VLForConditionalGeneration(config)


def is_vision_model(cfg: Any) -> bool:
    """True for ``tiny-vl`` and for Hugging Face models of a Qwen2-VL / Qwen2.5-VL type (read offline)."""
    if cfg.name == TINY_VL:
        return True
    if cfg.name == "tiny":
        return False
    from transformers import AutoConfig

    try:
        model_type = AutoConfig.from_pretrained(cfg.name, local_files_only=cfg.local_files_only).model_type
    except (OSError, ValueError):
        return False  # load_policy reports what is missing
    return model_type in VISION_MODEL_TYPES


def load_vision_processor(cfg: Any, tokenizer: Any) -> VisionProcessor | None:
    """The :class:`VisionProcessor` for ``cfg``'s policy, or None for a text-only one.

    ``tiny-vl`` builds its image processor locally; a Qwen2-VL / Qwen2.5-VL model reads its
    ``preprocessor_config.json`` (offline unless ``model.local_files_only=false``). The pixel
    budget per image is ``model.image_min_pixels`` .. ``model.image_max_pixels`` when set.
    """
    if not is_vision_model(cfg):
        return None
    if cfg.name == TINY_VL:
        proc = build_image_processor(cfg.image_min_pixels or TINY_MIN_PIXELS, cfg.image_max_pixels or TINY_MAX_PIXELS)
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        kwargs = {k: v for k, v in (("min_pixels", cfg.image_min_pixels), ("max_pixels", cfg.image_max_pixels)) if v}
        proc = Qwen2VLImageProcessorPil.from_pretrained(cfg.name, local_files_only=cfg.local_files_only, **kwargs)
    return VisionProcessor(proc, tokenizer)


def _solid_png(size: int = 56, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


__all__ = ["ImageFeatures", "VisionProcessor", "load_image", "images_in", "text_only", "vision_inputs",
           "suppress_tokens", "vision_token_ids", "build_image_processor", "build_tiny_vl_model", "is_vision_model",
           "load_vision_processor", "VISION_MODEL_TYPES", "TINY_VL"]
