"""The vLLM sampler (GPU): same interface as ``HFSampler``, weights pushed to vLLM after optimizer steps.

vLLM is imported when the sampler is built, never at module import. The policy is exported once to
a temporary directory for vLLM to load; after each optimizer step ``update_weights`` either saves
the LoRA adapter and switches to it by a new ``LoRARequest`` (LoRA runs), or streams the full
state dict into the running vLLM model with ``load_weights`` (full-parameter runs). vLLM runs
in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so weights move without pickling.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

from trainer.model import unwrap
from trainer.rollout.sampler import SamplingConfig
from trainer.rollout.types import GenRequest, GenResult


class VLLMSampler:
    """Batched vLLM generation with token-id prompts and per-token log-probs of the sampled ids."""

    def __init__(self, model: Any, tokenizer: Any, config: SamplingConfig | None = None, *, lora: bool = False,
                 gpu_memory_utilization: float = 0.3, max_model_len: int = 4096, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.config = config or SamplingConfig()
        self.lora = lora
        self.eos_id = int(tokenizer.eos_token_id)
        self.version = 0
        self.calls = self.sequences = 0
        self._dir = tempfile.mkdtemp(prefix="envhub-vllm-")
        base = unwrap(model)
        base.save_pretrained(os.path.join(self._dir, "base"))
        tokenizer.save_pretrained(os.path.join(self._dir, "base"))
        kwargs: dict[str, Any] = dict(model=os.path.join(self._dir, "base"), gpu_memory_utilization=gpu_memory_utilization,
                                      max_model_len=max_model_len, seed=seed, enable_prefix_caching=True,
                                      dtype="bfloat16")
        if lora:
            peft_config = getattr(model, "peft_config", None)
            kwargs.update(enable_lora=True, max_lora_rank=peft_config["default"].r if peft_config else 64)
        try:  # log-probs after temperature scaling, as the trainer computes them (newer vLLM)
            self.llm = LLM(**kwargs, logprobs_mode="processed_logprobs")
        except TypeError:
            self.llm = LLM(**kwargs)
        self._lora_request = None
        self._pending: list[tuple[GenRequest, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        if lora:
            self.update_weights(model, 0)

    # -- weights ---------------------------------------------------------------------------------
    def update_weights(self, model: Any, version: int) -> None:
        """Push the trainer's current weights into vLLM (a new LoRA adapter, or the full state dict)."""
        self.version = version
        if self.lora:
            from vllm.lora.request import LoRARequest

            path = os.path.join(self._dir, f"adapter_{version}")
            peft_model = model.module if hasattr(model, "module") else model
            peft_model.save_pretrained(path)
            self._lora_request = LoRARequest(f"policy-v{version}", version + 1, path)
            return
        state = unwrap(model).state_dict()
        _load_weights(self.llm, ((name, tensor.detach()) for name, tensor in state.items()))
        self.llm.reset_prefix_cache()

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, request: GenRequest) -> GenResult:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((request, fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(self.config.batch_wait_s / 10)
            batch, self._pending = self._pending, []
            try:
                results = await asyncio.to_thread(self.generate_batch, [r for r, _ in batch])
            except Exception as exc:
                for _, f in batch:
                    if not f.done():
                        f.set_exception(exc)
                continue
            for (_, f), res in zip(batch, results):
                if not f.done():
                    f.set_result(res)

    def generate_batch(self, requests: list[GenRequest]) -> list[GenResult]:
        """One ``LLM.generate`` over token-id prompts; per-request caps and greedy flags via SamplingParams."""
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0 if r.greedy else self.config.temperature,
                                 top_p=1.0 if r.greedy else self.config.top_p, logprobs=0,
                                 stop_token_ids=[self.eos_id], skip_special_tokens=False) for r in requests]
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outputs = self.llm.generate(prompts, params, lora_request=self._lora_request, use_tqdm=False)
        self.calls += 1
        self.sequences += len(requests)
        return [self._result(out.outputs[0]) for out in outputs]

    def _result(self, completion: Any) -> GenResult:
        ids = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs or [], ids)]
        finish = "stop" if completion.finish_reason == "stop" else "length"
        if finish == "stop" and (not ids or ids[-1] != self.eos_id):
            ids.append(self.eos_id)  # the stop token is part of the record: the policy must learn to end turns
            logprobs.append(0.0)
        return GenResult(ids, logprobs, finish)


def _load_weights(llm: Any, weights: Any) -> None:
    """``model.load_weights(weights)`` inside vLLM, across the engine layouts of recent versions."""
    apply_model = getattr(llm, "apply_model", None)
    if apply_model is not None:
        weights = list(weights)
        apply_model(lambda m: m.load_weights(weights))
        return
    worker = llm.llm_engine.model_executor.driver_worker
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    runner.model.load_weights(weights)


__all__ = ["VLLMSampler"]
