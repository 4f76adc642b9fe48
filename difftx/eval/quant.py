"""Low-bit attention logits (SPEC section 5; paper section 3.7).

Dynamic symmetric absmax quantisation of the scaled pre-softmax logits to ``bits`` bits:
``qmax = 2**(bits-1) - 1``, ``step = max|x| / qmax`` over a group, ``x -> round(x / step) * step``
(clamped to ``[-qmax, qmax]`` steps). Masked (``-inf``) entries are left out of the maximum and
stay masked. Groups:

- ``row``: one scale per query row of one (sub-)head: ``max`` over the keys.
- ``tensor``: one scale per attention map of one sequence and (sub-)head: ``max`` over all of
  its ``T x S`` logits. (One scale per map rather than per batch keeps results independent of
  the batch size; with a KV cache a decode step has one row, so evaluate with full forwards,
  ``generate(use_cache=False)``, to keep ``tensor`` meaning the whole map.)

:func:`quantized_kernel` builds an eager-like kernel that quantises the logits before the
softmax; :func:`register_quantized_backend` adds it to the backend table under a generated
name, so ``model(tokens, backend=name)`` and every evaluation can use it.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ..attention.kernels import eager, register_backend
from ..attention.masks import AttentionMask
from ..attention.modules import AttentionKind

_KIND_FORWARD = AttentionKind.forward

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
    """The ``eager`` kernel (same signature, maps available) with the scaled, masked logits
    quantised by :func:`absmax_quantize` before the softmax: a logits hook on eager's own
    computation, so the two cannot drift apart."""
    _check(bits, granularity)

    def kernel(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], mask: AttentionMask, scale: float,
               return_maps: bool = False):
        return eager(q, k, v, lam, mask, scale, return_maps,
                     logits_fn=lambda x: absmax_quantize(x, bits, granularity))

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


def kernel_bypass(model) -> Optional[str]:
    """Why quantising the kernels' logits would not reach every attention layer of ``model``, or None when it does:
    one forward of a few tokens through a counting kernel (eager's values) must call it once per layer. A kind
    whose own ``forward`` computes attention without the backend it is handed is named: a low-bit number for it
    would be its full-precision number."""
    from ..attention.kernels import BACKENDS

    layers = [m for m in model.modules() if isinstance(m, AttentionKind)]
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return eager(*args, **kwargs)

    name = "difftx-quant-reach"
    BACKENDS[name] = counting
    try:
        p = next(model.parameters())
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long, device=p.device), backend=name)
    finally:
        BACKENDS.pop(name, None)
    if len(calls) >= len(layers):
        return None
    own = sorted({type(m).__name__ for m in layers if type(m).forward is not _KIND_FORWARD})
    return (f"not measured: the kind's own forward ({', '.join(own) or 'an attention layer'}) does not call the "
            f"attention kernels this evaluation quantises ({len(calls)} kernel calls for {len(layers)} layers)")


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
