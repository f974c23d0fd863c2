"""A training client's saved state: the training core's one checkpoint format, for the service and the recipes.

A state directory (:meth:`TrainingClient.save_state <trainer.core.client.TrainingClient.save_state>`)::

    weights.pt          the trainable weights: the LoRA adapter alone, or the full model (FSDP: gathered)
    value_head.pt       the value head's weights, when the client has one (PPO)
    optimizer.pt        AdamW state (moments, step counts), when saved with ``optimizer=True``
    rng_rank0.pt ...    python, numpy, torch CPU and CUDA generator states, one file per rank (``rng=True``)
    meta.json           version (optimizer steps), lora_rank, optimizer, world_size, and the caller's metadata

A run directory of them (:func:`save_checkpoint`, what the recipes resume from)::

    latest              text: the name of the newest complete checkpoint
    step_00000012/      a state directory saved with the optimizer and RNG states, metadata ``{"step": 12, ...}``

A state is written into a hidden directory beside its place and renamed into it, then ``latest`` is
replaced atomically and older checkpoints beyond ``keep_last`` are pruned, so a crash mid-save leaves
the previous checkpoint intact and ``latest`` valid. Under ``torchrun`` every rank calls the save and the
load (each saves and restores its own RNG state; gathering an FSDP model is a collective); rank 0 writes
the rest. DDP wrappers are looked through; FSDP weights are gathered to whole tensors and re-sharded on load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from trainer.distributed import barrier, rank, world_size
from trainer.model import unwrap

LATEST = "latest"
#: meta.json keys the state itself writes; a caller's metadata may not reuse them
_OWN_KEYS = ("version", "lora_rank", "optimizer", "world_size")


class Checkpointable(Protocol):
    """What this module saves and restores: a :class:`~trainer.core.client.TrainingClient` (named by its parts so
    that the client, which saves through this module, and this module do not import each other)."""

    version: int

    @property
    def value_head(self) -> nn.Module | None: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def lora_rank(self) -> int: ...

    def weights_state(self) -> dict[str, Tensor]: ...

    def load_weights_state(self, state: dict[str, Tensor]) -> None: ...

    def optimizer_state(self) -> dict[str, Any]: ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...


def write_state(client: Checkpointable, path: str | os.PathLike[str], *, optimizer: bool = True, rng: bool = False,
                metadata: dict[str, Any] | None = None) -> Path:
    """Write ``client``'s state to directory ``path`` (see the module docstring); returns ``path``."""
    final = Path(path)
    optimizer = optimizer and client.optimizer is not None  # a forward-only client has no optimizer state
    clash = sorted(set(metadata or {}) & set(_OWN_KEYS))
    if clash:
        raise ValueError(f"Expected metadata keys other than {list(_OWN_KEYS)} (the state's own), got {clash}.")
    meta = {"version": client.version, "lora_rank": client.lora_rank, "optimizer": optimizer,
            "world_size": world_size(), **(metadata or {})}
    try:
        meta_text = json.dumps(meta, indent=2)
    except TypeError as exc:
        raise TypeError(f"Expected JSON-serialisable metadata, got {exc}; store plain ints, strings, lists, "
                        "dicts.") from exc
    # gathering an FSDP model's whole state is a collective: every rank takes part, rank 0 keeps it
    weights = client.weights_state()
    optim_state = client.optimizer_state() if optimizer else None
    tmp = final.with_name(f".{final.name}.tmp")
    main = rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    if rng:
        torch.save(_rng_state(), tmp / f"rng_rank{rank()}.pt")
    if main:
        torch.save(weights, tmp / "weights.pt")
        if client.value_head is not None:
            torch.save(unwrap(client.value_head, peft=False).state_dict(), tmp / "value_head.pt")
        if optim_state is not None:
            torch.save(optim_state, tmp / "optimizer.pt")
        (tmp / "meta.json").write_text(meta_text)
    barrier()
    if main:
        _replace(tmp, final)
    barrier()
    return final


def read_state(client: Checkpointable, path: str | os.PathLike[str], *, optimizer: bool = True,
               rng: bool = False) -> dict[str, Any]:
    """Restore into ``client`` what :func:`write_state` wrote to ``path``; returns its metadata.

    With ``rng`` this rank's generator states come back too; a rank the state holds none for (resuming on
    more ranks than were saved) keeps its own: rank 0's would make it sample exactly what rank 0 samples.
    """
    path = Path(path)
    _require(path / "weights.pt", "pass a directory written by save_state")
    optimizer = optimizer and client.optimizer is not None  # a forward-only client has no optimizer state
    if optimizer:
        _require(path / "optimizer.pt", "this state was saved without the optimizer; load it with optimizer=False")
    if client.value_head is not None:
        _require(path / "value_head.pt", "this state was saved without a value head; resume it with the same "
                                         "algorithm it was saved with (algo.name)")
    rng_file = path / f"rng_rank{rank()}.pt"
    if rng and rank() == 0:
        _require(rng_file, "this state was saved without RNG state; load it with rng=False")
    client.load_weights_state(_load(path / "weights.pt"))
    if client.value_head is not None:
        unwrap(client.value_head, peft=False).load_state_dict(_load(path / "value_head.pt"))
    if optimizer:
        client.load_optimizer_state(_load(path / "optimizer.pt"))
    if rng and rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    meta: dict[str, Any] = json.loads((path / "meta.json").read_text())
    client.version = int(meta.get("version", 0))
    return meta


def save_checkpoint(client: Checkpointable, run_dir: str | os.PathLike[str], step: int, *,
                    keep_last: int | None = None, metadata: dict[str, Any] | None = None) -> Path:
    """Save ``client`` with its optimizer and RNG states as ``run_dir/step_<step>``, point ``latest`` at it and
    prune all but the newest ``keep_last`` (None or 0: keep all); returns the checkpoint directory."""
    if "step" in (metadata or {}):
        raise ValueError("Expected metadata without 'step': the checkpoint records its own step.")
    _require_trainable(client)
    run_dir = Path(run_dir)
    final = write_state(client, run_dir / f"step_{int(step):08d}", optimizer=True, rng=True,
                        metadata={"step": int(step), **(metadata or {})})
    if rank() == 0:
        pointer = run_dir / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, run_dir / LATEST)
        if keep_last:
            for old in sorted(p for p in run_dir.glob("step_*") if p.is_dir())[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(client: Checkpointable, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore ``client`` (weights, value head, optimizer, this rank's RNG states) from a checkpoint directory,
    or from a run directory's ``latest``; returns the checkpoint's metadata (``step`` and the caller's keys)."""
    _require_trainable(client)
    return read_state(client, resolve_checkpoint(path), optimizer=True, rng=True)


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory from a checkpoint or a run directory; raises FileNotFoundError with the fix."""
    path = Path(path)
    if (path / "meta.json").exists():
        return path
    if (path / LATEST).exists():
        return path / (path / LATEST).read_text().strip()
    raise FileNotFoundError(f"Expected a checkpoint directory (with meta.json) or a run directory (with a "
                            f"'{LATEST}' file), got {path}; pass the directory given to save_checkpoint.")


def has_checkpoint(run_dir: str | os.PathLike[str]) -> bool:
    """Whether ``run_dir`` holds a checkpoint to resume from (its ``latest`` pointer)."""
    return (Path(run_dir) / LATEST).exists()


def _require_trainable(client: Checkpointable) -> None:
    if client.optimizer is None:
        raise ValueError("Expected a trainable client to checkpoint (a run resumes its optimizer state), got a "
                         "forward-only one (built with params=[]); use save_state/load_state for its weights.")


def _require(file: Path, fix: str) -> None:
    if not file.exists():
        raise FileNotFoundError(f"Expected {file}: {fix}.")


def _load(file: Path) -> Any:
    return torch.load(file, map_location="cpu", weights_only=True)


def _replace(tmp: Path, final: Path) -> None:
    """Move ``tmp`` to ``final``; an existing ``final`` (saving the same name again) is set aside, then dropped."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state(legacy=False)
    # torch.load(weights_only=True) refuses numpy arrays, so the MT19937 key travels as a tensor
    key = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {**numpy_state, "state": {**numpy_state["state"], "key": key}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    key = numpy_state["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state({**numpy_state, "state": {**numpy_state["state"], "key": key}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


__all__ = ["LATEST", "Checkpointable", "has_checkpoint", "load_checkpoint", "read_state", "resolve_checkpoint", "save_checkpoint",
           "write_state"]
