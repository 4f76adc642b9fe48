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

Parameter efficiency (Fig. 3a), from the final held-out loss of each size (``N``: parameters
without the token embedding):

- both arms' seed-mean losses are fitted as ``L = E + A N^-b`` with one floor ``E`` shared by the two
  arms (least squares: ``E`` in ``[0, the lowest loss]``, each ``b`` in :data:`B_RANGE`, ``A >= 0``;
  a grid narrowed in rounds, so deterministic and bounded where a free fit would run away);
- for a DIFF size ``N_D``, ``N_B`` solves ``L_B(N_B) = L_D(N_D)`` on the fitted curves (the floor
  cancels), and the ratio is ``N_D / N_B``; an ``N_B`` outside the measured sizes is marked as
  extrapolation; where the curves meet, the crossover size;
- the paper's straight line ``log L = a + b log N`` per arm and seed is read beside it (``loglog``),
  with its lack of fit: the curvature of ``log L`` in ``log N`` per seed (a floor bends it up), and
  both fits' residuals. A straight line fitted to a curve that flattens toward a floor gives ratios
  that drift with size and intervals that miss; with 2 sizes it is all there is.

Intervals. Seeds are the independent replicates: seed ``s`` of every arm shares its data order.
Token ratios are computed within a seed and the seeds' log-ratios averaged, with the t interval of
that mean (``n - 1`` degrees of freedom), mapped back to a ratio; it assumes the seeds' log-ratios are
roughly normal, which smooth LM loss curves give (the retrieval lottery of :mod:`difftx.eval.stats`
concerns accuracies, not these). The floor fit's ratio comes from the fit to the seeds' mean losses;
its interval is the jackknife's (the fit repeated without each seed, standard error times t with
``n - 1`` degrees of freedom), which assumes independent seeds and curves of that form: fitted per
seed, a 3-parameter curve on 4 noisy points has a bias that does not shrink with seeds, while the fit
to the mean has one that does. ``tests/test_efficiency.py`` checks its coverage at every size on
simulated power laws with and without a floor. The crossover's interval is Fieller's, from the
differences of intercept and slope (over seeds for the line, their jackknife covariance for the floor
fit): it is unbounded when the slopes are not clearly different, and then says so. One seed gives
estimates without intervals.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

from .stats import round_p, t_cdf, t_quantile

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


# -- parameter efficiency ----------------------------------------------------------------------------

B_RANGE = (1e-3, 3.0)  # the exponents b a floor fit may take
_LOG_B = np.log(np.geomspace(*B_RANGE, 24))  # the first grid of the search over b
_E_STEPS = np.linspace(0.0, 1.0, 17)  # the grid over the floor, between its current bounds
_CHUNK = 256  # problems fitted at once: bounds the memory of the vectorised search


def fit_power_law(params: Sequence[float], losses: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``log L = a + b log N``."""
    n, v = _checked_curve(params, losses, "sizes")
    x, y = np.log(n), np.log(v)
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def _excess_fit(x: np.ndarray, y: np.ndarray, E: np.ndarray, log_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Problems ``y`` (P, k) at centred log sizes ``x`` (k,), floors ``E`` (P, m), exponents
    ``exp(log_b)`` ((g,) for all, or (P, m, g)): the least-squares ``A >= 0`` of
    ``y ~ E + A exp(-b x)`` and the sum of squared residuals, each (P, m, g)."""
    b = np.exp(log_b)
    uy = su = suu = 0.0
    for i in range(x.size):  # a loop over the few sizes: faster than reductions over a short last axis
        u = np.exp(-b * x[i])
        yi = y[:, i, None, None] if u.ndim == 3 else y[:, i, None, None] * np.ones_like(u)
        uy, su, suu = uy + u * yi, su + u, suu + u * u
    num = np.maximum(uy - E[..., None] * su, 0.0)
    syy = (y * y).sum(1)[:, None] - 2 * E * y.sum(1)[:, None] + x.size * E * E
    return num / suu, syy[..., None] - num * num / suu


def _best_exponent(x: np.ndarray, y: np.ndarray, E: np.ndarray, zooms: int = 6) -> tuple[np.ndarray, ...]:
    """For every problem and floor, the exponent in :data:`B_RANGE` with the least squares: a
    log-spaced grid, then ``zooms`` rounds of 7 points between the best point's neighbours (each a
    third as wide). Returns ``(sse, A, log b)``, each (P, m)."""
    A, S = _excess_fit(x, y, E, _LOG_B)
    j = S.argmin(-1)[..., None]
    best, step = _LOG_B[j[..., 0]], _LOG_B[1] - _LOG_B[0]
    for _ in range(zooms):
        lo, hi = np.maximum(best - step, _LOG_B[0]), np.minimum(best + step, _LOG_B[-1])
        grid = lo[..., None] + (hi - lo)[..., None] * np.linspace(0.0, 1.0, 7)
        A, S = _excess_fit(x, y, E, grid)
        j = S.argmin(-1)[..., None]
        best, step = np.take_along_axis(grid, j, -1)[..., 0], (hi - lo) / 6
    return np.take_along_axis(S, j, -1)[..., 0], np.take_along_axis(A, j, -1)[..., 0], best


def _floor_fit(xa: np.ndarray, ya: np.ndarray, xr: np.ndarray, yr: np.ndarray) -> dict:
    """Least squares of ``L = E + A N^-b`` for two arms sharing ``E``, for many problems at once:
    ``ya`` (P, ka) and ``yr`` (P, kr) at centred log sizes ``xa``, ``xr``. ``E`` is searched in
    ``[0, the lowest loss]`` (a grid of 17, narrowed 5 times), each arm's ``b`` in :data:`B_RANGE`
    with ``A >= 0`` solved exactly: deterministic, and bounded where a free fit would run away.
    Returns arrays over the problems: ``E``, ``A_arm``, ``b_arm``, ``A_ref``, ``b_ref`` (``A`` at
    the centre of ``x``) and ``top`` (the upper bound of ``E``)."""
    parts = []
    for s in range(0, ya.shape[0], _CHUNK):
        a, r = ya[s:s + _CHUNK], yr[s:s + _CHUNK]
        top = np.minimum(a.min(1), r.min(1))
        lo, hi = np.zeros_like(top), top
        for _ in range(5):
            E = lo[:, None] + (hi - lo)[:, None] * _E_STEPS
            total = _best_exponent(xa, a, E)[0] + _best_exponent(xr, r, E)[0]
            e = E[np.arange(E.shape[0]), total.argmin(1)]
            step = (hi - lo) / (_E_STEPS.size - 1)
            lo, hi = np.maximum(e - step, 0.0), np.minimum(e + step, top)
        _, A_a, lb_a = _best_exponent(xa, a, e[:, None], zooms=9)
        _, A_r, lb_r = _best_exponent(xr, r, e[:, None], zooms=9)
        parts.append({"E": e, "A_arm": A_a[:, 0], "b_arm": np.exp(lb_a[:, 0]), "A_ref": A_r[:, 0],
                      "b_ref": np.exp(lb_r[:, 0]), "top": top})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _falls(fit: dict, arm: str) -> np.ndarray:
    return (fit[f"A_{arm}"] > 0) & (fit[f"b_{arm}"] > B_RANGE[0] * 1.001)


def _log_match(fit: dict, x: np.ndarray) -> np.ndarray:
    """Centred ``log N_B`` where the baseline's floor curve reaches the arm's at centred log sizes
    ``x``: ``A_ref N_B^-b_ref = A_arm N^-b_arm`` (the floor cancels). NaN where an arm's fitted
    loss does not fall with size (``A = 0``, or ``b`` at its lower bound)."""
    ok = _falls(fit, "arm") & _falls(fit, "ref")
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (np.log(fit["A_ref"])[..., None] - np.log(fit["A_arm"])[..., None]
               + fit["b_arm"][..., None] * x) / fit["b_ref"][..., None]
    return np.where(ok[..., None], out, np.nan)


def _checked_losses(losses, sizes: int, what: str) -> np.ndarray:
    try:
        v = np.asarray(losses, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: losses must be numbers, one row per seed and one column per size") from None
    if v.ndim != 2 or v.shape[0] == 0 or v.shape[1] != sizes:
        raise ValueError(f"{what}: need losses[seed][size] for {sizes} sizes, got shape {v.shape}")
    if not np.isfinite(v).all() or (v <= 0).any():
        raise ValueError(f"{what}: losses must be finite and positive")
    return v


def floor_ratios(arm_params: Sequence[float], arm_losses, ref_params: Sequence[float], ref_losses,
                 confidence: float = 0.95) -> dict:
    """The floor fit's parameter ratios ``N_arm / N_ref`` of many experiments at once (the tests'
    simulations; :func:`parameter_efficiency` reads one experiment): ``*_losses`` shaped
    (experiments, seeds, sizes), at least 3 sizes. Returns ``log_ratio`` (from the fit to the seeds'
    mean losses), ``half`` (its interval's half-width: the leave-one-seed-out jackknife standard error
    times t with ``seeds - 1`` degrees of freedom; NaN with one seed or where a leave-one-out fit has
    no ratio) and ``log_matched`` (the matching baseline size), each (experiments, sizes); ``fit``
    and ``loo`` (the fits, ``None`` with one seed) and ``center`` (the log size ``A`` refers to)."""
    na, nr = np.asarray(arm_params, dtype=np.float64), np.asarray(ref_params, dtype=np.float64)
    ya, yr = np.asarray(arm_losses, dtype=np.float64), np.asarray(ref_losses, dtype=np.float64)
    if ya.ndim != 3 or ya.shape != yr.shape or ya.shape[2] != na.size or na.shape != nr.shape or na.size < 3:
        raise ValueError(f"floor_ratios: need losses shaped (experiments, seeds, sizes) alike for both arms and at "
                         f"least 3 sizes, got {ya.shape} and {yr.shape} for {na.size} sizes")
    B, n, k = ya.shape
    center = float(np.log(np.concatenate([na, nr])).mean())
    xa, xr = np.log(na) - center, np.log(nr) - center
    fit = _floor_fit(xa, ya.mean(1), xr, yr.mean(1))
    log_ratio = xa - _log_match(fit, xa)
    out = {"log_ratio": log_ratio, "log_matched": xa - log_ratio + center,
           "half": np.full((B, k), np.nan), "fit": fit, "loo": None, "center": center}
    if n > 1:  # leave one seed out: the mean of the others, for every seed
        loo_a = ((ya.sum(1, keepdims=True) - ya) / (n - 1)).reshape(B * n, k)
        loo_r = ((yr.sum(1, keepdims=True) - yr) / (n - 1)).reshape(B * n, k)
        loo = {key: v.reshape(B, n) for key, v in _floor_fit(xa, loo_a, xr, loo_r).items()}
        theta = xa - _log_match(loo, xa)  # (B, n, k)
        se = np.sqrt((n - 1) / n * ((theta - theta.mean(1, keepdims=True)) ** 2).sum(1))
        out.update(half=t_quantile(1 - (1 - confidence) / 2, n - 1) * se, loo=loo)
    return out


def _curvature(params: np.ndarray, losses: np.ndarray, confidence: float) -> dict:
    """Lack of fit of the straight log-log line: per seed, the ``c`` of ``log L = a + b x + c x^2``
    (``x = log N``, centred), with the t interval and two-sided p-value over seeds. ``c > 0``: the
    curve bends up, flattening as a loss floor makes it."""
    x = np.log(params) - np.log(params).mean()
    c = np.linalg.lstsq(np.stack([np.ones_like(x), x, x * x], 1), np.log(losses).T, rcond=None)[0][2]
    out = {"value": float(c.mean()), "low": None, "high": None, "p": None, "n": int(c.size), "note": None}
    if c.size < 2:
        out["note"] = "one seed: no interval"
        return out
    se = float(c.std(ddof=1)) / math.sqrt(c.size)
    h = t_quantile(1 - (1 - confidence) / 2, c.size - 1) * se
    p = (0.0 if out["value"] else 1.0) if se == 0 else 2 * (1 - t_cdf(abs(out["value"]) / se, c.size - 1))
    out.update(low=out["value"] - h, high=out["value"] + h, p=round_p(p))
    return out


def _rms(fit_values: list[np.ndarray], losses: list[np.ndarray]) -> float:
    return float(np.sqrt(np.mean(np.concatenate([(f - v) ** 2 for f, v in zip(fit_values, losses)]))))


@dataclass
class Crossover:
    """The size where the two fitted curves meet (``params``), with Fieller's 95% interval
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
    """Per DIFF size: its parameters, the baseline parameters that reach its fitted loss and the
    ratio with its interval; whether that baseline size is extrapolated. ``method`` names the fit
    these come from: ``"floor"`` (``L = E + A N^-b``, ``E`` shared by the arms, fitted to the seeds'
    mean losses; at least 3 sizes) or ``"loglog"`` (the straight line ``log L = a + b log N`` per
    seed; 2 sizes). ``fit``: the floor fit (``None`` with 2 sizes); ``lack_of_fit``: each arm's
    curvature of the straight line and both fits' residuals; ``crossover``: where the curves meet;
    ``loglog``: the straight-line reading in full (ratios, matched sizes, per-seed fits, crossover)."""

    params: list[float]
    matched_params: list[Optional[float]]
    ratios: list[Ratio]
    extrapolated: list[bool]
    method: str
    fit: Optional[dict]
    lack_of_fit: Optional[dict]
    crossover: Crossover
    loglog: dict

    def to_dict(self) -> dict:
        return {"method": self.method, "params": self.params, "matched_params": self.matched_params,
                "ratios": [r.to_dict() for r in self.ratios], "extrapolated": self.extrapolated, "fit": self.fit,
                "lack_of_fit": self.lack_of_fit, "crossover": self.crossover.to_dict(), "loglog": self.loglog}


EXTRAPOLATED = "extrapolated: the matching baseline size lies outside the measured sizes"


FLAT_LINE = "the fitted line of an arm does not fall with size, a degenerate fit (models that did not learn?)"


def _loglog_reading(na: np.ndarray, la: np.ndarray, nr: np.ndarray, lr: np.ndarray, confidence: float) -> dict:
    """The straight log-log line per arm and seed (the paper's fit), read as before the floor fit."""
    fa = [fit_power_law(na, row) for row in la]
    fr = [fit_power_law(nr, row) for row in lr]
    ratios, matched, extrapolated = [], [], []
    flat = [s for s, ((_, b), (_, br)) in enumerate(zip(fa, fr)) if b >= 0 or br >= 0]
    for n in na:
        logs, log_nb = [], []
        if flat:  # a line that does not fall (untrained models): no baseline size reaches a loss, or any does
            ratios.append(Ratio(None, None, None, len(fa), f"{FLAT_LINE}; seeds {', '.join(map(str, flat))}: no ratio"))
            matched.append(None)
            extrapolated.append(False)
            continue
        for (a, b), (ar, br) in zip(fa, fr):
            x_b = (a + b * math.log(n) - ar) / br  # log N_B where the reference line reaches the arm's loss
            log_nb.append(x_b)
            logs.append(math.log(n) - x_b)
        ratio = ratio_over_seeds(logs, confidence)
        nb = math.exp(float(np.mean(log_nb))) if log_nb else None
        out = nb is not None and not nr.min() <= nb <= nr.max()
        if out:
            ratio.note = EXTRAPOLATED
        ratios.append(ratio)
        matched.append(nb)
        extrapolated.append(bool(out))
    da, db = np.array([a for a, _ in fa]) - [a for a, _ in fr], np.array([b for _, b in fa]) - [b for _, b in fr]
    cross = _crossover(*_mean_cov(da, db), da.size, 0.0, _measured(na, nr), confidence)
    return {"ratios": ratios, "matched_params": matched, "extrapolated": extrapolated,
            "fits": {"arm": fa, "reference": fr}, "crossover": cross}


def _mean_cov(da: np.ndarray, db: np.ndarray) -> tuple[float, float, float, float, float]:
    """Means of the seeds' ``da``, ``db`` and the variances and covariance of those means."""
    n = da.size
    if n < 2:
        return float(da.mean()), float(db.mean()), 0.0, 0.0, 0.0
    c = np.cov(da, db, ddof=1) / n
    return float(da.mean()), float(db.mean()), float(c[0, 0]), float(c[1, 1]), float(c[0, 1])


def _measured(na: np.ndarray, nr: np.ndarray) -> tuple[float, float]:
    return min(float(na.min()), float(nr.min())), max(float(na.max()), float(nr.max()))


def parameter_efficiency(arm_params: Sequence[float], arm_losses, ref_params: Sequence[float], ref_losses,
                         confidence: float = 0.95) -> ParameterEfficiency:
    """Parameter efficiency of ``arm`` (DIFF) against ``reference`` (the baseline): ``*_params``
    the non-embedding parameters of each size (increasing, at least 2 sizes), ``*_losses[seed]``
    the held-out loss of each size for that seed (seeds paired by position; nested lists or a 2-D
    array). With 3 sizes or more the ratios come from the floor fit, else from the straight line."""
    na, nr = np.asarray(arm_params, dtype=np.float64), np.asarray(ref_params, dtype=np.float64)
    if na.ndim != 1 or na.size < 2 or na.shape != nr.shape:
        raise ValueError(f"need at least 2 sizes, the same number for both arms (got {na.size} and {nr.size})")
    for what, n in (("arm", na), ("reference", nr)):
        if not np.isfinite(n).all() or (n <= 0).any() or (np.diff(n) <= 0).any():
            raise ValueError(f"{what} sizes: parameters must be positive and increasing, got {n.tolist()}")
    if len(arm_losses) != len(ref_losses) or len(arm_losses) == 0:
        raise ValueError(f"need the losses of the same seeds for both arms, got {len(arm_losses)} and "
                         f"{len(ref_losses)}")
    la, lr = _checked_losses(arm_losses, na.size, "arm"), _checked_losses(ref_losses, nr.size, "reference")
    line = _loglog_reading(na, la, nr, lr, confidence)
    loglog = {**{k: line[k] for k in ("matched_params", "extrapolated")},
              "ratios": [r.to_dict() for r in line["ratios"]], "crossover": line["crossover"].to_dict(),
              "fits": {k: [list(f) for f in v] for k, v in line["fits"].items()}}
    if na.size < 3:
        return ParameterEfficiency([float(x) for x in na], line["matched_params"], line["ratios"], line["extrapolated"],
                                   "loglog", None, None, line["crossover"], loglog)
    ratios, matched, extrapolated, fit, cross = _floor_reading(na, la, nr, lr, confidence)
    return ParameterEfficiency([float(x) for x in na], matched, ratios, extrapolated, "floor", fit,
                               _lack_of_fit(na, la, nr, lr, fit, confidence), cross, loglog)


def _floor_reading(na: np.ndarray, la: np.ndarray, nr: np.ndarray, lr: np.ndarray, confidence: float) -> tuple:
    """The floor fit of one sweep: its ratios, matching baseline sizes, extrapolation marks, the fit
    itself (``floor``, each arm's ``(A, b)``, the floor's range without one seed, notes) and the
    crossover."""
    got = floor_ratios(na, la[None], nr, lr[None], confidence)
    fit, n, c = {k: float(v[0]) for k, v in got["fit"].items()}, la.shape[0], got["center"]
    ratios, matched, extrapolated = [], [], []
    for lrat, half, lnb in zip(got["log_ratio"][0], got["half"][0], got["log_matched"][0]):
        if not math.isfinite(lrat):
            ratios.append(Ratio(None, None, None, n, "the fitted loss of an arm does not fall with size: no ratio"))
            matched.append(None)
            extrapolated.append(False)
            continue
        if n == 1 or not math.isfinite(half):
            why = "one seed: no interval" if n == 1 else "a fit without one seed has no ratio: no interval"
            ratio = Ratio(math.exp(lrat), None, None, n, why)
        else:
            ratio = Ratio(math.exp(lrat), math.exp(lrat - half), math.exp(lrat + half), n)
        nb = math.exp(lnb)
        out = not nr.min() <= nb <= nr.max()
        if out:
            ratio.note = EXTRAPOLATED if ratio.note is None else f"{EXTRAPOLATED}; {ratio.note}"
        ratios.append(ratio)
        matched.append(nb)
        extrapolated.append(bool(out))

    def gap(f: dict) -> tuple:  # the curves as lines log(L - E) = log A - b x: their intercept and slope gaps
        return (np.log(np.maximum(f["A_arm"], 1e-300)) - np.log(np.maximum(f["A_ref"], 1e-300)),
                f["b_ref"] - f["b_arm"])

    da, db = gap(fit)
    if got["loo"] is not None:
        jk = np.cov(*gap({k: v[0] for k, v in got["loo"].items()}), ddof=0) * (n - 1)  # the jackknife covariance
        moments = (float(da), float(db), float(jk[0, 0]), float(jk[1, 1]), float(jk[0, 1]))
    else:
        moments = (float(da), float(db), 0.0, 0.0, 0.0)
    cross = _crossover(*moments, n, c, _measured(na, nr), confidence)
    if not (_falls(fit, "arm") and _falls(fit, "ref")):
        cross = Crossover(None, None, None, None, "the fitted loss of an arm does not fall with size")
    notes = []
    if fit["E"] <= 1e-3 * fit["top"]:
        notes.append("the floor sits at 0: no floor is visible at these sizes, and the fit is a pure power law")
    elif fit["E"] >= fit["top"] * (1 - 1e-6):
        notes.append("the floor sits at the lowest loss measured: these sizes do not place it")
    for arm, name in (("arm", "arm"), ("ref", "reference")):
        if not B_RANGE[0] * 1.001 < fit[f"b_{arm}"] < B_RANGE[1] * 0.999:
            notes.append(f"the {name}'s exponent sits at a bound of {B_RANGE}")
    loo_E = None if got["loo"] is None else [float(got["loo"]["E"][0].min()), float(got["loo"]["E"][0].max())]
    floor = {"floor": fit["E"], "floor_without_one_seed": loo_E,
             "arm": [fit["A_arm"] * math.exp(fit["b_arm"] * c), fit["b_arm"]],
             "reference": [fit["A_ref"] * math.exp(fit["b_ref"] * c), fit["b_ref"]],
             "note": "; ".join(notes) or None}
    return ratios, matched, extrapolated, floor, cross


def _lack_of_fit(na: np.ndarray, la: np.ndarray, nr: np.ndarray, lr: np.ndarray, floor: dict,
                 confidence: float) -> dict:
    """Each arm's curvature of the straight log-log line over seeds, and the RMS residual of the
    seeds' mean losses around the straight lines and around the floor curves (``floor``: its fit)."""
    ma, mr = la.mean(0), lr.mean(0)
    (aa, ba), (ar, br) = fit_power_law(na, ma), fit_power_law(nr, mr)
    E, (A_a, b_a), (A_r, b_r) = floor["floor"], floor["arm"], floor["reference"]
    return {"arm": _curvature(na, la, confidence), "reference": _curvature(nr, lr, confidence),
            "rms": {"straight_line": _rms([np.exp(aa + ba * np.log(na)), np.exp(ar + br * np.log(nr))], [ma, mr]),
                    "floor": _rms([E + A_a * na ** -b_a, E + A_r * nr ** -b_r], [ma, mr])}}


def _crossover(mda: float, mdb: float, vaa: float, vbb: float, vab: float, n: int, center: float,
               measured: tuple[float, float], confidence: float) -> Crossover:
    """Where two lines ``a + s x`` meet (``x = log N - center``), from the difference of their
    intercepts ``mda`` and slopes ``mdb`` and the variances and covariance of those differences: the
    root ``-mda / mdb`` and Fieller's interval (the ``x`` for which ``|mda + mdb x|`` is within t
    standard errors of 0, with ``n - 1`` degrees of freedom)."""
    if mdb == 0.0 or abs(center - mda / mdb) > 700:
        return Crossover(None, None, None, None, "the fitted curves are parallel, or meet at no size a float can "
                                                 "hold: they do not cross")
    root = math.exp(center - mda / mdb)
    outside = not measured[0] <= root <= measured[1]
    if n < 2:
        return Crossover(root, None, None, outside, "one seed: no interval")
    t2 = t_quantile(1 - (1 - confidence) / 2, n - 1) ** 2
    # (mda + mdb x)^2 <= t2 (vaa + 2 vab x + vbb x^2): A x^2 + B x + C <= 0
    A, B, C = mdb ** 2 - t2 * vbb, 2 * (mda * mdb - t2 * vab), mda ** 2 - t2 * vaa
    disc = B * B - 4 * A * C
    note = "extrapolated: outside the measured sizes" if outside else None
    if A > 0 and disc >= 0:
        lo, hi = sorted(((-B - math.sqrt(disc)) / (2 * A), (-B + math.sqrt(disc)) / (2 * A)))
        lo, hi = lo + center, hi + center
        return Crossover(root, math.exp(max(lo, -700.0)), None if hi > 700 else math.exp(hi), outside, note)
    why = "the slopes are not clearly different at these seeds: the interval is unbounded"
    return Crossover(root, None, None, outside, why if note is None else f"{note}; {why}")
