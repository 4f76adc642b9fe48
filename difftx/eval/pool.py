"""Random-effects meta-analysis of one paired difference across comparisons (``difftx runs --pool``).

Each comparison ``i`` (a compare folder) gives an estimate ``y_i`` (the mean paired difference over its seeds) and
its within-comparison variance ``v_i = s_i^2 / n_i`` (the squared standard error over its ``n_i`` seeds). The model
is ``y_i ~ N(theta_i, v_i)`` with ``theta_i ~ N(mu, tau^2)``: every comparison (text, size, machine, regime) has its
own true difference, spread by ``tau`` around ``mu``. The functions here are pure: arrays in, numbers out; they
broadcast over leading axes (``y``, ``v`` of shape ``(..., k)``) so that ``benchmarks/pool_coverage.py`` runs
thousands of meta-analyses at once.

Formulas (the standard ones; written from the definitions):

- generalised Q: ``Q(t) = sum w_i(t) (y_i - mu(t))^2`` with ``w_i(t) = 1 / (v_i + t)`` and ``mu(t)`` the weighted
  mean; ``Q(0)`` is Cochran's Q (``k - 1`` df under ``tau = 0``); ``Q(t)`` decreases in ``t``.
- tau^2, Paule-Mandel (the default): the ``t >= 0`` with ``Q(t) = k - 1`` (0 when ``Q(0) <= k - 1``).
  DerSimonian-Laird: ``max(0, (Q(0) - (k - 1)) / (S1 - S2 / S1))``, ``S1 = sum w_i(0)``, ``S2 = sum w_i(0)^2``.
- tau's interval: the Q-profile (Viechtbauer 2007): the ``t`` at which ``Q(t)`` equals the chi-square ``k - 1``
  quantiles at ``1 - alpha/2`` (lower end) and ``alpha/2`` (upper end), each 0 where ``Q(0)`` is already below.
- the pooled mean's interval: Hartung-Knapp-Sidik-Jonkman, ``mu(tau^2) +- t_{k-1} sqrt(q / sum w_i)`` with
  ``q = Q(tau^2) / (k - 1)``; valid with few comparisons where the normal (Wald) interval is too narrow.
- I^2: ``max(0, (Q(0) - (k - 1)) / Q(0))`` (Higgins and Thompson), the share of the spread of the estimates beyond
  what their standard errors explain.
- the prediction interval for the true difference of a new comparison: from the predictive distribution that
  carries tau^2's uncertainty (its Q-profile confidence distribution, after Nagashima, Noma and Furukawa 2019:
  :func:`prediction_interval_cd`); beside it, for reference, the plug-in interval of Higgins, Thompson and
  Spiegelhalter (2009), ``mu +- t_{k-2} sqrt(tau^2 + SE(mu)^2)`` with the HKSJ standard error, which covers too
  little when tau is small next to the standard errors. None with fewer than 3 comparisons.
- subgroups: each pooled on its own (its own tau^2), then ``Q_between = sum W_g (mu_g - mu_bar)^2`` with
  ``W_g = 1 / SE(mu_g)^2`` (the random-effects variance ``1 / sum w_i``), chi-square on ``G - 1`` df.

The within-comparison variances are treated as known, as in every such analysis; with 3-14 seeds they are not, and
the simulation measures what that costs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

from .stats import t_quantile

METHODS = ("pm", "dl")
METHOD_NAMES = {"pm": "Paule-Mandel", "dl": "DerSimonian-Laird"}
_BISECTIONS = 80  # halvings of the tau^2 search interval: far below any printed digit


# -- the chi-square distribution (no SciPy) ------------------------------------------------------------


def _gamma_p_series(a: float, x: float) -> float:
    term = total = 1.0 / a
    n = a
    for _ in range(1000):
        n += 1.0
        term *= x / n
        total += term
        if abs(term) < abs(total) * 1e-16:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gamma_q_fraction(a: float, x: float) -> float:
    """The upper regularised incomplete gamma by its continued fraction (modified Lentz), for ``x >= a + 1``."""
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_sf(x: float, df: float) -> float:
    """``P(X >= x)`` for a chi-square with ``df > 0`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df: must be positive, got {df}")
    if x <= 0:
        return 1.0
    a, h = df / 2.0, x / 2.0
    return 1.0 - _gamma_p_series(a, h) if h < a + 1.0 else _gamma_q_fraction(a, h)


def chi2_p(x: float, df: float) -> float:
    """:func:`chi2_sf` as a reported p-value: at least :data:`difftx.eval.stats.P_FLOOR` (a bound where the tail
    underflows), never 0."""
    from .stats import P_FLOOR

    return max(P_FLOOR, chi2_sf(x, df))


@functools.lru_cache(maxsize=1024)
def chi2_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of a chi-square with ``df`` degrees of freedom (bisection on :func:`chi2_sf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p: must be in (0, 1), got {p}")
    lo, hi = 0.0, max(1.0, df)
    while 1.0 - chi2_sf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 1.0 - chi2_sf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# -- one comparison ------------------------------------------------------------------------------------


def study_estimate(differences: Sequence[float]) -> tuple[float, float, int]:
    """``(mean, standard error, n)`` of one comparison's paired differences over its seeds: the SE is the sample SD
    (``n - 1``) over ``sqrt(n)``. Needs at least 2 finite values."""
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or d.size < 2:
        raise ValueError(f"differences: need at least 2 seeds for a standard error, got {d.size}")
    if not np.all(np.isfinite(d)):
        raise ValueError("differences: every value must be finite")
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size)), int(d.size)


# -- the estimators (arrays of shape (..., k)) -----------------------------------------------------------


def _arrays(y, v) -> tuple[np.ndarray, np.ndarray]:
    y, v = np.asarray(y, dtype=np.float64), np.asarray(v, dtype=np.float64)
    if y.shape != v.shape or y.ndim < 1 or y.shape[-1] < 1:
        raise ValueError(f"y, v: need the same shape with at least one comparison, got {y.shape} and {v.shape}")
    if not (np.all(np.isfinite(y)) and np.all(np.isfinite(v))):
        raise ValueError("y, v: every estimate and variance must be finite")
    if np.any(v <= 0):
        raise ValueError("v: every within-comparison variance must be > 0 (a comparison whose seeds all agree has "
                         "no standard error)")
    return y, v


def q_statistic(y, v, tau2=0.0) -> np.ndarray:
    """The generalised Q at ``tau^2`` (Cochran's Q at 0)."""
    w = 1.0 / (np.asarray(v) + np.asarray(tau2)[..., None])
    mu = (w * y).sum(-1) / w.sum(-1)
    return (w * (y - mu[..., None]) ** 2).sum(-1)


def tau2_dl(y, v) -> np.ndarray:
    """DerSimonian-Laird's tau^2 (method of moments on Cochran's Q)."""
    y, v = _arrays(y, v)
    k = y.shape[-1]
    w = 1.0 / v
    s1, s2 = w.sum(-1), (w * w).sum(-1)
    q = q_statistic(y, v)
    return np.maximum(0.0, (q - (k - 1)) / np.where(k > 1, s1 - s2 / s1, 1.0))


def _solve_q(y, v, target) -> np.ndarray:
    """The ``tau^2 >= 0`` with ``Q(tau^2) = target`` (``Q`` decreases in ``tau^2``), 0 where ``Q(0) <= target``.
    Bisection over ``[0, sum (y - mean y)^2 / target]``: at that end ``Q <= target``, as the weighted mean minimises
    the weighted sum of squares and each weight is below ``1 / tau^2``."""
    target = np.broadcast_to(np.asarray(target, dtype=np.float64), y.shape[:-1])
    spread = ((y - y.mean(-1, keepdims=True)) ** 2).sum(-1)
    lo = np.zeros(y.shape[:-1])
    hi = spread / np.maximum(target, 1e-300) + 1e-300
    above = q_statistic(y, v, lo) > target
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        up = q_statistic(y, v, mid) > target
        lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
    return np.where(above, 0.5 * (lo + hi), 0.0)


def tau2_pm(y, v) -> np.ndarray:
    """Paule-Mandel's tau^2: the generalised Q set to its expectation ``k - 1``."""
    y, v = _arrays(y, v)
    k = y.shape[-1]
    if k < 2:
        return np.zeros(y.shape[:-1])
    return _solve_q(y, v, k - 1)


def tau2_estimate(y, v, method: str = "pm") -> np.ndarray:
    if method not in METHODS:
        raise ValueError(f"method: one of {', '.join(METHODS)}, got {method!r}")
    return tau2_pm(y, v) if method == "pm" else tau2_dl(y, v)


def tau2_interval(y, v, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """The Q-profile interval of tau^2 (needs ``k >= 2``)."""
    y, v = _arrays(y, v)
    k = y.shape[-1]
    if k < 2:
        raise ValueError("tau2_interval: needs at least 2 comparisons")
    alpha = 1.0 - confidence
    low = _solve_q(y, v, chi2_quantile(1.0 - alpha / 2, k - 1))
    high = _solve_q(y, v, chi2_quantile(alpha / 2, k - 1))
    return low, high


def hksj(y, v, tau2, confidence: float = 0.95, floor: bool = False):
    """``(mean, se, low, high)``: the random-effects mean at ``tau2`` with the Hartung-Knapp-Sidik-Jonkman interval
    (t on ``k - 1`` df; needs ``k >= 2``). ``floor``: the modification that keeps ``q >= 1`` (never narrower than
    the ordinary random-effects standard error)."""
    y, v = _arrays(y, v)
    k = y.shape[-1]
    if k < 2:
        raise ValueError("hksj: needs at least 2 comparisons")
    w = 1.0 / (v + np.asarray(tau2, dtype=np.float64)[..., None])
    sw = w.sum(-1)
    mu = (w * y).sum(-1) / sw
    q = (w * (y - mu[..., None]) ** 2).sum(-1) / (k - 1)
    if floor:
        q = np.maximum(q, 1.0)
    se = np.sqrt(q / sw)
    half = t_quantile(0.5 + confidence / 2, k - 1) * se
    return mu, se, mu - half, mu + half


def i_squared(y, v) -> np.ndarray:
    """Higgins and Thompson's I^2 from Cochran's Q (0 with one comparison)."""
    y, v = _arrays(y, v)
    k = y.shape[-1]
    q = q_statistic(y, v)
    return np.where(q > k - 1, (q - (k - 1)) / np.where(q > 0, q, 1.0), 0.0)


def prediction_interval(mean, se, tau2, k: int, confidence: float = 0.95):
    """``(low, high)`` for the true difference of a new comparison: t on ``k - 2`` df (needs ``k >= 3``)."""
    if k < 3:
        raise ValueError(f"prediction_interval: needs at least 3 comparisons, got {k}")
    half = t_quantile(0.5 + confidence / 2, k - 2) * np.sqrt(np.asarray(tau2) + np.asarray(se) ** 2)
    return mean - half, mean + half


PI_GRID, PI_DRAWS = 100, 40  # the confidence distribution's tau^2 at 100 quantiles, 40 draws of the rest at each


def prediction_interval_cd(y, v, confidence: float = 0.95, floor: bool = True, grid: int = PI_GRID,
                           draws: int = PI_DRAWS, seed: int = 0):
    """``(low, high)``: the prediction interval for a new comparison's true difference from the predictive
    distribution that carries the uncertainty of tau^2 (after Nagashima, Noma and Furukawa 2019; needs ``k >= 3``).
    tau^2 is taken at ``grid`` evenly spaced quantiles of its confidence distribution (the Q-profile's:
    ``Q(tau^2) = u`` for ``u`` the chi-square ``k - 1`` quantiles, 0 where ``Q(0) <= u``); at each, the new true
    difference is ``mu(tau^2) + T SE(tau^2) + Z tau`` (``SE``: HKSJ's, ``floor`` as in :func:`hksj`; ``T`` Student t
    on ``k - 1`` df, ``Z`` standard normal, ``draws`` of each from a fixed ``seed``, the same for every analysis),
    and the interval is the central ``confidence`` of all of them. The plug-in interval
    (:func:`prediction_interval`) treats tau^2 as known and covers too little when tau is small next to the
    standard errors (``benchmarks/pool_coverage.py``)."""
    y, v = _arrays(y, v)
    k = y.shape[-1]
    if k < 3:
        raise ValueError(f"prediction_interval_cd: needs at least 3 comparisons, got {k}")
    u = np.array([chi2_quantile((j + 0.5) / grid, k - 1) for j in range(grid)])
    yg, vg = y[..., None, :], v[..., None, :]
    tau2 = _solve_q(np.broadcast_to(yg, y.shape[:-1] + (grid, k)), np.broadcast_to(vg, v.shape[:-1] + (grid, k)), u)
    w = 1.0 / (vg + tau2[..., None])
    sw = w.sum(-1)
    mu = (w * yg).sum(-1) / sw
    q = (w * (yg - mu[..., None]) ** 2).sum(-1) / (k - 1)
    se = np.sqrt((np.maximum(q, 1.0) if floor else q) / sw)
    rng = np.random.default_rng(seed)
    t, z = rng.standard_t(k - 1, size=(grid, draws)), rng.standard_normal((grid, draws))
    theta = mu[..., None] + t * se[..., None] + z * np.sqrt(tau2)[..., None]
    theta = theta.reshape(theta.shape[:-2] + (grid * draws,))
    alpha = 1.0 - confidence
    return np.quantile(theta, alpha / 2, axis=-1), np.quantile(theta, 1.0 - alpha / 2, axis=-1)


# -- one meta-analysis, as reported ------------------------------------------------------------------------


@dataclass
class Pooled:
    """A random-effects meta-analysis of ``k`` comparisons (``None`` where ``k`` is too small: ``notes`` says why).
    ``weights``: each comparison's share of the pooled mean (``w_i / sum w``, at ``tau2``); ``pi_low``, ``pi_high``:
    the prediction interval (:func:`prediction_interval_cd`); ``pi_plugin_low``, ``pi_plugin_high``: the plug-in
    one (:func:`prediction_interval`), for reference."""

    k: int
    mean: float
    se: Optional[float]
    weights: list
    method: str
    confidence: float = 0.95
    floor: bool = True
    re_se: Optional[float] = None  # the ordinary random-effects standard error 1 / sqrt(sum w_i) (subgroup test's)
    low: Optional[float] = None
    high: Optional[float] = None
    df: Optional[int] = None
    tau2: Optional[float] = None
    tau: Optional[float] = None
    tau_low: Optional[float] = None
    tau_high: Optional[float] = None
    i2: Optional[float] = None
    q: Optional[float] = None
    q_p: Optional[float] = None
    pi_low: Optional[float] = None
    pi_high: Optional[float] = None
    pi_plugin_low: Optional[float] = None
    pi_plugin_high: Optional[float] = None
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**asdict(self), "tau2_method": METHOD_NAMES[self.method],
                "interval": None if self.k < 2 else "HKSJ, q >= 1" if self.floor else "HKSJ",
                "prediction": None if self.k < 3 else "tau^2's confidence distribution",
                "prediction_plugin_df": self.k - 2 if self.k >= 3 else None}


def pool(y: Sequence[float], se: Sequence[float], method: str = "pm", confidence: float = 0.95,
         floor: bool = True) -> Pooled:
    """Pool estimates ``y`` with standard errors ``se``: tau^2 by ``method`` (``"pm"`` Paule-Mandel, ``"dl"``
    DerSimonian-Laird) with its Q-profile interval (reported as tau), the HKSJ interval of the mean (``floor``: its
    factor ``q`` kept at least 1, see :func:`hksj`), I^2, Cochran's Q with its p-value and the prediction intervals
    (from 3 comparisons on). One comparison: its own estimate, nothing pooled."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    y_, v = _arrays(y, np.square(np.asarray(se, dtype=np.float64)))
    if y_.ndim != 1:
        raise ValueError(f"y: one estimate per comparison (1-D), got shape {y_.shape}")
    k = y_.size
    if k == 1:
        se1 = float(math.sqrt(v[0]))
        return Pooled(1, float(y_[0]), se1, [1.0], method, confidence, floor, se1,
                      notes=["one comparison: nothing to pool (no between-comparison spread, no interval)"])
    tau2 = float(tau2_estimate(y_, v, method))
    mean, se_mu, low, high = (float(x) for x in hksj(y_, v, tau2, confidence, floor))
    t_lo, t_hi = (float(x) for x in tau2_interval(y_, v, confidence))
    w = 1.0 / (v + tau2)
    q = float(q_statistic(y_, v))
    out = Pooled(k, mean, se_mu, (w / w.sum()).tolist(), method, confidence, floor, float(1.0 / math.sqrt(w.sum())),
                 low=low, high=high, df=k - 1, tau2=tau2, tau=math.sqrt(tau2), tau_low=math.sqrt(t_lo),
                 tau_high=math.sqrt(t_hi), i2=float(i_squared(y_, v)), q=q, q_p=chi2_p(q, k - 1))
    if k >= 3:
        out.pi_low, out.pi_high = (float(x) for x in prediction_interval_cd(y_, v, confidence, floor))
        out.pi_plugin_low, out.pi_plugin_high = (float(x) for x in prediction_interval(mean, se_mu, tau2, k,
                                                                                       confidence))
    else:
        out.notes.append("a prediction interval needs at least 3 comparisons")
    return out


def subgroup_test(groups: dict) -> dict:
    """The test of a difference between subgroups (``{name: Pooled}``, each pooled on its own): ``Q_between`` over
    the subgroups' means weighted by their inverse random-effects variances, chi-square on ``G - 1`` df. ``None``
    fields with one subgroup."""
    if len(groups) < 2:
        return {"q_between": None, "df": None, "p": None, "note": "one subgroup: nothing to test"}
    mu = np.array([g.mean for g in groups.values()])
    w = np.array([1.0 / g.re_se ** 2 for g in groups.values()])
    m = (w * mu).sum() / w.sum()
    qb = float((w * (mu - m) ** 2).sum())
    df = len(groups) - 1
    return {"q_between": qb, "df": df, "p": chi2_p(qb, df),
            "note": "each subgroup pooled with its own tau^2; the chi-square test treats their standard errors as "
                    "known, so with few comparisons per subgroup it rejects too often"}
