"""Several tenants on one base model in memory: LoRA adapters (peft named adapters) or one full-parameter tenant.

>>> host = ModelHost(ModelConfig(name="tiny"))                                   # doctest: +SKIP
>>> alice = host.create_lora_client("alice", rank=8, seed=0)                      # doctest: +SKIP
>>> bob = host.create_lora_client("bob", rank=8)                                 # doctest: +SKIP
>>> host.forward_backward_batch([(alice, data_a, "cross_entropy", {}), (bob, data_b, "ppo", {})])  # doctest: +SKIP

Each tenant is a :class:`~trainer.core.client.TrainingClient` with its own adapter, gradients and AdamW
state; the base weights are frozen and shared. Forward passes apply each row's adapter to its rows
(:class:`~trainer.sampling.row_adapters.RowAdapters`: each request's rows together, one LoRA term per
tenant on contiguous rows), so one pass serves several tenants (:meth:`ModelHost.forward_backward_batch`).
Passes run with dropout off (the model stays in eval mode), as peft's mixed batches required; the tiny
and common chat models use no dropout anyway. A full-parameter tenant trains the
base weights themselves, so it is the only tenant while it lives; removing it restores the base.

Samplers come from the decode loop of :mod:`trainer.sampling` on the host's model (``sampler="hf"``) or from one vLLM
engine built with the host (``sampler="vllm"``, :mod:`trainer.core.vllm_samplers`): the same methods give
either kind, so callers ask the host and never build samplers themselves.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.core.client import TrainingClient, _per_datum
from trainer.core.forward import (
    BASE_ADAPTER,
    Padded,
    PassLogits,
    joined,
    model_device,
    pad,
    plan_passes,
    rows_of,
    run_model,
)
from trainer.core.losses import check_loss, weighted_loss
from trainer.core.prefix import PrefixPlan, prefix_plan, shared_prefix_logits
from trainer.core.sampling import SamplingClient
from trainer.core.types import Datum, ForwardBackwardOutput

if TYPE_CHECKING:
    from trainer.core.vllm_samplers import VLLMSamplers, VLLMView

#: one checked request of a batched pass: (its slot, its tenant's adapter, its padded rows, its loss and config)
_Prepared = tuple[int, str, Padded, str, dict[str, float]]
#: a pass's rows merged: (tokens [B, T], mask [B, T], lengths, adapters, images, shared-prefix plan or None)
_Merged = tuple[Tensor, Tensor, list[int], list[str], list[list[Any]], "PrefixPlan | None"]


#: default bound of one merged forward_backward pass, in padded tokens: on the tiny CPU model a pass's cost per
#: token is lowest from about 4k to 8k tokens and rises past them (docs/service.md, "Many tenants")
MAX_PASS_TOKENS = 8192


class TenantError(ValueError):
    """A tenant request the host cannot honour (unknown, duplicate, over the limit, full next to LoRA)."""


class ModelHost:
    """One base model (a :class:`~trainer.model.ModelConfig`) and the tenants training on it.

    ``max_tenants`` caps training tenants (samplers made by :meth:`snapshot` do not count). ``sampler`` is
    ``"hf"`` or ``"vllm"`` (one engine, LoRA ranks up to ``max_lora_rank``, built here: vLLM must be installed).
    ``max_pass_tokens`` bounds one pass of :meth:`forward_backward_batch` (the padded tokens it computes: rows x
    their longest row, or with shared prefixes the prefix and suffix passes'; None: no bound): merged work past
    it runs as several passes with the same gradients. ``share_prefixes`` (True): rows of one adapter
    sharing a token prefix compute it once in a pass (:mod:`trainer.core.prefix`).
    """

    def __init__(self, model_cfg: Any, *, device: torch.device | str = "cpu", max_tenants: int = 8,
                 micro_batch_size: int | None = None, sampler: str = "hf", max_lora_rank: int = 64,
                 max_model_len: int = 4096, max_pass_tokens: int | None = MAX_PASS_TOKENS):
        from trainer.model import load_policy

        if getattr(model_cfg, "lora_rank", 0):
            raise ValueError("Expected the host's ModelConfig with lora_rank=0: each tenant brings its own rank.")
        if max_pass_tokens is not None and max_pass_tokens < 1:
            raise ValueError(f"Expected max_pass_tokens >= 1 (or None: no bound), got {max_pass_tokens}.")
        self.max_pass_tokens = max_pass_tokens
        self.share_prefixes = True
        self.model_cfg, self.device, self.max_tenants = model_cfg, torch.device(device), max_tenants
        self.micro_batch_size = micro_batch_size
        self.base, self.tokenizer = load_policy(model_cfg, self.device)
        _freeze(self.base)
        self.model: Any = self.base  # the peft wrapper once a LoRA tenant exists
        self.clients: dict[str, TrainingClient] = {}
        self.samplers: dict[str, str] = {}  # sampler name -> its adapter
        self.full: str | None = None
        self._adapters = 0  # adapters get internal names (tenant0, tenant1, ...): peft is picky about names
        if sampler not in ("hf", "vllm"):
            raise ValueError(f"Expected sampler 'hf' or 'vllm', got {sampler!r}.")
        self.vllm: VLLMSamplers | None = None  # when sampler == "vllm"
        if sampler == "vllm":
            from trainer.core.vllm_samplers import VLLMSamplers

            self.vllm = VLLMSamplers(self.base, self.tokenizer, max_lora_rank=max_lora_rank,
                                     max_model_len=max_model_len)

    # -- tenants ----------------------------------------------------------------------------------
    def create_lora_client(self, name: str, *, rank: int = 32, alpha: int = 32, seed: int | None = None,
                           target_modules: Any = "all-linear") -> TrainingClient:
        """A new LoRA tenant; ``seed`` makes its initial adapter reproducible."""
        self._check_new(name)
        if self.full is not None:
            raise TenantError(f"Tenant {self.full!r} trains the full model; LoRA tenants can join once it is removed.")
        if rank < 1:
            raise TenantError(f"Expected a LoRA rank >= 1, got {rank}.")
        adapter = self._add_adapter(rank, alpha, seed, target_modules)
        params = self._adapter_params(adapter)
        for p in params:
            p.requires_grad_(True)
        client = TrainingClient(self.model, self.tokenizer, adapter=adapter, params=params,
                                micro_batch_size=self.micro_batch_size)
        self.clients[name] = client
        return client

    def create_full_client(self, name: str) -> TrainingClient:
        """The single tenant that trains every base weight (refused while any other tenant exists)."""
        self._check_new(name)
        if self.clients or self.samplers:
            raise TenantError(f"Expected no other tenants for full-parameter training, got "
                              f"{sorted([*self.clients, *self.samplers])}.")
        if self.model is not self.base:  # LoRA layers linger after their adapters left: start from a clean base
            self._reload_base()
        self.full = name
        for p in self.base.parameters():
            p.requires_grad_(True)
        client = TrainingClient(self.base, self.tokenizer, micro_batch_size=self.micro_batch_size)
        self.clients[name] = client
        return client

    def remove(self, name: str) -> None:
        """Drop a tenant or sampler and free its adapter (a full tenant's weights are reloaded from the config)."""
        if name in self.samplers:
            adapter = self.samplers.pop(name)
            if self.vllm is not None:
                self.vllm.remove(name)
            else:
                self._delete_adapter(adapter)
            return
        if name not in self.clients:
            raise TenantError(f"Unknown tenant {name!r}; known: {sorted(self.clients)}.")
        client = self.clients.pop(name)
        client.zero_grad()
        if name == self.full:
            self.full = None
            self._reload_base()
            if self.vllm is not None:
                self.vllm.restore_base(self.base)
        elif client.adapter is not None:  # every other tenant is a LoRA adapter on the shared base
            self._delete_adapter(client.adapter)

    def client(self, name: str) -> TrainingClient:
        if name not in self.clients:
            raise TenantError(f"Unknown tenant {name!r}; known: {sorted(self.clients)}.")
        return self.clients[name]

    # -- sampling ---------------------------------------------------------------------------------
    def base_sampler(self) -> SamplingClient | VLLMView:
        """Samples from the untrained base model."""
        if self.full is not None:
            raise TenantError(f"Tenant {self.full!r} is training the base weights; base sampling is unavailable.")
        if self.vllm is not None:
            return self.vllm.base()
        adapter = BASE_ADAPTER if self.model is not self.base else None
        return SamplingClient(self.model, self.tokenizer, adapter=adapter)

    def snapshot(self, client: TrainingClient, name: str) -> SamplingClient | VLLMView:
        """A sampler frozen at ``client``'s current weights (a copy of its adapter named ``name``).

        A full-parameter tenant's sampler is live instead: copying the whole model would double memory.
        """
        if client.adapter is None:
            return self.live_sampler(client)
        return self.load_sampler(name, client.weights_state(), rank=self._rank(client.adapter))

    def live_sampler(self, client: TrainingClient, generation: int | None = None) -> SamplingClient | VLLMView:
        """A sampler over ``client``'s live weights. With vLLM only a full-parameter tenant has one: its weights
        are synced into the engine when ``generation`` (a count of its optimizer steps; None: always) moved."""
        if self.vllm is None:
            return client.sampling_client()
        if client.adapter is not None:
            raise TenantError("Expected a full-parameter tenant: a LoRA tenant samples from vLLM through a snapshot "
                              "(ModelHost.snapshot).")
        name = next(n for n, c in self.clients.items() if c is client)
        return self.vllm.live(name, client.model, -1 if generation is None else generation)

    def sampler_from_state(self, name: str, path: Any) -> SamplingClient | VLLMView:
        """A sampler over the weights a LoRA tenant's ``save_state`` wrote to ``path``."""
        import json
        from pathlib import Path

        path = Path(path)
        if not (path / "weights.pt").exists():
            raise FileNotFoundError(f"Expected {path / 'weights.pt'}; pass a directory written by save_state.")
        rank = int(json.loads((path / "meta.json").read_text()).get("lora_rank", 0))
        if rank < 1:
            raise TenantError(f"Expected LoRA weights in {path}, got full-parameter ones (load them with load_state).")
        weights = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
        return self.load_sampler(name, weights, rank=rank)

    def load_sampler(self, name: str, weights: dict[str, torch.Tensor], *, rank: int, alpha: int = 32,
                     target_modules: Any = None) -> SamplingClient | VLLMView:
        """A sampler over saved adapter ``weights`` (from :meth:`TrainingClient.weights_state`); ``target_modules``
        are the layers the adapter was trained on (default: those of the host's adapters)."""
        from peft import set_peft_model_state_dict

        self._check_new(name, tenant=False)
        if self.full is not None:
            raise TenantError(f"Tenant {self.full!r} trains the full model; adapters cannot be loaded beside it.")
        if self.vllm is not None:
            client = self.vllm.add_adapter(name, weights, rank=rank, alpha=alpha,
                                           target_modules=target_modules or self._targets())
            self.samplers[name] = name
            return client
        adapter = self._add_adapter(rank, alpha, None, target_modules or self._targets())
        set_peft_model_state_dict(self.model, weights, adapter_name=adapter)
        for p in self._adapter_params(adapter):
            p.requires_grad_(False)
        self.samplers[name] = adapter
        return SamplingClient(self.model, self.tokenizer, adapter=adapter)

    # -- batched training -------------------------------------------------------------------------
    def forward_backward_batch(self, requests: Sequence[tuple[TrainingClient, Sequence[Datum], str, dict[str, float]]], *,
                               backward: bool = True) -> list[ForwardBackwardOutput]:
        """One forward (and backward) pass for several tenants' requests, each scored with its own loss.

        Every tenant's gradient comes only from its own rows, so the result equals one
        ``forward_backward`` per request. The requests' rows run in passes of at most ``max_pass_tokens``
        (:func:`plan_passes`; a request may span passes: its loss is a sum over rows, so its gradient is the
        same). Validation happens before any pass: a bad request fails alone (its error in its slot) and the
        others still run.
        """
        results: list[Any] = [None] * len(requests)
        good: list[_Prepared] = []
        for i, (client, data, loss_fn, config) in enumerate(requests):
            try:
                config = dict(config or {})
                if client.adapter is None or client not in self.clients.values():
                    raise TenantError("Expected LoRA tenants of this host in a batched pass.")
                data = list(data)
                for d in data:
                    check_loss(loss_fn, d.loss_fn_inputs, config)
                good.append((i, client.adapter, pad(data, model_device(self.model)), loss_fn, config))
            except (ValueError, TypeError) as exc:
                results[i] = exc
        parts: dict[int, list[ForwardBackwardOutput]] = {}
        with torch.set_grad_enabled(backward):
            for chunk, merged in self._passes(good):
                for i, out in self._batched(chunk, backward, merged):
                    parts.setdefault(i, []).append(out)
        for i, outs in parts.items():
            results[i] = joined(outs)
        return results

    def _passes(self, good: list[_Prepared]) -> list[tuple[list[_Prepared], _Merged | None]]:
        """The passes of ``good``'s rows: one while its tokens fit ``max_pass_tokens``, counted as the pass
        computes them (with shared prefixes, the prefix and suffix passes' padded tokens), else
        :func:`plan_passes` with the bound scaled by that share of the full rows' padded tokens."""
        if not good:
            return []
        merged = self._merge(good)
        lengths, plan = merged[2], merged[5]
        dense = len(lengths) * int(merged[0].shape[1])
        cost = plan.cost(lengths) if plan is not None else dense
        if self.max_pass_tokens is None or cost <= self.max_pass_tokens:
            return [(good, merged)]
        bound = max(1, self.max_pass_tokens * dense // cost)
        return [([(good[r][0], good[r][1], rows_of(good[r][2], start, end), good[r][3], good[r][4])
                  for r, start, end in pieces], None)
                for pieces in plan_passes([p.lengths for _, _, p, _, _ in good], bound)]

    def _merge(self, good: list[_Prepared]) -> _Merged:
        """The requests' rows as one right-padded batch and its shared-prefix plan (None: one full pass)."""
        width = max(p.tokens_BT.shape[1] for _, _, p, _, _ in good)
        tokens = torch.cat([F.pad(p.tokens_BT, (0, width - p.tokens_BT.shape[1])) for _, _, p, _, _ in good])
        attn = torch.cat([F.pad(p.attn_BT, (0, width - p.attn_BT.shape[1])) for _, _, p, _, _ in good])
        adapters = [adapter for _, adapter, p, _, _ in good for _ in p.lengths]
        images_B = [imgs for _, _, p, _, _ in good for imgs in (p.images_B or [[] for _ in p.lengths])]
        lengths = [n for _, _, p, _, _ in good for n in p.lengths]
        plan = prefix_plan(self.model, tokens, lengths, adapters, images_B) if self.share_prefixes else None
        return tokens, attn, lengths, adapters, images_B, plan

    def _batched(self, good: list[_Prepared], backward: bool,
                 merged: _Merged | None = None) -> list[tuple[int, ForwardBackwardOutput]]:
        tokens, attn, lengths, adapters, images_B, plan = merged or self._merge(good)
        if plan is not None:  # a GRPO group's samples: their prompt once
            logits = shared_prefix_logits(self.model, tokens, lengths, adapters, plan)
        else:
            logits = PassLogits(run_model(self.model, tokens, attn, adapters=adapters, images_B=images_B)[0])
        losses: list[Tensor] = []
        outs: list[tuple[int, ForwardBackwardOutput]] = []
        pieces = logits.split([p.tokens_BT.shape[0] for _, _, p, _, _ in good],
                              [p.tokens_BT.shape[1] for _, _, p, _, _ in good])
        for (i, _adapter, padded, loss_fn, config), piece in zip(good, pieces):
            lp_BT = piece.logprobs(padded.inputs["target_tokens"], config.get("temperature", 1.0))
            predicted_BT = piece.argmax() if loss_fn == "cross_entropy" else None
            loss, elementwise_BT, metrics = weighted_loss(loss_fn, lp_BT, padded.inputs, config,
                                                          predicted_BT=predicted_BT)
            losses.append(loss)
            active = float((padded.inputs["weights"] != 0).sum())
            out_metrics = {"loss:sum": float(loss.detach()), "tokens:sum": active,
                           **{k: float(v) for k, v in metrics.items()}}
            outs.append((i, ForwardBackwardOutput(_per_datum(padded, lp_BT, elementwise_BT, None), out_metrics)))
        if backward:
            torch.stack(losses).sum().backward()
        return outs

    # -- internals --------------------------------------------------------------------------------
    def _check_new(self, name: str, *, tenant: bool = True) -> None:
        if not name:
            raise TenantError("Expected a non-empty tenant name.")
        if name in self.clients or name in self.samplers:
            raise TenantError(f"Tenant {name!r} exists already.")
        if tenant and len(self.clients) >= self.max_tenants:
            raise TenantError(f"Expected at most {self.max_tenants} tenants (max_tenants), got a request for one more; "
                              "remove an idle one first.")

    def _add_adapter(self, rank: int, alpha: int, seed: int | None, target_modules: Any) -> str:
        from peft import LoraConfig, get_peft_model

        name = f"tenant{self._adapters}"
        self._adapters += 1
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=target_modules,
                            task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            if self.model is self.base:
                self.model = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.model.add_adapter(name, config)
        if self.model.active_adapter not in self.model.peft_config:
            # every earlier adapter was deleted, but peft still names the last one active and looks it up
            # on each forward: make the new one active instead
            self.model.set_adapter(name)
        self.model.eval()
        self._unfreeze_tenants()
        return name

    def _delete_adapter(self, name: str) -> None:
        with warnings.catch_warnings():  # peft warns that it picks another active adapter: rows name theirs
            warnings.simplefilter("ignore", UserWarning)
            self.model.delete_adapter(name)
        self._unfreeze_tenants()

    def _unfreeze_tenants(self) -> None:
        # peft freezes every adapter but the active one whenever the active one changes: undo that
        for tenant in self.clients.values():
            for p in tenant.params:
                p.requires_grad_(True)

    def _adapter_params(self, name: str) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if f".{name}." in n]

    def _rank(self, adapter: str) -> int:
        return int(self.model.peft_config[adapter].r)

    def _targets(self) -> Any:
        if self.model is self.base:
            return "all-linear"
        return next(iter(self.model.peft_config.values())).target_modules

    def _reload_base(self) -> None:
        from trainer.model import load_policy

        self.base, _ = load_policy(self.model_cfg, self.device)
        _freeze(self.base)
        self.model = self.base


def _freeze(base: torch.nn.Module) -> None:
    """The shared base weights: eval mode (no dropout; peft refuses mixed batches in training mode), no gradients."""
    base.eval()
    for p in base.parameters():
        p.requires_grad_(False)


__all__ = ["ModelHost", "TenantError", "MAX_PASS_TOKENS", "plan_passes", "joined"]
