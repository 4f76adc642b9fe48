"""difftx.eval.blocks: intervals over windows of one text, by simulation in the regime they are used
in (per-window NLL of consecutive windows: an AR(1) series with rho = 0.3 per window, document
offsets, windows spread over a text with document offsets, independent windows, and documents drawn
from a larger set), for one run and for a paired difference; then the block layout itself, what
each interval is over (:func:`units`), and the errors.

The t interval over windows is printed beside each coverage (``pytest -s``) to show what the blocks
fix. About 15 s in all."""

from __future__ import annotations

import numpy as np
import pytest

from difftx.eval.blocks import (ESTIMANDS, MAX_BLOCKS, MIN_BLOCK_TOKENS, MIN_BLOCKS, block_bounds, block_interval,
                                block_means, document_bounds, paired_block_interval, units, window_bounds)
from difftx.eval.stats import t_mean_interval as t_interval

REPLICATES = 2000
T = 128  # predictions per window


def _ar1(rng, reps: int, n: int, rho: float = 0.3) -> np.ndarray:
    """``(reps, n)`` stationary AR(1) series with unit innovations (per-window NLL around its mean)."""
    e = rng.normal(size=(n, reps))  # time first: each step reads one contiguous row
    x = np.empty_like(e)
    x[0] = e[0] / np.sqrt(1 - rho ** 2)
    for i in range(1, n):
        x[i] = rho * x[i - 1] + e[i]
    return x.T


def _documents(rng, n: int, mean_windows: float, spread: str) -> np.ndarray:
    """Document index of each of ``n`` consecutive windows: documents of geometric length
    (``spread="geometric"``, lengths vary as much as their mean) or of a length uniform within
    +-50% of the mean (``"uniform"``: plays, chapters)."""
    k = int(3 * n / mean_windows) + 10
    lengths = (rng.geometric(1 / mean_windows, size=k) if spread == "geometric" else
               np.maximum(1, np.rint(mean_windows * rng.uniform(0.5, 1.5, size=k))))
    return np.searchsorted(np.cumsum(lengths), np.arange(n), side="right")


def _doc_offsets(rng, reps: int, n: int, mean_windows: float, sd: float,
                 spread: str = "geometric") -> tuple[np.ndarray, list[np.ndarray]]:
    """``(reps, n)`` per-window offsets of the document each window lies in, and each replicate's
    document index per window."""
    out, docs = np.empty((reps, n)), []
    for r in range(reps):
        d = _documents(rng, n, mean_windows, spread)
        out[r] = rng.normal(0, sd, size=d[-1] + 1)[d]
        docs.append(d)
    return out, docs


def _coverage(series: np.ndarray, tokens: np.ndarray, bounds_of=None) -> tuple[float, float, float]:
    """Coverage of the true mean 0 by the block interval and by the t interval over windows, and
    the mean ratio of their widths."""
    hits = t_hits = 0
    ratios = []
    for r, x in enumerate(series):
        b = block_bounds(tokens) if bounds_of is None else bounds_of(r)
        ci = block_interval(x, tokens, b)
        assert ci.low is not None, ci.note
        hits += ci.low <= 0 <= ci.high
        m, lo, hi = t_interval(x)
        t_hits += lo <= 0 <= hi
        ratios.append((ci.high - ci.low) / (hi - lo))
    return hits / len(series), t_hits / len(series), float(np.mean(ratios))


@pytest.mark.parametrize("n", [300, 1000, 8000])  # 4, 15 and 16 blocks
def test_autocorrelated_windows_are_covered(n):
    """AR(1), rho = 0.3 per window (measured on real text: 0.26-0.34 at 32 tokens), one run."""
    rng = np.random.default_rng(n)
    tokens = np.full(n, T)
    cov, t_cov, ratio = _coverage(_ar1(rng, REPLICATES, n), tokens)
    print(f"AR(1) n={n}: blocks {cov:.3f}, t over windows {t_cov:.3f}, width ratio {ratio:.2f}")
    assert cov >= 0.93, cov
    assert t_cov < 0.9  # what the blocks are for


@pytest.mark.parametrize("n", [300, 2000])
def test_paired_difference_of_autocorrelated_windows_is_covered(n):
    """Two models on the same consecutive windows: a text difficulty they share (AR(1), which the
    difference cancels) plus each model's own AR(1) deviations; the true difference is 0.02."""
    rng = np.random.default_rng(10 + n)
    tokens = np.full(n, T)
    shared = 3 + 2 * _ar1(rng, REPLICATES, n)
    a = shared + 0.3 * _ar1(rng, REPLICATES, n) + 0.02
    b = shared + 0.3 * _ar1(rng, REPLICATES, n)
    bounds = block_bounds(tokens)
    hits = t_hits = 0
    for x, y in zip(a, b):
        ci = paired_block_interval(x, y, tokens, bounds)
        hits += ci.low <= 0.02 <= ci.high
        _, lo, hi = t_interval(x - y)
        t_hits += lo <= 0.02 <= hi
    print(f"paired AR(1) n={n}: blocks {hits / REPLICATES:.3f}, t over windows {t_hits / REPLICATES:.3f}")
    assert hits / REPLICATES >= 0.93
    assert t_hits / REPLICATES < 0.9


def test_document_effect_with_documents_shorter_than_a_block():
    """Each document shifts the NLL of all its windows (offset SD 0.7, documents of 8 windows =
    1,024 tokens on average) on top of AR(1) noise; the documents are not known to the interval
    (one plain text file), and blocks of 8k-32k tokens hold many of them."""
    rng = np.random.default_rng(7)
    for n in (600, 8000):
        offsets, _ = _doc_offsets(rng, REPLICATES, n, 8, 0.7)
        cov, t_cov, ratio = _coverage(offsets + _ar1(rng, REPLICATES, n), np.full(n, T))
        print(f"documents of ~1k tokens, n={n}: blocks {cov:.3f}, t over windows {t_cov:.3f}, width ratio {ratio:.2f}")
        assert cov >= 0.93, (n, cov)


@pytest.mark.parametrize("docs,mean_windows,spread", [(6, 400, "uniform"), (20, 150, "uniform"),
                                                      (20, 150, "geometric")])
def test_long_documents_known_make_the_blocks(docs, mean_windows, spread):
    """Play-length documents (about 20k-50k tokens) with their own offsets: where the documents are
    known (a JSONL file, a folder of files), blocks are whole documents, and the interval covers
    (also when lengths vary as much as their mean: unequal blocks get fewer degrees of freedom);
    token blocks inside the documents would not."""
    rng = np.random.default_rng(docs + len(spread))
    n = docs * mean_windows
    tokens = np.full(n, T)
    offsets, doc_ids = _doc_offsets(rng, REPLICATES, n, mean_windows, 0.3, spread)
    series = offsets + _ar1(rng, REPLICATES, n)

    def by_document(r):
        return document_bounds(tokens, np.flatnonzero(np.diff(doc_ids[r])) + 1)

    usable = [r for r in range(REPLICATES) if len(by_document(r)) - 1 >= MIN_BLOCKS]
    assert len(usable) > 0.9 * REPLICATES  # the few with fewer than 4 documents get no interval
    cov, t_cov, _ = _coverage(series[usable], tokens, lambda r: by_document(usable[r]))
    tokens_only, _, _ = _coverage(series[usable], tokens)
    print(f"{docs} {spread} documents known: blocks of documents {cov:.3f}, blocks by position {tokens_only:.3f}, "
          f"t {t_cov:.3f}")
    assert cov >= 0.93, cov
    assert tokens_only < 0.93  # below the target: the documents must be known


def test_windows_spread_over_a_text_with_documents_are_covered():
    """2,000 windows of 128 tokens, one in every 8 of a text (the default of ``eval lm`` on a
    validation split): their AR(1) dependence has faded, but documents of about 6.4k tokens
    (offset SD 0.5) still tie neighbouring windows together. Blocks by place in the text (16,
    spanning 128k tokens each) cover; the t interval over windows does not. (Documents of 12.8k
    tokens, a tenth of a block, bring the blocks' coverage down to 0.932: whole documents about as
    long as a block need to be known, as in the test above.)"""
    rng = np.random.default_rng(8)
    n, every = 2000, 8
    tokens, starts = np.full(n, T), np.arange(n) * every * T
    bounds = block_bounds(tokens, starts)
    assert len(bounds) - 1 == MAX_BLOCKS and np.diff(bounds).tolist() == [n // MAX_BLOCKS] * MAX_BLOCKS
    hits = t_hits = 0
    for _ in range(REPLICATES):
        docs = _documents(rng, n * every, 50, "geometric")[::every]
        x = rng.normal(0, 0.5, size=docs[-1] + 1)[docs] + rng.normal(size=n)
        ci = block_interval(x, tokens, bounds)
        hits += ci.low <= 0 <= ci.high
        _, lo, hi = t_interval(x)
        t_hits += lo <= 0 <= hi
    print(f"spread windows, documents: blocks {hits / REPLICATES:.3f}, t over windows {t_hits / REPLICATES:.3f}")
    assert hits / REPLICATES >= 0.93
    assert t_hits / REPLICATES < 0.9


def test_independent_windows_are_not_made_needlessly_wide():
    """Windows whose NLLs are independent: the blocks cost little width against the t interval
    (mean width ratio about 1.07 at 15 and 16 blocks), and still cover."""
    rng = np.random.default_rng(3)
    for n, most in ((1000, 1.12), (8000, 1.11)):
        cov, t_cov, ratio = _coverage(rng.normal(size=(REPLICATES, n)), np.full(n, T))
        print(f"independent windows n={n}: blocks {cov:.3f}, t {t_cov:.3f}, width ratio {ratio:.3f}")
        assert cov >= 0.93 and ratio < most, (n, cov, ratio)


def test_block_layout():
    # 1,000 windows of 128 tokens = 128,000 tokens: 15 blocks of at least 8,192 tokens, nearly equal
    b = block_bounds([T] * 1000)
    sizes = np.diff(b) * T
    assert len(b) - 1 == 128_000 // MIN_BLOCK_TOKENS == 15 and sizes.min() >= MIN_BLOCK_TOKENS - T
    assert sizes.max() - sizes.min() <= T
    # a long text: at most MAX_BLOCKS blocks, which grow with it
    b = block_bounds([T] * 100_000)
    assert len(b) - 1 == MAX_BLOCKS and np.diff(b).min() >= 100_000 // MAX_BLOCKS
    # windows spread over a text: blocks by their place in it (40 windows over 20,000 tokens: 2 blocks)
    assert block_bounds([T] * 40, list(range(0, 20_000, 500))) == [0, 20, 40]
    assert block_bounds([T] * 3, [0, 50_000, 90_000]) == [0, 1, 2, 3]  # never more blocks than windows
    # shorter than one block: one block (and no interval); a shorter last window counts its own tokens
    assert block_bounds([T] * 10) == [0, 10]
    assert block_bounds([100] * 200 + [7]) == [0, 101, 201]  # 20,007 tokens: 2 blocks
    # documents known: one block per document, whatever its length (no minimum: a document is a unit)
    assert document_bounds([T] * 1000, [400, 410, 900]) == [0, 400, 410, 900, 1000]
    assert document_bounds([T] * 10, [5, 0, 5]) == [0, 5, 10]
    # more than MAX_BLOCKS documents: runs of consecutive documents cut at the start nearest an equal share
    b = document_bounds([T] * 100, list(range(1, 100, 3)))  # 34 documents of about 3 windows
    assert len(b) - 1 == MAX_BLOCKS and set(b[1:-1]) <= set(range(1, 100, 3)) and max(np.diff(b)) <= 9
    assert window_bounds(3) == [0, 1, 2, 3]


def test_block_interval_arithmetic():
    """Equal blocks: the token-weighted mean and sd(block means) / sqrt(B) with t on B - 1 df; the
    interval of independent windows (a block each) is the t interval."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=400)
    tokens = np.full(400, 64)
    b = [0, 100, 200, 300, 400]
    ci = block_interval(x, tokens, b)
    means = x.reshape(4, 100).mean(1)
    assert block_means(x, tokens, b) == pytest.approx(means.tolist())
    assert ci.mean == pytest.approx(x.mean()) and ci.se == pytest.approx(means.std(ddof=1) / 2)
    assert ci.df == 3 and ci.blocks == 4 and ci.tokens_per_block == 6400
    m, lo, hi = t_interval(x)
    one = block_interval(x, tokens, window_bounds(400))
    assert (one.mean, one.low, one.high) == pytest.approx((m, lo, hi))
    # unequal windows: the mean is per token, as the LM task reports it
    w = np.array([128, 128, 128, 5])
    v = np.array([1.0, 2.0, 3.0, 10.0])
    assert block_interval(v, w, [0, 1, 2, 3, 4], min_blocks=2).mean == pytest.approx((v * w).sum() / w.sum())
    # paired: the same blocks over the differences
    y = x + 0.5 + 0.1 * rng.normal(size=400)
    p = paired_block_interval(y, x, tokens, b)
    assert p.low < 0.5 < p.high and p.mean == pytest.approx((y - x).mean())


def test_too_few_blocks_give_no_interval_and_bad_input_is_refused():
    ci = block_interval(np.ones(30), np.full(30, T), block_bounds([T] * 30))
    assert ci.low is ci.high is ci.se is None and ci.blocks == 1 and "fewer than 4" in ci.note
    three = block_interval(np.arange(30.0), np.full(30, T), [0, 10, 20, 30])
    assert three.low is None and "3 blocks" in three.note
    with pytest.raises(ValueError, match="bounds"):
        block_interval(np.ones(4), np.ones(4), [0, 2, 2, 4])
    with pytest.raises(ValueError, match="bounds"):
        block_interval(np.ones(4), np.ones(4), [0, 3])
    with pytest.raises(ValueError, match="one length"):
        block_interval(np.ones(4), np.ones(3), [0, 4])
    with pytest.raises(ValueError, match="finite"):
        block_interval([1.0, float("nan")], [1, 1], [0, 1, 2])
    with pytest.raises(ValueError, match="same windows"):
        paired_block_interval(np.ones(4), np.ones(5), np.ones(4), [0, 4])
    with pytest.raises(ValueError, match="positive token counts"):
        block_bounds([128, 0])
    with pytest.raises(ValueError, match="starts: one per window"):
        block_bounds([T] * 3, [0, 500, 200])
    with pytest.raises(ValueError, match="doc_starts"):
        document_bounds([T] * 100, [101])
    with pytest.raises(ValueError, match="no windows"):
        block_interval([], [], [0])


def test_units_say_what_the_interval_is_over():
    """Documents known and the windows in at least 4: blocks of whole documents, over documents like
    these. In 2 or 3: blocks by position, over windows of this one text, and a note that says why
    not across documents. Not known (or one document): blocks by position, no note."""
    tokens = [T] * 1000  # 128,000 tokens: 15 blocks by position
    four = units(tokens, doc_starts=[250, 500, 750])
    assert (four.by, four.estimand, four.documents, four.note) == ("document", "documents", 4, None)
    assert four.bounds == [0, 250, 500, 750, 1000] and four.phrase == ESTIMANDS["documents"] == \
        "over documents like these"
    three = units(tokens, doc_starts=[300, 700])
    assert (three.by, three.estimand, three.documents) == ("position", "windows", 3)
    assert three.bounds == block_bounds(tokens) and "3 documents, too few" in three.note
    assert three.phrase == "over windows of this one text"
    plain, one = units(tokens), units(tokens, doc_starts=[])
    assert (plain.by, plain.documents, plain.note) == ("position", None, None)
    assert (one.estimand, one.documents, one.note) == ("windows", 1, None)
    # many short documents (a JSONL file of paragraphs) under 32,768 tokens: blocks of documents all the same
    short = units([T] * 100, doc_starts=list(range(5, 100, 5)))
    assert short.estimand == "documents" and len(short.bounds) - 1 == MAX_BLOCKS
    assert block_interval(np.arange(100.0), [T] * 100, short.bounds).low is not None


@pytest.mark.parametrize("drawn", [2, 4, 8])
def test_documents_drawn_from_a_larger_set_are_covered_by_blocks_of_documents(drawn):
    """K of 22 documents (30-90 windows each, offsets SD 0.5, AR(1) windows within each), drawn without
    replacement: the interval that :func:`units` chooses covers the 22-document mean at 4 and 8
    documents (blocks by position inside 4 of them do not); at 2 it is not across documents at all
    (``benchmarks/document_coverage.py`` runs the play-length version)."""
    rng = np.random.default_rng(38 + drawn)
    lengths = rng.integers(30, 91, size=22)
    runs, hits, position_hits, across = 600, 0, 0, 0
    for _ in range(runs):
        offsets = rng.normal(0, 0.5, size=22)
        pick = rng.choice(22, size=drawn, replace=False)
        per = lengths[pick]
        x = np.concatenate([offsets[d] + _ar1(rng, 1, int(m))[0] for d, m in zip(pick, per)])
        tokens = np.full(x.size, T)
        truth = float((offsets * lengths).sum() / lengths.sum())
        u = units(tokens, doc_starts=np.cumsum(per)[:-1])
        pos = block_interval(x, tokens, block_bounds(tokens, min_tokens=1024))  # 16 blocks by position
        position_hits += pos.low <= truth <= pos.high
        if u.estimand == "documents":
            across += 1
            ci = block_interval(x, tokens, u.bounds)
            hits += ci.low <= truth <= ci.high
    print(f"{drawn} of 22 documents: by document {hits / max(across, 1):.3f} ({across} intervals), "
          f"by position {position_hits / runs:.3f}")
    if drawn < MIN_BLOCKS:
        assert across == 0  # no interval across documents below 4
        return
    assert across == runs and hits / runs >= 0.90, hits / runs
    if drawn == 4:  # blocks by position see the dependence within a document only
        assert position_hits / runs < 0.85, position_hits / runs
