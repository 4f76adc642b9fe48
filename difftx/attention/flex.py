"""The ``flex`` backend: differential attention through PyTorch's ``flex_attention``.

Why it is worth having: ``flex_attention`` accepts a value wider than the query/key
(``dv = 2d``), which the fast SDPA kernels refuse. Each component map is therefore one call
over ``H`` heads with ``d``-wide queries and keys and the shared ``2d``-wide value, GQA
included (``enable_gqa``), so the two calls together do the cost model's 1.5x the baseline's
FLOPs (SPEC section 6) where the ``sdpa`` backend's zero-padded single call does 2x. What
the fused ``triton`` kernel saves on top is the second pass over K/V.

Masks become a ``BlockMask``, which skips whole tiles outside the causal triangle and outside
packed documents instead of reading a dense ``(T, S)`` mask. Block masks for plain causal
shapes are cached; one built from per-batch tensors (padding, document ids) is kept for the
mask object it came from, so the layers of one forward pass share it.

On CUDA the function is compiled (``torch.compile``, the form ``flex_attention`` is made for);
elsewhere it runs PyTorch's eager reference implementation, which is correct but
materialises the scores and has no backward pass on CPU (PyTorch's limit): on CPU it serves
inference and tests, and ``chunked`` is faster. ``auto`` never picks ``flex``:
nothing has measured it faster yet (``difftx bench`` and ``benchmarks/gpu_attention.py`` list it).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from .masks import AttentionMask

_compiled = None
_causal_cache: dict[tuple, object] = {}
_last_batch_mask: tuple = (None, None, None)  # (mask object, key, BlockMask)


def available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # PyTorch before 2.5
        return False
    return True


def _flex_fn(device: torch.device, needs_grad: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cpu" and needs_grad:
        raise ValueError("the 'flex' backend has no backward pass on CPU (PyTorch's flex_attention computes "
                         "gradients on GPUs only); train on CPU with backend 'chunked' or 'auto'")
    if device.type != "cuda":
        return flex_attention
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def _mask_mod(mask: AttentionMask):
    """The mask as flex's ``mask_mod(b, h, q_idx, kv_idx) -> bool``, same semantics as
    :meth:`AttentionMask.dense` (a query always keeps its own key)."""
    off, causal, docs, valid = mask.q_offset, mask.causal, mask.doc_ids, mask.key_valid
    if valid is not None and valid.dtype != torch.bool:  # 0/1 in another dtype, as the other backends read it
        valid = valid != 0
    per_key = docs if docs is not None else valid
    last = per_key.shape[1] - 1 if per_key is not None else 0  # last index of the per-key tensors
    # a per-key tensor of one row serves every sequence (AttentionMask.check allows (1, S))
    row_d = 0 if docs is not None and docs.shape[0] == 1 else None
    row_v = 0 if valid is not None and valid.shape[0] == 1 else None

    def mod(b, h, q_idx, kv_idx):
        pos = q_idx + off
        allowed = kv_idx == kv_idx  # an all-True tensor of the right shape
        if causal:
            allowed = allowed & (kv_idx <= pos)
        # indices clamped for the lookups: flex may evaluate padding positions past the end
        if docs is not None:
            r = b if row_d is None else row_d
            allowed = allowed & (docs[r, pos.clamp(max=last)] == docs[r, kv_idx.clamp(max=last)])
        if valid is not None:
            allowed = allowed & valid[b if row_v is None else row_v, kv_idx.clamp(max=last)]
        return allowed | (kv_idx == pos)

    return mod


def block_mask(mask: AttentionMask, B: int, T: int, S: int, device: torch.device):
    """The ``BlockMask`` for ``mask`` with ``T`` queries and ``S`` keys; ``None`` if unmasked."""
    global _last_batch_mask
    from torch.nn.attention.flex_attention import create_block_mask

    if mask.is_unmasked():
        return None
    per_batch = mask.doc_ids is not None or mask.key_valid is not None
    key = (B if per_batch else None, T, S, mask.q_offset, mask.causal, str(device))
    if not per_batch:
        if key not in _causal_cache:
            if len(_causal_cache) >= 64:
                _causal_cache.clear()
            _causal_cache[key] = create_block_mask(_mask_mod(mask), None, None, T, S, device=device)
        return _causal_cache[key]
    held, held_key, bm = _last_batch_mask
    if held is not mask or held_key != key:
        bm = create_block_mask(_mask_mod(mask), B, None, T, S, device=device)
        _last_batch_mask = (mask, key, bm)
    return bm


def flex(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], mask: AttentionMask, scale: float,
         return_maps: bool = False):
    """Differential attention as two ``flex_attention`` calls sharing the value (one call for
    standard attention). Same contract as every kernel in :mod:`difftx.attention.kernels`."""
    if return_maps:
        raise ValueError("the 'flex' backend does not return attention maps; use backend='eager'")
    B, T, HC, d = q.shape
    S, Hkv = k.shape[1], v.shape[2]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, lam) if t is not None)
    fn = _flex_fn(q.device, needs_grad)
    bm = block_mask(mask, B, T, S, q.device)
    vt = v.transpose(1, 2)  # (B, Hkv, S, dv)

    def call(qc: Tensor, kc: Tensor) -> Tensor:  # qc (B, T, H, d), kc (B, S, Hkv, d) -> (B, H, T, dv)
        with warnings.catch_warnings():  # the eager fallback warns that it is not compiled
            warnings.simplefilter("ignore", UserWarning)
            return fn(qc.transpose(1, 2), kc.transpose(1, 2), vt, block_mask=bm, scale=scale,
                      enable_gqa=qc.shape[2] != Hkv)

    if lam is None:
        return call(q, k).transpose(1, 2)
    H = HC // 2
    q2 = q.view(B, T, H, 2, d)  # sub-heads 2h, 2h+1 -> component 0, 1 of head h
    k2 = k.view(B, S, Hkv, 2, d)
    dt = torch.promote_types(v.dtype, torch.float32)
    lam = lam.repeat_interleave(B // lam.shape[0]).view(-1, 1, 1, 1) if lam.dim() else lam  # per group of sequences
    out = call(q2[..., 0, :], k2[..., 0, :]).to(dt) - lam.to(dt) * call(q2[..., 1, :], k2[..., 1, :]).to(dt)
    return out.to(v.dtype).transpose(1, 2)  # (B, T, H, 2d)
