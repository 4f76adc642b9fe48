"""Efficiency ratios across scale (the paper's Fig. 3): how many tokens, or how many parameters,
the baseline needs to reach the loss DIFF reaches. A ratio below 1 means DIFF is more efficient.

Token efficiency (Fig. 3b), from held-out loss curves along training, per seed:

- for each point ``(t, L_D(t))`` of DIFF's curve, ``t_B`` is where the *same seed's* baseline curve
  reaches ``L_D(t)``, and the ratio is ``t / t_B``;
- the baseline curve is first made monotone (its running minimum: the best loss reached by then),
  then interpolated in log tokens by a monotone cubic (PCHIP: no overshoot, and no bias from
  straight segments on a curved loss curve);
- a point is summarised over seeds only where every seed reached it: an average over the seeds
  that happened to reach a loss would favour them; otherwise its note says how many did;
- a loss the baseline curve never reaches, or one above its first point, is "not reached": nothing
  is extrapolated.

Parameter efficiency (Fig. 3a), from the final held-out loss of each size, per seed:

- per arm, a straight line ``log L = a + b log N`` (least squares over the sizes; ``N``: parameters
  without the token embedding);
- for a DIFF size ``N_D``, ``N_B`` solves ``L_B(N_B) = L_D(N_D)`` on the fitted lines, and the ratio
  is ``N_D / N_B``; an ``N_B`` outside the measured sizes is marked as extrapolation;
- where the two lines meet (if their slopes differ), the crossover size: above it the sign of the gap
  changes.

Intervals. Seeds are the independent replicates: seed ``s`` of every arm shares its data order, so
every ratio is computed within a seed and the seeds' log-ratios are averaged. The 95% interval is
the t interval of that mean over seeds (``n - 1`` degrees of freedom), mapped back to a ratio. It
assumes the seeds' log-ratios are roughly normal, which smooth LM loss curves give (the retrieval
lottery of :mod:`difftx.eval.stats` concerns accuracies, not these). ``tests/test_efficiency.py``
checks its coverage on synthetic power laws with seed noise and a known ratio. The crossover's
interval is Fieller's, from the seeds' differences of intercept and slope: it is unbounded when the
slopes are not clearly different, and then says so. One seed gives estimates without intervals.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

from .stats import t_quantile

NOT_REACHED = "not reached: outside the range both curves cover (never extrapolated)"


def _checked_curve(tokens: Sequence[float], losses: Sequence[float], what: str) -> tuple[np.ndarray, np.ndarray]:
    t, v = np.asarray(tokens, dtype=np.float64), np.asarray(losses, dtype=np.float64)
    if t.ndim != 1 or t.shape != v.shape or t.size < 2:
        raise ValueError(f"{what}: need two equal-length sequences of at least 2 points, got {t.shape} and {v.shape}")
    if not (np.isfinite(t).all() and np.isfinite(v).all()):
        raise ValueError(f"{what}: tokens and losses must be finite numbers")
    if (t <= 0).any() or (np.diff(t) <= 0).any():
        raise ValueError(f"{what}: tokens must be positive and increasing")
    if (v <= 0).any():
        raise ValueError(f"{what}: losses must be positive")
    return t, v


def _pchip_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Fritsch-Carlson slopes of the monotone cubic (PCHIP) through ``(x, y)``: the interpolant
    never overshoots, so a monotone curve stays monotone between its points."""
    h, d = np.diff(x), np.diff(y) / np.diff(x)
    m = np.zeros_like(y)
    for k in range(1, x.size - 1):
        if d[k - 1] * d[k] > 0:
            w1, w2 = 2 * h[k] + h[k - 1], h[k] + 2 * h[k - 1]
            m[k] = (w1 + w2) / (w1 / d[k - 1] + w2 / d[k])
    m[0], m[-1] = d[0], d[-1]
    for end, dd in ((0, d[0]), (-1, d[-1])):  # the ends: no overshoot either
        if m[end] * dd <= 0:
            m[end] = 0.0
    return m


def tokens_to_reach(tokens: Sequence[float], losses: Sequence[float], target: float) -> Optional[float]:
    """Where a loss curve first reaches ``target``: the curve made monotone (its running minimum)
    and interpolated by a monotone cubic (PCHIP) in log tokens, which follows a curved loss curve
    between its points (linear interpolation sits above a convex curve and biased the ratio by
    about 1.5% at 3 points per decade). ``None`` when the curve never gets that low, or when
    ``target`` lies above its first point (the curve does not cover it)."""
    t, v = _checked_curve(tokens, losses, "curve")
    best = np.minimum.accumulate(v)
    if target > best[0] or target < best[-1]:
        return None
    i = int(np.argmax(best <= target))  # the first point at or below the target
    if i == 0:
        return float(t[0])
    x = np.log(t)
    m = _pchip_slopes(x, best)
    x0, x1, y0, y1, m0, m1 = x[i - 1], x[i], best[i - 1], best[i], m[i - 1], m[i]
    h = x1 - x0

    def value(u: float) -> float:  # the Hermite cubic on [x0, x1] at fraction u
        return ((2 * u ** 3 - 3 * u ** 2 + 1) * y0 + (u ** 3 - 2 * u ** 2 + u) * h * m0
                + (-2 * u ** 3 + 3 * u ** 2) * y1 + (u ** 3 - u ** 2) * h * m1)

    lo, hi = 0.0, 1.0  # value(lo) >= target >= value(hi), non-increasing in between
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if value(mid) > target else (lo, mid)
    return float(math.exp(x0 + hi * h))


@dataclass
class Ratio:
    """A ratio (``value``, the geometric mean over seeds) with its 95% interval over seeds
    (``low``/``high``; ``None`` with one seed), from ``n`` seeds; ``note`` says why a value is
    missing or qualified."""

    value: Optional[float]
    low: Optional[float]
    high: Optional[float]
    n: int
    note: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


def ratio_over_seeds(log_ratios: Sequence[float], confidence: float = 0.95) -> Ratio:
    """Geometric mean of per-seed ratios, given as logs, with the t interval over seeds."""
    x = np.asarray(log_ratios, dtype=np.float64)
    if x.size == 0:
        return Ratio(None, None, None, 0, NOT_REACHED)
    m = float(x.mean())
    if x.size == 1:
        return Ratio(math.exp(m), None, None, 1, "one seed: no interval")
    h = t_quantile(1 - (1 - confidence) / 2, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Ratio(math.exp(m), math.exp(m - h), math.exp(m + h), int(x.size))


@dataclass
class TokenEfficiency:
    """Per DIFF point (by index along the curves): its tokens, the ratio ``t / t_B`` over the seeds
    that reached it, and the overall ratio over the points every seed reached."""

    tokens: list[float]
    ratios: list[Ratio]
    overall: Ratio
    per_seed: list[list[Optional[float]]] = field(default_factory=list)  # [seed][point]: the ratio or None

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "ratios": [r.to_dict() for r in self.ratios],
                "overall": self.overall.to_dict(), "per_seed": self.per_seed}


def token_efficiency(arm: Sequence[tuple[Sequence[float], Sequence[float]]],
                     reference: Sequence[tuple[Sequence[float], Sequence[float]]],
                     confidence: float = 0.95) -> TokenEfficiency:
    """Token efficiency of ``arm`` (DIFF) against ``reference`` (the baseline): one ``(tokens,
    losses)`` curve per seed for each, paired by position (seed ``s`` of both), every arm curve
    sampled at the same tokens."""
    if len(arm) != len(reference) or not arm:
        raise ValueError(f"need one curve per seed for both arms, got {len(arm)} and {len(reference)}")
    curves = [_checked_curve(t, v, f"seed {s} (arm)") for s, (t, v) in enumerate(arm)]
    refs = [_checked_curve(t, v, f"seed {s} (reference)") for s, (t, v) in enumerate(reference)]
    points = curves[0][0]
    if any(c[0].shape != points.shape or not np.allclose(c[0], points) for c in curves):
        raise ValueError("every seed's arm curve must be sampled at the same tokens")
    per_seed: list[list[Optional[float]]] = []
    for (t, v), (rt, rv) in zip(curves, refs):
        row = []
        for ti, li in zip(t, v):
            tb = tokens_to_reach(rt, rv, float(li))
            row.append(None if tb is None else float(ti / tb))
        per_seed.append(row)
    ratios = []
    for i in range(points.size):
        got = [math.log(r[i]) for r in per_seed if r[i] is not None]
        if 0 < len(got) < len(per_seed):  # a subset of seeds is not summarised (see the module doc)
            ratio = Ratio(None, None, None, len(got), f"reached in {len(got)} of {len(per_seed)} seeds: "
                                                      "not summarised (every seed must reach it)")
        else:
            ratio = ratio_over_seeds(got, confidence)
        ratios.append(ratio)
    common = [i for i in range(points.size) if all(r[i] is not None for r in per_seed)]
    overall = ratio_over_seeds([float(np.mean([math.log(r[i]) for i in common])) for r in per_seed]
                               if common else [], confidence)
    if common:
        where = f"mean over the {len(common)} points every seed reached"
        overall.note = where if overall.note is None else f"{overall.note}; {where}"
    return TokenEfficiency([float(x) for x in points], ratios, overall, per_seed)


# -- parameter efficiency ----------------------------------------------------------------------------

def fit_power_law(params: Sequence[float], losses: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``log L = a + b log N``."""
    n, v = _checked_curve(params, losses, "sizes")
    x, y = np.log(n), np.log(v)
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


@dataclass
class Crossover:
    """The size where the two fitted lines meet (``params``), with Fieller's 95% interval
    (``low``/``high``: ``None`` on a side where it is unbounded), and whether it lies outside the
    measured sizes (``extrapolated``)."""

    params: Optional[float]
    low: Optional[float]
    high: Optional[float]
    extrapolated: Optional[bool]
    note: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ParameterEfficiency:
    """Per DIFF size: its parameters, the baseline parameters that reach its fitted loss (geometric
    mean over seeds) and the ratio with its interval; whether that baseline size is extrapolated;
    each arm's fit per seed; the crossover."""

    params: list[float]
    matched_params: list[Optional[float]]
    ratios: list[Ratio]
    extrapolated: list[bool]
    fits: dict  # {"arm": [(a, b) per seed], "reference": [...]}
    crossover: Crossover

    def to_dict(self) -> dict:
        return {"params": self.params, "matched_params": self.matched_params,
                "ratios": [r.to_dict() for r in self.ratios], "extrapolated": self.extrapolated,
                "fits": {k: [list(f) for f in v] for k, v in self.fits.items()},
                "crossover": self.crossover.to_dict()}


def parameter_efficiency(arm_params: Sequence[float], arm_losses: Sequence[Sequence[float]],
                         ref_params: Sequence[float], ref_losses: Sequence[Sequence[float]],
                         confidence: float = 0.95) -> ParameterEfficiency:
    """Parameter efficiency of ``arm`` (DIFF) against ``reference`` (the baseline): ``*_params``
    the non-embedding parameters of each size (increasing, at least 2 sizes), ``*_losses[seed]``
    the held-out loss of each size for that seed (seeds paired by position)."""
    na, nr = np.asarray(arm_params, dtype=np.float64), np.asarray(ref_params, dtype=np.float64)
    if na.size < 2 or na.shape != nr.shape:
        raise ValueError(f"need at least 2 sizes, the same number for both arms (got {na.size} and {nr.size})")
    if len(arm_losses) != len(ref_losses) or not arm_losses:
        raise ValueError(f"need the losses of the same seeds for both arms, got {len(arm_losses)} and "
                         f"{len(ref_losses)}")
    fa = [fit_power_law(na, row) for row in arm_losses]
    fr = [fit_power_law(nr, row) for row in ref_losses]
    lo_n, hi_n = float(nr.min()), float(nr.max())
    ratios, matched, extrapolated = [], [], []
    for n in na:
        logs, log_nb = [], []
        for (a, b), (ar, br) in zip(fa, fr):
            if br == 0:
                continue
            x_b = (a + b * math.log(n) - ar) / br  # log N_B where the reference line reaches the arm's loss
            log_nb.append(x_b)
            logs.append(math.log(n) - x_b)
        ratio = ratio_over_seeds(logs, confidence)
        nb = math.exp(float(np.mean(log_nb))) if log_nb else None
        out = nb is not None and not lo_n <= nb <= hi_n
        if out:
            ratio.note = "extrapolated: the matching baseline size lies outside the measured sizes"
        ratios.append(ratio)
        matched.append(nb)
        extrapolated.append(bool(out))
    cross = _crossover([a for a, _ in fa], [b for _, b in fa], [a for a, _ in fr], [b for _, b in fr],
                       (min(lo_n, float(na.min())), max(hi_n, float(na.max()))), confidence)
    return ParameterEfficiency([float(x) for x in na], matched, ratios, extrapolated, {"arm": fa, "reference": fr},
                               cross)


def _crossover(a1: Sequence[float], b1: Sequence[float], a2: Sequence[float], b2: Sequence[float],
               measured: tuple[float, float], confidence: float) -> Crossover:
    """Where ``a1 + b1 x = a2 + b2 x`` (``x = log N``), from the seeds' differences ``da = a1 - a2``
    and ``db = b1 - b2``: the root ``-mean(da) / mean(db)`` and Fieller's interval (the ``x`` for
    which ``|mean(da) + mean(db) x|`` is within t standard errors of 0)."""
    da, db = np.asarray(a1) - np.asarray(a2), np.asarray(b1) - np.asarray(b2)
    n = da.size
    mda, mdb = float(da.mean()), float(db.mean())
    if mdb == 0.0 or abs(mda / mdb) > 700:
        return Crossover(None, None, None, None, "the fitted lines are parallel, or meet at no size a float can "
                                                 "hold: they do not cross")
    root = math.exp(-mda / mdb)
    outside = not measured[0] <= root <= measured[1]
    if n < 2:
        return Crossover(root, None, None, outside, "one seed: no interval")
    t2 = t_quantile(1 - (1 - confidence) / 2, n - 1) ** 2
    vaa, vbb = float(da.var(ddof=1)) / n, float(db.var(ddof=1)) / n
    vab = float(np.cov(da, db, ddof=1)[0, 1]) / n
    # (mda + mdb x)^2 <= t2 (vaa + 2 vab x + vbb x^2): A x^2 + B x + C <= 0
    A, B, C = mdb ** 2 - t2 * vbb, 2 * (mda * mdb - t2 * vab), mda ** 2 - t2 * vaa
    disc = B * B - 4 * A * C
    note = "extrapolated: outside the measured sizes" if outside else None
    if A > 0 and disc >= 0:
        lo, hi = sorted(((-B - math.sqrt(disc)) / (2 * A), (-B + math.sqrt(disc)) / (2 * A)))
        return Crossover(root, math.exp(max(lo, -700.0)), None if hi > 700 else math.exp(hi), outside, note)
    why = "the slopes are not clearly different at these seeds: the interval is unbounded"
    return Crossover(root, None, None, outside, why if note is None else f"{note}; {why}")
