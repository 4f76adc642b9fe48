"""The decoder-only language model (SPEC section 3). DIFF and baseline share everything here;
only the attention module differs, picked by ``ModelConfig.attention``.

Legend: ``B`` batch, ``T`` new tokens, ``S`` cached + new tokens, ``D`` model width,
``V`` vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import AttentionMask, DiffAttention, DiffAttentionV2, LayerKV, StandardAttention
from .config import ModelConfig


def make_attention(config: ModelConfig, layer_idx: int) -> nn.Module:
    c = config
    if c.attention == "diff":
        return DiffAttention(c.dim, c.n_heads, layer_idx, c.n_kv_heads, c.rope_theta, backend=c.backend,
                             norm_eps=c.norm_eps, lambda_init=c.lambda_init, use_subln=c.use_subln)
    if c.attention == "diff_v2":
        return DiffAttentionV2(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend)
    return StandardAttention(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm block: ``x + Attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = make_attention(config, layer_idx)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.hidden_dim)

    def forward(self, x: Tensor, **attn_kwargs) -> Tensor:
        x = x + self.attn(self.attn_norm(x), **attn_kwargs)
        return x + self.mlp(self.mlp_norm(x))


class KVCache:
    """Per-layer key/value buffers for incremental decoding; ``length`` tokens are filled."""

    def __init__(self, model: "Transformer", batch_size: int, max_len: int,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        p = next(model.parameters())
        device, dtype = device or p.device, dtype or p.dtype
        self.max_len, self.length = max_len, 0
        self.layers: list[LayerKV] = []
        for block in model.layers:
            k_shape, v_shape = block.attn.cache_shapes()
            self.layers.append(LayerKV.empty(batch_size, max_len, k_shape, v_shape, device=device, dtype=dtype))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"Transformer expects a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) linears and embeddings; unit norm gains; lambda ~ N(0, 0.1)."""
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, nn.RMSNorm) and m.weight is not None:
                nn.init.ones_(m.weight)
            elif isinstance(m, DiffAttention):
                m.reset_lambda()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: Tensor, *, positions: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None, doc_ids: Optional[Tensor] = None,
                cache: Optional[KVCache] = None, backend: Optional[str] = None) -> Tensor:
        """Logits ``(B, T, V)`` for ``tokens`` ``(B, T)``: ``lm_head(hidden(...))``, arguments as
        in :meth:`hidden`."""
        return self.lm_head(self.hidden(tokens, positions=positions, attention_mask=attention_mask,
                                         doc_ids=doc_ids, cache=cache, backend=backend))  # (B, T, V)

    def hidden(self, tokens: Tensor, *, positions: Optional[Tensor] = None,
               attention_mask: Optional[Tensor] = None, doc_ids: Optional[Tensor] = None,
               cache: Optional[KVCache] = None, backend: Optional[str] = None) -> Tensor:
        """Final-normed hidden states ``(B, T, D)`` for ``tokens`` ``(B, T)`` (the LM head's input:
        a loss on a few positions can apply ``lm_head`` to those alone).

        ``attention_mask`` ``(B, S)``: 1 for real tokens, 0 for padding, over cached + new
        positions. ``positions`` ``(B, T)``: RoPE positions (default: counting from the cache
        length). ``doc_ids`` ``(B, T)``: packed documents attend only within themselves (not
        with a cache). ``cache``: a :class:`KVCache`; its ``length`` advances by ``T``.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, time), got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        offset = cache.length if cache is not None else 0
        S = offset + T
        if attention_mask is not None and tuple(attention_mask.shape) != (B, S):
            raise ValueError(f"attention_mask must have shape {(B, S)} (cached + new tokens), "
                             f"got {tuple(attention_mask.shape)}")
        if doc_ids is not None:
            if cache is not None:
                raise ValueError("doc_ids (packed documents) cannot be combined with a KV cache")
            if tuple(doc_ids.shape) != (B, T):
                raise ValueError(f"doc_ids must have shape {(B, T)}, got {tuple(doc_ids.shape)}")
        if cache is not None and S > cache.max_len:
            raise ValueError(f"KV cache is full: {S} tokens do not fit in its {cache.max_len} positions")
        mask = AttentionMask(causal=True, q_offset=offset,
                             key_valid=None if attention_mask is None else attention_mask.bool(),
                             doc_ids=doc_ids)
        x = self.tok_embeddings(tokens)  # (B, T, D)
        for i, block in enumerate(self.layers):
            x = block(x, positions=positions, mask=mask, cache=None if cache is None else cache.layers[i],
                      backend=backend)
        if cache is not None:
            cache.length = S
        return self.norm(x)  # (B, T, D)


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean next-token cross-entropy (nats); ``targets`` ``(B, T)`` already shifted."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
