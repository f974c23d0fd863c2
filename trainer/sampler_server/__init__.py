"""Sampler servers: inference apart from training, weights pushed to them, an OpenAI API beside the trainer's.

``envhub-train sampler`` (:mod:`.serve`) runs one: :mod:`.app` (routes, weight updates, metrics) and
:mod:`.openai_api` over a backend (:mod:`.backends` for HF, :mod:`.vllm_backend` for vLLM) behind the
request batcher (:mod:`.batcher`); weight bodies also arrive over the weight channel (:mod:`.channel`,
a plain TCP port). The trainer's side is :class:`trainer.sampling.RemoteSampler` (routing, one batched
request per server, weight pushes, faults) and the training service's is ``trainer.service._remote``
(``envhub-train serve --sampler-servers``: one adapter per sampler), both on
:class:`trainer.sampling.SamplerPool`; :mod:`trainer.sampling.wire` is the streamed safetensors format
weights travel in.
"""
