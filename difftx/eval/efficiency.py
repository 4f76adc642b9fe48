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
  is extrapolated;
- the overall ratio averages the points every seed reached, unless the curves cross (one point's
  interval above 1, another's below): then there is none, and the first and last points stand in.

Parameter efficiency (Fig. 3a): :mod:`difftx.eval.floor_fit`.

Intervals. Seeds are the independent replicates: seed ``s`` of every arm shares its data order.
Token ratios are computed within a seed and the seeds' log-ratios averaged, with the t interval of
that mean (``n - 1`` degrees of freedom), mapped back to a ratio; it assumes the seeds' log-ratios are
roughly normal, which smooth LM loss curves give (the retrieval lottery of :mod:`difftx.eval.stats`
concerns accuracies, not these).
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
    """A ratio (``value``: a geometric mean over seeds, or the floor fit's reading of the seeds' mean
    losses) with its 95% interval over seeds (``low``/``high``; ``None`` with one seed), from ``n``
    seeds; ``note`` says why a value is missing or qualified."""

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
    that reached it, and the overall ratio over the points every seed reached. ``crosses``: the
    curves clearly cross (one of those points has its whole interval above 1 and another below; with
    one seed, values on both sides of 1): then ``overall`` has no value, as an average across the
    crossing would read like no difference. ``span``: the first and last of those points, each
    ``{"tokens": t, **Ratio.to_dict()}`` (``None`` when no point was reached by every seed)."""

    tokens: list[float]
    ratios: list[Ratio]
    overall: Ratio
    per_seed: list[list[Optional[float]]] = field(default_factory=list)  # [seed][point]: the ratio or None
    crosses: bool = False
    span: Optional[dict] = None

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "ratios": [r.to_dict() for r in self.ratios],
                "overall": self.overall.to_dict(), "crosses": self.crosses, "span": self.span,
                "per_seed": self.per_seed}


def _crosses(ratios: Sequence[Ratio]) -> bool:
    """Whether the ratios clearly lie on both sides of 1: a whole interval above and another below
    (the values themselves where there are no intervals)."""
    if any(r.low is not None for r in ratios):
        return any(r.low is not None and r.low > 1 for r in ratios) and \
            any(r.high is not None and r.high < 1 for r in ratios)
    return any(r.value > 1 for r in ratios) and any(r.value < 1 for r in ratios)


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
    crosses, span = False, None
    if common:
        span = {k: {"tokens": float(points[i]), **ratios[i].to_dict()} for k, i in (("first", common[0]),
                                                                                   ("last", common[-1]))}
        crosses = _crosses([ratios[i] for i in common])
        where = f"mean over the {len(common)} points every seed reached"
        overall.note = where if overall.note is None else f"{overall.note}; {where}"
    if crosses:
        first, last = span["first"], span["last"]
        overall = Ratio(None, None, None, overall.n,
                        f"the curves cross: the ratio runs from {first['value']:.2f} at {first['tokens']:,.0f} tokens "
                        f"to {last['value']:.2f} at {last['tokens']:,.0f} tokens; no overall ratio (an average "
                        "across a crossing would read like no difference)")
    return TokenEfficiency([float(x) for x in points], ratios, overall, per_seed, crosses, span)
