"""Paired comparisons: DIFF minus its baseline over seeds, with a bootstrap CI and a verdict.

Every comparison in difftx is paired (SPEC section 5): seed ``i`` of the DIFF model and seed
``i`` of the baseline share data order and initial seed. The statistic is the mean of the
per-seed differences ``diff_i - base_i``; its 95% CI is the percentile interval of that mean
over ``n_boot`` resamples of the pairs with replacement (seeded, so repeatable).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

# below this many paired seeds the percentile bootstrap has few distinct resamples (10 for 3 seeds) and
# its CI is too narrow: a CI that excludes 0 is then reported as suggestive, never as a conclusion
FEW_SEEDS = 5


@dataclass
class PairedDifference:
    """``mean`` of ``diff - baseline`` over ``n`` pairs with its bootstrap CI ``[low, high]``."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float
    diff_mean: float
    baseline_mean: float

    @property
    def excludes_zero(self) -> bool:
        return self.n > 1 and (self.low > 0 or self.high < 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "excludes_zero": self.excludes_zero}


def paired_bootstrap(diff: Sequence[float], baseline: Sequence[float], *, n_boot: int = 10_000,
                     confidence: float = 0.95, seed: int = 0) -> PairedDifference:
    """Bootstrap CI of the mean paired difference ``diff[i] - baseline[i]``."""
    a, b = np.asarray(diff, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"diff and baseline must be equal-length, non-empty 1-D sequences "
                         f"(got {a.shape} and {b.shape})")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    d = a - b
    if d.size == 1:
        return PairedDifference(float(d[0]), float(d[0]), float(d[0]), 1, confidence, float(a[0]), float(b[0]))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_boot, d.size))
    means = d[idx].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return PairedDifference(float(d.mean()), float(low), float(high), int(d.size), confidence,
                            float(a.mean()), float(b.mean()))


def verdict(result: PairedDifference, metric: str, *, lower_is_better: bool, unit: str = "",
            digits: int = 3) -> str:
    """A plain-language sentence: the difference, its CI and one of: no conclusion (one seed),
    within noise (the CI contains 0), suggestive (the CI excludes 0 but fewer than
    :data:`FEW_SEEDS` seeds), DIFF is better / worse."""
    u = f" {unit}" if unit else ""
    f = f"{{:+.{digits}f}}"
    head = f"{metric}: DIFF - baseline = {f.format(result.mean)}{u}"
    if result.n == 1:
        return head + " (one seed: no confidence interval, so no conclusion)"
    pct = round(100 * result.confidence)
    ci = f" ({pct}% CI [{f.format(result.low)}, {f.format(result.high)}] over {result.n} paired seeds)"
    few = (f"; with only {result.n} seeds a bootstrap CI understates the uncertainty"
           if result.n < FEW_SEEDS else "")
    if not result.excludes_zero:
        return head + ci + ": within noise (the CI contains 0)" + few
    better = "better" if (result.mean < 0) == lower_is_better else "worse"
    if result.n < FEW_SEEDS:
        return (head + ci + f": suggests DIFF is {better} (the CI excludes 0), but {result.n} seeds are too few for "
                "a conclusion" + few)
    return head + ci + f": DIFF is {better} (the CI excludes 0)"


def mean_and_ci(values: Sequence[float], *, n_boot: int = 10_000, confidence: float = 0.95,
                seed: int = 0) -> tuple[float, Optional[float], Optional[float]]:
    """Mean of one model's values over seeds with a bootstrap CI (``None`` bounds for one value)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("mean_and_ci needs at least one value")
    if v.size == 1:
        return float(v[0]), None, None
    r = paired_bootstrap(v, np.zeros_like(v), n_boot=n_boot, confidence=confidence, seed=seed)
    return r.mean, r.low, r.high
