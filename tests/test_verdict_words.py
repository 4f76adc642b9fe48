"""What a verdict says and what its interval covers: the words by estimand and each printed interval's coverage of the
estimand its label names, a small version of benchmarks/verdict_rates.py (tables 2 and 4)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from difftx.eval.stats import paired_estimate, seed_median_interval, seeds_words, verdict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import verdict_rates  # noqa: E402


def test_the_words_name_the_seeds_side_and_a_disagreeing_mean():
    assert seeds_words("DIFF", 7, 0, 7, -0.3) == "DIFF lower in 7 of 7 seeds"
    assert seeds_words("DIFF", 1, 6, 7, -0.02) == ("DIFF higher in 6 of 7 seeds, though lower on average: most seeds "
                                                   "and the mean disagree")
    assert seeds_words("DIFF", 3, 3, 7, 0.1) == "DIFF lower in 3 and higher in 3 of 7 seeds, higher on average"


def test_better_or_worse_only_where_the_mean_is_established():
    """Equal means, skewed differences (90% +0.056, 10% -0.5) at 7 seeds: the verdict on exchangeability comes often,
    and no sentence says "better" or "worse" (the betting test at 7 seeds cannot establish such a mean); an
    unbounded metric never says it, and says its mean is not established."""
    rng = np.random.default_rng(3)
    verdicts = words = 0
    for _ in range(60):
        base = rng.uniform(0.55, 0.9, 7)
        d = np.where(rng.random(7) < 0.1, -0.5, 0.05 / 0.9) + rng.normal(0, 0.01, 7)
        for bounds in ((0.0, 1.0), None):
            e = paired_estimate(base + d, base, bounds=bounds)
            text = verdict(e, "x", lower_is_better=False, adjusted_p=e.p_value)
            verdicts += "not interchangeable" in text
            words += verdict_rates.WORD.search(text) is not None
            if bounds is None and "not interchangeable" in text:
                assert "the mean difference is not established" in text and "of the median [" in text
    assert verdicts > 20 and words == 0


@pytest.mark.parametrize("kind", ["skewed", "rare"])
def test_the_printed_interval_covers_what_its_label_names(kind):
    """The interval of the median seed difference covers the true median at 7 and 10 seeds, skewed or with a rare
    failure (seed values alone, and with 16 examples whose shared effect moves every seed), where the t and sign-flip
    hull missed the mean in a third or more of runs (benchmarks/verdict_rates.py, table 4)."""
    for what in ("unbounded", "examples"):
        extra = verdict_rates.NOISE_SD / np.sqrt(verdict_rates.EXAMPLES) if what == "examples" else 0.0
        median = verdict_rates._median(kind, extra)
        for n in (7, 10):
            rng = verdict_rates._rng("test", what, kind, n)
            hits = 0
            for _ in range(300):
                x = verdict_rates._draw4(what, kind, rng, n)
                _, lo, hi = seed_median_interval(x["diff"] - x["baseline"], x.get("diff_examples"))
                hits += lo <= median <= hi
            assert hits / 300 >= 0.93, (what, kind, n, hits)
    x = verdict_rates._draw4("examples", kind, verdict_rates._rng("one", kind), 10)
    e = paired_estimate(**x)  # what the compare prints: the same interval
    assert e.interval_of == "median" and e.printed_interval() == seed_median_interval(
        x["diff"] - x["baseline"], x["diff_examples"])[1:]


def test_the_median_interval_is_widened_by_the_examples_shared_effect():
    d = np.linspace(-1.0, 1.0, 10)
    D = d[:, None] + np.linspace(-0.5, 0.5, 16)[None, :] * np.linspace(0.5, 1.5, 10)[:, None]
    _, lo, hi = seed_median_interval(D.mean(1), D)
    _, lo0, hi0 = seed_median_interval(D.mean(1))
    assert lo < lo0 and hi > hi0  # the examples' shared part adds width
    flat = np.tile(d[:, None], (1, 16))  # the examples add nothing: the order statistics alone
    assert seed_median_interval(d, flat)[1:] == seed_median_interval(d)[1:] == (d[1], d[8])
    assert seed_median_interval(d[:5])[1:] == (None, None)  # 5 seeds: no distribution-free interval
