"""The Hugging Face batch sampler: the policy model itself, left-padded batches through the decode loop.

:class:`HFSampler` samples on the trainer's own model object (or a private copy of it, for asynchronous
rollouts) with :func:`trainer.sampling.decode.decode`, and with Hugging Face ``generate`` for a
vision-language model (whose multimodal position ids are model-specific). Requests with images carry
their pixel patches and grids into the same call.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.model import frozen_copy, unwrap
from trainer.sampling.batching import BatchingSampler
from trainer.sampling.decode import decode, supports_decode
from trainer.sampling.types import GenRequest, SampledSequence, SamplingConfig
from trainer.vision import vision_inputs


class HFSampler(BatchingSampler):
    """Batched sampling (left-padded, :func:`~trainer.sampling.decode.decode`) on the trainer's own model, or on a
    private copy.

    By default the sampler shares the trainer's model object, so no weight copy is needed: this is
    right when generation and optimizer steps alternate (synchronous rollouts). With ``own_copy=True``
    (asynchronous rollouts, where episodes run during the optimizer step) it samples from its own
    copy of the weights, refreshed by ``update_weights`` under ``weights_lock``.

    Sampling draws from the global torch RNG: seed it (``train`` gives every torchrun rank its own seed,
    :func:`trainer.distributed.rank_seed`) for reproducible completions that differ across ranks.

    >>> sampler = HFSampler(model, tokenizer)                           # doctest: +SKIP
    >>> await sampler.generate(GenRequest(prompt_ids, max_new_tokens=16)) # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: Any, config: SamplingConfig | None = None, *, own_copy: bool = False):
        super().__init__(config)
        self.own_copy = own_copy
        self.model = frozen_copy(model) if own_copy else model
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)

    def update_weights(self, model: Any, version: int) -> None:
        """Shared model: the sampler samples ``model`` itself from now on. Own copy: ``model``'s weights are copied
        into the sampler's copy. Either way under the lock, with the new ``version``."""
        with self.weights_lock:
            if self.own_copy:
                target = dict(generation_model(self.model).named_parameters())
                with torch.no_grad():
                    for name, param in generation_model(model).named_parameters():
                        target[name].copy_(param.detach())
            else:
                self.model = model
            self.version = version

    @torch.no_grad()
    def generate_batch(self, requests: list[GenRequest]) -> list[SampledSequence]:
        """One left-padded batch for all ``requests`` (same greedy flag): the decode loop for a text model (each
        row stops at EOS or its own budget), ``generate`` for a vision-language one."""
        model = generation_model(self.model)
        device = next(model.parameters()).device
        ids_BT, attn_BT = self._left_padded(requests)
        was_training = model.training
        model.eval()
        try:
            if supports_decode(model) and not any(r.images for r in requests):
                return self._decode(model, requests, ids_BT.to(device), attn_BT.to(device))
            return self._generate(model, requests, ids_BT.to(device), attn_BT.to(device))
        finally:
            model.train(was_training)

    def _left_padded(self, requests: list[GenRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r.prompt_ids) for r in requests)
        ids_BT = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        attn_BT = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids_BT[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attn_BT[i, width - len(r.prompt_ids):] = 1
        return ids_BT, attn_BT

    def _temperature(self, greedy: bool) -> float:
        return 1.0 if greedy else self.config.temperature

    def _decode(self, model: Any, requests: list[GenRequest], ids_BT: torch.Tensor,
                attn_BT: torch.Tensor) -> list[SampledSequence]:
        greedy = requests[0].greedy
        out = decode(model, ids_BT, attn_BT, max_new_tokens=[r.max_new_tokens for r in requests],
                     eos_ids={self.eos_id}, temperature=self._temperature(greedy), greedy=greedy,
                     top_p=self.config.top_p)
        return [SampledSequence(ids, lps, reason)
                for ids, lps, reason in zip(out.token_ids, out.logprobs, out.finish_reasons)]

    def _generate(self, model: Any, requests: list[GenRequest], ids_BT: torch.Tensor,
                  attn_BT: torch.Tensor) -> list[SampledSequence]:
        """Hugging Face ``generate`` (a vision-language model), log-probs from its logits at the temperature."""
        greedy = requests[0].greedy
        temperature = self._temperature(greedy)
        gen = model.generate(input_ids=ids_BT, attention_mask=attn_BT,
                             max_new_tokens=max(r.max_new_tokens for r in requests), do_sample=not greedy,
                             temperature=temperature if not greedy else None,
                             top_p=self.config.top_p if not greedy else None, top_k=0 if not greedy else None,
                             eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                             return_dict_in_generate=True, output_logits=True,
                             **_image_inputs(model, requests, ids_BT))
        new_BN = gen.sequences[:, ids_BT.shape[1]:].cpu()
        logits_BNV = torch.stack(gen.logits, dim=1).float().cpu() / temperature
        logprobs_BN = torch.log_softmax(logits_BNV, dim=-1).gather(-1, new_BN.unsqueeze(-1)).squeeze(-1)
        return [self._until_eos(new_BN[i].tolist(), logprobs_BN[i].tolist(), r.max_new_tokens)
                for i, r in enumerate(requests)]

    def _until_eos(self, ids: list[int], logprobs: list[float], cap: int) -> SampledSequence:
        """A row of ``generate``'s output as a sequence: at most ``cap`` ids, ending at the first EOS if any."""
        ids, logprobs = ids[:cap], logprobs[:cap]
        if self.eos_id in ids:
            end = ids.index(self.eos_id) + 1
            return SampledSequence(ids[:end], logprobs[:end], "stop")
        return SampledSequence(ids, logprobs, "length")


def _image_inputs(model: Any, requests: list[GenRequest], ids_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    if not any(r.images for r in requests):
        return {}
    token_id = getattr(getattr(model, "config", None), "image_token_id", None)
    if token_id is None:
        raise ValueError("Expected a vision-language policy for requests with images (model.name='tiny-vl' or a "
                         f"Qwen2-VL / Qwen2.5-VL model), got {type(model).__name__}.")
    return vision_inputs([r.images for r in requests], ids_BT, token_id)


def generation_model(model: Any) -> Any:
    """The model to generate with: ``model`` under its DDP/FSDP wrappers (which do not expose ``generate``;
    peft models do, and are kept)."""
    return unwrap(model, peft=False)


__all__ = ["HFSampler", "generation_model"]
