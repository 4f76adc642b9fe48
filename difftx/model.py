"""The decoder-only language model (SPEC section 3). DIFF and baseline share everything here;
only the attention module differs, picked by ``ModelConfig.attention``.

Legend: ``B`` batch, ``T`` new tokens, ``S`` cached + new tokens, ``D`` model width,
``V`` vocabulary.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import ATTENTIONS, AttentionMask, DiffAttention, LayerKV
from .config import ModelConfig
from .ops import linear, rms_norm, swiglu


def make_attention(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s attention module: the kind ``config.attention`` names in :data:`ATTENTIONS`."""
    return ATTENTIONS[config.attention].from_config(config, layer_idx)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; the weights may be stacked (:mod:`difftx.ops`)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        """``residual + down(...)`` (a stack adds it inside its batched product)."""
        return linear(swiglu(linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)),
                      self.down_proj.weight, residual)


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose gain may be stacked (:func:`difftx.ops.rms_norm`)."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    """Pre-norm block: ``x + Attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = make_attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.dim, eps=config.norm_eps)
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
            self.layers.append(LayerKV.empty(batch_size, max_len, k_shape, v_shape, device=device, dtype=dtype,
                                             v_parts=block.attn.cache_value_parts(device)))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"Transformer expects a ModelConfig, got {type(config).__name__}")
        self.config = config
        base = self._draw_base()  # before any module draws from the global RNG (see reset_parameters)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.reset_parameters(base)

    @staticmethod
    def _draw_base() -> int:
        # the CPU generator, also when the model is built under a meta device
        return int(torch.randint(0, 2**62, (1,), device="cpu").item())

    def reset_parameters(self, base: Optional[int] = None) -> None:
        """Normal(0, init_std) linears and embeddings; unit norm gains; lambda ~ N(0, 0.1).

        Paired initialisation: one number ``base`` is drawn from the global RNG (by the
        constructor, before anything else draws), and every parameter is then drawn from its own
        generator seeded by ``base`` and the parameter's name. So after ``torch.manual_seed(s)`` a
        DIFF model and its baseline (or any other arm) hold identical values in every parameter with
        the same name and shape (embeddings, projections, MLP, head), which takes initialisation
        noise out of their paired difference."""
        base = self._draw_base() if base is None else base
        std = self.config.init_std
        owners = {f"{n}.{k}" if n else k: m for n, m in self.named_modules()
                  for k, _ in m.named_parameters(recurse=False)}
        for name, p in self.named_parameters():
            m = owners[name]
            if p.is_meta:  # built to be loaded into (checkpoint loading): nothing to draw
                continue
            with torch.no_grad():
                if isinstance(m, nn.RMSNorm):
                    p.fill_(1.0)
                    continue
                sd = 0.1 if isinstance(m, DiffAttention) and name.rsplit(".", 1)[-1].startswith("lambda_") else std
                g = torch.Generator().manual_seed((base + zlib.crc32(name.encode()) * 1_000_003) % 2**63)
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32, device="cpu").mul_(sd))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: Tensor, *, positions: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None, doc_ids: Optional[Tensor] = None,
                cache: Optional[KVCache] = None, backend: Optional[str] = None,
                logits_at: Optional[Tensor] = None) -> Tensor:
        """Logits ``(B, T, V)`` for ``tokens`` ``(B, T)``: ``lm_head(hidden(...))``, arguments as
        in :meth:`hidden`.

        ``logits_at`` ``(B, T)`` bool: return only the logits at its True positions, ``(N, V)`` in
        row-major order (equal to ``forward(...)[logits_at]``), running the LM head on those ``N``
        positions alone. A loss on a few positions per sequence (answer tokens) then skips most of
        the head's work; being part of ``forward``, it also works through DDP / FSDP2 wrappers."""
        h = self.hidden(tokens, positions=positions, attention_mask=attention_mask, doc_ids=doc_ids, cache=cache,
                        backend=backend)  # (B, T, D)
        if logits_at is not None:
            if logits_at.dtype != torch.bool or tuple(logits_at.shape) != tuple(tokens.shape):
                raise ValueError(f"logits_at must be a bool tensor of shape {tuple(tokens.shape)}, got "
                                 f"{logits_at.dtype} {tuple(logits_at.shape)}")
            h = h[logits_at]  # (N, D)
        return self.lm_head(h)  # (B, T, V), or (N, V) with logits_at

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
        if not isinstance(tokens, Tensor):
            raise TypeError(f"tokens must be a torch.Tensor of token ids (batch, time), got {type(tokens).__name__}; "
                            "wrap it: torch.tensor(ids, dtype=torch.long)")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, time), got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if T == 0:
            raise ValueError("tokens: a sequence needs at least one token, got shape (batch, 0)")
        weight = self.tok_embeddings.weight
        if tokens.device != weight.device and weight.device.type != "meta":
            raise ValueError(f"tokens are on {tokens.device} but the model is on {weight.device}; "
                             f"move one of them (tokens.to({str(weight.device)!r}))")
        _check_token_ids(tokens, self.config.vocab_size)
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


def _check_token_ids(tokens: Tensor, vocab_size: int) -> None:
    """ValueError unless every id is in ``[0, vocab_size)``: one min/max reduction (skipped while
    torch.compile traces), instead of torch's index error (a device assert on a GPU)."""
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.numel() == 0 or tokens.device.type == "meta" or torch.compiler.is_compiling():
        return
    lo, hi = (int(x) for x in torch.aminmax(tokens))
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"tokens: ids must be in [0, vocab_size={vocab_size}), got min {lo} and max {hi}")


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean next-token cross-entropy (nats); ``targets`` ``(B, T)`` already shifted."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
