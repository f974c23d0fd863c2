"""A trainable policy behind the training core's primitives: forward_backward, forward, optim_step, sample, save/load.

>>> client = TrainingClient.from_config(ModelConfig(name="tiny", lora_rank=8))          # doctest: +SKIP
>>> out = client.forward_backward([Datum.from_sequence(ids, weights=mask)], "cross_entropy")  # doctest: +SKIP
>>> client.optim_step(AdamParams(learning_rate=1e-3))                                  # doctest: +SKIP
>>> client.sample(prompt_ids, 4, SamplingParams(max_tokens=32)).sequences               # doctest: +SKIP

Gradients accumulate over ``forward_backward`` calls until ``optim_step`` applies and clears them, as in
Tinker; ``forward`` never touches them. The recipes (RL, SFT, two-agent) are loops over these calls,
and ``envhub-train serve`` exposes the same calls over HTTP.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trainer.core.forward import Padded, PassLogits, model_device, pad, run_model
from trainer.core.losses import check_loss, weighted_loss
from trainer.core.prefix import prefix_plan, shared_prefix_logits
from trainer.core.sampling import SamplingClient
from trainer.core.state import read_state, write_state
from trainer.core.types import AdamParams, Datum, ForwardBackwardOutput, SampleResponse, SamplingParams
from trainer.distributed import (
    gathered_model_state,
    gathered_optimizer_state,
    is_fsdp,
    load_gathered_model_state,
    load_gathered_optimizer_state,
)
from trainer.model import unwrap, vocab_size_of


class TrainingClient:
    """One trainable policy: ``model`` (plain, peft or DDP-wrapped), or one named LoRA ``adapter`` of a
    model several tenants share (see :class:`~trainer.core.host.ModelHost`), plus an optional value head.

    ``micro_batch_size`` splits a call's datums into passes of at most that many sequences (the loss is a
    sum, so the gradient is the same); None runs each call in one pass. ``share_prefixes`` (True): rows sharing
    a token prefix compute it once in a pass (:mod:`trainer.core.prefix`; not with a value head or DDP).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, *, adapter: str | None = None,
                 value_head: nn.Module | None = None, micro_batch_size: int | None = None,
                 params: list[nn.Parameter] | None = None):
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"Expected micro_batch_size >= 1 (or None: one pass), got {micro_batch_size}.")
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.value_head = value_head
        self.micro_batch_size = micro_batch_size
        self.share_prefixes = True  # rows sharing a token prefix compute it once (trainer.core.prefix)
        policy = params if params is not None else [p for p in model.parameters() if p.requires_grad]
        self.params = policy + (list(value_head.parameters()) if value_head is not None else [])
        if not self.params and params is None:
            raise ValueError("Expected a model with trainable parameters, got none (all frozen); pass params=[] "
                             "for a forward-only client.")
        # hyperparameters come with every optim_step; state (moments, step counts) lives here between them
        self.optimizer = torch.optim.AdamW(self.params, lr=0.0, fused=_fusable(self.params)) if self.params else None
        self.version = 0  # optimizer steps taken: the policy version samplers report

    @classmethod
    def from_config(cls, model_cfg: Any, *, device: torch.device | str = "cpu", value_head: bool = False,
                    micro_batch_size: int | None = None) -> TrainingClient:
        """A single-tenant client for a :class:`~trainer.model.ModelConfig` (LoRA when ``lora_rank > 0``)."""
        from trainer.algos import ValueHead
        from trainer.model import hidden_size_of, load_policy

        model, tok = load_policy(model_cfg, device)
        head = ValueHead(hidden_size_of(model)).to(device) if value_head else None
        return cls(model.train(), tok, value_head=head, micro_batch_size=micro_batch_size)

    # -- training ---------------------------------------------------------------------------------
    def forward_backward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict[str, float] | None = None) -> ForwardBackwardOutput:
        """Loss and gradients for ``data``; gradients add to those of earlier calls until ``optim_step``."""
        return self._run(data, loss_fn, dict(loss_fn_config or {}), backward=True)

    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: dict[str, float] | None = None) -> ForwardBackwardOutput:
        """The same outputs and metrics as ``forward_backward``, without any gradient (none computed or kept)."""
        with torch.no_grad():
            return self._run(data, loss_fn, dict(loss_fn_config or {}), backward=False)

    def optim_step(self, adam: AdamParams | None = None) -> dict[str, float]:
        """One AdamW step on the accumulated gradients (clipped to ``grad_clip_norm`` when > 0), then clear them.

        Returns ``grad_norm`` (before clipping) and ``learning_rate``.
        """
        optimizer = self._trainable()
        adam = adam or AdamParams()
        for group in optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": grad_norm, "learning_rate": adam.learning_rate}

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping."""
        for p in self.params:
            p.grad = None

    # -- sampling ---------------------------------------------------------------------------------
    def sampling_client(self) -> SamplingClient:
        """A sampler over this client's live weights (it sees every later optim_step)."""
        return SamplingClient(self.model, self.tokenizer, adapter=self.adapter)

    def sample(self, prompt_tokens: Sequence[int], num_samples: int = 1,
               sampling_params: SamplingParams | None = None, *,
               include_prompt_logprobs: bool = False) -> SampleResponse:
        """``num_samples`` completions from the current weights (see :class:`SamplingClient`)."""
        return self.sampling_client().sample(prompt_tokens, num_samples, sampling_params,
                                             include_prompt_logprobs=include_prompt_logprobs)

    def compute_logprobs(self, tokens: Sequence[int]) -> list[float | None]:
        """log p(tokens[i] | tokens[:i]) under the current weights (None at position 0)."""
        return self.sampling_client().compute_logprobs(tokens)

    def save_weights_for_sampler(self, sampler: Any, version: int | None = None) -> int:
        """Hand the current weights to a rollout engine's ``sampler`` (``HFSampler`` shares the model, so
        nothing moves; ``VLLMSampler`` gets them pushed), stamped ``version`` (default: optimizer steps so far).
        """
        version = self.version if version is None else version
        sampler.update_weights(self.model, version)
        return version

    # -- state ------------------------------------------------------------------------------------
    def save_state(self, path: str | os.PathLike[str], *, optimizer: bool = True, rng: bool = False,
                   metadata: dict[str, Any] | None = None) -> Path:
        """Write this policy's trainable weights (the adapter alone for LoRA), value head, with ``optimizer`` its
        AdamW state and with ``rng`` this rank's RNG states to directory ``path`` (:mod:`trainer.core.state`)."""
        return write_state(self, path, optimizer=optimizer, rng=rng, metadata=metadata)

    def load_state(self, path: str | os.PathLike[str], *, optimizer: bool = True,
                   rng: bool = False) -> dict[str, Any]:
        """Restore what :meth:`save_state` wrote (the optimizer and RNG states too when asked); returns its
        metadata."""
        return read_state(self, path, optimizer=optimizer, rng=rng)

    @property
    def lora_rank(self) -> int:
        """The rank of this policy's LoRA adapter; 0 when it trains full parameters."""
        model: Any = unwrap(self.model, peft=False)  # a peft model: its adapters' configs by name
        if not _is_peft(model):
            return 0
        return int(model.peft_config[self.adapter or "default"].r)

    def weights_state(self) -> dict[str, Tensor]:
        """The trainable weights on the CPU: this adapter's (keys without its name) or the full model's."""
        if is_fsdp(self.model):
            return gathered_model_state(self.model)
        model = unwrap(self.model, peft=False)
        if _is_peft(model):
            from peft import get_peft_model_state_dict

            # the adapter alone: a LoRA on the output layer would otherwise bring that frozen base layer along
            state = get_peft_model_state_dict(model, adapter_name=self.adapter or "default", save_embedding_layers=False)
        else:
            state = model.state_dict()
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def load_weights_state(self, state: dict[str, Tensor]) -> None:
        """Load weights from :meth:`weights_state`; keys that do not fit this policy are refused."""
        if is_fsdp(self.model):
            load_gathered_model_state(self.model, state)
            return
        model = unwrap(self.model, peft=False)
        if _is_peft(model):
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(model, state, adapter_name=self.adapter or "default")
            unexpected = getattr(result, "unexpected_keys", [])
            if unexpected:
                raise KeyError(f"Expected adapter weights matching this LoRA config, got unknown keys "
                               f"{unexpected[:5]}.")
            return
        model.load_state_dict(state)

    def optimizer_state(self) -> dict[str, Any]:
        """The AdamW state (moments, step counts; an FSDP model's gathered whole on rank 0)."""
        optimizer = self._trainable()
        if is_fsdp(self.model):
            return gathered_optimizer_state(self.model, optimizer)
        return optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore AdamW state from :meth:`optimizer_state`."""
        optimizer = self._trainable()
        if is_fsdp(self.model):
            load_gathered_optimizer_state(self.model, optimizer, state)
        else:
            optimizer.load_state_dict(state)

    # -- internals --------------------------------------------------------------------------------
    def _trainable(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("Expected a trainable client, got a forward-only one (built with params=[]).")
        return self.optimizer

    def _run(self, data: Sequence[Datum], loss_fn: str, config: dict[str, float], *,
             backward: bool) -> ForwardBackwardOutput:
        data = list(data)
        if not data:
            raise ValueError("Expected at least one Datum, got none.")
        for d in data:
            if not isinstance(d, Datum):
                raise TypeError(f"Expected Datum items, got {type(d).__name__}.")
            check_loss(loss_fn, d.loss_fn_inputs, config)
        _check_ids(self.model, data)
        size = self.micro_batch_size or len(data)
        outputs: list[dict[str, Tensor]] = []
        totals: dict[str, float] = {}
        for start in range(0, len(data), size):
            padded = pad(data[start:start + size], model_device(self.model))
            loss, elementwise_BT, lp_BT, values_BT, metrics = self.loss(padded, loss_fn, config)
            if backward:
                loss.backward()
            outputs += _per_datum(padded, lp_BT, elementwise_BT, values_BT)
            active = float((padded.inputs["weights"] != 0).sum())
            totals["loss:sum"] = totals.get("loss:sum", 0.0) + float(loss.detach())
            totals["tokens:sum"] = totals.get("tokens:sum", 0.0) + active
            for key, value in metrics.items():  # token means: weighted by each pass's active tokens
                totals[key] = totals.get(key, 0.0) + float(value) * active
        tokens = max(totals["tokens:sum"], 1.0)
        return ForwardBackwardOutput(outputs, {k: v if k.endswith(":sum") else v / tokens for k, v in totals.items()})

    def loss(self, padded: Padded, loss_fn: str, config: dict[str, float]
             ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
        """One pass: ``(loss, elementwise [B, T], target log-probs [B, T], values [B, T] or None, metrics)``."""
        adapters = [self.adapter] * len(padded.lengths) if self.adapter is not None else None
        plan = None
        if self.share_prefixes and self.value_head is None:  # (a value head reads hidden states: one pass)
            plan = prefix_plan(self.model, padded.tokens_BT, padded.lengths, adapters, padded.images_B)
        if plan is not None:  # rows sharing a prompt (a GRPO group's samples): the prompt once
            logits, hidden = shared_prefix_logits(self.model, padded.tokens_BT, padded.lengths, adapters, plan), None
        else:
            dense, hidden = run_model(self.model, padded.tokens_BT, padded.attn_BT, adapters=adapters,
                                      hidden=self.value_head is not None, images_B=padded.images_B)
            logits = PassLogits(dense)
        lp_BT = logits.logprobs(padded.inputs["target_tokens"], config.get("temperature", 1.0))
        values_BT = self.value_head(hidden) if self.value_head is not None else None
        predicted_BT = logits.argmax() if loss_fn == "cross_entropy" else None
        loss, elementwise_BT, metrics = weighted_loss(loss_fn, lp_BT, padded.inputs, config, values_BT=values_BT,
                                                      predicted_BT=predicted_BT)
        return loss, elementwise_BT, lp_BT, values_BT, metrics


def _per_datum(padded: Padded, lp_BT: Tensor, elementwise_BT: Tensor, values_BT: Tensor | None
               ) -> list[dict[str, Tensor]]:
    out = []
    for i, n in enumerate(padded.lengths):
        row = {"logprobs": lp_BT[i, :n].detach().float().cpu(),
               "elementwise_loss": elementwise_BT[i, :n].detach().float().cpu()}
        if values_BT is not None:
            row["values"] = values_BT[i, :n].detach().float().cpu()
        out.append(row)
    return out


def _check_ids(model: nn.Module, data: list[Datum]) -> None:
    """Refuse token ids outside the vocabulary before any pass (an embedding lookup would fail mid-batch)."""
    vocab = vocab_size_of(model)
    for i, d in enumerate(data):
        ids = [d.model_input] + ([d.loss_fn_inputs["target_tokens"]] if "target_tokens" in d.loss_fn_inputs else [])
        if any(int(t.min()) < 0 or int(t.max()) >= vocab for t in ids):
            raise ValueError(f"Expected token ids in [0, {vocab}) (the model's vocabulary), got one out of range "
                             f"in datum {i}.")


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(unwrap(model, peft=False), PeftModel)


def _fusable(params: list[nn.Parameter]) -> bool | None:
    """Whether AdamW runs fused: one kernel over every parameter instead of a loop of per-parameter ops (5x
    faster on the tiny CPU model, where the loop is all dispatch). Plain CPU or CUDA tensors of float dtypes
    only; anything else (FSDP's DTensors, other devices) keeps torch's default implementation."""
    floats = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    return all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.dtype in floats
               for p in params) or None


__all__ = ["TrainingClient"]
