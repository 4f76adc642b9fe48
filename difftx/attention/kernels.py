"""Attention kernels: plain functions with one signature, chosen by name.

Every kernel computes the attention *core* for both attention kinds:

``kernel(q, k, v, lam, mask, scale, return_maps=False)``

Notation: ``B`` batch, ``T`` queries, ``S`` keys, ``H`` output heads, ``Hkv`` key/value
groups, ``R = H // Hkv`` heads per group, ``d`` query/key width, ``C`` maps per head
(2 for differential attention, 1 for standard attention).

- Standard attention (``lam is None``): ``q (B, T, H, d)``, ``k (B, S, Hkv, d)``,
  ``v (B, S, Hkv, dv)``; head ``h`` uses group ``h // R``. Returns ``(B, T, H, dv)``.
- Differential attention (``lam`` a float32 scalar tensor): ``q (B, T, 2H, d)`` with
  sub-heads ``2h`` / ``2h+1`` the two components of head ``h``; ``k (B, S, 2Hkv, d)`` paired
  the same way per group; ``v (B, S, Hkv, 2d)``. Head ``h`` uses keys ``2g``, ``2g+1`` and
  value ``g`` with ``g = h // R``. Returns ``(A1 - lam * A2) V`` as ``(B, T, H, 2d)``; the
  per-head norm is the module's job.

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
from .masks import AttentionMask

# Query rows per block in the chunked kernel (see ``chunked``); 128 measured best on CPU.
CHUNK_ROWS = 128


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


def _group_views(q: Tensor, k: Tensor, v: Tensor, diff: bool):
    """Arrange inputs by kv group: q -> (B, Hkv, C, R, T, d), k -> (B, Hkv, C, S, d),
    v -> (B, Hkv, S, dv). Views only (no copies)."""
    C = 2 if diff else 1
    B, T, HC, d = q.shape
    S = k.shape[1]
    Hkv = v.shape[2]
    R = HC // (C * Hkv)
    qg = q.view(B, T, Hkv, R, C, d).permute(0, 2, 4, 3, 1, 5)  # (B, Hkv, C, R, T, d)
    kg = k.view(B, S, Hkv, C, d).permute(0, 2, 3, 1, 4)  # (B, Hkv, C, S, d)
    vg = v.transpose(1, 2)  # (B, Hkv, S, dv)
    return qg, kg, vg


def _core(qg: Tensor, kg: Tensor, vg: Tensor, lam: Optional[Tensor], allowed: Optional[Tensor], scale: float):
    """Materialised attention for one block of query rows.

    qg (B, Hkv, C, R, t, d), kg (B, Hkv, C, s, d), vg (B, Hkv, s, dv), allowed (B|1, t, s).
    Returns out (B, Hkv, R, t, dv) and the float32 logits, probs (B, Hkv, C, R, t, s) and
    effective map (B, Hkv, R, t, s).
    """
    B, Hkv, C, R, t, d = qg.shape
    s = kg.shape[-2]
    # all R heads of a group share one key matrix: fold them into the rows of one matmul
    scores = torch.matmul(qg.reshape(B, Hkv, C, R * t, d), kg.transpose(-1, -2))  # (B, Hkv, C, R*t, s)
    logits = scores.view(B, Hkv, C, R, t, s).to(_acc_dtype(scores.dtype)) * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed[:, None, None, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    eff = probs[:, :, 0] if lam is None else probs[:, :, 0] - lam * probs[:, :, 1]  # (B, Hkv, R, t, s)
    out = torch.matmul(eff.to(vg.dtype).reshape(B, Hkv, R * t, s), vg)  # (B, Hkv, R*t, dv)
    return out.view(B, Hkv, R, t, -1), logits, probs, eff


def _merge_heads(out: Tensor) -> Tensor:
    """(B, Hkv, R, T, dv) -> (B, T, H, dv)."""
    B, Hkv, R, T, dv = out.shape
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * R, dv)


def eager(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False):
    """The oracle: both maps materialised in one piece, O(T*S) memory per head."""
    qg, kg, vg = _group_views(q, k, v, lam is not None)
    T, S = q.shape[1], k.shape[1]
    out, logits, probs, eff = _core(qg, kg, vg, lam, mask.dense(T, S, q.device), scale)
    out = _merge_heads(out)
    if not return_maps:
        return out
    B, Hkv, C, R = logits.shape[:4]
    # sub-head order of the projections: head h = g*R + r, component c -> index (h*C + c)
    to_proj = lambda x: x.permute(0, 1, 3, 2, 4, 5).reshape(B, Hkv * R * C, T, S)  # noqa: E731
    return out, AttentionMaps(to_proj(logits), to_proj(probs), eff.reshape(B, Hkv * R, T, S))


def _block_mask(mask: AttentionMask, T: int, S: int, r0: int, r1: int, s: int, device):
    """For query rows ``r0:r1`` over keys ``0..s-1``: ``(col0, allowed)`` where ``allowed``
    ``(B|1, t, s - col0)`` covers keys ``col0..s-1`` (all earlier keys are allowed), or None."""
    if mask.is_plain_causal(T, S):
        t = r1 - r0
        tri = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        return r0, tri[None]
    allowed = mask.dense(T, S, device, rows=slice(r0, r1), keys=s)
    return (0, allowed) if allowed is not None else None


class _ChunkedAttention(torch.autograd.Function):
    """Blocked materialised attention with a hand-written backward.

    Layout inside: ``qg (B, Hkv, C, T, R, d)`` (pre-scaled), so a block of ``t`` query rows of
    all ``R`` heads of a group is one contiguous ``(t*R, d)`` matrix against the group's
    keys ``kg (B, Hkv, C, S, d)`` and values ``vg (B, Hkv, S, dv)``. Each block keeps its
    softmax maps for the backward pass, which accumulates into preallocated dk/dv slices
    (autograd over slices would allocate a full-size zero gradient per block).
    """

    @staticmethod
    def forward(ctx, q, k, v, lam, mask, scale, rows):
        diff = lam is not None
        C = 2 if diff else 1
        B, T, HC, d = q.shape
        S, Hkv, dv = k.shape[1], v.shape[2], v.shape[3]
        R = HC // (C * Hkv)
        qg = (q.view(B, T, Hkv, R, C, d).permute(0, 2, 4, 1, 3, 5) * scale).contiguous()  # (B, Hkv, C, T, R, d)
        kg = k.view(B, S, Hkv, C, d).permute(0, 2, 3, 1, 4).contiguous()  # (B, Hkv, C, S, d)
        vg = v.transpose(1, 2).contiguous()  # (B, Hkv, S, dv)
        out = q.new_empty(B, Hkv, T, R, dv)
        acc = _acc_dtype(q.dtype)
        lam_f = lam.detach().to(acc) if diff else None
        saved, blocks = [], []
        for r0 in range(0, T, rows):
            r1 = min(T, r0 + rows)
            t, s = r1 - r0, (min(S, mask.q_offset + r1) if mask.causal else S)
            qb = qg[:, :, :, r0:r1].reshape(B, Hkv, C, t * R, d)
            logits = torch.matmul(qb, kg[:, :, :, :s].transpose(-1, -2)).to(acc)  # (B, Hkv, C, t*R, s)
            bm = _block_mask(mask, T, S, r0, r1, s, q.device)
            if bm is not None:
                col0, allowed = bm  # allowed (B|1, t, s-col0) -> broadcast over Hkv, C and R
                view = logits.view(B, Hkv, C, t, R, s)[..., col0:]
                view.masked_fill_(~allowed[:, None, None, :, None, :], float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            eff = probs[:, :, 0] - lam_f * probs[:, :, 1] if diff else probs[:, :, 0]  # (B, Hkv, t*R, s)
            out[:, :, r0:r1] = torch.matmul(eff.to(vg.dtype), vg[:, :, :s]).view(B, Hkv, t, R, dv)
            saved.append(probs)
            blocks.append((r0, r1, s))
        ctx.save_for_backward(qg, kg, vg, lam_f if diff else None, *saved)
        ctx.blocks, ctx.scale, ctx.shape = blocks, scale, (B, T, S, Hkv, C, R, d, dv)
        ctx.diff = diff
        return out.permute(0, 2, 1, 3, 4).reshape(B, T, Hkv * R, dv)  # (B, T, H, dv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        qg, kg, vg, lam_f, *saved = ctx.saved_tensors
        B, T, S, Hkv, C, R, d, dv = ctx.shape
        do = dout.view(B, T, Hkv, R, dv).permute(0, 2, 1, 3, 4).contiguous()  # (B, Hkv, T, R, dv)
        dq = torch.empty_like(qg)
        dk = torch.zeros_like(kg)
        dvg = torch.zeros_like(vg)
        dlam = torch.zeros((), dtype=lam_f.dtype, device=qg.device) if ctx.diff else None
        for (r0, r1, s), probs in zip(ctx.blocks, saved):
            t = r1 - r0
            dob = do[:, :, r0:r1].reshape(B, Hkv, t * R, dv)
            eff = probs[:, :, 0] - lam_f * probs[:, :, 1] if ctx.diff else probs[:, :, 0]
            dvg[:, :, :s] += torch.matmul(eff.to(vg.dtype).transpose(-1, -2), dob)
            deff = torch.matmul(dob, vg[:, :, :s].transpose(-1, -2)).to(probs.dtype)  # (B, Hkv, t*R, s)
            if ctx.diff:
                dlam -= (deff * probs[:, :, 1]).sum()
                dprobs = torch.stack((deff, deff * -lam_f), dim=2)  # (B, Hkv, 2, t*R, s)
            else:
                dprobs = deff[:, :, None]
            dlogits = torch._softmax_backward_data(dprobs, probs, -1, probs.dtype).to(qg.dtype)
            qb = qg[:, :, :, r0:r1].reshape(B, Hkv, C, t * R, d)
            dq[:, :, :, r0:r1] = torch.matmul(dlogits, kg[:, :, :, :s]).view(B, Hkv, C, t, R, d)
            dk[:, :, :, :s] += torch.matmul(dlogits.transpose(-1, -2), qb)
        dq = (dq * ctx.scale).permute(0, 3, 1, 4, 2, 5).reshape(B, T, Hkv * R * C, d)  # (B, T, HC, d)
        dk = dk.permute(0, 3, 1, 2, 4).reshape(B, S, Hkv * C, d)  # (B, S, Hkv*C, d)
        dvg = dvg.transpose(1, 2)  # (B, S, Hkv, dv)
        return dq, dk, dvg, dlam, None, None, None


def chunked(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False):
    """Materialised attention in blocks of ``CHUNK_ROWS`` query rows, with its own backward.

    Under a causal mask a block needs only the keys up to its last row, so the work is
    about half of ``eager``'s, and each block's maps stay small enough for the CPU caches.
    This is the fastest form measured on CPU (see ``benchmarks/attention.py``). Training
    memory is O(T*S) per head, as for ``eager``: the blocks' maps are kept for backward.
    """
    if return_maps:
        raise ValueError("the 'chunked' backend does not return attention maps; use backend='eager'")
    return _ChunkedAttention.apply(q, k, v, lam, mask, scale, CHUNK_ROWS)


def sdpa(q, k, v, lam, mask: AttentionMask, scale: float, return_maps: bool = False):
    """PyTorch ``scaled_dot_product_attention``.

    Standard attention is one call. Differential attention needs a ``2d``-wide value, which
    the fast SDPA kernels refuse (they want equal q/k/v widths) and send to the slow math
    path. Of the stock arrangements, the fastest measured (SPEC section 6) is one call over
    all ``2H`` sub-heads with q and k zero-padded to ``2d`` (dot products unchanged): it
    costs twice the baseline's matmuls but computes each softmax once, where the four-call
    form on ``d``-wide value halves computes each twice.
    """
    if return_maps:
        raise ValueError("the 'sdpa' backend does not return attention maps; use backend='eager'")
    B, T, HC, d = q.shape
    S = k.shape[1]
    plain = mask.is_plain_causal(T, S)
    attn_mask = None if plain else mask.dense(T, S, q.device)
    if attn_mask is not None:
        attn_mask = attn_mask[:, None]  # (B|1, 1, T, S)
    if lam is None:
        Hkv = k.shape[2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=attn_mask, is_causal=plain, scale=scale, enable_gqa=HC != Hkv,
        )  # (B, H, T, dv)
        return out.transpose(1, 2)
    Hkv = v.shape[2]
    H, R = HC // 2, HC // (2 * Hkv)
    # component-major order, so that SDPA's GQA rule (query i -> kv i // R) pairs correctly
    qc = q.view(B, T, Hkv, R, 2, d).permute(0, 4, 2, 3, 1, 5).reshape(B, 2 * H, T, d)  # (B, 2H, T, d)
    kc = k.view(B, S, Hkv, 2, d).permute(0, 3, 2, 1, 4).reshape(B, 2 * Hkv, S, d)  # (B, 2Hkv, S, d)
    vc = v.transpose(1, 2).unsqueeze(1).expand(B, 2, Hkv, S, 2 * d).reshape(B, 2 * Hkv, S, 2 * d)
    out = F.scaled_dot_product_attention(
        F.pad(qc, (0, d)), F.pad(kc, (0, d)), vc,
        attn_mask=attn_mask, is_causal=plain, scale=scale, enable_gqa=R > 1,
    ).view(B, 2, H, T, 2 * d)
    dt = _acc_dtype(out.dtype)
    out = out[:, 0].to(dt) - lam.to(dt) * out[:, 1].to(dt)  # (B, H, T, 2d)
    return out.to(v.dtype).transpose(1, 2)


Kernel = Callable[..., object]

BACKENDS: dict[str, Kernel] = {"eager": eager, "chunked": chunked, "sdpa": sdpa}
if _flex.available():
    BACKENDS["flex"] = _flex.flex


def register_backend(name: str, fn: Kernel) -> None:
    """Add a kernel to the table (used by optional backends such as ``triton``)."""
    BACKENDS[name] = fn


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
# ``eager``, longer ones ``chunked``. Measured with a 1,024-token KV cache, D=512, float32, one
# layer: chunked / eager = 1.41, 1.34, 1.16, 0.93, 0.97 at 1, 4, 16, 64, 128 query rows (DIFF,
# 4 heads) and 1.38, 1.30, 1.20, 1.04, 0.72 (baseline, 8 heads).
AUTO_EAGER_MAX_ROWS = 16


def resolve_backend(name: str, device: torch.device, q_len: Optional[int] = None) -> Kernel:
    """The kernel for ``name``; ``auto`` picks the fastest measured for the device and, on CPU,
    for the number of query rows ``q_len`` of the call (:data:`AUTO_EAGER_MAX_ROWS`)."""
    check_backend_name(name)
    if name in BACKENDS:
        return BACKENDS[name]
    if name != "auto" and name not in _warned:  # a known optional backend that is not installed
        _warned.add(name)
        warnings.warn(f"attention backend {name!r} is unavailable ({OPTIONAL_BACKENDS[name]}); using 'auto'",
                      stacklevel=2)
    if device.type == "cuda":
        return BACKENDS.get("triton", sdpa)
    return eager if q_len is not None and q_len <= AUTO_EAGER_MAX_ROWS else chunked
