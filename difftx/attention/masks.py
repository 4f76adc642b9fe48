"""Attention masks, described once and materialised by each backend as it needs.

A mask is a small description, not a tensor: most calls are plain causal self-attention,
which fast kernels handle with a flag and no ``(T, S)`` tensor at all. Backends ask for the
dense boolean form (``True`` = may attend) only for the rows and keys they work on.

Semantics: there are ``S`` keys (cached prefix plus the new tokens) and ``T`` queries; query
``i`` sits at key index ``q_offset + i``. ``causal`` allows keys ``j <= q_offset + i``;
``key_valid`` ``(B, S)`` removes padding keys; ``doc_ids`` ``(B, S)`` restricts attention to
keys of the same packed document. A query always keeps its own key, so no row is ever empty
(rows of padding queries then hold harmless values instead of NaN).

A static decoding step gives ``q_offset`` as a 0-d integer tensor (the cache position of its first query, read on
the device): ``S`` is then the whole cache buffer, the causal rule masks the keys beyond each query, and the mask's
form does not depend on the position (no Python branch reads it), so one compiled graph serves every position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionMask:
    causal: bool = True
    q_offset: Union[int, Tensor] = 0  # a 0-d integer tensor: a static decoding step (see the module doc)
    key_valid: Optional[Tensor] = None  # (B, S) bool, True = a real token
    doc_ids: Optional[Tensor] = None  # (B, S) integer document id per key position

    def check(self, B: int, T: int, S: int) -> None:
        """ValueError unless the mask fits ``B`` rows of ``T`` queries over ``S`` keys (a tensor
        longer or shorter than the keys would otherwise be cut or fail deep in a kernel)."""
        for name in ("key_valid", "doc_ids"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, Tensor):
                raise TypeError(f"AttentionMask.{name}: expected a tensor, got {type(t).__name__}")
            if t.dim() != 2 or t.shape[0] not in (1, B) or t.shape[1] != S:
                raise ValueError(f"AttentionMask.{name}: expected shape ({B}, {S}) for {B} rows over {S} keys "
                                 f"(cached + new tokens), got {tuple(t.shape)}")
        if self.is_static:
            off = self.q_offset
            if off.dim() != 0 or off.is_floating_point() or off.is_complex() or off.dtype == torch.bool:
                raise ValueError(f"AttentionMask.q_offset: a tensor offset must be a 0-d integer tensor, got "
                                 f"{off.dtype} of shape {tuple(off.shape)}")
            return  # its range is the caller's to check: reading it would synchronise with the device
        if not 0 <= self.q_offset <= S - T:
            raise ValueError(f"AttentionMask.q_offset: {self.q_offset} does not place {T} queries within {S} keys "
                             f"(need 0 <= q_offset <= {S - T})")

    @property
    def is_static(self) -> bool:
        """True for a static decoding step's mask: ``q_offset`` is a tensor."""
        return isinstance(self.q_offset, Tensor)

    def is_plain_causal(self, T: int, S: int) -> bool:
        """True when a kernel's built-in causal flag expresses the mask exactly."""
        return (not self.is_static and self.causal and self.key_valid is None and self.doc_ids is None and T == S
                and self.q_offset == 0)

    def is_unmasked(self) -> bool:
        return not self.causal and self.key_valid is None and self.doc_ids is None

    def dense(self, T: int, S: int, device, rows: Optional[slice] = None, keys: int | None = None) -> Optional[Tensor]:
        """Boolean mask ``(B or 1, t, s)`` for query rows ``rows`` (default all) and keys
        ``0..keys-1`` (default ``S``); ``None`` when nothing is masked."""
        if self.is_unmasked():
            return None
        r0, r1 = (0, T) if rows is None else (rows.start, rows.stop)
        s = S if keys is None else keys
        if not self.is_static and self.key_valid is None and self.doc_ids is None and self.q_offset + r0 >= s - 1:
            return None  # causal only, and every row sees all s keys (a decoding step over its cache)
        qpos = torch.arange(r0, r1, device=device) + self.q_offset  # (t,) key index of each query
        kpos = torch.arange(s, device=device)  # (s,)
        allowed = torch.ones(1, r1 - r0, s, dtype=torch.bool, device=device)
        if self.causal:
            allowed = allowed & (kpos[None, :] <= qpos[:, None])[None]
        if self.doc_ids is not None:
            docs = self.doc_ids[:, :s]
            qdocs = self.doc_ids[:, qpos]
            allowed = allowed & (qdocs[:, :, None] == docs[:, None, :])
        if self.key_valid is not None:
            allowed = allowed & self.key_valid[:, None, :s].bool()
        # a query always sees itself: keeps every softmax row non-empty
        allowed = allowed | (kpos[None, None, :] == qpos[None, :, None])
        return allowed
