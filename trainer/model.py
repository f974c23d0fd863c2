"""The policy: a Hugging Face causal LM (by name or local path) or a tiny Qwen2 built from a config, plus LoRA.

``load_policy(ModelConfig(name="Qwen/Qwen2.5-0.5B-Instruct"))`` loads a real model from the local
cache (nothing is downloaded unless ``local_files_only=False``); ``ModelConfig(name="tiny")``
builds a randomly initialised Qwen2 of the same architecture with the shipped byte-level
tokenizer, for CPU, tests and the quick start. Both go through ``AutoModelForCausalLM``.
Vision-language policies: a Qwen2-VL / Qwen2.5-VL name loads through ``AutoModelForImageTextToText``;
``ModelConfig(name="tiny-vl")`` builds a random ``Qwen2VLForConditionalGeneration`` with the
shipped tokenizer plus the vision tokens (:mod:`trainer.vision`).

>>> model, tok = load_policy(ModelConfig(name="tiny", hidden_size=32, num_layers=1, num_heads=2))
>>> type(model).__name__
'Qwen2ForCausalLM'
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TINY = "tiny"
#: head sizes vLLM's attention kernels accept, its CPU kernel included (vLLM 0.32; the CPU one refuses 16)
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
TINY_VL = "tiny-vl"


@dataclass
class ModelConfig:
    """Which policy to load and how to train it.

    ``name``: ``"tiny"`` (local random Qwen2 + shipped tokenizer), ``"tiny-vl"`` (local random Qwen2-VL),
    or a Hugging Face name / path (Qwen2-VL / Qwen2.5-VL ones are vision-language policies).
    ``lora_rank`` 0 trains all parameters; > 0 wraps the model with a peft LoRA adapter.
    ``dtype``: ``"auto"`` (bf16 on a GPU that supports it, else fp32), ``"bf16"``, ``"fp32"``.
    """

    name: str = TINY
    dtype: str = "auto"
    local_files_only: bool = True
    lora_rank: int = 0
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: Any = "all-linear"
    gradient_checkpointing: bool = False
    # tiny model shape (ignored for real models)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 2048
    init_seed: int = 0
    # tiny-vl vision tower (ignored otherwise)
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_heads: int = 2
    # pixels per image after resizing, for vision-language policies (None: the model's own; tiny-vl 56^2..100^2)
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bf16", "fp32", "fp16"):
            raise ValueError(f"Expected model.dtype in auto|bf16|fp16|fp32, got {self.dtype!r}.")
        if self.lora_rank < 0:
            raise ValueError(f"Expected model.lora_rank >= 0 (0 = full parameters), got {self.lora_rank}.")
        targets = self.lora_target_modules
        if isinstance(targets, str):  # peft reads one string as a regex over the module names
            try:
                re.compile(targets)
            except re.error as exc:
                raise ValueError(f"Expected model.lora_target_modules to be a list of module names, \"all-linear\" "
                                 f"or a valid regex, got {targets!r} ({exc}).") from None
        elif not (isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets)):
            raise ValueError(f"Expected model.lora_target_modules to be a non-empty list of module names, "
                             f"\"all-linear\" or a regex, got {targets!r}.")
        if self.name in (TINY, TINY_VL) and self.hidden_size % self.num_heads:
            raise ValueError(f"Expected hidden_size divisible by num_heads, got {self.hidden_size} "
                             f"and {self.num_heads}.")


def for_vllm(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with a tiny-model head size vLLM accepts: the same hidden size in fewer, wider heads.

    The default tiny shape (hidden 64 in 4 heads of 16) becomes 2 heads of 32, 2 KV heads; shapes
    vLLM already accepts, and real models, come back unchanged. A LoRA on the output layer is refused:
    vLLM loads no adapter on ``lm_head``.
    """
    if cfg.lora_rank > 0 and targets_output_layer(cfg.lora_target_modules):
        raise ValueError("Expected no LoRA on the output layer with sampling.backend='vllm' (vLLM loads no adapter "
                         f"on lm_head), got model.lora_target_modules={cfg.lora_target_modules!r}; leave 'lm_head' "
                         "out, or sample with the hf backend.")
    if cfg.name != TINY or cfg.hidden_size // cfg.num_heads in VLLM_HEAD_SIZES:
        return cfg
    for heads in range(cfg.num_heads, 0, -1):
        if cfg.hidden_size % heads == 0 and cfg.hidden_size // heads in VLLM_HEAD_SIZES:
            kv_heads = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= cfg.num_kv_heads)
            return dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv_heads)
    raise ValueError(f"Expected a tiny model vLLM can run: hidden_size {cfg.hidden_size} splits into no head size "
                     f"vLLM accepts ({list(VLLM_HEAD_SIZES)}); use e.g. model.hidden_size=128 model.num_heads=2.")


def targets_output_layer(targets: Any) -> bool:
    """Whether peft ``target_modules`` (a list of names, or one regex; ``"all-linear"`` leaves it out) name the
    output layer, ``lm_head``."""
    if isinstance(targets, str):
        try:
            return targets != "all-linear" and re.fullmatch(targets, "lm_head") is not None
        except re.error:  # names nothing (ModelConfig refuses it; a server's check says so on its own)
            return False
    return "lm_head" in (targets or ())


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype for a config string on this device (bf16 only where the hardware supports it)."""
    device = torch.device(device)
    if name == "fp32":
        return torch.float32
    if name == "fp16":
        return torch.float16
    if name == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def build_tiny_model(cfg: ModelConfig, vocab_size: int, *, pad_token_id: int, eos_token_id: int) -> PreTrainedModel:
    """A randomly initialised ``Qwen2ForCausalLM`` with the shape from ``cfg`` (seeded by ``cfg.init_seed``)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         intermediate_size=cfg.intermediate_size,
                         max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
                         pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None,
                         use_cache=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config)
    return model


class ModelLoadError(OSError):
    """A model or tokenizer that could not be loaded (a name that is neither ``tiny`` nor in the local Hugging
    Face cache, nor downloadable): the message says which and how to get it. The CLIs print it as one line."""

    def __init__(self, cfg: ModelConfig, what: str, cause: BaseException):
        where = "offline (from the local Hugging Face cache)" if cfg.local_files_only else "(download allowed)"
        reason = " ".join(str(cause).split()).rstrip(".")  # Hugging Face's message spans lines: one line here
        fix = (f"Download it once with `huggingface-cli download {cfg.name}` (envhub-train downloads it itself with "
               "model.local_files_only=false); `tiny` names the built-in test model" if cfg.local_files_only else
               "Check the name and the network")
        super().__init__(f"Could not load {what + ' ' if what else ''}{cfg.name!r} {where}: {reason}. {fix}.")


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer for ``cfg``: the shipped byte-level one for ``tiny`` (with vision tokens for ``tiny-vl``),
    else ``AutoTokenizer``."""
    if cfg.name in (TINY, TINY_VL):
        from trainer.tokenizer import build_tiny_tokenizer

        return build_tiny_tokenizer(vision=cfg.name == TINY_VL)
    from transformers import AutoTokenizer

    try:
        tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(cfg.name, local_files_only=cfg.local_files_only)
    except OSError as exc:
        raise ModelLoadError(cfg, "the tokenizer of", exc) from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_policy(cfg: ModelConfig, device: torch.device | str = "cpu") -> tuple[nn.Module, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` for ``cfg`` on ``device``, with LoRA applied when ``cfg.lora_rank > 0``."""
    tok = load_tokenizer(cfg)
    dtype = resolve_dtype(cfg.dtype, device)
    from trainer.vision import build_tiny_vl_model, is_vision_model, suppress_tokens, vision_token_ids

    vision = is_vision_model(cfg)
    model: PreTrainedModel
    if cfg.name == TINY:
        model = build_tiny_model(cfg, len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    elif cfg.name == TINY_VL:
        model = build_tiny_vl_model(cfg, tok)
    else:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        try:
            model = auto.from_pretrained(cfg.name, dtype=dtype, local_files_only=cfg.local_files_only, **cfg.extra)
        except OSError as exc:
            raise ModelLoadError(cfg, "", exc) from exc
    if cfg.name in (TINY, TINY_VL):  # initialised in fp32 (seeded), then cast
        # functools.wraps on PreTrainedModel.to makes mypy read it as an unbound function
        model.to(dtype=dtype)  # type: ignore[call-arg]
    # Qwen2.5 instruct ends an assistant turn with <|im_end|>: make generation stop there.
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    if vision:  # the policy never writes an image placeholder (it would break the next forward pass)
        suppress_tokens(model, vision_token_ids(tok))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    policy = apply_lora(model, cfg) if cfg.lora_rank > 0 else model
    return policy.to(device), tok


def apply_lora(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Wrap ``model`` with a peft LoRA adapter (rank ``cfg.lora_rank``); only adapter weights train."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # An adapter on an output layer tied to the input embedding (`lm_head` in the targets of a tied model)
        # is only a hazard where it is merged: the forward adds it to the output alone, checkpoints and weight
        # pushes carry the adapter alone, and trainer.export unties the two before it merges.
        warnings.filterwarnings("ignore", message=r".*tie_word_embeddings=True.* tied layer is part of the adapter")
        wrapped: nn.Module = get_peft_model(model, lora)
    return wrapped


def hidden_size_of(model: nn.Module) -> int:
    """The hidden size of a (possibly peft-wrapped) causal LM."""
    from transformers import PretrainedConfig

    config = unwrap(model).config
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"Expected a Hugging Face model (with a .config), got {type(unwrap(model)).__name__}.")
    return int(config.get_text_config().hidden_size)


def vocab_size_of(model: nn.Module) -> int:
    """Rows of a (possibly DDP- or peft-wrapped) model's input embedding: the ids it accepts."""
    get_embeddings: Any = getattr(unwrap(model), "get_input_embeddings", None)  # a Hugging Face model's accessor
    table = get_embeddings() if callable(get_embeddings) else None
    if not isinstance(table, nn.Embedding):
        raise TypeError(f"Expected a Hugging Face model with an input embedding, got {type(unwrap(model)).__name__}.")
    return int(table.num_embeddings)


def unwrap(model: nn.Module, *, peft: bool = True) -> nn.Module:
    """``model`` under its DDP wrapper (the model in ``.module``) and, with ``peft`` (the default), under its
    peft wrapper too: the Hugging Face base model. ``peft=False`` keeps a peft model, which knows its
    adapters (what a checkpoint saves, what a sampler merges)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    get_base = getattr(model, "get_base_model", None) if peft else None
    return get_base() if callable(get_base) else model


FINGERPRINT_VALUES = 4096


def base_fingerprint(model: nn.Module) -> str:
    """A short hash of ``model``'s base weights: each parameter's name (peft's ``.base_layer`` undone, its LoRA
    tensors left out), shape and first values rounded to bf16 — the same base in fp32 or bf16 gives the same
    hash, another checkpoint or init seed another. A sampler server names its own at ``/health``: LoRA
    adapters trained on one base are refused onto another (their samples would look right and be wrong)."""
    digest = hashlib.sha256()
    params = {name.replace(".base_layer", ""): p for name, p in unwrap(model).named_parameters() if "lora_" not in name}
    for name in sorted(params):
        p = params[name].detach()
        digest.update(f"{name}:{tuple(p.shape)};".encode())
        head = p.flatten()[:FINGERPRINT_VALUES].to(device="cpu", dtype=torch.bfloat16)
        digest.update(head.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_keyword(model: nn.Module) -> str:
    """The keyword a Hugging Face model's ``forward`` takes its KV cache under: ``cache`` in the transformers
    releases that renamed it (``past_key_values`` deprecated there), ``past_key_values`` before them."""
    cls: Any = type(unwrap(model))  # a class hashes by identity (mypy sees nn.Module's __eq__)
    return _cache_keyword(cls)


@functools.cache
def _cache_keyword(cls: Any) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def output_cache(out: Any) -> Any:
    """The KV cache a Hugging Face forward returned (``out.cache``, or ``out.past_key_values`` before the rename)."""
    cache = out.get("cache")
    return cache if cache is not None else out.past_key_values


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (under DDP: of the model it wraps; peft kept) in eval mode with every parameter
    frozen: a KL reference, or a sampler's own weights while the trainer updates the original."""
    copy_ = copy.deepcopy(unwrap(model, peft=False)).eval()
    for p in copy_.parameters():
        p.requires_grad_(False)
    return copy_


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that receive gradients (all of them, or the LoRA adapter's)."""
    return [p for p in model.parameters() if p.requires_grad]


__all__ = ["ModelConfig", "ModelLoadError", "load_policy", "load_tokenizer", "build_tiny_model", "apply_lora",
           "resolve_dtype", "for_vllm", "VLLM_HEAD_SIZES", "unwrap", "frozen_copy", "hidden_size_of", "vocab_size_of",
           "trainable_parameters", "TINY", "TINY_VL"]
