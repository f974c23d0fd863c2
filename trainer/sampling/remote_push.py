"""Weight pushes to sampler servers: what a push carries (full weights or a LoRA adapter) and one push to one server.

The body is the :mod:`.wire` stream (a safetensors file written straight from the parameters, no
file on disk); :class:`~trainer.sampling.remote.RemoteSampler` pushes it to every server at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import torch

from trainer.sampling.hf import generation_model
from trainer.sampling.wire import encode


def payload(model: Any, version: int, *, lora: bool,
            adapter_name: str) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """The route, tensors and metadata of ``model``'s push as ``version`` (its adapter alone for LoRA)."""
    inner = generation_model(model)
    if lora:
        if not hasattr(inner, "peft_config"):
            raise ValueError("Expected a peft model for a LoRA run's weight push, got a plain one.")
        from peft import get_peft_model_state_dict

        cfg = inner.peft_config[inner.active_adapter]
        settings = {"r": int(cfg.r), "lora_alpha": cfg.lora_alpha, "use_rslora": bool(cfg.use_rslora),
                    "target_modules": sorted(cfg.target_modules) if not isinstance(cfg.target_modules, str)
                    else cfg.target_modules}
        tensors = dict(get_peft_model_state_dict(inner))
        meta = {"version": str(version), "kind": "lora", "lora_config": json.dumps(settings)}
        return f"/adapters/{adapter_name}", tensors, meta
    tensors = {n: p.detach() for n, p in inner.named_parameters()}
    return "/weights", tensors, {"version": str(version), "kind": "full"}


def push(http: httpx.Client, url: str, path: str, tensors: dict[str, torch.Tensor], meta: dict[str, str], *,
         probe: bool) -> tuple[str | None, str | None]:
    """Stream the weights to the server at ``url``: (its instance id, None) once it took them, else (None, why).

    ``probe``: ask ``/health`` first (a server out of rotation). A transport error is tried once more
    if the server still answers ``/health`` (a kept-alive connection it closed meanwhile); the server
    applies a body only once it arrived whole."""
    for attempt in (1, 2):
        try:
            if probe or attempt == 2:
                http.get(f"{url}/health", timeout=2.0).raise_for_status()
            chunks = encode(tensors, meta)
            first = next(chunks)
            size = len(first) + sum(t.numel() * t.element_size() for t in tensors.values())
            resp = http.put(f"{url}{path}", content=_prepend(first, chunks),
                            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
            break
        except httpx.TransportError as exc:
            if attempt == 2:
                return None, f"{type(exc).__name__}: {exc}"
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return None, f"HTTP {resp.status_code}: {reason(resp)}"
    return resp.json().get("instance"), None


def reason(resp: httpx.Response) -> str:
    """The error message of a server's answer (the OpenAI error shape), else the start of its text."""
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def _prepend(first: bytes | memoryview, rest: Iterator[bytes | memoryview]) -> Iterator[bytes]:
    yield bytes(first)
    yield from rest  # type: ignore[misc]  # httpx writes memoryviews as they are


__all__ = ["payload", "push", "reason"]
