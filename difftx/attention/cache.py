"""The KV cache of one attention layer: preallocated buffers, filled left to right, read by the kernels in place."""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

# Backends a static decoding step (a cache position given as a tensor) runs with: those whose mask is the dense
# boolean form of :class:`~difftx.attention.masks.AttentionMask`. ``auto`` is ``eager`` there on every device: it
# reads the keys of both maps and the values once per step (docs/kernels.md, "Decoding").
STATIC_BACKENDS = ("eager", "sdpa", "sdpa_pad", "sdpa_halves", "sdpa_wide")


def static_backend(name: str) -> str:
    """The backend a static decoding step runs for the backend name ``name`` (``auto`` is ``eager``); ValueError
    for a backend that cannot run it."""
    if name == "auto":
        return "eager"
    if name not in STATIC_BACKENDS:
        raise ValueError(f"backend: {name!r} cannot run a static decoding step (a cache position given as a tensor, "
                         f"every cache position masked); use one of {['auto', *STATIC_BACKENDS]}")
    return name


class LayerKV:
    """One layer's KV cache: preallocated buffers, filled left to right.

    Stored head-major, ``(B, heads, S_max, width)``, and handed to kernels as ``(B, S, heads, width)``
    views: each head's keys are then one strided matrix, so a kernel's batched matmul reads the
    cache in place instead of copying it on every decoding step.

    ``v_parts > 1`` stores each value row as that many contiguous pieces of ``width / v_parts``:
    the value buffer is ``(B, heads * v_parts, S_max, width / v_parts)`` and :meth:`update` hands
    the values to kernels as a ``(B, S, heads, v_parts, width / v_parts)`` view. DIFF V1 uses
    ``v_parts=2`` on CPU (its ``2d``-wide value as two ``d``-wide halves, the baseline's layout),
    so that a decoding step's ``A V`` is ``d``-wide matrix-vector products over contiguous rows;
    kernels that do not read this form get the joined ``(B, S, heads, width)`` values (a copy).
    """

    def __init__(self, k: Tensor, v: Tensor, v_parts: int = 1):
        self.k, self.v = k, v  # (B, heads, S_max, width); v: (B, heads * v_parts, S_max, width / v_parts)
        self.v_parts = v_parts
        # values of the layer's parameters alone (lambda, the head norm's gain) that a decoding step reads, kept for
        # this cache's life (difftx.attention.modules._inference_value)
        self.kept: dict = {}

    @classmethod
    def empty(cls, batch: int, max_len: int, k_shape: tuple[int, int], v_shape: tuple[int, int], device=None,
              dtype=None, v_parts: int = 1) -> "LayerKV":
        """Zeroed buffers for ``max_len`` positions of keys ``(heads, width)`` and values ``(heads, width)``,
        the values stored in ``v_parts`` contiguous pieces per row (see the class)."""
        (kh, kd), (vh, vd) = k_shape, v_shape
        if v_parts < 1 or vd % v_parts:
            raise ValueError(f"v_parts: {v_parts} does not divide the value width {vd}")
        return cls(torch.zeros(batch, kh, max_len, kd, device=device, dtype=dtype),
                   torch.zeros(batch, vh * v_parts, max_len, vd // v_parts, device=device, dtype=dtype), v_parts)

    def update(self, pos: Union[int, Tensor], k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write new ``k``, ``v`` ``(B, T, heads, width)`` at ``pos``; return everything up to ``pos + T``
        as ``(B, S, heads, width)`` views (values ``(B, S, heads, v_parts, width / v_parts)`` when
        ``v_parts > 1``).

        ``pos`` a 0-d integer tensor (a static decoding step): the same write by ``index_copy_`` at that
        position, and the whole buffers returned, ``S = S_max`` (the caller masks the keys beyond ``pos + T``): the
        same shapes and operations at every position. Its range is the caller's to check (reading it would
        synchronise with the device)."""
        if isinstance(pos, Tensor):
            return self._write_static(pos, k, v)
        end = pos + k.shape[1]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache is full: {end} tokens do not fit in its {self.k.shape[2]} positions")
        self.k[:, :, pos:end] = k.transpose(1, 2)
        P = self.v_parts
        if P == 1:
            self.v[:, :, pos:end] = v.transpose(1, 2)
            return self.k[:, :, :end].transpose(1, 2), self.v[:, :, :end].transpose(1, 2)
        B, T, H, w = v.shape
        self.v[:, :, pos:end] = v.reshape(B, T, H * P, w // P).transpose(1, 2)
        vs = self.v[:, :, :end]  # (B, H*P, S, w/P)
        return self.k[:, :, :end].transpose(1, 2), vs.unflatten(1, (H, P)).permute(0, 3, 1, 2, 4)

    def _write_static(self, pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, T, H, w = v.shape
        idx = pos.reshape(1) + torch.arange(T, device=pos.device)  # (T,) the positions written
        self.k.index_copy_(2, idx, k.transpose(1, 2).to(self.k.dtype))
        P = self.v_parts
        if P == 1:
            self.v.index_copy_(2, idx, v.transpose(1, 2).to(self.v.dtype))
            return self.k.transpose(1, 2), self.v.transpose(1, 2)
        self.v.index_copy_(2, idx, v.reshape(B, T, H * P, w // P).transpose(1, 2).to(self.v.dtype))
        return self.k.transpose(1, 2), self.v.unflatten(1, (H, P)).permute(0, 3, 1, 2, 4)
