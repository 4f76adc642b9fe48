"""Intervals over windows of one text, which are not independent draws.

Windows of one text are dependent: a scene, a speaker or a document that is hard for a model is
hard over many windows in a row. Per-window NLL of consecutive 32-token windows of real text has a
lag-1 autocorrelation near 0.3, and a t interval that treats the windows as independent draws
understates the standard error 2-3 fold. Windows spread over a text are less dependent, but not
independent: on 1.2 MB of Shakespeare scored by a small model, 576 windows of 128 tokens spread
over it (one in 16) still understated the standard error of a paired difference by 1.2x (docs/results.md,
2026-11-26). This module replaces the windows by contiguous *blocks* of windows and treats the
blocks as the units (batch means):

- The text the windows span is cut into ``B = min(MAX_BLOCKS, span // MIN_BLOCK_TOKENS, windows)``
  stretches of equal length, and a block holds the windows that start in one stretch. A block
  spans at least ``MIN_BLOCK_TOKENS`` (8,192) tokens of text, and blocks grow with the text once
  there are ``MAX_BLOCKS`` (16) of them. A fixed number of ever longer blocks is what makes batch
  means valid for any dependence that fades with distance: the block means become nearly
  independent, and the statistic follows a t with ``B - 1`` degrees of freedom (Schmeiser, 1982).
  On real text the standard error still grows with the block length up to the length of a
  document (a play: about 130k tokens), so blocks are made as long as 16 of them allow.
- Where documents are known (the records of a JSONL file, the files of a folder), block boundaries
  move forward to the next document start, so that blocks hold whole documents and an effect of a
  whole document stays inside one block. Where they are not (one plain text file), the effect of a
  document longer than a block is not fully in the interval.
- The estimate is the token-weighted mean (what the LM task reports); its standard error is that of
  a ratio of block totals, ``sqrt(B / (B - 1) * sum(w_b^2 (m_b - mean)^2)) / sum(w_b)`` (``m_b``:
  a block's token-weighted mean, ``w_b``: its tokens), which is the usual ``sd(m_b) / sqrt(B)``
  when blocks are equal. The t quantile has ``(sum w_b^2)^2 / sum w_b^4 - 1`` degrees of freedom:
  ``B - 1`` for equal blocks, fewer when a few large blocks (long documents) carry the estimate.
- Fewer than ``MIN_BLOCKS`` (4) blocks give no interval: the text is too short for one that allows
  for dependence between neighbouring windows. ``BlockInterval.note`` says so.

A paired difference of two models scored on the same windows uses the same blocks over the
window-by-window differences.

What the interval is about: when every token of a file is scored, the file's own mean has no
sampling error. The interval is about text like it (other text from the same source, of the same
length), which is the question a comparison of models asks.

The coverage of these intervals is checked by simulation in ``tests/test_blocks.py`` (an AR(1)
series of window means, document offsets, independent windows).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from .stats import t_quantile

MIN_BLOCK_TOKENS = 8192
MAX_BLOCKS = 16
MIN_BLOCKS = 4


@dataclass(frozen=True)
class BlockInterval:
    """A token-weighted mean over windows with its interval over blocks of windows.

    ``low``/``high``/``se``/``df`` are ``None`` when there is no interval (``note`` says why)."""

    mean: float
    low: Optional[float]
    high: Optional[float]
    se: Optional[float]
    df: Optional[float]  # B - 1 for equal blocks, fewer for unequal ones
    blocks: int
    tokens_per_block: float  # mean tokens per block
    confidence: float
    note: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


def window_bounds(n_windows: int) -> list[int]:
    """Bounds of one block per window: the plain t interval, for windows known to be independent
    (and for results recorded before blocks were)."""
    if n_windows < 0:
        raise ValueError(f"n_windows: must be >= 0, got {n_windows}")
    return list(range(n_windows + 1))


def block_bounds(window_tokens: Sequence[int], starts: Optional[Sequence[int]] = None, *,
                 min_tokens: int = MIN_BLOCK_TOKENS, max_blocks: int = MAX_BLOCKS,
                 doc_starts: Optional[Sequence[int]] = None) -> list[int]:
    """Window indices ``[0, i_1, ..., n]`` that cut windows (holding ``window_tokens`` predictions
    each, in text order) into contiguous blocks by their place in the text: ``starts`` (each
    window's first token; default: the windows are consecutive). The text they span is cut into
    ``min(max_blocks, span // min_tokens, n)`` stretches of equal length, and a block holds the
    windows that start in one stretch (with fewer than two stretches: ``[0, n]``, one block). With
    ``doc_starts`` (indices of the windows that begin a document) each boundary moves forward to
    the next document start, so blocks hold whole documents (and may be fewer)."""
    w = np.asarray(window_tokens, dtype=np.float64)
    if w.ndim != 1 or (w.size and w.min() <= 0):
        raise ValueError("window_tokens: must be a 1-D sequence of positive token counts")
    if min_tokens < 1 or max_blocks < 1:
        raise ValueError(f"min_tokens and max_blocks: must be >= 1, got {min_tokens} and {max_blocks}")
    n = int(w.size)
    if starts is None:
        pos = np.concatenate([[0.0], np.cumsum(w)[:-1]])  # consecutive: the tokens before each window
    else:
        pos = np.asarray(starts, dtype=np.float64)
        if pos.shape != w.shape or np.any(np.diff(pos) < 0):
            raise ValueError("starts: one per window, in text order")
    if doc_starts is not None:
        docs = np.asarray(sorted(set(int(s) for s in doc_starts)), dtype=np.int64)
        if docs.size and (docs[0] < 0 or docs[-1] > n):
            raise ValueError(f"doc_starts: window indices must lie in [0, {n}]")
    if n == 0:
        return [0, 0]
    span = float(pos[-1] + w[-1] - pos[0])
    count = min(max_blocks, int(span // min_tokens), n)
    if count <= 1:
        return [0, n]
    cuts = np.searchsorted(pos - pos[0], np.arange(1, count) * (span / count), side="left")
    if doc_starts is not None:
        at = np.searchsorted(docs, cuts, side="left")
        cuts = np.where(at < docs.size, docs[np.minimum(at, docs.size - 1)], n)
    inner = sorted({int(c) for c in cuts if 0 < c < n})
    return [0] + inner + [n]


def _block_sums(values: np.ndarray, weights: np.ndarray, bounds: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Token totals and token-weighted value totals of each block."""
    b = np.asarray(bounds, dtype=np.int64)
    if b.ndim != 1 or b.size < 2 or b[0] != 0 or b[-1] != values.size or np.any(np.diff(b) <= 0):
        raise ValueError(f"bounds: must run strictly upward from 0 to {values.size}, got {list(bounds)[:6]}...")
    cum_w = np.concatenate([[0.0], np.cumsum(weights)])
    cum_v = np.concatenate([[0.0], np.cumsum(values * weights)])
    return np.diff(cum_w[b]), np.diff(cum_v[b])


def block_means(values: Sequence[float], weights: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """The token-weighted mean of ``values`` (one per window, ``weights`` tokens each) within each
    block of ``bounds`` (:func:`block_bounds`)."""
    v, w = _check(values, weights)
    tw, tv = _block_sums(v, w, bounds)
    return (tv / tw).tolist()


def block_interval(values: Sequence[float], weights: Sequence[float], bounds: Sequence[int], *,
                   confidence: float = 0.95, min_blocks: int = MIN_BLOCKS) -> BlockInterval:
    """The token-weighted mean of per-window ``values`` (window ``i`` holds ``weights[i]`` tokens)
    with its t interval over the blocks ``bounds`` (``B - 1`` degrees of freedom for equal blocks;
    see the module docstring). No interval below ``min_blocks`` blocks or when the windows hold no tokens."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    v, w = _check(values, weights)
    if v.size == 0 or w.sum() <= 0:
        raise ValueError("no windows (or no tokens in them): nothing to average")
    tw, tv = _block_sums(v, w, bounds)
    total = float(tw.sum())
    mean = float(tv.sum() / total)
    count = int(tw.size)
    per_block = total / count
    if count < max(min_blocks, 2):
        note = (f"no interval: {total:,.0f} tokens make {count} block{'s' if count != 1 else ''}, fewer than "
                f"{max(min_blocks, 2)}")
        return BlockInterval(mean, None, None, None, None, count, per_block, confidence, note)
    means = tv / tw
    se = math.sqrt(count / (count - 1) * float(((tw * (means - mean)) ** 2).sum())) / total
    # unequal blocks (whole documents): the variance rests on the largest ones, so fewer degrees of freedom
    df = float((tw ** 2).sum() ** 2 / (tw ** 4).sum()) - 1.0
    h = t_quantile(1 - (1 - confidence) / 2, df) * se
    return BlockInterval(mean, mean - h, mean + h, se, df, count, per_block, confidence)


def paired_block_interval(values: Sequence[float], reference: Sequence[float], weights: Sequence[float],
                          bounds: Sequence[int], **kw) -> BlockInterval:
    """:func:`block_interval` of ``values - reference``: two models scored on the same windows."""
    a, r = np.asarray(values, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if a.shape != r.shape:
        raise ValueError(f"values and reference: must be scored on the same windows, got {a.shape} and {r.shape}")
    return block_interval(a - r, weights, bounds, **kw)


def _check(values, weights) -> tuple[np.ndarray, np.ndarray]:
    v, w = np.asarray(values, dtype=np.float64), np.asarray(weights, dtype=np.float64)
    if v.ndim != 1 or v.shape != w.shape:
        raise ValueError(f"values and weights: must be 1-D and of one length, got {v.shape} and {w.shape}")
    if w.size and w.min() < 0:
        raise ValueError("weights: token counts must be >= 0")
    if not np.all(np.isfinite(v)):
        raise ValueError("values: must be finite")
    return v, w
