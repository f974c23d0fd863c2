"""Which layers a training run's LoRA adapter covers: Tinker's ``train_attn`` / ``train_mlp`` / ``train_unembed``
flags as peft ``target_modules``, and the rank and layers a saved adapter holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.service._errors import UserError


def linear_parts(base: Any) -> dict[str, str]:
    """Each linear layer's name (as peft ``target_modules`` matches it) and the part of the model it is in:
    ``attn``, ``mlp`` (the rest of each block) or ``unembed``. Read from the base model before any adapter."""
    import torch

    unembed = base.get_output_embeddings()
    parts: dict[str, str] = {}
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            parts[leaf] = "unembed" if module is unembed else "attn" if "attn" in name or "attention" in name else "mlp"
    return parts


def lora_targets(parts: dict[str, str], lora_config: dict[str, Any]) -> list[str]:
    """The layers Tinker's ``train_attn`` / ``train_mlp`` / ``train_unembed`` flags (all True by default) select."""
    chosen = sorted(leaf for leaf, part in parts.items() if lora_config.get(f"train_{part}", True))
    if not chosen:
        raise UserError("Expected at least one of train_attn, train_mlp, train_unembed to be true, got none.")
    return chosen


def checkpoint_lora(directory: Path) -> tuple[int, list[str]]:
    """``(rank, target layer names)`` of the LoRA adapter a checkpoint holds."""
    import torch

    weights = torch.load(Path(directory) / "weights.pt", map_location="cpu", weights_only=True)
    ranks = {int(v.shape[0]) for k, v in weights.items() if ".lora_A." in k}
    targets = sorted({k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in weights if ".lora_A." in k})
    if len(ranks) != 1:
        raise UserError(f"Expected LoRA adapter weights with one rank in {directory.name}, got ranks {sorted(ranks)}.")
    return ranks.pop(), targets
