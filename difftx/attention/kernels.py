"""Attention kernels: plain functions with one signature, chosen by name.

Every kernel computes the attention *core* for both attention kinds:

``kernel(q, k, v, lam, mask, scale, return_maps=False)``

Notation: ``B`` batch, ``T`` queries, ``S`` keys, ``H`` output heads, ``Hkv`` key/value
groups, ``R = H // Hkv`` heads per group, ``d`` query/key width, ``C`` maps per head
(2 for differential attention, 1 for standard attention).

- Standard attention (``lam is None``): ``q (B, T, H, d)``, ``k (B, S, Hkv, d)``,
  ``v (B, S, Hkv, dv)``; head ``h`` uses group ``h // R``. Returns ``(B, T, H, dv)``.
- Differential attention (``lam`` a float32 scalar tensor, or ``(G,)``: one per group of ``B / G``
  consecutive sequences, a stack's models): ``q (B, T, 2H, d)`` with
  sub-heads ``2h`` / ``2h+1`` the two components of head ``h``; ``k (B, S, 2Hkv, d)`` paired
  the same way per group; ``v (B, S, Hkv, 2d)``. Head ``h`` uses keys ``2g``, ``2g+1`` and
  value ``g`` with ``g = h // R``. Returns ``(A1 - lam * A2) V`` as ``(B, T, H, 2d)``; the
  per-head norm is the module's job. The value may have any width ``dv`` (a converted model's
  heads, :mod:`difftx.attention.converted`, have ``dv = d``); only the fused ``triton`` kernel
  needs ``2d`` and hands other widths to ``sdpa``.

Split values: a KV cache may hold each value row as ``P`` contiguous pieces (``LayerKV`` with
``v_parts``) and hand over ``v (B, S, Hkv, P, dv / P)``; a kernel whose ``split_values``
attribute is true (``eager``) reads that form directly, every other kernel gets the joined
``(B, S, Hkv, dv)`` values from the module.

Softmax and ``lam`` are applied in float32 (float64 for float64 inputs) whatever the input dtype. ``eager`` is the
oracle every other kernel is tested against; with ``return_maps=True`` it also returns an
:class:`AttentionMaps` (pre-softmax logits and maps) for analysis.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import flex as _flex
from ..ops import batch_first, is_mapped, records_grad
from .masks import AttentionMask



_WIDE = (torch.float32, torch.float64)  # dtypes whose softmax runs in their own precision


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax/lambda precision: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class AttentionMaps:
    """Intermediates of one attention call (eager kernel only), in float32 (or float64).

    ``logits``: ``(B, C*H, T, S)`` scaled pre-softmax logits, sub-heads in projection order
    (``2h + c`` for differential attention); masked entries are ``-inf``.
    ``probs``: softmax of ``logits``, same layout.
    ``effective``: ``(B, H, T, S)`` map applied to the values: ``A1 - lam * A2`` for
    differential attention, ``probs`` for standard attention.
    """

    logits: Tensor
    probs: Tensor
    effective: Tensor


def per_sequence(lam: Tensor, batch: int, dims: int) -> Tensor:
    """``lam`` against a tensor of ``dims`` dimensions whose first is the ``batch``: a scalar as it is; one
    lambda per group of consecutive sequences ``(G,)`` (a stack's models) as ``(batch, 1, ..., 1)``."""
    if lam.dim() == 0:
        return lam
    return lam.repeat_interleave(batch // lam.shape[0]).view(-1, *([1] * (dims - 1)))


def _group_views(q: Tensor, k: Tensor, v: Tensor, diff: bool):
    """Arrange inputs by kv group: q -> (B, Hkv, C, R, T, d), k -> (B, Hkv, C, S, d),
    v -> (B, Hkv, S, dv), or split values ``(B, S, Hkv, P, e)`` -> (B, Hkv, P, S, e). Views only (no copies)."""
    C = 2 if diff else 1
    B, T, HC, d = q.shape
    S = k.shape[1]
    Hkv = v.shape[2]
    R = HC // (C * Hkv)
    qg = q.view(B, T, Hkv, R, C, d).permute(0, 2, 4, 3, 1, 5)  # (B, Hkv, C, R, T, d)
    kg = k.view(B, S, Hkv, C, d).permute(0, 2, 3, 1, 4)  # (B, Hkv, C, S, d)
    vg = v.transpose(1, 2) if v.dim() == 4 else v.permute(0, 2, 3, 1, 4)  # (B, Hkv, S, dv) / (B, Hkv, P, S, e)
    return qg, kg, vg


def _core(qg: Tensor, kg: Tensor, vg: Tensor, lam: Optional[Tensor], allowed: Optional[Tensor], scale: float,
          logits_fn: Optional[Callable[[Tensor], Tensor]] = None):
    """Materialised attention for one block of query rows.

    qg (B, Hkv, C, R, t, d), kg (B, Hkv, C, s, d), vg (B, Hkv, s, dv) or split (B, Hkv, P, s, dv / P),
    allowed (B|1, t, s).
    ``logits_fn``: applied to the scaled, masked float32 logits before the softmax (an analysis
    hook, e.g. low-bit quantisation; it sees the (B, Hkv, C, R, t, s) layout).
    Returns out (B, Hkv, R, t, dv) (split values: a (B, Hkv, R, t, P, dv / P) view) and the float32
    logits, probs (B, Hkv, C, R, t, s) and effective map (B, Hkv, R, t, s).
    """
    B, Hkv, C, R, t, d = qg.shape
    s = kg.shape[-2]
    # all R heads of a group share one key matrix: fold them into the rows of one matmul
    scores = torch.matmul(qg.reshape(B, Hkv, C, R * t, d), kg.transpose(-1, -2))  # (B, Hkv, C, R*t, s)
    acc = _acc_dtype(scores.dtype)
    logits = scores.view(B, Hkv, C, R, t, s)
    logits = (logits if logits.dtype == acc else logits.to(acc)) * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed[:, None, None, None], float("-inf"))
    if logits_fn is not None:
        logits = logits_fn(logits)
    probs = torch.softmax(logits, dim=-1)
    # (B, Hkv, R, t, s): A1 - lam * A2 in one pass
    eff = probs[:, :, 0] if lam is None else torch.addcmul(probs[:, :, 0], probs[:, :, 1], per_sequence(lam, B, 5),
                                                           value=-1)
    effv = (eff if eff.dtype == vg.dtype else eff.to(vg.dtype)).reshape(B, Hkv, R * t, s)
    if vg.dim() == 4:
        out = torch.matmul(effv, vg).view(B, Hkv, R, t, -1)
    else:  # split values: one e-wide product per piece over contiguous rows, the pieces side by side
        P, e = vg.shape[2], vg.shape[-1]
        out = torch.matmul(effv[:, :, None], vg)  # (B, Hkv, P, R*t, e)
        out = out.view(B, Hkv, P, R, t, e).permute(0, 1, 3, 4, 2, 5)  # (B, Hkv, R, t, P, e), a view
    return out, logits, probs, eff


def _merge_heads(out: Tensor) -> Tensor:
    """(B, Hkv, R, T, dv) -> (B, T, H, dv); split (B, Hkv, R, T, P, e) -> (B, T, H, P*e). One copy."""
    B, Hkv, R, T = out.shape[:4]
    return out.transpose(2, 3).transpose(1, 2).reshape(B, T, Hkv * R, -1)


def _values(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], allowed: Optional[Tensor], scale: float) -> Tensor:
    """:func:`eager`'s output without autograd, maps or a logits hook, in fewer calls: the same products, scale,
    softmax and ``A1 - lam * A2`` (so the same values), as three-dimensional ``bmm`` calls on views of a cache's
    head-major buffers (a decoding step costs a fixed number of small calls; docs/kernels.md, "Decode step")."""
    B, T, HC, d = q.shape
    S = k.shape[1]
    C = 1 if lam is None else 2
    Hkv = v.shape[2]
    R = HC // (C * Hkv)
    one = R * T == 1  # one query row per kv group and component (decoding without GQA): the rows are in place
    qg = q.reshape(B * Hkv * C, 1, d) if one else \
        q.view(B, T, Hkv, R, C, d).permute(0, 2, 4, 3, 1, 5).reshape(B * Hkv * C, R * T, d)
    scores = torch.bmm(qg, k.permute(0, 2, 3, 1).flatten(0, 1)).mul_(scale)  # (B*Hkv*C, R*T, S)
    if allowed is not None:
        scores.view(B, Hkv * C, R, T, S).masked_fill_(~allowed[:, None, None], float("-inf"))
    maps = torch.softmax(scores, dim=-1).view(B, Hkv, C, R * T, S).unbind(2)
    eff = maps[0] if lam is None else torch.addcmul(maps[0], maps[1], per_sequence(lam, B, 4), value=-1)
    if v.dim() == 4:  # eff: (B, Hkv, R*T, S)
        out = torch.bmm(eff.reshape(B * Hkv, R * T, S), v.transpose(1, 2).flatten(0, 1))  # (B*Hkv, R*T, dv)
        return out.view(B, 1, Hkv, -1) if one else \
            out.view(B, Hkv, R, T, -1).permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * R, -1)
    P, e = v.shape[3], v.shape[4]  # split values: one e-wide product per piece, the pieces side by side
    out = torch.bmm(eff.unsqueeze(2).expand(B, Hkv, P, R * T, S).reshape(B * Hkv * P, R * T, S),
                    v.permute(0, 2, 3, 1, 4).flatten(0, 2))  # (B*Hkv*P, R*T, e)
    return out.view(B, 1, Hkv, P * e) if one else \
        out.view(B, Hkv, P, R, T, e).permute(0, 4, 1, 3, 2, 5).reshape(B, T, Hkv * R, P * e)


def eager(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False,
          logits_fn: Optional[Callable[[Tensor], Tensor]] = None):
    """The oracle: both maps materialised in one piece, O(T*S) memory per head. ``logits_fn``
    transforms the pre-softmax logits (see :func:`_core`; used by low-bit analysis kernels)."""
    T, S = q.shape[1], k.shape[1]
    if (not return_maps and logits_fn is None and q.dtype in _WIDE
            and not (torch.is_grad_enabled() and records_grad(*(t for t in (q, k, v, lam) if t is not None)))
            and not is_mapped(q)):
        return _values(q, k, v, lam, mask.dense(T, S, q.device), scale)
    qg, kg, vg = _group_views(q, k, v, lam is not None)
    out, logits, probs, eff = _core(qg, kg, vg, lam, mask.dense(T, S, q.device), scale, logits_fn)
    out = _merge_heads(out)
    if not return_maps:
        return out
    B, Hkv, C, R = logits.shape[:4]
    # sub-head order of the projections: head h = g*R + r, component c -> index (h*C + c)
    to_proj = lambda x: x.permute(0, 1, 3, 2, 4, 5).reshape(B, Hkv * R * C, T, S)  # noqa: E731
    return out, AttentionMaps(to_proj(logits), to_proj(probs), eff.reshape(B, Hkv * R, T, S))


eager.split_values = True  # reads a cache's split value rows in place (see the module doc)


# Query rows per block in the chunked kernel (see ``chunked``); 128 measured best on CPU.
CHUNK_ROWS = 128
# Blocks of the chunked kernel with at most this many keys keep their softmax maps for the backward pass;
# longer blocks recompute them there (one more QK^T product and softmax per block), so that training memory
# grows linearly in T: at most ``STORE_MAX_KEYS`` stored scores per query row and sub-head.
STORE_MAX_KEYS = 256

_bias_cache: dict = {}


def _diag_bias(t: int, R: int, device, dtype) -> Tensor:
    """Additive causal mask ``(t*R, t)`` of a block's diagonal keys, rows in ``(t, R)`` order:
    0 where key ``j <= `` query row ``i``, ``-inf`` above the diagonal. Cached per shape."""
    key = (t, R, device, dtype)
    bias = _bias_cache.get(key)
    if bias is None:
        if len(_bias_cache) > 64:
            _bias_cache.clear()
        tri = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
        bias = torch.zeros(t, t, dtype=dtype, device=device).masked_fill_(tri, float("-inf"))
        bias = _bias_cache[key] = bias.repeat_interleave(R, dim=0)
    return bias


class _Blocks:
    """The chunked kernel's tensors in 3-D batched form and its per-block products.

    ``q3 (B*Hkv*C, T*R, d)`` (rows of a block of ``t`` queries of all ``R`` heads of a group are
    contiguous), ``k3 (B*Hkv*C, S, d)``, ``v3 (B*Hkv, S, dv)``; scores are scaled inside the
    matmul (``alpha``), so q is not copied a second time.
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], mask: AttentionMask, scale: float):
        self.diff = lam is not None
        C = self.C = 2 if self.diff else 1
        B, T, HC, d = q.shape
        S, Hkv, dv = k.shape[1], v.shape[2], v.shape[3]
        R = self.R = HC // (C * Hkv)
        self.shape = (B, T, S, Hkv, d, dv)
        self.q3 = q.view(B, T, Hkv, R, C, d).permute(0, 2, 4, 1, 3, 5).reshape(B * Hkv * C, T * R, d)
        self.k3 = k.view(B, S, Hkv, C, d).permute(0, 2, 3, 1, 4).reshape(B * Hkv * C, S, d)
        self.v3 = v.transpose(1, 2).reshape(B * Hkv, S, dv)
        self.acc = _acc_dtype(q.dtype)
        self.fast = q.dtype == self.acc  # float32/float64: scores and maps in the input dtype, no casts
        self.mask, self.scale = mask, scale
        self.plain = mask.is_plain_causal(T, S)
        self.neg_lam = None
        self.groups = 0 if not self.diff or lam.dim() == 0 else lam.shape[0]  # one lambda per group of sequences
        if self.diff:  # a scalar, or per group: then (B*Hkv, 1, 1) against a map's rows
            neg = -lam.detach()
            neg = neg if neg.dtype == self.acc else neg.to(self.acc)
            self.neg_lam = neg if not self.groups else neg.repeat_interleave(B * Hkv // self.groups).view(-1, 1, 1)

    def keys(self, r0: int, r1: int) -> int:
        """Keys a block of query rows ``r0:r1`` can see (causal: up to its last row)."""
        B, T, S = self.shape[:3]
        return min(S, self.mask.q_offset + r1) if self.mask.causal else S

    def probs(self, r0: int, r1: int, s: int) -> Tensor:
        """Softmax maps ``(B*Hkv*C, t*R, s)`` of query rows ``r0:r1`` over keys ``0..s-1``."""
        R, t = self.R, r1 - r0
        qb, kb = self.q3[:, r0 * R:r1 * R], self.k3[:, :s].transpose(1, 2)
        if self.fast:
            if self.plain and s == t:  # the whole block is the diagonal: mask added by the matmul itself
                logits = torch.baddbmm(_diag_bias(t, R, qb.device, qb.dtype), qb, kb, alpha=self.scale)
            else:
                logits = qb.new_empty(qb.shape[0], qb.shape[1], s).baddbmm_(qb, kb, beta=0.0, alpha=self.scale)
                self._mask(logits, r0, r1, s)
        else:
            logits = torch.bmm(qb, kb).to(self.acc).mul_(self.scale)
            self._mask(logits, r0, r1, s)
        return torch.softmax(logits, dim=-1)

    def _mask(self, logits: Tensor, r0: int, r1: int, s: int) -> None:
        B, T, S = self.shape[:3]
        R, t = self.R, r1 - r0
        if self.plain:
            logits[:, :, r0:s].add_(_diag_bias(t, R, logits.device, logits.dtype))
            return
        allowed = self.mask.dense(T, S, logits.device, rows=slice(r0, r1), keys=s)  # (B|1, t, s)
        if allowed is None:
            return
        b = allowed.shape[0]
        view = logits.view(b, -1, t, R, s)  # the batch is outermost in logits' first dimension
        view.masked_fill_(~allowed[:, None, :, None, :], float("-inf"))

    def effective(self, probs: Tensor) -> Tensor:
        """``(B*Hkv, t*R, s)``: ``A1 - lam * A2`` (differential) or the map itself, in the values' dtype."""
        if self.diff:
            p = probs.unflatten(0, (-1, 2))
            eff = torch.addcmul(p[:, 0], p[:, 1], self.neg_lam)
        else:
            eff = probs
        return eff if eff.dtype == self.v3.dtype else eff.to(self.v3.dtype)


def _chunked_forward(bl: _Blocks, rows: int, keep: bool):
    """Output ``(B*Hkv, T*R, dv)`` and, if ``keep``, the blocks ``[(r0, r1, s, (probs, effective) or None)]``
    (maps stored only for blocks of at most :data:`STORE_MAX_KEYS` keys)."""
    B, T, S, Hkv, d, dv = bl.shape
    R = bl.R
    out = bl.v3.new_empty(B * Hkv, T * R, dv)
    blocks = []
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        s = bl.keys(r0, r1)
        probs = bl.probs(r0, r1, s)
        eff = bl.effective(probs)
        torch.bmm(eff, bl.v3[:, :s], out=out[:, r0 * R:r1 * R])
        if keep:
            blocks.append((r0, r1, s, (probs, eff) if s <= STORE_MAX_KEYS else None))
    return out, blocks


class _ChunkedAttention(torch.autograd.Function):
    """Blocked materialised attention with a hand-written backward (see :func:`chunked`). ``lam``: None,
    a scalar, or one lambda per group of sequences ``(G,)``; the mask as its tensors (``key_valid``, ``doc_ids``)
    and flags. Under ``torch.vmap`` the mapped dimension joins the batch (``K`` models' sequences in one
    call, each model's lambda for its own sequences)."""

    @staticmethod
    def forward(q, k, v, lam, key_valid, doc_ids, causal, q_offset, scale, rows, keep=True):
        mask = AttentionMask(causal=causal, q_offset=q_offset, key_valid=key_valid, doc_ids=doc_ids)
        bl = _Blocks(q, k, v, lam, mask, scale)
        out, blocks = _chunked_forward(bl, rows, keep=keep)
        return _out_layout(bl, out), (bl, blocks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.bl, ctx.blocks = output[1]
        lam = inputs[3]
        ctx.lam_dtype = None if lam is None else lam.dtype

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _):
        bl, blocks = ctx.bl, ctx.blocks
        B, T, S, Hkv, d, dv = bl.shape
        R, C, scale = bl.R, bl.C, bl.scale
        do3 = dout.view(B, T, Hkv, R, dv).transpose(1, 2).reshape(B * Hkv, T * R, dv)
        if do3.dtype != bl.v3.dtype:
            do3 = do3.to(bl.v3.dtype)
        dq3 = torch.empty_like(bl.q3)
        dk3 = torch.empty_like(bl.k3)
        dv3 = torch.empty_like(bl.v3)
        G = bl.groups
        dlam = bl.neg_lam.new_zeros(G if G else ()) if bl.diff else None
        first = True
        for r0, r1, s, stored in reversed(blocks):  # the last block sees all S keys: it initialises dk, dv
            t = r1 - r0
            rows = slice(r0 * R, r1 * R)
            beta = 0.0 if first else 1.0
            if first and s < S:  # keys no query row sees
                dk3[:, s:].zero_()
                dv3[:, s:].zero_()
            first = False
            if stored is None:  # recomputed: the same operations as in forward, so the same maps
                probs = bl.probs(r0, r1, s)
                eff = bl.effective(probs)
            else:
                probs, eff = stored
            dob = do3[:, rows]  # (B*Hkv, t*R, dv)
            dv3[:, :s].baddbmm_(eff.transpose(1, 2), dob, beta=beta)
            deff = torch.bmm(dob, bl.v3[:, :s].transpose(1, 2))  # (B*Hkv, t*R, s): dL/d(effective map)
            if deff.dtype != probs.dtype:
                deff = deff.to(probs.dtype)
            # softmax backward, public form: dS = dP*P - P*rowsum(dP*P); for the two maps of a differential
            # head dP1 = deff and dP2 = -lam * deff, and the formula is linear in dP
            p = probs.view(B * Hkv, C, t * R, s)
            ds = p * deff[:, None]  # (B*Hkv, C, t*R, s)
            rsum = ds.sum(-1, keepdim=True)  # (B*Hkv, C, t*R, 1)
            ds.addcmul_(p, rsum, value=-1.0)
            if bl.diff:
                ds[:, 1].mul_(bl.neg_lam)
                dlam -= rsum[:, 1].reshape(G, -1).sum(1) if G else rsum[:, 1].sum()  # -sum(deff * A2)
            ds = ds.view(B * Hkv * C, t * R, s)
            if ds.dtype != bl.q3.dtype:
                ds = ds.to(bl.q3.dtype)
            dq3[:, rows].baddbmm_(ds, bl.k3[:, :s], beta=0.0, alpha=scale)
            dk3[:, :s].baddbmm_(ds.transpose(1, 2), bl.q3[:, rows], beta=beta, alpha=scale)
        dq = dq3.view(B, Hkv, C, T, R, d).permute(0, 3, 1, 4, 2, 5).reshape(B, T, Hkv * R * C, d)  # (B, T, HC, d)
        dk = dk3.view(B, Hkv, C, S, d).permute(0, 3, 1, 2, 4).reshape(B, S, Hkv * C, d)  # (B, S, Hkv*C, d)
        dvg = dv3.view(B, Hkv, S, dv).transpose(1, 2)  # (B, S, Hkv, dv)
        if dlam is not None and dlam.dtype != ctx.lam_dtype:
            dlam = dlam.to(ctx.lam_dtype)
        return dq, dk, dvg, dlam, None, None, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, lam, key_valid, doc_ids, causal, q_offset, scale, rows, keep=True):
        K = info.batch_size
        q, k, v = (t.flatten(0, 1) for t in batch_first(info, in_dims[:3], q, k, v))  # (K*B, ...)
        B = q.shape[0] // K
        if lam is not None and in_dims[3] is not None:  # each model's lambda for its group of sequences
            lam = lam.movedim(in_dims[3], 0)
            if lam.dim() > 1:  # already one per group inside each model: K * G groups
                lam = lam.flatten()
        masks = []
        for t, dim in ((key_valid, in_dims[4]), (doc_ids, in_dims[5])):
            if t is not None and (dim is not None or t.shape[0] != 1):
                t = batch_first(info, (dim,), t)[0]
                t = t.expand(K, B, *t.shape[2:]).reshape(K * B, *t.shape[2:])
            masks.append(t)
        out, saved = _ChunkedAttention.apply(q, k, v, lam, *masks, causal, q_offset, scale, rows, keep)
        return (out.unflatten(0, (K, B)), saved), (0, None)


def _out_layout(bl: _Blocks, out: Tensor) -> Tensor:
    """``(B*Hkv, T*R, dv)`` -> ``(B, T, H, dv)``."""
    B, T, S, Hkv, d, dv = bl.shape
    return out.view(B, Hkv, T, bl.R, dv).transpose(1, 2).reshape(B, T, Hkv * bl.R, dv)


def chunked(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False):
    """Materialised attention in blocks of ``CHUNK_ROWS`` query rows, with its own backward.

    Under a causal mask a block needs only the keys up to its last row, so the work is
    about half of ``eager``'s, and each block's maps stay small enough for the CPU caches.
    This is the fastest form measured on CPU (see ``benchmarks/attention.py``). Training memory
    is linear in ``T``: blocks of more than ``STORE_MAX_KEYS`` keys recompute their maps in the
    backward pass instead of keeping them; without gradients nothing is kept at all.
    """
    if return_maps:
        raise ValueError("the 'chunked' backend does not return attention maps; use backend='eager'")
    grad = records_grad(*(t for t in (q, k, v, lam) if t is not None))
    if not grad and not is_mapped(q):  # inference: the plain forward, nothing kept, no autograd node
        bl = _Blocks(q, k, v, lam, mask, scale)
        return _out_layout(bl, _chunked_forward(bl, CHUNK_ROWS, keep=False)[0])
    return _ChunkedAttention.apply(q, k, v, lam, mask.key_valid, mask.doc_ids, mask.causal, mask.q_offset, scale,
                                   CHUNK_ROWS, grad)[0]  # maps kept for a backward only


def _sdpa_mask(mask: AttentionMask, T: int, S: int, device):
    """``(is_causal, attn_mask)`` for SDPA: the causal flag only for plain causal self-attention (SDPA aligns its
    causal mask to the top left when ``T != S``), else the dense mask as ``(B|1, 1, T, S)`` (or None)."""
    plain = mask.is_plain_causal(T, S)
    attn_mask = None if plain else mask.dense(T, S, device)
    return plain, None if attn_mask is None else attn_mask[:, None]


def sdpa_pad(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False):
    """SDPA form ``pad``: one ``scaled_dot_product_attention`` call over all ``2H`` sub-heads.

    Standard attention is one call. For differential attention q and k are zero-padded to the value's width
    ``dv`` (dot products unchanged) and the value is expanded to ``2Hkv`` heads: three copies, and at ``dv = 2d``
    twice the baseline's matmul FLOPs at head width ``2d``, but one softmax per map. A value as wide as q and k
    (a converted model's, ``dv = d``) needs no padding.
    """
    if return_maps:
        raise ValueError("the 'sdpa' backend does not return attention maps; use backend='eager'")
    B, T, HC, d = q.shape
    S = k.shape[1]
    plain, attn_mask = _sdpa_mask(mask, T, S, q.device)
    if lam is None:
        Hkv = k.shape[2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=attn_mask, is_causal=plain, scale=scale, enable_gqa=HC != Hkv,
        )  # (B, H, T, dv)
        return out.transpose(1, 2)
    Hkv, dv = v.shape[2], v.shape[3]  # dv: 2d (DIFF), d (a converted model)
    H, R = HC // 2, HC // (2 * Hkv)
    # component-major order, so that SDPA's GQA rule (query i -> kv i // R) pairs correctly
    qc = q.view(B, T, Hkv, R, 2, d).permute(0, 4, 2, 3, 1, 5).reshape(B, 2 * H, T, d)  # (B, 2H, T, d)
    kc = k.view(B, S, Hkv, 2, d).permute(0, 3, 2, 1, 4).reshape(B, 2 * Hkv, S, d)  # (B, 2Hkv, S, d)
    vc = v.transpose(1, 2).unsqueeze(1).expand(B, 2, Hkv, S, dv).reshape(B, 2 * Hkv, S, dv)
    if dv > d:  # q and k zero-padded to the value's width: dot products unchanged
        qc, kc = F.pad(qc, (0, dv - d)), F.pad(kc, (0, dv - d))
    out = F.scaled_dot_product_attention(
        qc, kc, vc, attn_mask=attn_mask, is_causal=plain, scale=scale, enable_gqa=R > 1,
    ).view(B, 2, H, T, dv)
    dt = _acc_dtype(out.dtype)
    out = out[:, 0].to(dt) - per_sequence(lam, B, 4).to(dt) * out[:, 1].to(dt)  # (B, H, T, dv)
    return out.to(v.dtype).transpose(1, 2)


def _by_component(q, k, v, lam, mask: AttentionMask, scale: float, width: int, name: str, return_maps: bool):
    """Differential attention as two SDPA calls per ``width``-wide piece of the value, one per map, on views.

    ``q[:, :, c::2]`` (a view, by ``unbind``) is component ``c`` of every head in head order ``h = g*R + r``
    (so SDPA's GQA rule, query head ``h`` -> kv head ``h // R``, pairs it with ``k[:, :, c::2]``'s group ``g``);
    the value's pieces are slices of its last dimension. Nothing is padded, expanded or copied before the kernel.
    Each piece's two outputs are combined as ``O1 - lam * O2`` in float32 (float64 for float64 inputs); the
    pieces are joined along the last dimension (the only copy: the result, ``(B, T, H, dv)``).
    """
    if return_maps:
        raise ValueError(f"the {name!r} backend does not return attention maps; use backend='eager'")
    if lam is None:  # standard attention: the one call of every form
        return sdpa_pad(q, k, v, None, mask, scale)
    B, T, HC, d = q.shape
    S, Hkv = k.shape[1], v.shape[2]
    gqa = HC != 2 * Hkv
    plain, attn_mask = _sdpa_mask(mask, T, S, q.device)
    # (B, H, T, d) / (B, Hkv, S, d) views; unbind's backward writes both components' gradients in one pass
    qs = [t.transpose(1, 2) for t in q.unflatten(2, (HC // 2, 2)).unbind(3)]
    ks = [t.transpose(1, 2) for t in k.unflatten(2, (Hkv, 2)).unbind(3)]
    lam_b = per_sequence(lam, B, 4)  # against (B, H, T, w)
    pieces = []
    for vj in v.transpose(1, 2).split(width, dim=-1):  # (B, Hkv, S, w) views
        o1, o2 = (F.scaled_dot_product_attention(qs[c], ks[c], vj, attn_mask=attn_mask, is_causal=plain,
                                                 scale=scale, enable_gqa=gqa) for c in (0, 1))  # (B, H, T, w)
        dt = _acc_dtype(o1.dtype)
        out = torch.addcmul(o1.to(dt), o2, lam_b.to(dt), value=-1)  # O1 - lam * O2, o2 read in its own dtype
        pieces.append(out.to(v.dtype).transpose(1, 2))  # (B, T, H, w)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def sdpa_halves(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False):
    """SDPA form ``halves``: four calls at head width ``d``, one per map and ``d``-wide half of the value, each
    over ``H`` heads (views of q, k and v; see :func:`_by_component`). Twice the baseline's FLOPs, at the
    baseline's own head width ``d`` and so its own kernel.

    Both halves in one call would need the value halves as ``2Hkv`` kv heads and each key head repeated for both
    (a stride-0 head dimension no single view expresses): a copy of k. Two calls over all ``2H`` sub-heads (the
    maps as heads) would need each value half expanded to ``2Hkv`` heads (a copy of v) and, with GQA, q reordered
    (a copy of q). So the four-call form, with no copies, is kept."""
    return _by_component(q, k, v, lam, mask, scale, q.shape[-1], "sdpa_halves", return_maps)


def sdpa_wide(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False):
    """SDPA form ``wide``: two calls, one per map, q and k of width ``d`` against the whole ``dv``-wide value
    (views; see :func:`_by_component`): 1.5x the baseline's FLOPs at ``dv = 2d``. On CUDA only kernels that take
    a value wider than q/k run it (cuDNN, up to 128; the memory-efficient kernel), so it is fast only where
    ``dv <= 128`` (``d <= 64``)."""
    return _by_component(q, k, v, lam, mask, scale, v.shape[-1], "sdpa_wide", return_maps)


# The forms of the ``sdpa`` backend, each also a backend of its own (``sdpa_<form>``).
SDPA_FORMS: dict[str, Callable[..., Tensor]] = {"pad": sdpa_pad, "halves": sdpa_halves, "wide": sdpa_wide}
# The form ``sdpa`` runs on CPU.
CPU_SDPA_FORM = "pad"


def sdpa(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False):
    """PyTorch ``scaled_dot_product_attention`` in the form measured fastest for the call.

    Standard attention is one call. Differential attention runs one of :data:`SDPA_FORMS`: on CUDA the one the
    measured table (:mod:`difftx.attention.gpu_table`) picks for the card, dtype, ``d``, ``T`` and whether
    gradients are recorded (``pad`` where nothing was measured); on CPU :data:`CPU_SDPA_FORM`.
    """
    if return_maps:
        raise ValueError("the 'sdpa' backend does not return attention maps; use backend='eager'")
    if lam is None:
        return sdpa_pad(q, k, v, None, mask, scale)
    return SDPA_FORMS[sdpa_form(q, k, v, lam)](q, k, v, lam, mask, scale)


def sdpa_form(q: Tensor, k: Tensor, v: Tensor, lam: Tensor) -> str:
    """The form ``sdpa`` runs for this differential-attention call: on CUDA the measured table's
    (:func:`difftx.attention.gpu_table.sdpa_form_for`), on CPU :data:`CPU_SDPA_FORM`."""
    if not q.is_cuda:
        return CPU_SDPA_FORM
    from . import gpu_table

    return gpu_table.sdpa_form_for(q, k, v, lam, SDPA_FORMS)


Kernel = Callable[..., object]

BACKENDS: dict[str, Kernel] = {"eager": eager, "chunked": chunked, "sdpa": sdpa,
                               **{f"sdpa_{form}": fn for form, fn in SDPA_FORMS.items()}}
if _flex.available():
    BACKENDS["flex"] = _flex.flex


# Backends that take only some calls: name -> ``declines(q, k, v, lam, mask)``, the reason it would hand this call
# to another kernel, or None where it takes it (the fused Triton kernels'); ``auto`` on CUDA passes over one that
# declines.
DECLINES: dict[str, Callable[..., Optional[str]]] = {}


def register_backend(name: str, fn: Kernel, declines: Optional[Callable[..., Optional[str]]] = None) -> None:
    """Add a kernel to the table (used by optional backends such as ``triton``); ``declines``: see
    :data:`DECLINES`."""
    BACKENDS[name] = fn
    if declines is not None:
        DECLINES[name] = declines
    else:
        DECLINES.pop(name, None)


def cuda_choice(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, mask: AttentionMask) -> str:
    """The backend ``auto`` runs for this differential-attention call on its CUDA card: the measured table's choice
    (:func:`difftx.attention.gpu_table.backend_for`) among the registered backends that take the call."""
    from . import gpu_table

    takes: dict = {}  # each check asked once per call (the fused kernels' three backends share one)
    for check in {id(f): f for f in DECLINES.values()}.values():
        takes[id(check)] = check(q, k, v, lam, mask) is None
    names = [n for n in BACKENDS if n not in DECLINES or takes[id(DECLINES[n])]]
    return gpu_table.backend_for(q, k, v, lam, names)


def auto_cuda(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False):
    """``auto`` on CUDA: the backend the measured table picks for the call (:func:`cuda_choice`); standard
    attention (``lam is None``) is ``sdpa``'s one call."""
    if return_maps:
        raise ValueError("the 'auto' backend on CUDA does not return attention maps; use backend='eager'")
    if lam is None:
        return sdpa(q, k, v, None, mask, scale)
    return BACKENDS[cuda_choice(q, k, v, lam, mask)](q, k, v, lam, mask, scale)


# Backends difftx knows by name even when their optional package is missing, so a config that
# names one stays loadable everywhere (it falls back to ``auto`` with a warning until then).
OPTIONAL_BACKENDS = {"triton": "needs the 'triton' package (pip install 'difftx[triton]') and a CUDA GPU",
                     "flex": "needs PyTorch 2.5 or later (torch.nn.attention.flex_attention)"}


def backend_names() -> list[str]:
    return ["auto", *BACKENDS, *(n for n in OPTIONAL_BACKENDS if n not in BACKENDS)]


def check_backend_name(name: str) -> None:
    if name not in backend_names():
        raise ValueError(f"backend: unknown attention backend {name!r}; choose one of {backend_names()}")


_warned: set[str] = set()


# ``auto`` on CPU: calls with at most this many query rows (decoding, short continuations) use
# ``eager``, longer ones ``chunked``, which was faster there from 64 rows on (measured: docs/results.md,
# "2026-11-27: Timings moved out of docstrings").
AUTO_EAGER_MAX_ROWS = 16


def resolve_backend(name: str, device: torch.device, q_len: Optional[int] = None) -> Kernel:
    """The kernel for ``name``; ``auto`` picks the fastest measured for the device: on CUDA a dispatcher that
    asks the measured table (:func:`auto_cuda`) at call time; on CPU by the number
    of query rows ``q_len`` of the call (:data:`AUTO_EAGER_MAX_ROWS`)."""
    check_backend_name(name)
    if name in BACKENDS:
        return BACKENDS[name]
    if name != "auto" and name not in _warned:  # a known optional backend that is not installed
        _warned.add(name)
        warnings.warn(f"attention backend {name!r} is unavailable ({OPTIONAL_BACKENDS[name]}); using 'auto'",
                      stacklevel=2)
    if device.type == "cuda":
        return auto_cuda
    return eager if q_len is not None and q_len <= AUTO_EAGER_MAX_ROWS else chunked
