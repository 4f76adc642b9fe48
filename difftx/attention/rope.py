"""Rotary position embedding, GPT-J ("interleaved") convention.

Within each ``d``-wide head, dims ``(2i, 2i+1)`` rotate together by angle
``pos * theta ** (-2i / d)``. (Hugging Face Llama uses the rotate-half convention; the two
differ by a fixed permutation of q/k projection rows, applied by the interop converters.)
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_angles(positions: Tensor, d: int, theta: float, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos, sin of shape ``(B|1, T, 1, d/2)`` for integer ``positions`` ``(B|1, T)``, computed in
    ``dtype`` (float32, or float64 for float64 models)."""
    inv_freq = theta ** (-torch.arange(0, d, 2, device=positions.device, dtype=dtype) / d)  # (d/2,)
    ang = positions.to(dtype)[..., None] * inv_freq  # (B, T, d/2)
    return ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, T, heads, d)`` by the angles from :func:`rope_angles`."""
    xf = x.to(cos.dtype).unflatten(-1, (-1, 2))  # (B, T, heads, d/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)
