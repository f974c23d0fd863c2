"""Sampler servers: inference apart from training, weights pushed to them, an OpenAI API beside the trainer's.

``envhub-train sampler`` (:mod:`.serve`) runs one; :class:`~.client.RemoteSampler` is the trainer's side
(routing, weight pushes, faults); :mod:`.weights` is the streamed safetensors format weights travel in.
"""
