"""An up-front estimate of a model's training memory, so that a run too large for its machine is refused in one
line before anything is written, instead of being killed by the kernel partway with nothing said. ``difftx compare``
(each model of a stack) and ``difftx train`` ask the same estimate."""

from __future__ import annotations

import os
from typing import Optional


def training_bytes(cfg, batch_size: int, seq_len: int, map_keys: Optional[int] = None) -> int:
    """A generous estimate of one model's training memory: weights, gradients and two AdamW moments (16 bytes a
    parameter) and float32 activations (about 24 tensors of ``dim`` per token and layer, and 4 attention maps per
    head over ``map_keys`` keys: every key, ``seq_len``, by default)."""
    params = 12 * cfg.n_layers * cfg.dim ** 2 + 2 * cfg.vocab_size * cfg.dim
    keys = seq_len if map_keys is None else map_keys
    acts = 4 * batch_size * seq_len * cfg.n_layers * (24 * cfg.dim + 4 * cfg.n_heads * keys)
    return 16 * params + acts


def physical_bytes() -> int:
    """This machine's memory (8 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 8 << 30


def check_training_fits(cfg, batch_size: int, seq_len: int, memory: int, map_keys: Optional[int] = None,
                        what: str = "this run's model") -> None:
    """Refuse (one ValueError naming the sizes and the estimate) a model whose training would not fit in ``memory``
    bytes (:func:`training_bytes`)."""
    need = training_bytes(cfg, batch_size, seq_len, map_keys)
    if need > memory:
        raise ValueError(f"{what} would need about {need / 2**30:,.1f} GiB to train (vocabulary {cfg.vocab_size:,}, "
                         f"dim {cfg.dim}, n_layers {cfg.n_layers}, batch_size {batch_size} x {seq_len} tokens), more "
                         f"than this machine's {memory / 2**30:,.1f} GiB: give smaller values")
