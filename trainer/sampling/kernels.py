"""The model arithmetic :func:`trainer.sampling.decode.decode` runs on: a prefill and one cached step per new id.

:class:`HFKernel` drives any Hugging Face causal LM through its own ``forward`` and cache (the general
path). :class:`LlamaKernel` runs the Llama family (:data:`LLAMA_FAMILY`) from the model's own weights with
a preallocated KV cache and fused small projections: the same arithmetic as the Hugging Face modules,
minus the per-step bookkeeping a decode step does not need. Both answer the same three calls:
``prefill(ids_BT, attn_BT, pos_BT) -> logits_BV``, ``expand(index_B) -> bool`` (copy cache rows after a
prefill of unique prompts) and ``step(tok_B, attn_BS, pos_B, all_running) -> logits_BV``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.model import cache_keyword, output_cache, unwrap


class HFKernel:
    """Any Hugging Face causal LM through its own ``forward`` and cache (the general path)."""

    def __init__(self, model: Any):
        self.model, self.cache = model, None

    def prefill(self, ids_BT: Tensor, attn_BT: Tensor, pos_BT: Tensor, **kwargs: Any) -> Tensor:
        out = self.model(input_ids=ids_BT, attention_mask=attn_BT, position_ids=pos_BT, use_cache=True,
                         logits_to_keep=1, **kwargs)
        self.cache = output_cache(out)
        logits_BTV: Tensor = out.logits
        return logits_BTV[:, -1]

    def expand(self, index_B: Tensor) -> bool:
        """Row ``i`` of the cache becomes a copy of row ``index_B[i]`` (after a prefill of unique prompts); False
        when this model's cache type cannot copy rows."""
        reorder = getattr(self.cache, "reorder_cache", None)
        if reorder is None:
            return False
        reorder(index_B)
        return True

    def step(self, tok_B: Tensor, attn_BS: Tensor, pos_B: Tensor, all_running: bool, **kwargs: Any) -> Tensor:
        out = self.model(input_ids=tok_B[:, None], attention_mask=attn_BS, position_ids=pos_B[:, None],
                         use_cache=True, **{cache_keyword(self.model): self.cache}, **kwargs)
        self.cache = output_cache(out)
        logits_B1V: Tensor = out.logits
        return logits_B1V[:, -1]


#: decoder families whose layers are pre-norm RMSNorm -> attention (RoPE, grouped KV heads, optional q/k norm)
#: -> RMSNorm -> gated SiLU MLP: the lean kernel runs them from their own modules
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
#: projections of at most this many weights (summed over the ones fused) run as one matmul on a concatenated
#: copy: small layers are bound by per-op dispatch, not arithmetic, and a copy of them costs nothing
FUSE_MAX_WEIGHTS = 1 << 20


class LlamaKernel:
    """The Llama family decoded from the model's own weights with a preallocated KV cache.

    Each layer is the Hugging Face module's arithmetic (its RMSNorm formula, its rotary embedding module,
    grouped-query attention with the same scaling), minus what one decode step does not need: no mask
    building, cache objects, output records or hooks, and fewer ops per layer. Plain ``nn.Linear``
    projections run as ``F.linear`` on their weights (q/k/v and gate/up each as one matmul when small,
    :data:`FUSE_MAX_WEIGHTS`); any other projection (a peft LoRA layer) is called as the module it is, so
    adapters decode too. A kernel is built per :func:`decode` call and reads the weights as they are then.
    """

    def __init__(self, lm: Any, capacity: int):
        body = lm.model
        self.embed, self.rotary = _embedding(body.embed_tokens), body.rotary_emb
        self.norm, self.head = _rms_norm_rows(body.norm), _linear(lm.lm_head)
        first = body.layers[0].self_attn
        self.heads, self.kv_heads = int(lm.config.num_attention_heads), int(lm.config.num_key_value_heads)
        self.head_dim, self.scaling = int(first.head_dim), float(first.scaling)
        self.blocks = [_Block(layer, self.head_dim) for layer in body.layers]
        self.capacity, self.length = capacity, 0
        self.bias_R1S = torch.empty(0)  # additive key mask of the decode steps (0 or -inf), a row per (row, KV head)
        self.cos_sin: tuple[Tensor, Tensor] | None = None
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []

    @classmethod
    def build(cls, model: Any, capacity: int) -> LlamaKernel | None:
        """A kernel for ``model`` (a plain or peft-wrapped Llama-family causal LM), or None when it is not one."""
        lm: Any = unwrap(model)  # the Hugging Face model under any peft wrapper
        config = getattr(lm, "config", None)
        if getattr(config, "model_type", None) not in LLAMA_FAMILY or not hasattr(getattr(lm, "model", None), "layers"):
            return None
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "pretraining_tp", 1) != 1:
            return None
        for layer in lm.model.layers:
            attn = layer.self_attn  # the layer's window, or the model's (Mistral keeps it on the config only)
            window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
            if window is not None and window < capacity:
                return None  # sliding-window attention at this length: the general path applies it
        return cls(lm, capacity)

    def prefill(self, ids_BT: Tensor, attn_BT: Tensor, pos_BT: Tensor) -> Tensor:
        B, T = ids_BT.shape
        x = self.embed(ids_BT.reshape(-1))  # [B*T, hidden]: the layers work on rows, attention on [B, heads, T, D]
        shape = (B, self.kv_heads, self.capacity, self.head_dim)
        self.k = [x.new_zeros(shape) for _ in self.blocks]
        self.v = [x.new_zeros(shape) for _ in self.blocks]
        if bool(attn_BT.all()):
            mask_B1TT = None  # no padding: SDPA's causal path, the fastest
        else:
            causal_TT = torch.ones((T, T), dtype=torch.bool, device=x.device).tril_()
            # a padding query sees itself, so no row of the mask is empty (an empty row is NaN in SDPA)
            mask_B1TT = (causal_TT & attn_BT[:, None, None, :].bool()) | torch.eye(T, dtype=torch.bool, device=x.device)
        self.length = T
        # rotary cos/sin of every position the cache can hold, once (a rope type whose frequencies depend on
        # the length reached, dynamic NTK or longrope, keeps the module's per-step arithmetic)
        rope = str(getattr(self.rotary, "rope_type", "dynamic"))
        self.cos_sin = None
        if "dynamic" not in rope and "longrope" not in rope:
            cos, sin = self.rotary(x, torch.arange(self.capacity, device=x.device)[None])
            self.cos_sin = (cos[0], self._signed(sin[0]))
        bias_BS = x.new_zeros((B, self.capacity))
        bias_BS[:, :T].masked_fill_(attn_BT == 0, float("-inf"))
        self.bias_R1S = bias_BS.repeat_interleave(self.kv_heads, dim=0)[:, None]
        return self._forward(x, B, T, pos_BT, mask_B1TT, 0)

    def expand(self, index_B: Tensor) -> bool:
        """Row ``i`` of the cache becomes a copy of row ``index_B[i]`` (after a prefill of unique prompts)."""
        self.k = [k.index_select(0, index_B) for k in self.k]
        self.v = [v.index_select(0, index_B) for v in self.v]
        Hk = self.kv_heads
        rows_R = (index_B[:, None] * Hk + torch.arange(Hk, device=index_B.device)).flatten()
        self.bias_R1S = self.bias_R1S.index_select(0, rows_R)
        return True

    def step(self, tok_B: Tensor, attn_BS: Tensor, pos_B: Tensor, all_running: bool) -> Tensor:
        if self.length >= self.capacity:
            raise RuntimeError(f"Expected at most {self.capacity} positions in the decode cache.")
        x = self.embed(tok_B)
        start, self.length = self.length, self.length + 1
        if not all_running:  # the new key is masked for rows that already stopped (attn_BS's last column)
            stopped_R = (attn_BS[:, -1] == 0).repeat_interleave(self.kv_heads)
            self.bias_R1S[:, 0, start].masked_fill_(stopped_R, float("-inf"))
        return self._forward(x, len(tok_B), 1, pos_B[:, None], self.bias_R1S[:, :, :start + 1], start)

    def _signed(self, sin: Tensor) -> Tensor:
        half = self.head_dim // 2
        return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    def _forward(self, x: Tensor, B: int, T: int, pos_BT: Tensor, mask: Tensor | None, start: int) -> Tensor:
        """Logits at the last position of each row of ``x`` [B*T, hidden] (row-major [B, T]), whose keys/values
        go to cache slots start..start+T."""
        end = start + T
        if self.cos_sin is not None:  # a lookup per step, not the rotary module's arithmetic
            cos, sin = F.embedding(pos_BT, self.cos_sin[0])[:, None], F.embedding(pos_BT, self.cos_sin[1])[:, None]
        else:
            cos, sin = self.rotary(x, pos_BT)
            cos, sin = cos[:, None], self._signed(sin)[:, None]
        H, Hk, D = self.heads, self.kv_heads, self.head_dim
        for block, k_cache, v_cache in zip(self.blocks, self.k, self.v):
            h = block.norm1(x)
            if block.qk_swapped_v is not None:  # rotate_half's swap came out of the matmul: rope is 2 ops
                qk, swapped, v = block.qk_swapped_v(h)
                qk = (qk.view(B, T, H + Hk, D).transpose(1, 2) * cos).addcmul_(
                    swapped.view(B, T, H + Hk, D).transpose(1, 2), sin)
            else:
                q, k, v = block.qkv(h)
                if block.qk_norms is not None:
                    q_norm, k_norm = block.qk_norms
                    q, k = q_norm(q.view(B, T, H, D)), k_norm(k.view(B, T, Hk, D))
                qk = _rope(torch.cat([q.view(B, T, H, D), k.view(B, T, Hk, D)], dim=2).transpose(1, 2), cos, sin)
            k_cache[:, :, start:end] = qk[:, H:]
            v_cache[:, :, start:end] = v.view(B, T, Hk, D).transpose(1, 2)
            if T == 1:
                assert mask is not None  # a decode step always has its additive key mask
                o = _attend_one(qk[:, :H], k_cache[:, :, :end], v_cache[:, :, :end], mask, self.scaling)
            else:
                o = F.scaled_dot_product_attention(qk[:, :H], k_cache[:, :, :end], v_cache[:, :, :end],
                                                   attn_mask=mask, is_causal=mask is None, scale=self.scaling,
                                                   enable_gqa=Hk != H)
            x = block.o_proj(o.transpose(1, 2).reshape(B * T, H * D), x)
            gate, up = block.gate_up(block.norm2(x))
            x = block.down(F.silu(gate) * up, x)
        return self.head(self.norm(x.view(B, T, -1)[:, -1] if T > 1 else x))


class _Block:
    """One decoder layer's callables: norms, projections (fused where plain and small), optional q/k norms."""

    def __init__(self, layer: Any, head_dim: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = _rms_norm_rows(layer.input_layernorm), _rms_norm_rows(layer.post_attention_layernorm)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        # Qwen3's per-head q/k RMSNorms (a model has both or neither)
        self.qk_norms = None if q_norm is None else (_rms_norm(q_norm), _rms_norm(k_norm))
        self.qkv = _projections([attn.q_proj, attn.k_proj, attn.v_proj])
        self.qk_swapped_v = None if q_norm is not None else _swapped_projection(attn.q_proj, attn.k_proj, attn.v_proj,
                                                                                head_dim)
        self.gate_up = _projections([mlp.gate_proj, mlp.up_proj])
        self.o_proj, self.down = _residual(attn.o_proj), _residual(mlp.down_proj)


def _attend_one(q_BH1D: Tensor, k_BHkSD: Tensor, v_BHkSD: Tensor, bias_R1S: Tensor, scale: float) -> Tensor:
    """Attention of one new query per row, the query heads of each KV head grouped (no KV copy for GQA): one
    ``baddbmm`` (bias + scale * q k^T) over R = rows x KV heads, a softmax, one ``bmm``."""
    B, H, _, D = q_BH1D.shape
    Hk, S = k_BHkSD.shape[1], k_BHkSD.shape[2]
    k_RSD, v_RSD = k_BHkSD.reshape(B * Hk, S, D), v_BHkSD.reshape(B * Hk, S, D)  # views of the cache
    scores_RGS = torch.baddbmm(bias_R1S, q_BH1D.reshape(B * Hk, H // Hk, D), k_RSD.transpose(1, 2), alpha=scale)
    return torch.bmm(scores_RGS.softmax(-1), v_RSD).view(B, H, 1, D)


def _rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary embedding, HF's ``x * cos + rotate_half(x) * sin`` with the sign of rotate_half folded into sin."""
    *lead, D = x.shape
    return x * cos + x.view(*lead, 2, D // 2).flip(-2).view(*lead, D) * signed_sin


def _linear(module: Any) -> Callable[[Tensor], Tensor]:
    """``F.linear`` on a plain ``nn.Linear``'s weights; any other module (LoRA) as itself."""
    if type(module) is not torch.nn.Linear:
        return module  # type: ignore[no-any-return]
    weight, bias = module.weight, module.bias
    return lambda x: F.linear(x, weight, bias)


def _swapped_projection(q_proj: Any, k_proj: Any, v_proj: Any,
                        head_dim: int) -> Callable[[Tensor], tuple[Tensor, ...]] | None:
    """q|k, the same with the two halves of every head swapped (rotate_half before its sign), and v, from one
    matmul over [Wq; Wk; swapped Wq; swapped Wk; Wv] (a row permutation: each output is the same dot product);
    None unless all three are plain ``nn.Linear`` and small (:data:`FUSE_MAX_WEIGHTS`)."""
    modules = [q_proj, k_proj, v_proj]
    if any(type(m) is not torch.nn.Linear for m in modules):
        return None
    if sum(m.weight.numel() for m in modules) + q_proj.weight.numel() + k_proj.weight.numel() > FUSE_MAX_WEIGHTS:
        return None
    half = head_dim // 2

    def swap(t: Tensor) -> Tensor:  # rows grouped per head: [first half; second half] -> [second; first]
        per_head = t.view(-1, head_dim, *t.shape[1:])
        return torch.cat([per_head[:, half:], per_head[:, :half]], dim=1).reshape(t.shape)

    qk_w, qk_b = _stacked([q_proj, k_proj])
    weight = torch.cat([qk_w, swap(qk_w), v_proj.weight])
    bias = None if qk_b is None and v_proj.bias is None else torch.cat(
        [*(2 * [qk_w.new_zeros(len(qk_w))] if qk_b is None else [qk_b, swap(qk_b)]),
         v_proj.bias if v_proj.bias is not None else v_proj.weight.new_zeros(v_proj.out_features)])
    sizes = [len(qk_w), len(qk_w), v_proj.out_features]
    return lambda x: F.linear(x, weight, bias).split_with_sizes(sizes, dim=-1)


def _residual(module: Any) -> Callable[[Tensor, Tensor], Tensor]:
    """``residual + module(x)`` on rows [N, features]: one ``addmm`` for a plain bias-free ``nn.Linear``, else the
    module and an add."""
    if type(module) is not torch.nn.Linear or getattr(module, "bias", None) is not None:
        return lambda x, residual: residual + module(x)
    weight_t = module.weight.t()
    return lambda x, residual: torch.addmm(residual, x, weight_t)


def _embedding(module: Any) -> Callable[[Tensor], Tensor]:
    """``F.embedding`` on a plain ``nn.Embedding``'s weight (no module call per step); anything else as itself."""
    if type(module) is not torch.nn.Embedding or module.max_norm is not None:
        return module  # type: ignore[no-any-return]
    weight = module.weight
    return lambda ids: F.embedding(ids, weight)


def _stacked(modules: list[Any]) -> tuple[Tensor, Tensor | None]:
    """The weights of several ``nn.Linear`` stacked (one matmul computes all), and their biases (zeros for a
    bias-free one; None when none has a bias)."""
    weight = torch.cat([m.weight for m in modules])
    if all(m.bias is None for m in modules):
        return weight, None
    return weight, torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules])


def _projections(modules: list[Any]) -> Callable[[Tensor], tuple[Tensor, ...]]:
    """Several projections of the same input: one matmul over their concatenated weights when all are plain
    ``nn.Linear`` and small (:data:`FUSE_MAX_WEIGHTS`), else each on its own."""
    if all(type(m) is torch.nn.Linear for m in modules) and sum(m.weight.numel() for m in modules) <= FUSE_MAX_WEIGHTS:
        sizes = [m.out_features for m in modules]
        weight, bias = _stacked(modules)
        return lambda x: F.linear(x, weight, bias).split_with_sizes(sizes, dim=-1)
    each = [_linear(m) for m in modules]
    return lambda x: tuple(f(x) for f in each)


def _rms_norm(module: Any) -> Callable[[Tensor], Tensor]:
    """The Hugging Face RMSNorm arithmetic (in float32, scaled in the input dtype) on the module's weight."""
    eps = _epsilon(module)
    weight: Tensor = module.weight

    def norm(x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)) * weight
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))).to(x.dtype)

    return norm


def _rms_norm_rows(module: Any) -> Callable[[Tensor], Tensor]:
    """:func:`_rms_norm` for rows [N, features], its mean of squares and epsilon one ``addmm`` (mean and a scalar
    add cost several times a small matmul in dispatch; the sum differs from ``mean``'s by float rounding)."""
    weight: Tensor = module.weight
    features = weight.shape[-1]
    eps_1 = torch.tensor([_epsilon(module)], dtype=torch.float32, device=weight.device)
    mean_F1 = torch.full((features, 1), 1.0 / features, dtype=torch.float32, device=weight.device)

    def norm(x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return x * torch.addmm(eps_1, x * x, mean_F1).rsqrt_() * weight
        x32 = x.float()
        return weight * (x32 * torch.addmm(eps_1, x32 * x32, mean_F1).rsqrt_()).to(x.dtype)

    return norm


def _epsilon(module: Any) -> float:
    """An RMSNorm module's epsilon (``variance_epsilon`` in Hugging Face's, ``eps`` in torch's)."""
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))


__all__ = ["HFKernel", "LlamaKernel", "LLAMA_FAMILY", "FUSE_MAX_WEIGHTS"]
