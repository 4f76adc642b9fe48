"""Low-bit attention logits (SPEC section 5; paper section 3.7).

Dynamic symmetric absmax quantisation of the scaled pre-softmax logits to ``bits`` bits:
``qmax = 2**(bits-1) - 1``, ``step = max|x| / qmax`` over a group, ``x -> round(x / step) * step``
(clamped to ``[-qmax, qmax]`` steps). Masked (``-inf``) entries are left out of the maximum and
stay masked. Groups:

- ``row``: one scale per query row of one (sub-)head: ``max`` over the keys.
- ``tensor``: one scale per attention map of one sequence and (sub-)head: ``max`` over all of
  its ``T x S`` logits. (One scale per map rather than per batch keeps results independent of
  the batch size; with a KV cache a decode step has one row, so evaluate with full forwards,
  ``greedy_decode(use_cache=False)``, to keep ``tensor`` meaning the whole map.)

:func:`quantized_kernel` builds an eager-like kernel that quantises the logits before the
softmax; :func:`register_quantized_backend` adds it to the backend table under a generated
name, so ``model(tokens, backend=name)`` and every evaluation can use it.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ..attention.kernels import AttentionMaps, register_backend
from ..attention.masks import AttentionMask

GRANULARITIES = ("row", "tensor")
DEFAULT_BITS: tuple[int, ...] = (16, 8, 6, 4, 3)


def _check(bits: int, granularity: str) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 32:
        raise ValueError(f"bits: must be an integer in 2..32, got {bits!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: must be one of {GRANULARITIES}, got {granularity!r}")


def absmax_quantize(x: Tensor, bits: int, granularity: str = "row") -> Tensor:
    """Fake-quantised copy of logits ``x`` ``(..., T, S)`` (at least float32; ``-inf`` kept)."""
    _check(bits, granularity)
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    finite = torch.isfinite(x)
    mag = torch.where(finite, x.abs(), torch.zeros_like(x))
    amax = mag.amax(-1, keepdim=True) if granularity == "row" else mag.amax((-2, -1), keepdim=True)
    qmax = float(2 ** (bits - 1) - 1)
    step = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(x / step).clamp(-qmax, qmax) * step
    return torch.where(finite, q, x)


def quantized_kernel(bits: int, granularity: str = "row"):
    """An ``eager``-equivalent kernel (same signature, maps available) that quantises the
    scaled logits with :func:`absmax_quantize` before the softmax."""
    _check(bits, granularity)

    def kernel(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], mask: AttentionMask, scale: float,
               return_maps: bool = False):
        # the eager kernel's arrangement by kv group (see difftx.attention.kernels)
        C = 1 if lam is None else 2
        B, T, HC, d = q.shape
        S, Hkv = k.shape[1], v.shape[2]
        R = HC // (C * Hkv)
        qg = q.view(B, T, Hkv, R, C, d).permute(0, 2, 4, 3, 1, 5)  # (B, Hkv, C, R, T, d)
        kg = k.view(B, S, Hkv, C, d).permute(0, 2, 3, 1, 4)  # (B, Hkv, C, S, d)
        vg = v.transpose(1, 2)  # (B, Hkv, S, dv)
        scores = torch.matmul(qg.reshape(B, Hkv, C, R * T, d), kg.transpose(-1, -2))  # (B, Hkv, C, R*T, S)
        logits = scores.view(B, Hkv, C, R, T, S).to(torch.promote_types(scores.dtype, torch.float32)) * scale
        allowed = mask.dense(T, S, q.device)  # (B|1, T, S) or None
        if allowed is not None:
            logits = logits.masked_fill(~allowed[:, None, None, None], float("-inf"))
        logits = absmax_quantize(logits, bits, granularity)
        probs = torch.softmax(logits, dim=-1)
        eff = probs[:, :, 0] if lam is None else probs[:, :, 0] - lam * probs[:, :, 1]  # (B, Hkv, R, T, S)
        out = torch.matmul(eff.to(vg.dtype).reshape(B, Hkv, R * T, S), vg)  # (B, Hkv, R*T, dv)
        out = out.view(B, Hkv, R, T, -1).permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * R, -1)  # (B, T, H, dv)
        if not return_maps:
            return out

        def to_proj(x: Tensor) -> Tensor:  # (B, Hkv, C, R, T, S) -> (B, Hkv*R*C, T, S), projection order
            return x.permute(0, 1, 3, 2, 4, 5).reshape(B, Hkv * R * C, T, S)

        return out, AttentionMaps(to_proj(logits), to_proj(probs), eff.reshape(B, Hkv * R, T, S))

    kernel.__name__ = f"absmax{bits}_{granularity}"
    kernel.__doc__ = f"eager attention with logits absmax-quantised to {bits} bits per {granularity}"
    return kernel


def backend_name(bits: int, granularity: str = "row") -> str:
    return f"absmax{bits}-{granularity}"


def register_quantized_backend(bits: int, granularity: str = "row") -> str:
    """Register :func:`quantized_kernel` ``(bits, granularity)`` and return its backend name."""
    name = backend_name(bits, granularity)
    register_backend(name, quantized_kernel(bits, granularity))
    return name


def quantization_sweep(evaluate: Callable[[str], float], bits: Sequence[int] = DEFAULT_BITS,
                       granularities: Sequence[str] = GRANULARITIES) -> dict:
    """Run ``evaluate(backend_name)`` (any metric: NLL, needle accuracy, ...) once in full
    precision (``eager``) and once per (granularity, bits).

    Returns ``{"full": m, "row": {"16": m, ...}, "tensor": {...}}`` (bit widths as strings, JSON-ready).
    """
    out: dict = {"full": evaluate("eager")}
    for g in granularities:
        out[g] = {str(b): evaluate(register_quantized_backend(b, g)) for b in bits}
    return out
