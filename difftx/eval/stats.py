"""Paired comparisons that hold at small n: DIFF minus its baseline over seeds and evaluation
examples, with an interval whose coverage is checked by simulation (tests/test_stats.py).

Every comparison in difftx is paired: seed ``s`` of every arm shares the data order and seed,
and every model is scored on the same evaluation examples. A metric's paired difference is
``D[s, i] = diff[s, i] - baseline[s, i]`` over seeds ``s = 1..n`` and examples ``i = 1..m``
(windows, prompts, episodes), and the estimate is its grand mean. Two sources of noise enter
it: which seeds were drawn (training noise) and which examples were drawn (evaluation-set noise,
shared by every seed because the examples are the same). With the two-way decomposition
``D = mu + a_s + b_i + e_si``, the variance of the mean is ``sigma_a^2/n + sigma_b^2/m +
sigma_e^2/(n m)``. It is estimated in two parts: the seed part, the variance of the seeds' row
means over ``n`` (which holds ``sigma_a^2/n + sigma_e^2/(n m)``, ``n-1`` degrees of freedom), and
the example part, ``(MS_example - MS_residual)/(n m)`` (``m-1``). The interval's half-width
scales each part by the t quantile of its own degrees of freedom, a conservative rule
(Banerjee's) that keeps its nominal coverage when one part has very few degrees of freedom, as
the seed part does at 2-3 seeds. (An earlier version split the residual off the seed part; when
a few seeds agreed by chance, the seed part collapsed to 0 and a large-sample quantile was left
on a small-sample estimate: two seeds at a ceiling read as p = 5e-6.)
Metrics without per-example values (extremes, a training step) get the paired t-interval over
seeds (``n-1`` degrees of freedom). The p-value is the level at which the interval just reaches
0. An exact sign-flip (randomisation) p-value over the seeds' differences is reported beside
it; it needs no distributional assumption but cannot fall below ``2 / 2^n`` (0.25 at 3 seeds).

Multiplicity: :func:`holm` adjusts a family of p-values (and :func:`benjamini_hochberg` is
there for false-discovery control).

Benchmarks: :func:`median_interval` is the distribution-free (order-statistic) interval of a
median, used on the round-by-round time ratios of ``difftx bench`` and the training benchmark.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

# -- the Student t distribution (no SciPy) -------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function ``I_x(a, b)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df > 0`` degrees of freedom (non-integer allowed)."""
    if df <= 0:
        raise ValueError(f"df: must be positive, got {df}")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (Newton from a normal start)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p: must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    z = _normal_quantile(p)
    # Cornish-Fisher start, then Newton steps on the CDF
    x = z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    for _ in range(50):
        pdf = math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))
        step = (t_cdf(x, df) - p) / max(pdf, 1e-300)
        x -= max(min(step, 10.0), -10.0)
        if abs(step) < 1e-12 * max(1.0, abs(x)):
            break
    return x


def _normal_quantile(p: float) -> float:
    """Standard normal quantile (bisection on erf; used only as a starting point)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# -- the paired estimate ----------------------------------------------------------------------


@dataclass
class PairedEstimate:
    """DIFF - baseline: ``mean`` with its two-sided interval ``[low, high]`` at ``confidence``
    (``None`` with one seed), ``p_value`` (the level at which the interval just reaches 0),
    ``sign_flip_p`` (exact, over seeds), and what the interval covers (``method``)."""

    mean: float
    low: Optional[float]
    high: Optional[float]
    p_value: Optional[float]
    sign_flip_p: Optional[float]
    n: int  # seeds
    n_examples: int  # aligned examples per seed (1: seed-level only)
    confidence: float
    method: str
    diff_mean: float
    baseline_mean: float

    @property
    def excludes_zero(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "excludes_zero": self.excludes_zero}


def _components(D: np.ndarray) -> list[tuple[float, float]]:
    """``[(variance contribution to the mean, degrees of freedom)]`` of an ``(n, m)`` table.

    The seed part is the variance of the seeds' row means over ``n`` (it holds the seed effect and
    the seed-by-example noise averaged over the row), with ``n - 1`` degrees of freedom; the example
    part is the example effect shared by every seed (the same examples for all), from the two-way
    mean squares, with ``m - 1``. Not splitting the seed part further keeps it from collapsing to 0
    when a few seeds happen to agree (two seeds at a ceiling), which would leave a large-sample
    quantile on what is a small-sample estimate."""
    n, m = D.shape
    rows = D.mean(1)
    seed = (float(rows.var(ddof=1)) / n, n - 1)
    if m == 1:
        return [seed]
    gm, cols = D.mean(), D.mean(0)
    ms_e = n * float(((cols - gm) ** 2).sum()) / (m - 1)
    ms_r = float(((D - rows[:, None] - cols[None, :] + gm) ** 2).sum()) / ((n - 1) * (m - 1))
    return [seed, (max(ms_e - ms_r, 0.0) / (n * m), m - 1)]


def _half_width(parts: list[tuple[float, float]], alpha: float) -> float:
    return math.sqrt(sum(v * t_quantile(1 - alpha / 2, df) ** 2 for v, df in parts if v > 0))


def half_width(D: np.ndarray, confidence: float = 0.95) -> float:
    """Half-width of the interval of ``D.mean()`` for a table ``D`` ``(seeds, examples)`` of
    paired differences (one column: seed-level values only)."""
    return _half_width(_components(np.asarray(D, dtype=np.float64)), 1 - confidence)


def _p_value(mean: float, parts: list[tuple[float, float]]) -> float:
    if not any(v > 0 for v, _ in parts):
        return 1.0 if mean == 0 else 0.0
    lo, hi = 1e-12, 1.0  # the half-width falls as alpha grows: find alpha where it equals |mean|
    if _half_width(parts, lo) <= abs(mean):
        return lo
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if _half_width(parts, mid) > abs(mean):
            lo = mid
        else:
            hi = mid
    return hi


def sign_flip_p(d: Sequence[float], max_exact: int = 16, draws: int = 100_000, seed: int = 0) -> float:
    """Two-sided randomisation p-value of ``mean(d) = 0`` by flipping the signs of the paired
    differences ``d``: exact over all ``2^n`` flips up to ``max_exact`` seeds, else ``draws``
    random flips."""
    x = np.asarray(d, dtype=np.float64)
    obs = abs(x.mean())
    if x.size <= max_exact:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=x.size)))
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(draws, x.size))
    return float((np.abs((signs * x).mean(1)) >= obs - 1e-12).mean())


def paired_estimate(diff: Sequence[float], baseline: Sequence[float], *,
                    diff_examples: Optional[np.ndarray] = None, baseline_examples: Optional[np.ndarray] = None,
                    confidence: float = 0.95) -> PairedEstimate:
    """The paired difference of per-seed values ``diff`` and ``baseline`` (length n). With
    ``*_examples`` ``(n, m)`` (the same m examples, in the same order, for every seed and both
    arms; a seed's value is the mean of its row) the interval includes evaluation-set noise."""
    a, b = np.asarray(diff, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"diff and baseline must be equal-length, non-empty 1-D sequences (got {a.shape} and "
                         f"{b.shape})")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    n = a.size
    if diff_examples is not None and baseline_examples is not None:
        da, db = np.asarray(diff_examples, dtype=np.float64), np.asarray(baseline_examples, dtype=np.float64)
        if da.shape != db.shape or da.ndim != 2 or da.shape[0] != n:
            raise ValueError(f"per-example values must be (seeds, examples) alike for both arms, got {da.shape} and "
                             f"{db.shape} for {n} seeds")
        D, method = da - db, "paired t, seeds x examples (two-level)"
    else:
        D, method = (a - b)[:, None], "paired t over seeds"
    mean = float((a - b).mean())
    if n == 1:
        return PairedEstimate(mean, None, None, None, None, 1, D.shape[1], confidence, "one seed: no interval",
                              float(a[0]), float(b[0]))
    parts = _components(D)
    h = _half_width(parts, 1 - confidence)
    return PairedEstimate(mean, mean - h, mean + h, _p_value(mean, parts), sign_flip_p(a - b), n, D.shape[1],
                          confidence, method, float(a.mean()), float(b.mean()))


def mean_interval(values: Sequence[float], examples: Optional[np.ndarray] = None,
                  confidence: float = 0.95) -> tuple[float, Optional[float], Optional[float]]:
    """One arm's mean over seeds with its interval (the same construction, against 0)."""
    v = np.asarray(values, dtype=np.float64)
    z = None if examples is None else np.zeros_like(np.asarray(examples, dtype=np.float64))
    e = paired_estimate(v, np.zeros_like(v), diff_examples=examples, baseline_examples=z, confidence=confidence)
    return e.mean, e.low, e.high


def median_interval(values: Sequence[float],
                    confidence: float = 0.95) -> tuple[float, Optional[float], Optional[float]]:
    """Median of ``values`` with a distribution-free interval: the order statistics ``x_(l)``,
    ``x_(n+1-l)`` with the largest rank ``l`` for which ``P(Binomial(n, 1/2) < l) <= (1 - confidence) / 2``
    (exact binomial tails, integer arithmetic). For independent draws of any continuous distribution
    it covers the population median with probability at least ``confidence``; benchmarks use it on
    per-round paired time ratios. Bounds are ``None`` when ``n`` is too small for any such interval
    (fewer than 6 values at 95%)."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = x.size
    if n == 0:
        raise ValueError("median_interval: no values")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence!r}")
    med = float(np.median(x))
    # tail(k) = P(Bin(n, 1/2) <= k - 1) * 2^n, compared with alpha/2 * 2^n exactly
    limit = Fraction(1 - confidence) / 2 * 2 ** n
    below, rank = 0, 0
    for k in range(n // 2 + 1):
        below += math.comb(n, k)  # P(Bin <= k) * 2^n
        if below > limit:
            break
        rank = k + 1  # P(Bin < rank) = P(Bin <= k) <= alpha/2
    if rank == 0:
        return med, None, None
    return med, float(x[rank - 1]), float(x[n - rank])


# -- multiplicity -----------------------------------------------------------------------------


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control), in the input order."""
    p = np.asarray(p_values, dtype=np.float64)
    order = np.argsort(p)
    adj = np.empty_like(p)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (p.size - rank) * p[i]))
        adj[i] = running
    return adj.tolist()


def benjamini_hochberg(p_values: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (false-discovery-rate control), in the input order."""
    p = np.asarray(p_values, dtype=np.float64)
    order = np.argsort(p)[::-1]
    adj = np.empty_like(p)
    running = 1.0
    for k, i in enumerate(order):
        running = min(running, p[i] * p.size / (p.size - k))
        adj[i] = running
    return adj.tolist()


# -- wording ----------------------------------------------------------------------------------


def verdict(est: PairedEstimate, metric: str, *, lower_is_better: bool, adjusted_p: Optional[float] = None,
            alpha: float = 0.05, unit: str = "", digits: int = 3, names: tuple[str, str] = ("DIFF", "baseline")) -> str:
    """A plain sentence: "DIFF better/worse" (the first of ``names``) only where the (adjusted)
    test rejects at ``alpha``, otherwise "no detectable difference" with the range of differences
    the interval allows; always "at this scale and budget"."""
    u = f" {unit}" if unit else ""
    f = f"{{:+.{digits}f}}"
    head = f"{metric}: {names[0]} - {names[1]} = {f.format(est.mean)}{u}"
    if est.low is None:
        return head + " (one seed: no interval, so no conclusion)"
    p = est.p_value if adjusted_p is None else adjusted_p
    ci = (f" ({round(100 * est.confidence)}% interval [{f.format(est.low)}, {f.format(est.high)}] over {est.n} paired "
          f"seeds{'' if est.n_examples == 1 else f' x {est.n_examples} examples'}; p = {p:.3g}"
          f"{' adjusted' if adjusted_p is not None else ''})")
    if p < alpha:
        better = "better" if (est.mean < 0) == lower_is_better else "worse"
        return head + ci + f": {names[0]} is {better} at this scale and budget"
    return (head + ci + f": no detectable difference at this scale and budget; the interval allows anything from "
            f"{f.format(est.low)} to {f.format(est.high)}{u}")
