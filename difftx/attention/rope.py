"""Rotary position embedding, GPT-J ("interleaved") convention.

Within each ``d``-wide head, dims ``(2i, 2i+1)`` rotate together by angle
``pos * theta ** (-2i / d)``. (Hugging Face Llama uses the rotate-half convention; the two
differ by a fixed permutation of q/k projection rows, applied by the interop converters.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import records_grad


def rope_angles(positions: Tensor, d: int, theta: float, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos, sin of shape ``(B|1, T, 1, d/2)`` for integer ``positions`` ``(B|1, T)``, computed in
    ``dtype`` (float32, or float64 for float64 models)."""
    inv_freq = theta ** (-torch.arange(0, d, 2, device=positions.device, dtype=dtype) / d)  # (d/2,)
    ang = positions.to(dtype)[..., None] * inv_freq  # (B, T, d/2)
    return ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]


class _Rotate(torch.autograd.Function):
    """``x`` rotated pair by pair by the unit complex numbers ``rot``: one complex product, and its
    backward the rotation by the opposite angle. Under ``torch.vmap`` the mapped dimension leads."""

    @staticmethod
    def forward(x, rot):
        xc = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
        return torch.view_as_real(xc * rot).flatten(-2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rot = inputs[1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        gc = torch.view_as_complex(g.contiguous().unflatten(-1, (-1, 2)))
        return torch.view_as_real(gc * ctx.rot.conj()).flatten(-2), None

    @staticmethod
    def vmap(info, in_dims, x, rot):
        x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x.expand(info.batch_size, *x.shape)
        rot = rot.movedim(in_dims[1], 0) if in_dims[1] is not None else rot
        return _Rotate.apply(x.contiguous(), rot), 0


def _rotate_real(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rope`'s rotation in real arithmetic, for torch.compile (which generates no complex code): one
    pointwise expression, ``x * cos + swap(x) * (-sin, sin)`` with ``swap`` exchanging each pair, that the compiler
    fuses with the cast before it and the copies after it (a ``torch.stack`` of the two halves becomes a
    concatenation, written to memory in float32 first)."""
    pairs = x.unflatten(-1, (-1, 2))  # (..., d/2, 2)
    sign = torch.tensor([-1.0, 1.0], dtype=x.dtype, device=x.device)
    return (pairs * cos[..., None] + pairs.flip(-1) * (sin[..., None] * sign)).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, T, heads, d)`` by the angles from :func:`rope_angles`, in their dtype: each pair
    ``(x0, x1)`` becomes ``(x0 cos - x1 sin, x0 sin + x1 cos)``, the complex product ``(x0 + i x1)(cos + i sin)``."""
    xf = x.to(cos.dtype)
    if torch.compiler.is_compiling():
        return _rotate_real(xf, cos, sin).to(x.dtype)
    xf = xf if xf.is_contiguous() else xf.contiguous()
    rot = torch.complex(cos, sin)
    if records_grad(xf):
        out = _Rotate.apply(xf, rot)
    else:  # inference (decoding): the product itself, without a Function's call overhead
        out = torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (-1, 2))) * rot).flatten(-2)
    return out.to(x.dtype)
