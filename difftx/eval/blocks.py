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
- Where the text's documents are known (the records of a JSONL file, the files of a folder, the
  separator that opens every packed document), and the windows lie in at least ``MIN_BLOCKS`` (4)
  of them, the blocks are whole documents instead (:func:`document_bounds`): one document each, or
  with more than ``MAX_BLOCKS`` documents, runs of consecutive documents of about equal text. The
  interval is then *over documents like these*: blocks by position inside a few documents measure
  the dependence within a document only, and in simulation (``benchmarks/document_coverage.py``)
  their 95% intervals covered the mean of the 22 documents the 4 or 8 were drawn from far less
  often than 95%.
- Where documents are not known (one plain text file), or the windows lie in fewer than 4 of
  them, the blocks are by position and the interval is *over windows of this one text*: other
  windows of the same documents, not other documents. :func:`units` decides, and says which
  (``Units.estimand``); with 2-3 documents known it says why there is no interval across them.
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
sampling error. The interval is about text like it: other documents like these (blocks by
document), or other windows of the same documents (blocks by position). :data:`ESTIMANDS` holds
the two phrases every report prints.

The coverage of these intervals is checked by simulation in ``tests/test_blocks.py`` (an AR(1)
series of window means, document offsets, independent windows, documents drawn from a larger
set) and ``benchmarks/document_coverage.py``.
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
# what an interval over blocks is about (``Units.estimand``): the phrase every report prints
ESTIMANDS = {"documents": "over documents like these", "windows": "over windows of this one text"}


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
                 min_tokens: int = MIN_BLOCK_TOKENS, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Window indices ``[0, i_1, ..., n]`` that cut windows (holding ``window_tokens`` predictions
    each, in text order) into contiguous blocks by their place in the text: ``starts`` (each
    window's first token; default: the windows are consecutive). The text they span is cut into
    ``min(max_blocks, span // min_tokens, n)`` stretches of equal length, and a block holds the
    windows that start in one stretch (with fewer than two stretches: ``[0, n]``, one block)."""
    w, pos = _positions(window_tokens, starts)
    if min_tokens < 1 or max_blocks < 1:
        raise ValueError(f"min_tokens and max_blocks: must be >= 1, got {min_tokens} and {max_blocks}")
    n = int(w.size)
    if n == 0:
        return [0, 0]
    span = float(pos[-1] + w[-1] - pos[0])
    count = min(max_blocks, int(span // min_tokens), n)
    if count <= 1:
        return [0, n]
    cuts = np.searchsorted(pos - pos[0], np.arange(1, count) * (span / count), side="left")
    inner = sorted({int(c) for c in cuts if 0 < c < n})
    return [0] + inner + [n]


def document_bounds(window_tokens: Sequence[int], doc_starts: Sequence[int], starts: Optional[Sequence[int]] = None,
                    *, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Window indices of blocks of whole documents: ``doc_starts`` are the indices of the windows that
    begin a document (0 is implied). Up to ``max_blocks`` documents, one block per document; with
    more, ``max_blocks`` runs of consecutive documents, each cut at the document start nearest to an
    equal share of the text (``starts`` as in :func:`block_bounds`). No minimum length: a document is
    a unit whatever its length."""
    w, pos = _positions(window_tokens, starts)
    if max_blocks < 1:
        raise ValueError(f"max_blocks: must be >= 1, got {max_blocks}")
    n = int(w.size)
    docs = _doc_starts(doc_starts, n)
    if n == 0:
        return [0, 0]
    if docs.size <= max_blocks:
        return docs.tolist() + [n]
    at = pos[docs] - pos[0]
    targets = np.arange(1, max_blocks) * (float(pos[-1] + w[-1] - pos[0]) / max_blocks)
    right = np.minimum(np.searchsorted(at, targets, side="left"), docs.size - 1)
    left = np.maximum(right - 1, 0)
    nearest = np.where(np.abs(at[left] - targets) <= np.abs(at[right] - targets), left, right)
    inner = sorted({int(docs[i]) for i in nearest if 0 < docs[i] < n})
    return [0] + inner + [n]


@dataclass(frozen=True)
class Units:
    """What an interval over windows is over: the ``bounds`` of its blocks, cut ``by`` "document" or
    "position"; its ``estimand`` ("documents": over documents like these; "windows": over windows of
    this one text; :data:`ESTIMANDS`); the ``documents`` the windows lie in (``None``: not known);
    and, where documents are known but too few for blocks of them, a ``note`` saying so."""

    bounds: list
    by: str
    estimand: str
    documents: Optional[int] = None
    note: Optional[str] = None

    @property
    def phrase(self) -> str:
        return ESTIMANDS[self.estimand]


def units(window_tokens: Sequence[int], starts: Optional[Sequence[int]] = None, *,
          doc_starts: Optional[Sequence[int]] = None, min_tokens: int = MIN_BLOCK_TOKENS,
          max_blocks: int = MAX_BLOCKS, min_blocks: int = MIN_BLOCKS) -> Units:
    """The blocks of an interval over windows and what it is about. With ``doc_starts`` (the indices
    of the windows that begin a document; documents known) and windows in at least ``min_blocks``
    documents: blocks of whole documents (:func:`document_bounds`), over documents like these.
    Otherwise blocks by position (:func:`block_bounds`), over windows of this one text; with 2 or 3
    documents known, ``note`` says that they are too few for an interval across documents."""
    n = len(window_tokens)
    if doc_starts is None:
        return Units(block_bounds(window_tokens, starts, min_tokens=min_tokens, max_blocks=max_blocks),
                     "position", "windows")
    docs = int(_doc_starts(doc_starts, n).size) if n else 0
    if docs >= min_blocks:
        return Units(document_bounds(window_tokens, doc_starts, starts, max_blocks=max_blocks), "document",
                     "documents", docs)
    note = None if docs < 2 else (f"the windows lie in {docs} documents, too few for an interval "
                                  f"{ESTIMANDS['documents']}, which needs {min_blocks}")
    return Units(block_bounds(window_tokens, starts, min_tokens=min_tokens, max_blocks=max_blocks), "position",
                 "windows", docs, note)


def _positions(window_tokens, starts) -> tuple[np.ndarray, np.ndarray]:
    """The windows' token counts and their place in the text (the tokens before each, when consecutive)."""
    w = np.asarray(window_tokens, dtype=np.float64)
    if w.ndim != 1 or (w.size and w.min() <= 0):
        raise ValueError("window_tokens: must be a 1-D sequence of positive token counts")
    if starts is None:
        return w, np.concatenate([[0.0], np.cumsum(w)[:-1]])
    pos = np.asarray(starts, dtype=np.float64)
    if pos.shape != w.shape or np.any(np.diff(pos) < 0):
        raise ValueError("starts: one per window, in text order")
    return w, pos


def _doc_starts(doc_starts, n: int) -> np.ndarray:
    """The sorted window indices that begin a document, 0 included (none beyond the last window)."""
    d = np.asarray(sorted({int(s) for s in doc_starts}), dtype=np.int64)
    if d.size and (d[0] < 0 or d[-1] > n):
        raise ValueError(f"doc_starts: window indices must lie in [0, {n}]")
    return np.union1d(d[d < n], [0]).astype(np.int64) if n else d[:0]


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
