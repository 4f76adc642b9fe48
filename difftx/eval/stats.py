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
the seed part does at 2-3 seeds. The residual stays in the seed part: split off, the seed part
falls to 0 when a few seeds agree by chance, leaving a large-sample quantile on a small-sample
estimate.
Metrics without per-example values (extremes, a training step) get the paired t-interval over
seeds (``n-1`` degrees of freedom).

Few seeds, and seeds that learn a task or not. The t interval assumes roughly normal seed
effects. When each seed of each arm either learns a task or does not (retrieval in the demo), the
seeds' values sit in a few modes, and at 2-5 seeds the t interval's coverage falls to 0.6-0.85
(tests/test_stats_lottery.py and benchmarks/stats_lottery.py simulate it). So every difference
is also backed by the exact sign-flip (randomisation) test over the seeds' differences, which
assumes no distribution: under the null
the two arms of a seed are exchangeable, so each difference is as likely positive as negative. Its
smallest p-value is ``2 / 2^n``, 0.0625 at 5 seeds: no verdict is possible below 6 seeds, and
:func:`seeds_for_verdict` says how many a Holm family needs. The p-value is the larger of the t
and the sign-flip p-values (never 0: a constant difference gets the sign-flip p). The interval is
the hull of the t interval and the sign-flip interval (:func:`sign_flip_interval`), with the betting
one for a bounded metric (below), clipped to the metric's range; it is ``None`` where it is unbounded
(below 6 seeds), with the reason in ``PairedEstimate.note``. These intervals are unadjusted: verdicts
use the Holm-adjusted p-value.

Two estimands. The t test and the sign-flip test reject *exchangeability*: that a seed's two arms
are interchangeable, so its difference is as likely +d as -d. Under that null a verdict is valid at
any distribution, and verdicts are drawn on it for every metric, worded as what it is ("the arms are
not interchangeable: DIFF lower in 7 of 7 seeds"). It is not a statement about means: where most seeds
gain a little and a few fail badly (equal means, skewed differences), both tests reject at rates far
above 5% (benchmarks/verdict_rates.py). So a metric with known bounds (accuracies, rates, steps within
a budget) also gets a test of the *mean* that assumes nothing else, stated beside the verdict ("mean
established", or "not yet established: about N seeds", :func:`seeds_for_mean`): the betting test of the
paired differences, which lie in ``[-(high - low), high - low]`` (:func:`betting_interval`,
``betting_p``), whose interval joins the printed hull so that the interval covers the mean. It is
wide at few seeds because it must be: at 8 seeds it rejects only differences of most of the range. An
unbounded metric (an NLL) has no finite-sample test of its mean; the verdict alone speaks for it.

Looks. Every reading of a folder with another set of seeds is a look at the same question. Look ``k`` is
given the share ``w_k`` of alpha (:func:`look_share`): 0.95 at the first look, and the remaining 0.05 spread
over the later ones as ``0.05 * 6 / (pi^2 (k - 1)^2)``, so the shares sum to 1 over any number of looks and
a false verdict at any look has chance at most alpha (Bonferroni over looks). Its p-values (both estimands)
are multiplied by ``1 / w_k`` (:func:`look_factor`, :func:`look_adjusted`): x1.053 at the first look (7 seeds
still allow a verdict in a family of 3), x32.9 at the second, x132 at the third (benchmarks/looks_error.py).

P-values are never 0. The exact sign-flip test's smallest is ``2 / 2^(n - ties)`` (``1 / (draws + 1)``
from random flips, above 16 seeds); the t test's tail is computed without cancellation
(:func:`t_two_sided_p`) and stored as :data:`P_FLOOR` where it lies below it (a bound: ``p <= 1e-300``);
a t test of two parts as ``1e-12`` below that (a bound); the betting p is ``1 / capital``, a finite
capital. Differences without spread have no t test (``p_t`` ``None``), and a constant difference gets the
sign-flip p.

Ties. Seeds whose two arms score the same value (two models that both never learned within the
budget, censored at the same step) carry no sign: the sign-flip test is decided by the other seeds,
and its smallest p-value is ``2 / 2^(n - ties)``. :class:`PairedEstimate` counts them (``ties``) and
the verdict names them when they are why no verdict is possible.

Power. :func:`seeds_for_verdict` is the least number of seeds at which a verdict is *possible*;
:func:`seeds_for_power` (:func:`power_plan`, with what it assumed) is the number at which the rule
finds a difference in 80% of repeats, planned for the pessimistic end of what the observed seeds show:
the lower 85% bound of their effect / SD, with their shape (a lottery's modes) kept, and for a bounded
metric, or any metric whose seeds split into modes (:func:`seeds_split`), also the largest share of seeds
on the far side of 0 that 90% confidence allows (a lottery's losing seeds, which 5 seeds can all miss). Planned for the observed differences as they are, the true
power at the answer was 0.43-0.73 for effects of 0.5-1.2 SD from pilots of 5 and 8 seeds, and about 0.1
for 5-seed pilots of a noisy lottery that drew no losing seed (benchmarks/power_delivered.py).

One arm's mean (:func:`mean_interval`) has no symmetry to lean on: the lottery makes it skewed. For
a metric with known bounds (accuracies, rates) its interval is the hull of the t interval and a
betting interval (:func:`betting_interval`, Waudby-Smith and Ramdas' hedged capital process),
which holds for any distribution inside the bounds at any number of seeds, and is wide at few
seeds because it must be: distribution-free and conservative (its coverage is at least 0.99 in
the simulations). An unbounded metric gets the hull with the sign-flip interval.

Multiplicity: :func:`holm` adjusts a family of p-values.

Benchmarks: :func:`median_interval` is the distribution-free (order-statistic) interval of a
median, used on the round-by-round time ratios of ``difftx bench`` and the training benchmark.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from dataclasses import asdict, dataclass
from decimal import ROUND_CEILING, Decimal
from fractions import Fraction
from typing import Optional, Sequence

import numpy as np

from ..arm_table import ARM_LABELS, PRIMARY

DEFAULT_NAMES = tuple(ARM_LABELS[a] for a in PRIMARY)  # a verdict's two samples unless named: DIFF - baseline

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


P_FLOOR = 1e-300  # the least p-value a t or F test reports: the tail below it is a bound, "p <= 1e-300"


def t_two_sided_p(t: float, df: float) -> float:
    """The two-sided p-value ``P(|T| >= |t|)`` of Student's t with ``df`` degrees of freedom, from the tail itself
    (``I_{df / (df + t^2)}(df / 2, 1 / 2)``, not ``1 - CDF``, which rounds to 0 once the tail is below about 1e-16:
    ``|t|`` beyond 58 at 14 seeds, 985 at 7) and at least :data:`P_FLOOR` (a bound where the tail underflows; ``|t|``
    infinite included): never 0."""
    if not df > 0:
        raise ValueError(f"t_two_sided_p: df must be positive, got {df}")
    if math.isnan(t):
        raise ValueError("t_two_sided_p: t is NaN")
    if math.isinf(t):
        return P_FLOOR
    return min(1.0, max(P_FLOOR, betainc(df / 2.0, 0.5, df / (df + t * t))))


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
    """Standard normal quantile (the standard library's; used only as a starting point)."""
    return statistics.NormalDist().inv_cdf(p)


# -- the paired estimate ----------------------------------------------------------------------


# the note of a paired difference whose seeds all differ by the same amount: an interval of width 0 would claim a
# certainty that no spread backs, so there is none (the sign-flip test of exchangeability still applies)
NO_SPREAD = "no spread, so no interval"


def round_p(p: Optional[float], digits: int = 4) -> Optional[float]:
    """A p-value kept to ``digits`` significant digits (a p-value is not known to 16), rounded up, so that a stored p
    is never below the test's (a sign-flip p of 2 / 2^8 = 0.0078125 is kept as 0.007813, not 0.007812) and never 0."""
    if p is None or not p > 0 or not math.isfinite(p):
        return p
    e = math.floor(math.log10(p)) - (digits - 1)
    up = float((Decimal(repr(p)).scaleb(-e).to_integral_value(rounding=ROUND_CEILING)).scaleb(e))
    return up if up >= p else math.nextafter(up, math.inf)


def p_text(p: float, digits: int = 3) -> str:
    """A p-value as printed: ``digits`` significant digits, rounded up like :func:`round_p`, so that no printed p is
    below the test's floor (``:.3g`` printed 2/64 = 0.03125 as 0.0312, and ``:.2g`` 0.625 as 0.62)."""
    return "-" if p is None else f"{round_p(p, digits) if p < 1 else p:.{digits}g}"


@dataclass
class PairedEstimate:
    """DIFF - baseline: ``mean`` with its two-sided, unadjusted interval ``[low, high]`` at
    ``confidence`` (``None`` with one seed, or where no distribution-free test can back one: ``note``
    says why; for a bounded metric it holds the betting interval, so it covers the mean), two estimands'
    tests: ``p_value``, the test that the two arms of a seed are interchangeable (the larger of ``p_t``
    and ``sign_flip_p``: what verdicts are drawn on, for every metric), and for a bounded metric
    ``betting_p``, the test of the mean difference (stated beside the verdict: "mean established" or
    not), and what the interval covers (``method``). ``p_t`` is ``None`` where the differences have no
    spread (a t test is undefined there). ``ties``: seeds whose two arms scored the same value (no sign
    for the sign-flip test); ``lower`` / ``higher``: seeds where the first arm scored below / above."""

    mean: float
    low: Optional[float]
    high: Optional[float]
    p_value: Optional[float]  # exchangeability: the larger of p_t and sign_flip_p (what verdicts are drawn on)
    sign_flip_p: Optional[float]
    n: int  # seeds
    n_examples: int  # aligned examples per seed (1: seed-level only)
    confidence: float
    method: str
    diff_mean: float
    baseline_mean: float
    p_t: Optional[float] = None  # the two-level t test alone
    note: Optional[str] = None  # why there is no interval, when there is none
    betting_p: Optional[float] = None  # the bounded test of the mean (metrics with bounds only), stated beside
    ties: int = 0
    tests: str = "exchangeability"  # what the p-value rejects (every metric; the mean: betting_p)
    lower: int = 0  # seeds whose first arm scored below the second
    higher: int = 0  # ... above
    # what the printed interval covers: "mean" (a bounded metric: [low, high] holds the betting interval) or
    # "median" (an unbounded metric, which no test of its mean holds for: [median_low, median_high] is printed)
    interval_of: str = "mean"
    median: Optional[float] = None  # the seeds' median difference
    median_low: Optional[float] = None  # the distribution-free interval of the median seed difference
    median_high: Optional[float] = None  # (:func:`seed_median_interval`; None where low is None)

    @property
    def unadjusted_excludes_zero(self) -> bool:
        """Whether the *unadjusted* interval [low, high] excludes 0 (verdicts use the Holm-adjusted p-value)."""
        return self.low is not None and (self.low > 0 or self.high < 0)

    def printed_interval(self) -> tuple[Optional[float], Optional[float]]:
        """The interval a report prints, of the estimand ``interval_of`` names: ``(low, high)`` for the mean of a
        bounded metric, ``(median_low, median_high)`` for an unbounded one."""
        return (self.median_low, self.median_high) if self.interval_of == "median" else (self.low, self.high)

    def to_dict(self) -> dict:
        out = asdict(self)
        for k in ("p_value", "sign_flip_p", "p_t", "betting_p"):
            out[k] = round_p(out[k])
        return {**out, "unadjusted_excludes_zero": self.unadjusted_excludes_zero}


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


def _p_value(mean: float, parts: list[tuple[float, float]]) -> Optional[float]:
    """The t test's p-value of ``mean = 0``; ``None`` where the parts have no spread at all."""
    if not any(v > 0 for v, _ in parts):
        return None
    live = [(v, df) for v, df in parts if v > 0]
    if len(live) == 1:  # one part: the t test's own p-value
        return t_two_sided_p(abs(mean) / math.sqrt(live[0][0]), live[0][1])
    lo, hi = 1e-12, 1.0  # the half-width falls as alpha grows: find alpha where it equals |mean|
    if _half_width(parts, lo) <= abs(mean):
        return lo
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if _half_width(parts, mid) > abs(mean):
            lo = mid
        else:
            hi = mid
    return hi


def sign_flip_p(d: Sequence[float], max_exact: int = 16, draws: int = 20_000, seed: int = 0) -> float:
    """Two-sided randomisation p-value of ``mean(d) = 0`` by flipping the signs of the paired
    differences ``d``: exact over all ``2^n`` flips up to ``max_exact`` seeds, else ``draws``
    random flips (then never below ``1 / (draws + 1)``)."""
    x = np.asarray(d, dtype=np.float64)
    return float(_flip_p(x, _signs(x.size, max_exact, draws, seed), np.zeros(1))[0])


@functools.lru_cache(maxsize=32)
def _signs(n: int, max_exact: int = 16, draws: int = 20_000, seed: int = 0) -> np.ndarray:
    """``(flips, n)`` sign patterns: all ``2^n`` up to ``max_exact``, else random draws (kept per ``n``, read-only)."""
    if n <= max_exact:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(draws, n))
    signs.flags.writeable = False
    return signs


def _flip_p(x: np.ndarray, signs: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """Sign-flip p-values of ``mean(x) = mu`` for each candidate ``mu`` ``(G,)``."""
    c = x[None, :] - mu[:, None]  # (G, n)
    obs = np.abs(c.sum(1))  # (G,)
    tol = 1e-12 * (1.0 + np.abs(c).sum(1))
    flipped = np.abs(c @ signs.T)  # (G, flips)
    p = (flipped >= (obs - tol)[:, None]).mean(1)
    if signs.shape[0] < 2 ** x.size:  # random flips: count the observed pattern as one of them
        p = (p * signs.shape[0] + 1) / (signs.shape[0] + 1)
    return p


def sign_flip_interval(d: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The values ``mu`` that the exact sign-flip test of ``mean(d) = mu`` does not reject at
    ``1 - confidence`` (valid when the seeds' differences are symmetric about ``mu``). Unbounded,
    ``(-inf, inf)``, while ``2 / 2^n`` exceeds ``1 - confidence`` (fewer than 6 values at 95%)."""
    x = np.asarray(d, dtype=np.float64)
    alpha = 1 - confidence
    if x.size < 2 or (x.size <= 16 and 2.0 / 2 ** x.size > alpha):
        return -math.inf, math.inf
    signs = _signs(x.size)
    mean = float(x.mean())
    if float(x.max() - x.min()) == 0.0:
        return mean, mean
    # the p-value changes only where a flipped sum ties the observed one, i.e. at the mean of a
    # subset of the values; the interval's ends are such subset means (at most 2^16 of them)
    members = (signs[1:] < 0) if x.size <= 16 else (signs < 0)
    sizes = members.sum(1)
    means = np.unique((members @ x)[sizes > 0] / sizes[sizes > 0])
    ends = []
    for side in (means[means < mean], means[means > mean][::-1]):  # each ordered from far to near
        lo, hi = 0, side.size  # find the first (farthest) breakpoint the test accepts
        while lo < hi:
            mid = (lo + hi) // 2
            if _flip_p(x, signs, side[mid:mid + 1])[0] > alpha:
                hi = mid
            else:
                lo = mid + 1
        ends.append(float(side[lo]) if lo < side.size else mean)
    return ends[0], ends[1]


def betting_capital(x: Sequence[float], candidates: Sequence[float], alpha: float = 0.05) -> np.ndarray:
    """The largest hedged capital, over the sequence, of a bettor against ``mean = m`` for each
    candidate ``m`` in ``[0, 1]``, on values ``x`` in ``[0, 1]`` taken in order (Waudby-Smith and
    Ramdas 2024, "Estimating means of bounded random variables by betting", the hedged capital
    process with predictable plug-in bets). Under ``mean = m`` the capital is a nonnegative
    supermartingale that starts at 1, so ``P(max capital >= 1 / alpha) <= alpha`` (Ville's
    inequality) for *any* distribution on ``[0, 1]``: the test and the interval assume nothing else."""
    v = np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0)
    m = np.asarray(candidates, dtype=np.float64)
    n = v.size
    t = np.arange(1, n + 1)
    mu = (0.5 + np.cumsum(v)) / (t + 1)  # running mean after t values, shrunk toward 1/2
    var = (0.25 + np.cumsum((v - mu) ** 2)) / (t + 1)
    bet = np.sqrt(2 * math.log(2 / alpha) / (n * np.concatenate([[0.25], var[:-1]])))  # (n,) uses values before t
    c = 0.75  # bets stay below c / m (and c / (1 - m)): the capital never loses more than 75% in a step
    up = np.minimum(bet[None], c / np.maximum(m[:, None], 1e-12))  # (G, n)
    down = np.minimum(bet[None], c / np.maximum(1 - m[:, None], 1e-12))
    gap = v[None] - m[:, None]
    capital = np.maximum(0.5 * np.cumprod(1 + up * gap, 1), 0.5 * np.cumprod(1 - down * gap, 1))
    return capital.max(1)


def betting_interval(x: Sequence[float], low: float, high: float, confidence: float = 0.95,
                     point: Optional[float] = None, grid: int = 2001) -> tuple[float, float, Optional[float]]:
    """The betting interval of the mean of values ``x`` known to lie in ``[low, high]``
    (:func:`betting_capital`): the candidates not rejected at ``1 - confidence``, on a grid of
    ``grid`` points plus ``point``, and the betting p-value of ``mean = point`` (``1 / max capital``,
    at most 1; ``None`` without ``point``). Valid at any number of values, for any distribution."""
    if not high > low:
        raise ValueError(f"betting_interval: need low < high, got [{low}, {high}]")
    alpha = 1 - confidence
    scale = high - low
    v = (np.asarray(x, dtype=np.float64) - low) / scale
    m = np.linspace(0.0, 1.0, grid)
    if point is not None:
        m = np.sort(np.append(m, min(max((point - low) / scale, 0.0), 1.0)))
    capital = betting_capital(v, m, alpha)
    kept = m[capital < 1 / alpha]
    lo, hi = (float(kept.min()), float(kept.max())) if kept.size else (float(v.mean()),) * 2
    p = None
    if point is not None:
        p = float(min(1.0, 1.0 / betting_capital(v, [min(max((point - low) / scale, 0.0), 1.0)], alpha)[0]))
    return low + scale * lo, low + scale * hi, p


MEAN_MAX_SEEDS = 64  # seeds_for_mean looks this far


def seeds_for_mean(d: Sequence[float], bounds: tuple[float, float], comparisons: float = 1, alpha: float = 0.05,
                   most: int = MEAN_MAX_SEEDS) -> Optional[int]:
    """The fewest seeds at which the betting test of the mean difference (:func:`betting_interval` over
    ``[-(high - low), high - low]``, at ``alpha / comparisons``: Holm's first step) would reject a mean of 0 if
    the seeds' differences ``d`` went on as these ones (cycled in their order): a plan as observed, so it keeps a
    pilot's luck. ``None`` when it does not within ``most`` seeds, or the differences average 0."""
    x = np.asarray(d, dtype=np.float64)
    if x.size == 0 or x.mean() == 0:
        return None
    span = float(bounds[1] - bounds[0])
    level = alpha / max(comparisons, 1)
    lengths = np.arange(max(x.size, 2), most + 1)
    if lengths.size == 0:
        return None
    # betting_interval's p of a mean of 0 (0.5 on [0, 1]) at every length at once: the same arithmetic
    p = np.minimum(1.0, 1.0 / _capital_by_length((np.resize(x, most) + span) / (2 * span), lengths, 0.5, level))
    hit = np.flatnonzero(p < level)
    return int(lengths[hit[0]]) if hit.size else None


def _capital_by_length(x: np.ndarray, lengths: np.ndarray, m: float, alpha: float) -> np.ndarray:
    """``betting_capital(x[:k], [m], alpha)[0]`` for each ``k`` of ``lengths`` at once: the running mean and
    variance depend only on the values before, the bets also on ``k``."""
    v = np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0)
    t = np.arange(1, v.size + 1)
    mu = (0.5 + np.cumsum(v)) / (t + 1)
    var = (0.25 + np.cumsum((v - mu) ** 2)) / (t + 1)
    k = np.asarray(lengths)[:, None]
    bet = np.sqrt(2 * math.log(2 / alpha) / (k * np.concatenate([[0.25], var[:-1]])[None]))  # (K, n)
    c = 0.75
    up = np.minimum(bet, c / max(m, 1e-12))
    down = np.minimum(bet, c / max(1 - m, 1e-12))
    gap = (v - m)[None]
    capital = np.maximum(0.5 * np.cumprod(1 + up * gap, 1), 0.5 * np.cumprod(1 - down * gap, 1))
    return np.where(t[None] <= k, capital, -np.inf).max(1)


def seeds_for_verdict(comparisons: float = 1, alpha: float = 0.05) -> int:
    """The fewest paired seeds at which the exact sign-flip test (smallest p ``2 / 2^n``) can reject
    at ``alpha`` after Holm's adjustment over ``comparisons`` tests (whose first step multiplies
    the smallest p-value by their number; a later look's :func:`look_factor` multiplies it too, so ``comparisons``
    may be a family size times that factor): 6 for one comparison, 7 for 3, 11 for 40. Above 16 seeds the sign-flip
    p-value is estimated from 20,000 random flips and cannot go below 1 / 20,001, so where ``comparisons`` reaches
    1,000 (a family of 3 at the fifth look) no number of seeds above 16 allows a verdict, whatever this says."""
    n = 1
    while 2.0 / 2 ** n * max(comparisons, 1) >= alpha:
        n += 1
    return n


POWER_MAX_SEEDS = 64
POWER_CONFIDENCE = 0.85  # the confidence of the pessimistic effect a power plan is made for
MODE_CONFIDENCE = 0.9  # the confidence of the share of seeds on the far side a plan with modes is made for
SPLIT_GAP = 2.0  # a pilot splits where its two sides lie further apart than this many within-side SDs (simulated)
# A pilot of fewer seeds cannot tell a lottery from a normal effect (its losing seeds may all be missing): power plans
# from it always allow for modes (results log, 2026-12-06: 5-seed pilots of noisy lotteries got numbers at 0.62 power).
MODES_BELOW = 6


def seeds_split(d: Sequence[float], gap: float = SPLIT_GAP) -> bool:
    """Whether the seeds' differences ``d`` can split into modes (a lottery: a seed learns a task with one arm
    or the other), the test that turns on :func:`power_plan`'s modes for an unbounded metric. The seeds on
    the far side of 0 from their mean and those on the near side must lie further apart (the smallest near
    value minus the largest far one, in the mean's direction) than ``gap`` times the SD within the two
    sides (pooled). Where no seed lies on the far side, the far side tested is the seeds' mirror image,
    the far side a plan with modes assumes: twice the smallest value against the seeds' SD. So a pilot
    whose values sit tightly far from 0 (a lottery's winning mode, its losing seeds unseen) splits, and a
    normal pilot whose spread reaches towards 0 does not. No test can tell the two apart where a normal
    effect is large (above about 2 SD a pilot of 5 often splits); benchmarks/power_delivered.py measures
    what either error costs, and chose ``gap``."""
    x = np.asarray(d, dtype=np.float64)
    if not gap > 0:
        raise ValueError(f"seeds_split: gap must be > 0; got {gap!r}")
    if x.size < 2 or not np.isfinite(x).all() or x.mean() == 0:
        return False
    y = x * math.copysign(1.0, float(x.mean()))  # the mean's side positive
    near, far = y[y >= 0], y[y < 0]
    if far.size == 0:
        far = -near  # the mirror image: its spread is the near side's, counted once
        ss, dof = float(((near - near.mean()) ** 2).sum()), near.size - 1
    else:
        ss = float(((near - near.mean()) ** 2).sum() + ((far - far.mean()) ** 2).sum())
        dof = y.size - 2
    if dof < 1:
        return False
    return bool(near.min() - far.max() > gap * math.sqrt(ss / dof))


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    """The standard normal CDF, elementwise (erfc by its Chebyshev fit, relative error below 1.2e-7)."""
    z = np.abs(np.asarray(x, dtype=np.float64)) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = (-1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
    erfc = t * np.exp(-z * z + poly)
    return np.where(np.asarray(x) >= 0, 1.0 - 0.5 * erfc, 0.5 * erfc)


@functools.lru_cache(maxsize=64)
def _chi_grid(df: int) -> tuple[np.ndarray, np.ndarray]:
    """Points ``u`` and trapezoid weights (summing to 1) of the chi distribution with ``df`` degrees
    of freedom, the law of ``sqrt(chi2_df)``, over the range that holds all but a negligible part of it."""
    centre = math.sqrt(df)
    u = np.linspace(max(centre - 12.0, 1e-12), centre + 12.0, 4001)
    logf = (df - 1) * np.log(u) - u * u / 2
    w = np.exp(logf - logf.max())
    w[[0, -1]] *= 0.5
    return u, w / w.sum()


def nct_cdf(t: float, df: int, ncp: float) -> float:
    """``P(T <= t)`` for the noncentral t with ``df`` degrees of freedom and noncentrality ``ncp``:
    ``T = (Z + ncp) / sqrt(V / df)``, so ``P(T <= t) = E[Phi(t sqrt(V / df) - ncp)]`` over the chi
    law of ``sqrt(V)`` (a quadrature on 4,001 points; absolute error well below 1e-4)."""
    u, w = _chi_grid(int(df))
    return float(np.dot(w, _normal_cdf(t * u / math.sqrt(df) - ncp)))


def effect_lower_bound(t: float, n: int, confidence: float = POWER_CONFIDENCE) -> float:
    """The one-sided lower ``confidence`` bound of the standardised effect ``delta = mean / SD`` of
    normal values, from ``t = sqrt(n) mean / sd`` of ``n`` of them: the ``delta`` at which the
    noncentral t with ``n - 1`` degrees of freedom and noncentrality ``sqrt(n) delta`` has ``t`` at
    its ``confidence`` quantile (exact for normal values). 0 where the bound is not above 0."""
    df = n - 1
    if not t > 0 or t_cdf(t, df) <= confidence:
        return 0.0
    lo, hi = 0.0, 2.0 * t + 10.0
    while nct_cdf(t, df, hi) >= confidence:
        hi *= 2.0
    while hi - lo > 1e-7 * max(1.0, hi):  # the CDF at t falls as the noncentrality grows
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if nct_cdf(t, df, mid) >= confidence else (lo, mid)
    return lo / math.sqrt(n)


def _t_rejects(x: np.ndarray, level: float) -> np.ndarray:
    """Whether the two-sided one-sample t test of ``mean = 0`` rejects at ``level`` for each row of
    ``x`` ``(reps, n)`` (``|t|`` above the t quantile: the p-value below ``level``, without computing
    it); a row without spread rejects where its mean is not 0 (its t p-value 0, the sign-flip's job)."""
    n = x.shape[1]
    m, sd = x.mean(1), x.std(1, ddof=1)
    return np.where(sd > 0, np.abs(m) * math.sqrt(n) > t_quantile(1 - level / 2, n - 1) * sd, m != 0)


def rule_power(d: Sequence[float], n: int, comparisons: float = 1, alpha: float = 0.05,
               bounds: Optional[tuple[float, float]] = None, reps: int = 300, seed: int = 0,
               estimand: str = "exchangeability", weights: Optional[Sequence[float]] = None) -> float:
    """The share of ``reps`` repeats in which a rule rejects at ``alpha`` (its p-value times ``comparisons``,
    Holm's first step), each repeat drawing ``n`` seeds' differences with replacement from the observed ``d``
    (so the seeds' modes, e.g. a retrieval lottery, are kept), each value with its chance in ``weights``
    (default: equal). ``estimand`` "exchangeability": the verdict rule, the larger of the t and sign-flip
    p-values; "mean": the betting test of the mean difference (``bounds`` needed). The sign-flip p-value is
    exact up to 12 seeds, then estimated from 2,000 random flips (ample for a level of 0.05 / comparisons)."""
    if estimand not in ("exchangeability", "mean") or (estimand == "mean" and bounds is None):
        raise ValueError(f"rule_power: estimand must be 'exchangeability', or 'mean' with bounds; got {estimand!r}")
    x0 = np.asarray(d, dtype=np.float64)
    rng = np.random.default_rng(seed)
    if estimand == "exchangeability" and n < seeds_for_verdict(comparisons, alpha):
        return 0.0
    x = x0[rng.integers(0, x0.size, (reps, n)) if weights is None else rng.choice(x0.size, (reps, n), p=weights)]
    if estimand == "mean":
        span = float(bounds[1] - bounds[0])
        v = (x + span) / (2 * span)
        # the bets of paired_estimate (tuned for alpha), whose p-value Holm then multiplies
        p_bet = np.array([min(1.0, 1.0 / betting_capital(row, [0.5], alpha)[0]) for row in v])
        return float((p_bet * comparisons < alpha).mean())
    signs = _signs(n, max_exact=12, draws=2000, seed=seed)
    obs = np.abs(x.sum(1))
    hits = (np.abs(x @ signs.T) >= obs[:, None] * (1 - 1e-12)).sum(1)
    p_sf = hits / signs.shape[0] if n <= 12 else (hits + 1) / (signs.shape[0] + 1)
    reject = (p_sf * comparisons < alpha) & _t_rejects(x, alpha / comparisons)  # the larger p, below alpha
    return float(reject.mean())


@dataclass
class PowerPlan:
    """What :func:`power_plan` assumed and found. ``seeds``: the fewest seeds at which the rule of ``estimand``
    reaches ``power`` for the planned differences; ``None`` where ``max_seeds`` do not (including where
    the pilot does not bound its effect above 0, or cannot exclude that half its seeds lie on the far side, so
    no number of seeds is sure to), or where the plan is ``unknown`` (fewer than 2 differences, or all equal:
    no spread to plan with); ``note`` says why. The pilot: ``pilot_n`` differences with mean ``pilot_mean``
    and SD ``pilot_sd``; the plan: the pilot's shape moved to mean ``planned_mean`` and SD ``planned_sd``,
    whose ratio is the lower ``confidence`` bound of the pilot's ``mean / SD``. With modes: ``far_seen`` of
    the pilot's seeds lay on the far side of 0 from its mean, and ``far_share`` is the share of seeds on the
    far side planned for as well (the upper ``mode_confidence`` bound of that share); ``far_mirror``: the
    near side's mirror image counted as one far seed more (an unbounded metric)."""

    seeds: Optional[int]
    power: float
    confidence: float
    pilot_n: int
    pilot_mean: float
    pilot_sd: Optional[float]
    planned_mean: Optional[float] = None
    planned_sd: Optional[float] = None
    max_seeds: int = POWER_MAX_SEEDS
    note: Optional[str] = None
    unknown: bool = False
    estimand: str = "exchangeability"
    mode_confidence: Optional[float] = None  # None: planned without modes
    far_seen: Optional[int] = None
    far_share: Optional[float] = None
    far_mirror: bool = False  # the near side's mirror image counted as one far seed more (unbounded, far_seen >= 1)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self, digits: int = 3, unit: str = "") -> str:
        """One clause: the seeds for the power, and the effect, spread and far side planned for."""
        u = f" {unit}" if unit else ""
        f = f"{{:+.{digits}f}}"
        g = f"{{:.{digits}g}}"
        pct, conf = round(100 * self.power), round(100 * self.confidence)
        what = f"{pct}% power" + (" for the mean" if self.estimand == "mean" else "")
        if self.unknown:
            return f"the seeds for {what} are unknown: {self.note}"
        if self.planned_mean is None:
            return f"{what} is not reached within {self.max_seeds} seeds: {self.note}"
        plan = (f"planning for a difference of {f.format(self.planned_mean)}{u} (SD {g.format(self.planned_sd)}): "
                f"the smallest effect / SD that these {self.pilot_n} seeds' {f.format(self.pilot_mean)} "
                f"(SD {g.format(self.pilot_sd)}) allow at {conf}% confidence, their shape kept")
        if self.far_share is not None:
            seen = (f"all {self.pilot_n} lay on one side: planned as their mirror image" if not self.far_seen
                    else f"{self.far_seen} of {self.pilot_n} lay there" + (
                        ", and the mirror image of the near side counted as one more" if self.far_mirror else ""))
            plan += (f"; and for {round(100 * self.far_share)}% of seeds on the far side of 0, the most that "
                     f"{round(100 * self.mode_confidence)}% confidence allows ({seen})")
        if self.seeds is None:
            return f"{what} is not reached within {self.max_seeds} seeds, {plan}"
        return f"{what} needs about {self.seeds} seeds, {plan}"


def share_upper_bound(k: int, n: int, confidence: float) -> float:
    """The one-sided upper ``confidence`` bound of a share from ``k`` of ``n`` draws (Clopper-Pearson: the share
    at which ``k`` or fewer happen with chance ``1 - confidence``); ``1 - (1 - confidence)^(1/n)`` at ``k = 0``."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"share_upper_bound: need 0 <= k <= n and n >= 1; got k={k}, n={n}")
    if k == n:
        return 1.0
    if k == 0:
        return 1.0 - (1.0 - confidence) ** (1.0 / n)
    lo, hi = k / n, 1.0
    while hi - lo > 1e-9:  # P(Bin(n, p) <= k) falls as p grows
        mid = 0.5 * (lo + hi)
        tail = sum(math.comb(n, j) * mid ** j * (1 - mid) ** (n - j) for j in range(k + 1))
        lo, hi = (mid, hi) if tail > 1.0 - confidence else (lo, mid)
    return lo


def power_plan(d: Sequence[float], comparisons: float = 1, alpha: float = 0.05, power: float = 0.8,
               bounds: Optional[tuple[float, float]] = None, max_seeds: int = POWER_MAX_SEEDS,
               reps: int = 300, confidence: float = POWER_CONFIDENCE, estimand: str = "exchangeability",
               modes: Optional[bool] = None, mode_confidence: float = MODE_CONFIDENCE) -> PowerPlan:
    """How many seeds the rule of ``estimand`` needs for ``power``, planned from the pilot differences ``d``
    (one per seed) so that the answer holds for the effect the pilot *guarantees*, not the one it
    happened to show.

    Resampling the pilot as it is answers too few seeds: a pilot that overstates the effect (half of
    them do) gives a number at which the true power is far below ``power``, and a pilot of 5 whose
    differences all share a sign resamples to experiments whose differences always share it. So:

    1. The effect: the lower ``confidence`` bound ``delta_L`` of the standardised effect ``mean / SD``
       (:func:`effect_lower_bound`, the noncentral t: exact for normal differences). The pilot's t
       statistic says how far its ``mean / SD`` can be from the truth, the uncertainty of its mean and
       of its SD both counted, so a small pilot is planned for a much smaller effect than it shows.
       A bound not above 0 gives ``None``: the pilot does not show the direction, so no number of
       seeds is sure to reach ``power``.
    2. Mean and spread: ``mean / SD = delta_L`` holds at many pairs; the plan moves the mean down and
       the SD up in proportion to their shares of the variance of ``mean / SD`` (``1 / n`` and
       ``delta^2 / (2 (n - 1))``), so consistent gains (a precise mean, an uncertain SD) keep their
       mean, which the bounded test of the mean (``bounds``) needs.
    3. The shape: the plan is the pilot's own differences, centred, stretched to the planned SD and
       moved to the planned mean, so the seeds' modes (a retrieval lottery) are kept; after the move
       some differences cross 0, as the truth's would.
    4. Modes (``modes``; default: where ``bounds`` are given, a metric like an accuracy, for any metric whose
       seeds split, :func:`seeds_split`: an NLL where one arm learns a task in some seeds, and for any pilot of
       fewer than :data:`MODES_BELOW` seeds, which cannot tell a lottery from a normal effect):
       the share of seeds on the far side of 0 is a binomial share the pilot saw ``k`` of ``n`` times,
       and can be far larger than ``k / n`` (a lottery whose losing seeds a pilot of 5 missed: 17% of
       pilots at 30% of them). A second plan gives the pilot's far side its upper ``mode_confidence``
       bound (:func:`share_upper_bound`; ``1 - (1 - c)^(1/n)`` where ``k = 0``: 37% at 5 seeds, 25% at
       8, at 90%, the far side then being the pilot's mirror image, as a seed that learns with the other
       arm would be), its values as they are; for an unbounded metric, where ``k`` seeds say little of
       where the far mode lies (one losing seed of 8 may sit near 0), the near side's mirror image counts
       as one far seed more. The answer is the larger of the two plans' seeds. Where that share reaches
       one half, no number is planned.
    5. The rule: :func:`rule_power` (the verdict rule, or with ``estimand="mean"`` the betting test of the
       mean; Holm's first step over ``comparisons``) resamples the plan, and a bisection finds the fewest
       seeds (from :func:`seeds_for_verdict` up to ``max_seeds``) at which it reaches ``power``.

    A pilot without spread (every difference the same) gives ``None`` and ``unknown``: its spread, and
    so the seeds, are unknown. benchmarks/power_delivered.py measures the true power at the answers
    (the results log, 2026-11-28). At most about 0.6 s per call."""
    x = np.asarray(d, dtype=np.float64)
    n0 = int(x.size)
    mean = float(x.mean()) if n0 else 0.0
    sd = float(x.std(ddof=1)) if n0 >= 2 else None
    modes = (bounds is not None or n0 < MODES_BELOW or seeds_split(x)) if modes is None else modes
    base = dict(power=power, confidence=confidence, pilot_n=n0, pilot_mean=mean, pilot_sd=sd, max_seeds=max_seeds,
                estimand=estimand, mode_confidence=mode_confidence if modes else None)
    if n0 < 2:
        return PowerPlan(None, note="fewer than 2 seeds: no spread to plan with", unknown=True, **base)
    if sd <= 1e-12 * float(np.abs(x).max()):  # equal up to rounding
        return PowerPlan(None, note=f"all {n0} differences are equal: their spread, and so the seeds, are unknown",
                         unknown=True, **base)
    ratio = abs(mean) / sd
    low = effect_lower_bound(math.sqrt(n0) * ratio, n0, confidence)
    if low <= 0.0:
        return PowerPlan(None, note=(f"at {round(100 * confidence)}% confidence, these {n0} seeds' {mean:+.3g} "
                                     f"(SD {sd:.3g}) allow an effect of 0, so no number of seeds is sure to reach "
                                     f"it"), **base)
    shrink = math.log(max(ratio / low, 1.0))
    mean_share = (1 / n0) / (1 / n0 + ratio ** 2 / (2 * (n0 - 1)))
    planned_sd = sd * math.exp((1 - mean_share) * shrink)
    planned_mean = math.copysign(low * planned_sd, mean)
    plan = planned_mean + (x - mean) * (planned_sd / sd) * math.sqrt(n0 / (n0 - 1))
    if bounds is not None:
        span = float(bounds[1] - bounds[0])
        plan = np.clip(plan, -span, span)
    base.update(planned_mean=planned_mean, planned_sd=planned_sd)
    far_plan = None
    if modes:
        far = x * math.copysign(1.0, mean) < 0
        k = int(far.sum())
        share = share_upper_bound(k, n0, mode_confidence)
        base.update(far_seen=k, far_share=share)
        if share >= 0.5:
            return PowerPlan(None, note=(f"{k} of {n0} seeds lie on the far side of 0, and at "
                                         f"{round(100 * mode_confidence)}% confidence so few cannot exclude that "
                                         f"{round(100 * share)}% of seeds do"), **base)
        # the pilot as it is, its far side given that share: the mirror image where it saw none
        if k == 0:
            far_plan = (np.concatenate([x, -x]), np.concatenate([np.full(n0, (1 - share) / n0), np.full(n0, share / n0)]))
        elif bounds is None:  # where the far mode lies, k seeds tell little: its mirror image counts as one seed more
            near = x[~far]
            base.update(far_mirror=True)
            far_plan = (np.concatenate([x, -near]), np.concatenate([np.where(far, share / (k + 1), (1 - share) / (n0 - k)),
                                                                    np.full(near.size, share / (k + 1) / near.size)]))
        else:
            far_plan = (x, np.where(far, share / k, (1 - share) / (n0 - k)))
    seeds = _fewest_seeds(plan, comparisons, alpha, power, bounds, max_seeds, reps, estimand)
    if seeds is not None and far_plan is not None:
        seeds = _fewest_seeds(far_plan[0], comparisons, alpha, power, bounds, max_seeds, reps, estimand, far_plan[1],
                              start=seeds)  # the larger of the two plans' seeds
    return PowerPlan(seeds, **base)


def _fewest_seeds(x: np.ndarray, comparisons: float, alpha: float, power: float,
                  bounds: Optional[tuple[float, float]], max_seeds: int, reps: int,
                  estimand: str = "exchangeability", weights: Optional[np.ndarray] = None,
                  start: int = 2) -> Optional[int]:
    """The fewest seeds (from ``start``, :func:`seeds_for_verdict` at least, or 2 for the mean, up to
    ``max_seeds``) at which :func:`rule_power` resampling ``x`` (each value with its chance in ``weights``)
    reaches ``power``; ``None`` when ``max_seeds`` do not."""
    def reaches(n: int) -> bool:
        return rule_power(x, n, comparisons, alpha, bounds, reps, estimand=estimand, weights=weights) >= power

    lo = max(start, seeds_for_verdict(comparisons, alpha) if estimand == "exchangeability" else 2)
    if not reaches(max_seeds):
        return None
    hi = max_seeds  # power at hi reaches the target; bisect for the fewest seeds that do (power grows with n)
    if reaches(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi


def seeds_for_power(d: Sequence[float], comparisons: float = 1, alpha: float = 0.05, power: float = 0.8,
                    bounds: Optional[tuple[float, float]] = None, max_seeds: int = POWER_MAX_SEEDS,
                    reps: int = 300, confidence: float = POWER_CONFIDENCE,
                    estimand: str = "exchangeability", modes: Optional[bool] = None) -> Optional[int]:
    """The seeds of :func:`power_plan` (``None``: not within ``max_seeds``, or unknown); call
    :func:`power_plan` for what it assumed, which a report prints next to the number."""
    return power_plan(d, comparisons, alpha, power, bounds, max_seeds, reps, confidence, estimand, modes).seeds


def paired_estimate(diff: Sequence[float], baseline: Sequence[float], *,
                    diff_examples: Optional[np.ndarray] = None, baseline_examples: Optional[np.ndarray] = None,
                    confidence: float = 0.95, bounds: Optional[tuple[float, float]] = None) -> PairedEstimate:
    """The paired difference of per-seed values ``diff`` and ``baseline`` (length n). With
    ``*_examples`` ``(n, m)`` (the same m examples, in the same order, for every seed and both
    arms; a seed's value is the mean of its row) the t part includes evaluation-set noise. With
    ``bounds`` ``(low, high)`` (the metric's range, e.g. ``(0, 1)`` for an accuracy) the interval
    stays inside ``[low - high, high - low]`` and also holds the betting interval of the mean
    difference, whose p-value is ``betting_p`` (the second estimand, stated beside the verdict; ``p_value``
    stays the test of exchangeability). See the module docstring for how the parts are combined."""
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
    d = a - b
    mean = float(d.mean())
    ties = int((d == 0).sum())
    if n == 1:
        return PairedEstimate(mean, None, None, None, None, 1, D.shape[1], confidence, "one seed: no interval",
                              float(a[0]), float(b[0]), note="one seed: no interval", ties=ties,
                              interval_of="mean" if bounds is not None else "median", median=mean)
    parts = _components(D)
    h = _half_width(parts, 1 - confidence)
    p_t, p_sf = _p_value(mean, parts), sign_flip_p(d)
    s_lo, s_hi = sign_flip_interval(d, confidence)
    low, high, note = min(mean - h, s_lo), max(mean + h, s_hi), None
    p_bet = None
    if bounds is not None:
        span = float(bounds[1] - bounds[0])
        b_lo, b_hi, p_bet = betting_interval(d, -span, span, confidence, point=0.0)
        low, high = min(low, b_lo), max(high, b_hi)
        method += ", exact sign-flip and betting (bounded mean)"
    else:
        method += " and exact sign-flip"
    if not (math.isfinite(low) and math.isfinite(high)):
        low = high = None
        note = (f"{n} seeds: no interval or verdict; the exact sign-flip test needs at least "
                f"{seeds_for_verdict(1, 1 - confidence)} paired seeds")
    elif bounds is not None:
        low, high = max(low, -span), min(high, span)
    if low is not None and not high - low > 1e-12 * max(abs(low), abs(high), 1e-300):  # width 0: no spread at all
        low = high = None
        note = f"all {n} seeds' differences are {mean:+.4g}: {NO_SPREAD}"
    p = max(x for x in (p_t, p_sf) if x is not None)  # exchangeability; the mean's own test is betting_p
    med, m_lo, m_hi = seed_median_interval(d, D if D.shape[1] > 1 else None, confidence)
    if low is None:  # too few seeds, or no spread: no interval of the median either
        m_lo = m_hi = None
    return PairedEstimate(mean, low, high, p, p_sf, n, D.shape[1], confidence, method, float(a.mean()),
                          float(b.mean()), p_t=p_t, note=note, betting_p=p_bet, ties=ties,
                          lower=int((d < 0).sum()), higher=int((d > 0).sum()),
                          interval_of="mean" if bounds is not None else "median", median=med, median_low=m_lo,
                          median_high=m_hi)


def t_mean_interval(values: Sequence[float], examples: Optional[np.ndarray] = None,
                    confidence: float = 0.95) -> tuple[float, Optional[float], Optional[float]]:
    """One arm's mean over seeds with its two-level t interval alone (the learning gate's screen:
    "above the floor by about 2 SE"); ``None`` bounds with one seed."""
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return float(v.mean()), None, None
    D = v[:, None] if examples is None else np.asarray(examples, dtype=np.float64)
    h = half_width(D, confidence)
    m = float(v.mean())
    return m, m - h, m + h


def mean_interval(values: Sequence[float], examples: Optional[np.ndarray] = None, confidence: float = 0.95,
                  bounds: Optional[tuple[float, float]] = None) -> tuple[float, Optional[float], Optional[float]]:
    """One arm's mean over seeds with an interval that holds whatever the seeds' distribution: the
    hull of the t interval and, with ``bounds``, the betting interval (valid at any n), clipped to
    the bounds; without bounds, the sign-flip interval (symmetric seeds; unbounded below 6 seeds,
    then ``None``)."""
    v = np.asarray(values, dtype=np.float64)
    m, lo, hi = t_mean_interval(v, examples, confidence)
    if lo is None:
        return m, None, None
    if bounds is not None:
        b_lo, b_hi, _ = betting_interval(v, bounds[0], bounds[1], confidence)
        return m, max(min(lo, b_lo), bounds[0]), min(max(hi, b_hi), bounds[1])
    s_lo, s_hi = sign_flip_interval(v, confidence)
    if not (math.isfinite(s_lo) and math.isfinite(s_hi)):
        return m, None, None
    return m, min(lo, s_lo), max(hi, s_hi)


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
    rank, _ = _median_rank(n, confidence)
    if rank == 0:
        return med, None, None
    return med, float(x[rank - 1]), float(x[n - rank])


def _median_rank(n: int, confidence: float) -> tuple[int, float]:
    """The largest rank ``l`` with ``P(Binomial(n, 1/2) < l) <= (1 - confidence) / 2`` (exact binomial tails, integer
    arithmetic; 0 where there is none) and the chance ``2 P(Binomial(n, 1/2) < l)`` that the order statistics
    ``x_(l)``, ``x_(n+1-l)`` miss the median (0.0156 at 7 values, 0.0215 at 10, 0.0129 at 14; 0 without a rank)."""
    limit = Fraction(1 - confidence) / 2 * 2 ** n  # tail(k) = P(Bin(n, 1/2) <= k - 1) * 2^n, against alpha/2 * 2^n
    below, rank, kept = 0, 0, 0
    for k in range(n // 2 + 1):
        below += math.comb(n, k)  # P(Bin <= k) * 2^n
        if below > limit:
            break
        rank, kept = k + 1, below  # P(Bin < rank) = P(Bin <= k) <= alpha/2
    return rank, float(Fraction(2 * kept, 2 ** n))


def seed_median_interval(d: Sequence[float], D: Optional[np.ndarray] = None,
                         confidence: float = 0.95) -> tuple[float, Optional[float], Optional[float]]:
    """The median of the seeds' paired differences ``d`` with an interval of the median seed difference that holds
    for any distribution of the seeds (what an unbounded metric prints: its mean has no test that holds for every
    distribution). Over seeds: the order statistics of :func:`median_interval`, which miss the median with chance
    ``a1`` (:func:`_median_rank`). With a seeds x examples table ``D`` (the same examples for every seed) the seeds'
    median moves with the examples drawn, by their shared effect: each end is widened by the example part of the
    two-level t interval (:func:`_components`, ``m - 1`` degrees of freedom) at the rest of alpha, ``1 - confidence -
    a1``, so the interval is of the median seed difference on examples like these (Bonferroni over the two parts; the
    example part assumes what the t interval's does: a seed and an example add). ``None`` bounds below 6 seeds."""
    x = np.asarray(d, dtype=np.float64)
    med, lo, hi = median_interval(x, confidence)
    if lo is None or D is None or np.shape(D)[1] < 2:
        return med, lo, hi
    rank, miss = _median_rank(x.size, confidence)
    if not 1 - confidence - miss > 1e-9:  # the order statistics spend all of alpha (e.g. 3 values at 75%)
        rank -= 1  # the next ranks out leave some for the examples
        if rank == 0:
            return med, None, None
        miss = float(Fraction(2 * sum(math.comb(x.size, k) for k in range(rank)), 2 ** x.size))
        xs = np.sort(x)
        lo, hi = float(xs[rank - 1]), float(xs[x.size - rank])
    v, df = _components(np.asarray(D, dtype=np.float64))[1]
    h = math.sqrt(v) * t_quantile(1 - (1 - confidence - miss) / 2, df) if v > 0 else 0.0
    return med, lo - h, hi + h


# -- multiplicity -----------------------------------------------------------------------------


LOOK_FIRST_SHARE = 0.95  # the share of alpha spent at a folder's first look; the rest spread over the later ones


def look_share(look: int) -> float:
    """The share of alpha that the ``look``-th reading of a comparison spends (1: the first): :data:`LOOK_FIRST_SHARE`
    at the first, and ``(1 - LOOK_FIRST_SHARE) * 6 / (pi^2 (look - 1)^2)`` at a later one, so the shares of all looks
    sum to 1 however many there are (``sum 1 / j^2 = pi^2 / 6``), and the chance of a false verdict at any look is at
    most alpha whatever the seeds of each look (Bonferroni over looks; the looks of one folder share seeds, so the
    truth is well below the bound). Most of alpha is spent at the first look, the planned one: a family of 3 keeps its
    verdict at 7 seeds (2 / 2^7 x 3 / 0.95 < 0.05); a later look pays for that with x33, x132, x296... (the simulation
    that chose the rule: benchmarks/looks_error.py)."""
    if isinstance(look, bool) or not isinstance(look, (int, np.integer)) or look < 1:
        raise ValueError(f"look: must be an integer >= 1, got {look!r}")
    if look == 1:
        return LOOK_FIRST_SHARE
    return (1.0 - LOOK_FIRST_SHARE) * 6.0 / (math.pi ** 2 * (look - 1) ** 2)


def look_factor(look: int) -> float:
    """What the ``look``-th reading multiplies its p-values by: ``1 / look_share(look)`` (1.053, 32.9, 132, 296, 526,
    822 at looks 1-6)."""
    return 1.0 / look_share(look)


def look_adjusted(p: Optional[float], look: int) -> Optional[float]:
    """``p`` at the ``look``-th reading of a comparison (1: the first): times :func:`look_factor`, at most 1, so that
    the verdicts of every look together keep their error within alpha (:func:`look_share`)."""
    if p is None:
        look_share(look)  # the look is checked all the same
        return None
    return min(1.0, p * look_factor(look))


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


# -- wording ----------------------------------------------------------------------------------


def seeds_words(first: str, lower: int, higher: int, n: int, mean: Optional[float]) -> str:
    """What the test of exchangeability saw, in words: "DIFF lower in 7 of 7 seeds" (the side most seeds lie on),
    and where the mean lies on the other side, ", though higher on average: most seeds and the mean disagree" (a
    few seeds differ by much more than the rest); "DIFF lower in 3 and higher in 3 of 7 seeds, higher on average"
    where the seeds split evenly. No "better" or "worse": the test says the arms differ, not whose mean is better."""
    avg = None if not mean else "lower" if mean < 0 else "higher"
    if lower == higher:
        return f"{first} lower in {lower} and higher in {higher} of {n} seeds" + (f", {avg} on average" if avg else "")
    side, k = ("lower", lower) if lower > higher else ("higher", higher)
    text = f"{first} {side} in {k} of {n} seeds"
    return text + (f", though {avg} on average: most seeds and the mean disagree" if avg and avg != side else "")


def mean_side(mean: float, lower_is_better: bool) -> str:
    """"better" or "worse": the side of an *established* mean difference (never of a verdict on exchangeability)."""
    return "better" if (mean < 0) == lower_is_better else "worse"


def verdict(est: PairedEstimate, metric: str, *, lower_is_better: bool, adjusted_p: Optional[float] = None,
            alpha: float = 0.05, unit: str = "", digits: int = 3, names: tuple[str, str] = DEFAULT_NAMES,
            family_size: Optional[int] = None, power_seeds: Optional[int] = None, power_checked: bool = False,
            power_plan: Optional[PowerPlan] = None, mean_p: Optional[float] = None,
            mean_seeds: Optional[int] = None, mean_plan: Optional[PowerPlan] = None,
            look: Optional[int] = None) -> str:
    """A plain sentence of what the tests show. Where the (Holm-adjusted, over ``family_size`` comparisons) test of
    exchangeability rejects at ``alpha``: "the arms are not interchangeable at this scale and budget: DIFF lower in
    7 of 7 seeds" (:func:`seeds_words`: the side most seeds lie on, and whether the mean disagrees); otherwise "no
    detectable difference", and why: too few seeds for any verdict (ties counted), a difference that does not survive
    the adjustment, or the range the interval allows. With ``power_checked``, the seeds at which a difference like
    this one reaches 80% power (``power_seeds``; ``None``: beyond what was simulated), or with ``power_plan``
    (:func:`power_plan`) those seeds with the effect and spread they were planned for. Always "at this scale and
    budget".

    "Better" and "worse" are said only of a mean difference that a valid test establishes: a bounded metric
    (``est.betting_p``) whose ``mean_p`` (the betting p, Holm-adjusted like the verdict's; default ``est.betting_p``)
    is below ``alpha`` ("the mean difference is established ...: DIFF is worse on average"), or not yet, with
    ``mean_seeds`` (:func:`seeds_for_mean`) when known and ``mean_plan`` (:func:`power_plan` of the mean) when
    planned. An unbounded metric's mean has no such test: beside a verdict it says so. The interval printed is the
    one ``est.interval_of`` names: of the mean difference (bounded), or of the median seed difference (unbounded).
    ``look``: which reading of its folder this is, where ``adjusted_p`` and ``mean_p`` are already multiplied by its
    :func:`look_factor` (:func:`look_adjusted`; ``None``: not adjusted for looks), named in the text, and counted in
    the seeds a verdict needs."""
    u = f" {unit}" if unit else ""
    f = f"{{:+.{digits}f}}"
    head = f"{metric}: {names[0]} - {names[1]} = {f.format(est.mean)}{u}"
    if est.n == 1:
        return head + " (one seed: no interval, so no conclusion)"
    adjusted = adjusted_p is not None
    p = est.p_value if not adjusted else adjusted_p
    over = f"{est.n} paired seeds{'' if est.n_examples == 1 else f' x {est.n_examples} examples'}"
    holm_p = f"; Holm-adjusted p = {p_text(adjusted_p)}" + (f" over {family_size} comparisons" if family_size else "") \
        + (f", x{look_factor(look):.3g} at look {look} of this folder" if look else "") if adjusted else ""
    needed = seeds_for_verdict((family_size or 1) * (look_factor(look) if look else 1), alpha)
    power = ""
    if power_checked and power_plan is not None:
        power = "; " + power_plan.describe(digits, unit)
    elif power_checked:
        power = (f"; resampling these {est.n} seeds' differences, a difference like this one reaches 80% power at "
                 f"about {power_seeds} seeds" if power_seeds else
                 f"; resampling these {est.n} seeds' differences, a difference like this one does not reach 80% "
                 f"power within {POWER_MAX_SEEDS} seeds")
    flat = est.low is None and NO_SPREAD in (est.note or "")  # a test, and no interval to show with it
    if est.low is None and not flat:
        return head + f" ({est.note}{f' ({needed} in a family of {family_size})' if family_size else ''}): no " \
                      "conclusion at this scale and budget" + power
    median = est.interval_of == "median"
    lo, hi = est.printed_interval()
    pct = round(100 * est.confidence)
    if flat:
        ci = f" ({est.note}; over {over}; p = {p_text(est.p_value)}{holm_p})"
    elif median and lo is None:  # order statistics need more seeds than the t and sign-flip hull at this confidence
        ci = (f" (the mean over {over}; median seed difference {f.format(est.median)}{u}, too few seeds for an "
              f"interval of the median at {pct}%; p = {p_text(est.p_value)}{holm_p})")
    elif median:
        ci = (f" (the mean over {over}; median seed difference {f.format(est.median)}{u}, unadjusted {pct}% interval "
              f"of the median [{f.format(lo)}, {f.format(hi)}]; p = {p_text(est.p_value)}{holm_p})")
    else:
        ci = (f" (unadjusted {pct}% interval of the mean difference [{f.format(lo)}, {f.format(hi)}] over {over}; "
              f"p = {p_text(est.p_value)}{holm_p})")
    mean = _mean_words(est, alpha, mean_p, mean_seeds, lower_is_better, names[0]) + (
        "" if mean_plan is None else "; " + mean_plan.describe(digits, unit))
    if p < alpha:
        if est.betting_p is None:
            mean = ("; the mean difference is not established: an unbounded metric's mean has no test that holds "
                    "for every distribution of seeds")
        return (head + ci + ": the arms are not interchangeable at this scale and budget: "
                + seeds_words(names[0], est.lower, est.higher, est.n, est.mean) + mean)
    informative = est.n - est.ties
    if est.n < needed:
        why = (f"a verdict among {family_size} comparisons" if family_size else "a verdict") + \
            f" needs at least {needed} seeds"
    elif est.ties and informative < needed:
        why = (f"{est.ties} of {est.n} seeds tie (both models scored the same, e.g. both censored at the budget) and "
               f"carry no sign: {informative} informative seeds, and a verdict needs at least {needed}")
    elif adjusted and est.p_value < alpha:
        why = f"the unadjusted p-value is below {alpha:g}, but the difference does not survive the Holm adjustment"
    else:
        what = "median seed difference" if median else "mean difference"
        why = (f"the sign-flip test of {est.n} equal differences does not reject" if flat else
               f"the tests do not reject (p = {p_text(est.p_value)})" if lo is None else
               f"the interval of the {what} allows anything from {f.format(lo)} to {f.format(hi)}{u}")
    return head + ci + f": no detectable difference at this scale and budget; {why}{mean}" + power


def _mean_words(est: PairedEstimate, alpha: float, mean_p: Optional[float], mean_seeds: Optional[int],
                lower_is_better: bool = True, first: str = "DIFF") -> str:
    """``; the mean difference is established (betting p = ...): DIFF is worse on average`` (the only place a
    verdict says "better" or "worse") or ``... not yet established ...: about N seeds``, for a bounded metric (empty
    otherwise): the second estimand, stated beside the verdict."""
    if est.betting_p is None:
        return ""
    p = est.betting_p if mean_p is None else mean_p
    which = "betting p" if mean_p is None or mean_p == est.betting_p else "Holm-adjusted betting p"
    if p < alpha:
        return (f"; the mean difference is established ({which} = {p:.3g}): {first} is "
                f"{mean_side(est.mean, lower_is_better)} on average")
    more = "" if est.mean == 0 else (f": about {mean_seeds} seeds if the differences go on as these" if mean_seeds
                                     else f": not within {MEAN_MAX_SEEDS} seeds at these differences")
    return f"; the mean difference is not yet established ({which} = {p:.3g}){more}"
