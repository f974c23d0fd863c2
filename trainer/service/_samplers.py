"""Which weights a sampling session samples from, and the adapters loaded to serve them.

A sampler is the base model, an ephemeral snapshot of a training run (from
``save_weights_and_get_sampling_client``), or a saved ``sampler_weights`` / ``weights`` checkpoint.
A snapshot keeps a CPU copy of the run's adapter and the run's weight generation: while the run
has not stepped since, samples come from the live adapter at no cost (the RL loop's case);
afterwards the copy is loaded as an adapter of its own (with ``--sampler vllm`` always: the copy is
registered in the vLLM engine's LoRA slots once, and later samples reuse it). Loaded sampler adapters take
``max_loaded`` slots (``--sampler-slots``); past them the least recently used one is swapped out (and loaded
again from its CPU copy or checkpoint when next asked for), each swap counted and timed in :class:`SwapStats`.
Adapters a running batch uses are pinned: they are never the ones swapped out. Each run keeps its last
``keep_snapshots`` snapshots.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.core import ModelHost, SamplingClient
from trainer.core.vllm_samplers import VLLMView
from trainer.service._lora import checkpoint_lora


@dataclass
class Snapshot:
    model_id: str
    generation: int
    weights: dict[str, torch.Tensor] | None  # None for a full-parameter run: it is always sampled live
    rank: int
    targets: Any = None


class SlotsFull(Exception):
    """Every adapter slot holds an adapter the running batch uses: the batch must run before another loads."""


@dataclass
class SwapStats:
    """Adapter loads into the sampler slots: all of them, the ones that swapped another out, and their cost."""

    loads: int = 0
    swaps: int = 0  # loads that first evicted the least recently used adapter
    load_s: float = 0.0  # time spent loading (and evicting for) adapters, all loads
    hits: int = 0  # requests served by an adapter already loaded

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = asdict(self)
        out["mean_swap_s"] = self.load_s / self.loads if self.loads else 0.0
        return out


class SamplerCache:
    """Sampling clients for sampler ids; runs on the work queue's worker thread only."""

    def __init__(self, host: ModelHost, *, max_loaded: int = 4, keep_snapshots: int = 4):
        self.host = host
        self.max_loaded = max_loaded
        self.keep_snapshots = keep_snapshots
        self.snapshots: dict[str, Snapshot] = {}
        self._loaded: OrderedDict[str, tuple[str, SamplingClient | VLLMView]] = OrderedDict()  # key -> (sampler name, client)
        self._slots = 0
        self._pinned: set[str] = set()  # keys the running batch uses (never evicted)
        self.stats = SwapStats()

    def snapshot(self, sampler_id: str, model_id: str, generation: int) -> None:
        client = self.host.client(model_id)
        weights, rank, targets = None, 0, None
        if client.adapter is not None:
            config = self.host.model.peft_config[client.adapter]
            weights, rank, targets = client.weights_state(), int(config.r), sorted(config.target_modules)
        self.drop(sampler_id)
        self.snapshots[sampler_id] = Snapshot(model_id, generation, weights, rank, targets)
        mine = [k for k, s in self.snapshots.items() if s.model_id == model_id]
        for old in mine[:-self.keep_snapshots]:
            self.drop(old)
            self.snapshots[old] = Snapshot(model_id, -1, None, 0)  # remembered, but its weights are gone

    def get(self, sampler_id: str) -> Snapshot:
        """The snapshot behind an ephemeral sampler; ``ValueError``, saying what to do, when it has none or it was
        released."""
        snap = self.snapshots.get(sampler_id)
        if snap is None:
            raise ValueError(f"Sampler {sampler_id!r} has no weights on this server (ephemeral samplers do not "
                             "survive a restart); save named weights with save_weights_for_sampler(name) and "
                             "create_sampling_client(model_path=...) to keep them.")
        if snap.weights is None and snap.generation < 0:
            raise ValueError(f"Sampler {sampler_id!r} was released: a training run keeps only its last "
                             f"{self.keep_snapshots} ephemeral samplers; ask for a new one with "
                             "save_weights_and_get_sampling_client().")
        return snap

    def for_snapshot(self, sampler_id: str, generation_of: Callable[[str], int | None]) -> SamplingClient | VLLMView:
        snap = self.get(sampler_id)
        live = generation_of(snap.model_id)
        # while the run has not stepped since the snapshot its live adapter is the snapshot (HF samples it
        # in place; a vLLM engine needs the adapter's copy registered, done once below)
        if (snap.generation >= 0 and live == snap.generation and snap.model_id in self.host.clients
                and (snap.weights is None or self.host.vllm is None)):
            return self.host.live_sampler(self.host.client(snap.model_id), live)
        if snap.weights is None:
            if snap.model_id in self.host.clients:  # full-parameter run: its sampler follows the live weights
                return self.host.live_sampler(self.host.client(snap.model_id), live)
            raise ValueError(f"Sampler {sampler_id!r} belongs to training run {snap.model_id!r}, which is unloaded.")
        weights = snap.weights
        return self._load(sampler_id, lambda: (weights, snap.rank, snap.targets))

    def for_checkpoint(self, directory: Path) -> SamplingClient | VLLMView:
        return self._load(f"path:{directory}", lambda: self.read_checkpoint(directory))

    def read_checkpoint(self, directory: Path) -> tuple[dict[str, torch.Tensor], int, list[str]]:
        """A saved LoRA adapter's ``(weights, rank, target layers)``; refused on a full-parameter server."""
        if self.host.full is not None:
            raise ValueError("This server trains the full model (--full-parameter); it samples only from the "
                             "training run's live weights, not from saved checkpoints.")
        rank, targets = checkpoint_lora(directory)
        return torch.load(directory / "weights.pt", map_location="cpu", weights_only=True), rank, targets

    def base(self) -> SamplingClient | VLLMView:
        return self.host.base_sampler()

    def drop(self, key: str) -> None:
        loaded = self._loaded.pop(key, None)
        if loaded is not None:
            self.host.remove(loaded[0])

    def drop_run(self, model_id: str) -> None:
        for key in [k for k, s in self.snapshots.items() if s.model_id == model_id]:
            self.drop(key)
            self.snapshots[key] = Snapshot(model_id, -1, None, 0)

    def unpin(self) -> None:
        """The running batch is done: its adapters may be swapped out again."""
        self._pinned.clear()

    def _load(self, key: str, read: Callable[[], tuple[dict[str, torch.Tensor], int, Any]]) -> SamplingClient | VLLMView:
        if key in self._loaded:
            self._loaded.move_to_end(key)
            self._pinned.add(key)
            self.stats.hits += 1
            return self._loaded[key][1]
        start = time.perf_counter()
        swapped = False
        while len(self._loaded) >= self.max_loaded:
            victim = next((k for k in self._loaded if k not in self._pinned), None)
            if victim is None:
                raise SlotsFull(f"all {self.max_loaded} sampler slots are in use by this batch")
            self.drop(victim)
            swapped = True
        weights, rank, targets = read()
        self._slots += 1
        name = f"sampler-{self._slots}"
        client = self.host.load_sampler(name, weights, rank=rank, target_modules=targets)
        self._loaded[key] = (name, client)
        self._pinned.add(key)
        self.stats.loads += 1
        self.stats.swaps += swapped
        self.stats.load_s += time.perf_counter() - start
        return client
