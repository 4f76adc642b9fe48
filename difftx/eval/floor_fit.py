"""Parameter efficiency (the paper's Fig. 3a): how large a baseline matches each DIFF size, from a floor fit of
the final held-out losses; token efficiency is in :mod:`difftx.eval.efficiency`.

Parameter efficiency (Fig. 3a), from the final held-out loss of each size (``N``: parameters
without the token embedding):

- each arm's seed-mean losses are fitted as ``L = E + A N^-b`` with its own floor ``E`` from 4 sizes
  on, one floor shared by the two arms with 3 (``fit["model"]``: ``"separate"`` or ``"shared"``; least
  squares: each ``E`` in ``[0, the lowest loss]`` of its arm or arms, each ``b`` in :data:`B_RANGE`,
  ``A >= 0``; a grid narrowed in rounds, so deterministic and bounded where a free fit would run
  away). One floor forced on two curves whose floors differ biases the ratio by more than its
  interval, and more seeds make that worse (issue 38; measured in docs/efficiency.md). The difference
  of the floors, DIFF minus the baseline, is a parameter of the fit, kept in the output but not
  reported as a finding: a few sizes cannot tell a lower floor from a term that fades faster than
  ``N^-b`` in one arm, which moves the fitted floor by about 0.1 nats while the seeds' jackknife sees
  only their noise (its interval covered 0.06-0.38 at 12 seeds; ``benchmarks/floor_coverage.py
  --one-arm``). The measured gap at the largest size stands in for it;
- for a DIFF size ``N_D``, ``N_B`` solves ``L_B(N_B) = L_D(N_D)`` on the fitted curves, and the ratio
  is ``N_D / N_B``; an ``N_B`` outside the measured sizes is marked as extrapolation; a DIFF loss below
  the baseline's floor has no ``N_B`` and no ratio; where the curves meet, the crossover size;
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
to the mean has one that does. ``tests/test_efficiency.py`` and
``benchmarks/floor_coverage.py`` check the coverage at every size on simulated power laws with and
without a floor, with floors equal and apart and exponents that differ. The crossover's interval is
Fieller's, from the differences of intercept and slope (over seeds for the line, their jackknife
covariance for one floor), or with two floors the same construction on the fitted gap: the sizes
where the gap is within t jackknife standard errors of 0. It is unbounded when the curves are not
clearly apart, and then says so. One seed gives estimates without intervals.

Lack of fit (issue 48). The jackknife over seeds sees the seeds' noise, not a curve of the wrong form,
whose bias does not shrink as seeds are added. Two allowances enter every interval of the floor fit:

- the floor curves' residuals at the sizes against the seeds' scatter, an F test of the form
  (:func:`lack_of_fit_test`): where ``F > 1`` the intervals (ratios, crossover) widen
  by ``sqrt(F)``, the lack-of-fit mean square in place of the pure error, whether or not the test
  rejects;
- the ratios' dependence on the smallest size: a term that fades faster than ``N^-b`` is taken up by a
  higher floor and a steeper exponent and leaves residuals too small to test, yet moves the ratio at the
  largest size; the fit is repeated without each arm's smallest size, and where a ratio moves by more
  than one standard error (the jackknife's, of the difference) the interval spans that fit's too.

Both are in ``fit["lack_of_fit"]`` and in the notes. Where the curve's form holds they seldom move an
interval by much; measured in ``benchmarks/floor_coverage.py --lack-of-fit``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from .efficiency import Ratio, _checked_curve, ratio_over_seeds
from .stats import P_FLOOR, betainc, round_p, t_quantile, t_two_sided_p


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


FLOOR_MODELS = ("auto", "separate", "shared")  # which floors the fit gives the two arms (see floor_ratios)


def _floor_search(curves: list[tuple[np.ndarray, np.ndarray]], zooms: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """The floor ``E`` one or more curves share, for many problems at once: ``curves`` are ``(x, y)``
    with ``y`` (P, k); ``E`` minimises the sum of their least squares (each curve its own ``A`` and
    ``b``, the exponent searched with ``zooms`` rounds), searched in ``[0, the lowest loss of these
    curves]`` on a grid of 17 narrowed 5 times. Returns ``E`` and that upper bound, each (P,)."""
    top = curves[0][1].min(1)
    for _, y in curves[1:]:
        top = np.minimum(top, y.min(1))
    lo, hi = np.zeros_like(top), top
    for _ in range(5):
        E = lo[:, None] + (hi - lo)[:, None] * _E_STEPS
        total = 0.0
        for x, y in curves:
            total = total + _best_exponent(x, y, E, zooms)[0]
        e = E[np.arange(E.shape[0]), total.argmin(1)]
        step = (hi - lo) / (_E_STEPS.size - 1)
        lo, hi = np.maximum(e - step, 0.0), np.minimum(e + step, top)
    return e, top


def _floor_fit(xa: np.ndarray, ya: np.ndarray, xr: np.ndarray, yr: np.ndarray, model: str = "shared") -> dict:
    """Least squares of ``L = E + A N^-b`` for two arms, for many problems at once: ``ya`` (P, ka) and
    ``yr`` (P, kr) at centred log sizes ``xa``, ``xr``. ``model`` ``"shared"``: one ``E`` for both
    arms, searched in ``[0, the lowest loss of either]``; ``"separate"``: each arm its own ``E`` in
    ``[0, its own lowest loss]``. Each arm's ``b`` in :data:`B_RANGE` with ``A >= 0`` solved exactly:
    deterministic, and bounded where a free fit would run away. Returns arrays over the problems:
    ``E_arm``, ``E_ref``, ``A_arm``, ``b_arm``, ``A_ref``, ``b_ref`` (``A`` at the centre of ``x``),
    ``top_arm``, ``top_ref`` (the upper bounds of the floors), ``E`` (the baseline's floor) and ``top``
    (the lower of the two bounds)."""
    parts = []
    for s in range(0, ya.shape[0], _CHUNK):
        a, r = ya[s:s + _CHUNK], yr[s:s + _CHUNK]
        if model == "shared":
            e_a, top_a = _floor_search([(xa, a), (xr, r)])
            e_r, top_r = e_a, top_a
        else:
            # one curve pins its floor less than two do: a finer exponent (8 zooms) keeps E to about 1e-6
            (e_a, top_a), (e_r, top_r) = _floor_search([(xa, a)], 8), _floor_search([(xr, r)], 8)
        _, A_a, lb_a = _best_exponent(xa, a, e_a[:, None], zooms=9)
        _, A_r, lb_r = _best_exponent(xr, r, e_r[:, None], zooms=9)
        parts.append({"E": e_r, "E_arm": e_a, "E_ref": e_r, "A_arm": A_a[:, 0], "b_arm": np.exp(lb_a[:, 0]),
                      "A_ref": A_r[:, 0], "b_ref": np.exp(lb_r[:, 0]), "top": np.minimum(top_a, top_r),
                      "top_arm": top_a, "top_ref": top_r})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _falls(fit: dict, arm: str) -> np.ndarray:
    return (fit[f"A_{arm}"] > 0) & (fit[f"b_{arm}"] > B_RANGE[0] * 1.001)


def _log_match(fit: dict, x: np.ndarray) -> np.ndarray:
    """Centred ``log N_B`` where the baseline's floor curve reaches the arm's at centred log sizes
    ``x``: ``E_ref + A_ref N_B^-b_ref = E_arm + A_arm N^-b_arm`` (with one floor, ``E`` cancels).
    NaN where an arm's fitted loss does not fall with size (``A = 0``, or ``b`` at its lower bound);
    ``+inf`` where the arm's fitted loss lies at or below the baseline's floor (no baseline size
    reaches it)."""
    ok = _falls(fit, "arm") & _falls(fit, "ref")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        num = np.log(fit["A_ref"])[..., None] - np.log(fit["A_arm"])[..., None] + fit["b_arm"][..., None] * x
        b_r = fit["b_ref"][..., None]
        d = (fit["E_arm"] - fit["E_ref"])[..., None] / fit["A_ref"][..., None]  # the floors' gap, in units of A_ref
        q = d + np.exp(-num)  # N_B^-b_ref (centred), where the floors differ
        general = np.where(q > 0, -np.log(np.where(q > 0, q, 1.0)) / b_r, np.inf)
        out = np.where(d == 0, num / b_r, general)
    return np.where(ok[..., None], out, np.nan)


def _at_bound(E: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Whether a fitted floor sits at a bound of its range: 0 (no floor visible) or the lowest loss (the
    sizes do not place it)."""
    return (E <= 1e-3 * top) | (E >= top * (1 - 1e-6))


def _jackknife_half(theta: np.ndarray, n: int, confidence: float) -> np.ndarray:
    """The jackknife's half-width over the leave-one-seed-out estimates ``theta`` (axis 1, ``n`` of them):
    standard error times t with ``n - 1`` degrees of freedom. NaN where an estimate is NaN, ``inf``
    where one is infinite (a ratio of 0: the interval is unbounded)."""
    with np.errstate(invalid="ignore"):
        se = np.sqrt((n - 1) / n * ((theta - theta.mean(1, keepdims=True)) ** 2).sum(1))
    half = t_quantile(1 - (1 - confidence) / 2, n - 1) * se
    nan, inf = np.isnan(theta).any(1), np.isinf(theta).any(1)
    return np.where(nan, np.nan, np.where(inf, np.inf, half))


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


SEPARATE_MIN_SIZES = 4  # sizes per arm from which "auto" gives each arm its own floor (3 parameters per arm)


def floor_model(sizes: int, model: str = "auto") -> str:
    """The floor model a fit over ``sizes`` sizes uses: ``"separate"`` (each arm its own floor) from
    :data:`SEPARATE_MIN_SIZES` sizes on, ``"shared"`` (one floor for both arms) below, unless ``model``
    names one."""
    if model not in FLOOR_MODELS:
        raise ValueError(f"floor model: one of {FLOOR_MODELS}, got {model!r}")
    if model != "auto":
        return model
    return "separate" if sizes >= SEPARATE_MIN_SIZES else "shared"


def floor_ratios(arm_params: Sequence[float], arm_losses, ref_params: Sequence[float], ref_losses,
                 confidence: float = 0.95, model: str = "auto", lack_of_fit: bool = True,
                 size_check: bool = True, at: Optional[Sequence[float]] = None) -> dict:
    """The floor fit's parameter ratios ``N_arm / N_ref`` of many experiments at once (the tests'
    simulations; :func:`parameter_efficiency` reads one experiment): ``*_losses`` shaped
    (experiments, seeds, sizes), at least 3 sizes. ``model``: ``"separate"`` (each arm its own floor),
    ``"shared"`` (one floor for both, the fit before issue 38) or ``"auto"`` (:func:`floor_model`: one
    floor with 3 sizes; from 4 on each arm its own, and where the sizes do not place the floors, the
    interval spans the fit with one floor too). ``lack_of_fit``: whether the intervals carry the lack of
    fit's widening (:func:`lack_of_fit_test`), ``size_check``: whether they span the fit without the
    smallest size where the ratio moves without it (:func:`_spans_without_smallest`); both ``False``
    give them as before issue 48, for comparison. ``at``: the arm's sizes at which the ratios are read
    (by default its own).

    Returns ``model`` (the fit the ratios come from), ``log_ratio`` (from the fit to the seeds' mean
    losses; ``-inf`` where the arm's fitted loss lies below the baseline's floor), ``half`` (that fit's
    own interval half-width: the leave-one-seed-out jackknife standard error times t with ``seeds - 1``
    degrees of freedom; NaN with one seed or where a leave-one-out fit has no ratio, ``inf`` where one
    has a ratio of 0), ``log_low`` and ``log_high`` (the interval in use: ``log_ratio -/+ half`` times
    ``widen``, or with ``spans_shared`` its hull with the one-floor fit's interval, from ``-inf`` where
    the ratio is 0; NaN where there is none) and
    ``log_matched`` (the matching baseline size), each (experiments, sizes); ``floor_difference`` (the
    arm's floor minus the baseline's, 0 under one floor), ``floors_placed`` (no floor at a bound of
    its range, 0 or its arm's lowest loss, in the fit or in any fit without one seed),
    ``spans_shared`` (``"auto"`` with two floors not placed), ``floor_half`` (the difference's
    jackknife half-width times ``widen``, for the benchmark that shows it misses; NaN with one seed, one
    floor, or floors not placed; never reported), ``lack_of_fit_F``, ``lack_of_fit_p`` and ``widen`` (the
    floor curves' lack-of-fit test and the factor it puts on the intervals, :func:`lack_of_fit_test`),
    each (experiments,); ``lack_of_fit_df``; ``log_ratio_without_smallest``, ``size_check_z`` and
    ``spans_without_smallest`` (the fit without the smallest size, each (experiments, sizes));
    ``fit`` and ``loo`` (the fits, ``None`` with one seed) and ``center`` (the log size ``A`` refers
    to)."""
    na, nr = np.asarray(arm_params, dtype=np.float64), np.asarray(ref_params, dtype=np.float64)
    ya, yr = np.asarray(arm_losses, dtype=np.float64), np.asarray(ref_losses, dtype=np.float64)
    if ya.ndim != 3 or ya.shape != yr.shape or ya.shape[2] != na.size or na.shape != nr.shape or na.size < 3:
        raise ValueError(f"floor_ratios: need losses shaped (experiments, seeds, sizes) alike for both arms and at "
                         f"least 3 sizes, got {ya.shape} and {yr.shape} for {na.size} sizes")
    auto, model = model == "auto", floor_model(na.size, model)
    B, n, k = ya.shape
    center = float(np.log(np.concatenate([na, nr])).mean())
    xa, xr = np.log(na) - center, np.log(nr) - center
    xq = xa if at is None else np.log(np.asarray(at, dtype=np.float64)) - center  # where the ratios are read
    kq = xq.size
    fit = _floor_fit(xa, ya.mean(1), xr, yr.mean(1), model)
    log_ratio = xq - _log_match(fit, xq)
    out = {"model": model, "log_ratio": log_ratio, "log_matched": xq - log_ratio + center,
           "half": np.full((B, kq), np.nan), "log_low": np.full((B, kq), np.nan),
           "log_high": np.full((B, kq), np.nan),
           "floor_difference": fit["E_arm"] - fit["E_ref"], "floor_half": np.full(B, np.nan),
           "floors_placed": ~(_at_bound(fit["E_arm"], fit["top_arm"]) | _at_bound(fit["E_ref"], fit["top_ref"])),
           "spans_shared": np.zeros(B, dtype=bool), "fit": fit, "loo": None, "center": center,
           "lack_of_fit_F": np.full(B, np.nan), "lack_of_fit_p": np.full(B, np.nan), "widen": np.ones(B),
           "lack_of_fit_df": (0, 0), "log_ratio_without_smallest": np.full((B, kq), np.nan),
           "size_check_z": np.full((B, kq), np.nan), "spans_without_smallest": np.zeros((B, kq), dtype=bool)}
    if n == 1:
        return out
    # leave one seed out: the mean of the others, for every seed
    loo_a = ((ya.sum(1, keepdims=True) - ya) / (n - 1)).reshape(B * n, k)
    loo_r = ((yr.sum(1, keepdims=True) - yr) / (n - 1)).reshape(B * n, k)
    loo = {key: v.reshape(B, n) for key, v in _floor_fit(xa, loo_a, xr, loo_r, model).items()}
    theta = xq - _log_match(loo, xq)  # the log ratios without each seed, (B, n, sizes read)
    half = _jackknife_half(theta, n, confidence)
    test = lack_of_fit_test(xa, ya, xr, yr, fit, model)
    if not lack_of_fit:  # the intervals as before issue 48 (the benchmark's "before"); the test is still read
        test["widen"] = np.ones(B)
    widen = test["widen"]
    out.update(half=half, loo=loo, **_log_interval(log_ratio, half * widen[:, None]), **test)
    out["floors_placed"] &= ~(_at_bound(loo["E_arm"], loo["top_arm"]) | _at_bound(loo["E_ref"], loo["top_ref"])).any(1)
    if model == "separate":
        d_half = _jackknife_half((loo["E_arm"] - loo["E_ref"])[..., None], n, confidence)[:, 0]
        out["floor_half"] = np.where(out["floors_placed"], d_half * widen, np.nan)
    if size_check:
        _spans_without_smallest(out, theta, na, ya, nr, yr, confidence, "auto" if auto else model, lack_of_fit,
                                xq + center)
    loose = ~out["floors_placed"] if auto and model == "separate" else np.zeros(B, dtype=bool)
    if loose.any():  # the sizes do not place two floors: the interval spans the fit with one floor too
        one = floor_ratios(na, ya[loose], nr, yr[loose], confidence, "shared", lack_of_fit, size_check, at)
        low, high = out["log_low"][loose], out["log_high"][loose]
        ok = ~np.isnan(low)  # no interval of its own stays none, except
        below = np.isneginf(log_ratio[loose]) & ~np.isnan(one["log_high"])  # a ratio of 0: from 0 to the one floor's
        out["log_low"][loose] = np.where(ok, np.fmin(low, one["log_low"]), np.where(below, -np.inf, np.nan))
        out["log_high"][loose] = np.where(ok, np.fmax(high, one["log_high"]), np.where(below, one["log_high"], np.nan))
        out["spans_shared"] = loose
    return out


SIZE_CHECK_Z = 1.0  # how many standard errors the ratio may move without the smallest size before it spans that fit


def _spans_without_smallest(out: dict, theta: np.ndarray, na: np.ndarray, ya: np.ndarray, nr: np.ndarray,
                            yr: np.ndarray, confidence: float, model: str, lack_of_fit: bool,
                            log_at: np.ndarray) -> None:
    """The ratios' dependence on the smallest size, a lack of fit the residuals hardly show: a term that
    fades faster than ``N^-b`` (``N_0 / N``, say) is taken up by a higher floor and a steeper exponent, and
    moves the ratio at the largest size. The fit is repeated without each arm's smallest size (with the
    same floor model: 5 sizes or more with two floors, 4 or more with one; else nothing is done) and at
    every size read (``log_at``, the smallest included: there that fit extrapolates), ``z``: the two
    fits' difference of log ratios over its jackknife standard error (over seeds, both fits without the
    same seed). Where ``z > SIZE_CHECK_Z`` (a loose test: one standard error), the interval in ``out``
    spans that fit's interval too (its own, with its lack of fit's widening). Fills ``out``'s
    ``log_ratio_without_smallest``, ``size_check_z`` and ``spans_without_smallest`` (NaN, NaN and
    ``False`` where not checked)."""
    B, n, k = ya.shape
    resolved = floor_model(k, model)
    need = SEPARATE_MIN_SIZES if resolved == "separate" else 3
    if n < 2 or k - 1 < need or floor_model(k - 1, model) != resolved:
        return
    part = floor_ratios(na[1:], ya[..., 1:], nr[1:], yr[..., 1:], confidence, model, lack_of_fit, False,
                        np.exp(log_at))
    xp = log_at - part["center"]
    with np.errstate(invalid="ignore"):
        d_seed = theta - (xp - _log_match(part["loo"], xp))  # (B, n, sizes read)
        d = out["log_ratio"] - part["log_ratio"]
        se = np.sqrt((n - 1) / n * ((d_seed - d_seed.mean(1, keepdims=True)) ** 2).sum(1))
        z = np.abs(d) / np.maximum(se, 1e-6)  # 1e-6: the fits' own precision (exact curves agree)
        spans = (z > SIZE_CHECK_Z) & ~np.isnan(out["log_low"])
    out["log_low"] = np.where(spans, np.fmin(out["log_low"], part["log_low"]), out["log_low"])
    out["log_high"] = np.where(spans, np.fmax(out["log_high"], part["log_high"]), out["log_high"])
    out.update(log_ratio_without_smallest=part["log_ratio"], size_check_z=z, spans_without_smallest=spans)


def _log_interval(log_ratio: np.ndarray, half: np.ndarray) -> dict:
    """``log_low``, ``log_high``: ``log_ratio -/+ half``; NaN where the ratio is missing (``-inf``: below
    the baseline's floor, or NaN) or the half-width is NaN; ``-inf`` and ``inf`` where it is unbounded."""
    none = ~np.isfinite(log_ratio) | np.isnan(half)
    with np.errstate(invalid="ignore"):
        return {"log_low": np.where(none, np.nan, log_ratio - half),
                "log_high": np.where(none, np.nan, log_ratio + half)}


LACK_OF_FIT_LEVEL = 0.05  # the level at which the notes say the floor curve's form is rejected
_PURE_FLOOR = 1e-5  # nats: the least pure error the lack-of-fit test assumes (exact curves fit)


def _f_sf(f: float, d1: int, d2: int) -> float:
    """``P(F > f)`` for Fisher's F with ``d1`` and ``d2`` degrees of freedom, at least :data:`.stats.P_FLOOR` (a
    bound where the tail underflows, ``f`` infinite included): never 0."""
    if not f > 0:
        return 1.0
    if math.isinf(f):
        return P_FLOOR
    return max(P_FLOOR, betainc(d2 / 2.0, d1 / 2.0, d2 / (d2 + d1 * f)))


def lack_of_fit_test(xa: np.ndarray, ya: np.ndarray, xr: np.ndarray, yr: np.ndarray, fit: dict,
                     model: str) -> dict:
    """How far the floor curves miss the seeds' mean losses against the seeds' own scatter, and how much
    that widens the intervals, for many experiments at once (``ya``, ``yr``: (experiments, seeds, sizes)
    at centred log sizes ``xa``, ``xr``; ``fit``: :func:`_floor_fit` of the means).

    The means' residuals and each seed's deviation from the mean are projected off the curves' tangent
    space at the fit (per arm the floor, ``N^-b`` and ``N^-b log N``; one floor column for both arms
    when ``model`` is ``"shared"``), which also removes a seed's offset common to its sizes (its data
    order); ``df`` (both arms' sizes less the parameters) dimensions are left. ``F``: the lack-of-fit
    mean square (seeds times the residuals' squares, over ``df``) over the pure error's (the seeds'
    deviations, over ``(seeds - 1) df``; at least :data:`_PURE_FLOOR` squared), Fisher's F with ``df``
    and ``(seeds - 1) df`` degrees of freedom where the curves' form holds, and ``p`` its test.

    The widening: where ``F > 1`` the lack-of-fit mean square stands in for the pure error, so every
    interval's half-width is multiplied by ``sqrt(F)`` (the misfit taken as noise the jackknife over
    seeds does not see; as seeds are added, ``F`` grows with them where the misfit is real, and the
    width stays). It is not gated on the test: at the sizes scale-cpu trains, a second term
    ``0.3 N_0 / N`` is rejected in about 1 run in 10 at 12 seeds, yet moves the ratio at the largest
    size by about 1 standard error (``benchmarks/floor_coverage.py --lack-of-fit``); the price where the
    form holds is small (``F`` is below 1 in most runs). Returns ``lack_of_fit_F``, ``lack_of_fit_p`` and
    ``widen`` (NaN, NaN and 1 with one seed or no degrees of freedom), each (experiments,), and
    ``lack_of_fit_df`` (the pair)."""
    B, n, k = ya.shape
    kr = yr.shape[2]
    p = 5 if model == "shared" else 6
    df = k + kr - p
    out = {"lack_of_fit_F": np.full(B, np.nan), "lack_of_fit_p": np.full(B, np.nan), "widen": np.ones(B),
           "lack_of_fit_df": (max(df, 0), max(df, 0) * (n - 1))}
    if n < 2 or df <= 0:
        return out
    J = np.zeros((B, k + kr, p))
    ua, ur = np.exp(-fit["b_arm"][:, None] * xa), np.exp(-fit["b_ref"][:, None] * xr)
    J[:, :k, 0] = 1.0
    J[:, k:, 0 if model == "shared" else p - 3] = 1.0
    J[:, :k, 1], J[:, :k, 2] = ua, xa * ua
    J[:, k:, p - 2], J[:, k:, p - 1] = ur, xr * ur
    Q = np.linalg.qr(J)[0]  # (B, sizes of both arms, p): an orthonormal basis of the tangent space

    def off(v: np.ndarray) -> np.ndarray:  # v (B, ..., k + kr) less its part in the tangent space
        return v - np.einsum("bip,b...p->b...i", Q, np.einsum("bip,b...i->b...p", Q, v))

    y = np.concatenate([ya, yr], 2)
    curve = np.concatenate([fit["E_arm"][:, None] + fit["A_arm"][:, None] * ua,
                            fit["E_ref"][:, None] + fit["A_ref"][:, None] * ur], 1)
    mean = y.mean(1)
    lack = n * (off(mean - curve) ** 2).sum(1) / df
    pure = np.maximum((off(y - mean[:, None]) ** 2).sum((1, 2)) / (df * (n - 1)), _PURE_FLOOR ** 2)
    F = lack / pure
    out.update(lack_of_fit_F=F, lack_of_fit_p=np.array([_f_sf(float(f), df, df * (n - 1)) for f in F]),
               widen=np.sqrt(np.maximum(F, 1.0)))
    return out


def _curvature(params: np.ndarray, losses: np.ndarray, confidence: float) -> dict:
    """Lack of fit of the straight log-log line: per seed, the ``c`` of ``log L = a + b x + c x^2``
    (``x = log N``, centred), with the t interval and two-sided p-value over seeds. ``c > 0``: the
    curve bends up, flattening as a loss floor makes it. Seeds whose curvatures are all equal (two identical
    seeds) have no spread to test against: no interval and no p-value (``note`` says so), not p = 0 with an
    interval of width 0."""
    x = np.log(params) - np.log(params).mean()
    c = np.linalg.lstsq(np.stack([np.ones_like(x), x, x * x], 1), np.log(losses).T, rcond=None)[0][2]
    out = {"value": float(c.mean()), "low": None, "high": None, "p": None, "n": int(c.size), "note": None}
    if c.size < 2:
        out["note"] = "one seed: no interval"
        return out
    se = float(c.std(ddof=1)) / math.sqrt(c.size)
    if not se > 1e-12 * max(float(np.abs(c).max()), 1e-300):  # equal up to rounding
        out["note"] = f"all {c.size} seeds' curvatures are equal: no spread over seeds, so no interval or test"
        return out
    h = t_quantile(1 - (1 - confidence) / 2, c.size - 1) * se
    p = t_two_sided_p(abs(out["value"]) / se, c.size - 1)
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
    these come from: ``"floor"`` (``L = E + A N^-b`` fitted to the seeds' mean losses; at least 3
    sizes) or ``"loglog"`` (the straight line ``log L = a + b log N`` per seed; 2 sizes). ``fit``: the
    floor fit (``None`` with 2 sizes): ``model`` (``"separate"``: each arm its own floor ``E``;
    ``"shared"``: one for both), ``floors`` (``{"arm": E, "reference": E}``), ``floor_difference``
    (the arm's floor minus the baseline's, a parameter of the fit and not a finding: ``value``, ``low``
    and ``high`` ``None``, ``n``, ``finding`` ``False``, ``note``), ``interval_spans_shared`` (the sizes
    do not place two floors, so the ratios' intervals span the one-floor fit's too), ``floor`` (the
    baseline's floor, the one ``E`` when shared), each
    arm's ``(A, b)``, the floors' range without one seed, ``lack_of_fit`` (:func:`floor_lack_of_fit`: the
    floor curves' test, the factor on the intervals, and ``without_smallest``: per size the ratio of the
    fit without the smallest size, its distance in standard errors, whether the interval spans it),
    ``note``; ``lack_of_fit``: each arm's
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
                         confidence: float = 0.95, floor_model: str = "auto") -> ParameterEfficiency:
    """Parameter efficiency of ``arm`` (DIFF) against ``reference`` (the baseline): ``*_params``
    the non-embedding parameters of each size (increasing, at least 2 sizes), ``*_losses[seed]``
    the held-out loss of each size for that seed (seeds paired by position; nested lists or a 2-D
    array). With 3 sizes or more the ratios come from the floor fit, else from the straight line.
    ``floor_model``: the floors the fit gives the arms (:func:`floor_model`; ``"auto"``: each arm its
    own from 4 sizes on, one shared with 3)."""
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
    ratios, matched, extrapolated, fit, cross = _floor_reading(na, la, nr, lr, confidence, floor_model)
    return ParameterEfficiency([float(x) for x in na], matched, ratios, extrapolated, "floor", fit,
                               _lack_of_fit(na, la, nr, lr, fit, confidence), cross, loglog)


BELOW_FLOOR = ("the arm's fitted loss lies below the baseline's fitted floor: no baseline size reaches it "
               "(the ratio tends to 0)")


def _floor_reading(na: np.ndarray, la: np.ndarray, nr: np.ndarray, lr: np.ndarray, confidence: float,
                   model: str = "auto") -> tuple:
    """The floor fit of one sweep: its ratios, matching baseline sizes, extrapolation marks, the fit
    itself (the model, each arm's floor and ``(A, b)``, the difference of the floors with its
    interval, the floors' range without one seed, notes) and the crossover."""
    got = floor_ratios(na, la[None], nr, lr[None], confidence, model)
    model = got["model"]
    fit, n, c = {k: float(v[0]) for k, v in got["fit"].items()}, la.shape[0], got["center"]
    lack = floor_lack_of_fit(float(got["lack_of_fit_F"][0]), float(got["lack_of_fit_p"][0]),
                             got["lack_of_fit_df"], float(got["widen"][0]), n)
    widen = lack["widened_by"]
    ratios, matched, extrapolated = [], [], []
    for i, (lrat, low, high, lnb) in enumerate(zip(got["log_ratio"][0], got["log_low"][0], got["log_high"][0],
                                                   got["log_matched"][0])):
        if math.isnan(lrat):
            ratios.append(Ratio(None, None, None, n, "the fitted loss of an arm does not fall with size: no ratio"))
            matched.append(None)
            extrapolated.append(False)
            continue
        if lrat == -math.inf:  # with floors not placed, an interval from 0 to the one-floor fit's upper end
            ratios.append(Ratio(None, None, None, n, BELOW_FLOOR) if math.isnan(high) else
                          Ratio(None, 0.0, math.exp(high), n, f"{BELOW_FLOOR}; the interval runs from 0 to the upper "
                                                              "end of the fit with one shared floor"))
            matched.append(None)
            extrapolated.append(True)
            continue
        if n == 1 or math.isnan(low):
            why = "one seed: no interval" if n == 1 else "a fit without one seed has no ratio: no interval"
            ratio = Ratio(math.exp(lrat), None, None, n, why)
        elif math.isinf(low) or math.isinf(high):
            ratio = Ratio(math.exp(lrat), None, None, n, "without one seed the arm's fitted loss lies below the "
                                                          "baseline's fitted floor: the interval is unbounded")
        else:
            why = [lack["ratio_note"]] if lack["ratio_note"] else []
            if got["spans_without_smallest"][0, i]:
                other = math.exp(got["log_ratio_without_smallest"][0, i])
                why.append(f"the fit without the smallest size gives {other:.3f}, {got['size_check_z'][0, i]:.1f} "
                           "standard errors away: the interval spans that fit's too")
            ratio = Ratio(math.exp(lrat), math.exp(low), math.exp(high), n, "; ".join(why) or None)
        nb = math.exp(lnb)
        out = not nr.min() <= nb <= nr.max()
        if out:
            ratio.note = EXTRAPOLATED if ratio.note is None else f"{EXTRAPOLATED}; {ratio.note}"
        ratios.append(ratio)
        matched.append(nb)
        extrapolated.append(bool(out))
    loo = None if got["loo"] is None else {k: v[0] for k, v in got["loo"].items()}
    if model == "shared":
        cross = _shared_crossover(fit, loo, n, c, _measured(na, nr), confidence, widen)
    else:
        cross = _curve_crossover(fit, loo, n, c, _measured(na, nr), confidence, widen)
    if not (_falls(fit, "arm") and _falls(fit, "ref")):
        cross = Crossover(None, None, None, None, "the fitted loss of an arm does not fall with size")
    notes = []
    floors = (("arm", "arm"), ("ref", "reference")) if model == "separate" else (("ref", "shared"),)
    for arm, name in floors:
        E, top = fit[f"E_{arm}"], fit[f"top_{arm}"]
        who = "the floor" if model == "shared" else f"the {name}'s floor"
        if E <= 1e-3 * top:  # as _at_bound
            notes.append(f"{who} sits at 0: no floor is visible at these sizes, and the fit is a pure power law")
        elif E >= top * (1 - 1e-6):
            notes.append(f"{who} sits at the lowest loss measured: these sizes do not place it")
    for arm, name in (("arm", "arm"), ("ref", "reference")):
        if not B_RANGE[0] * 1.001 < fit[f"b_{arm}"] < B_RANGE[1] * 0.999:
            notes.append(f"the {name}'s exponent sits at a bound of {B_RANGE}")
    spans = bool(got["spans_shared"][0])
    if spans:
        notes.append(SPANS_SHARED)
    if lack["ratio_note"]:
        notes.append(lack["note"])
    moved = [f"{x:,.0f}" for x, s in zip(na, got["spans_without_smallest"][0]) if s]
    if moved:
        notes.append(f"{SIZE_MOVED} (at N = {', '.join(moved)})")

    def spread(v: np.ndarray) -> list[float]:
        return [float(v.min()), float(v.max())]

    diff = _floor_difference(model, float(got["floor_difference"][0]), n, na.size)
    floor = {"model": model, "interval_spans_shared": spans, "floor": fit["E_ref"],
             "floor_without_one_seed": None if loo is None else spread(loo["E_ref"]),
             "floors": {"arm": fit["E_arm"], "reference": fit["E_ref"]},
             "floors_without_one_seed": None if loo is None else {"arm": spread(loo["E_arm"]),
                                                                  "reference": spread(loo["E_ref"])},
             "floor_difference": diff,
             "arm": [fit["A_arm"] * math.exp(fit["b_arm"] * c), fit["b_arm"]],
             "reference": [fit["A_ref"] * math.exp(fit["b_ref"] * c), fit["b_ref"]],
             "lack_of_fit": {**{k: v for k, v in lack.items() if k != "ratio_note"},
                             "without_smallest": _without_smallest(got)},
             "note": "; ".join(notes) or None}
    return ratios, matched, extrapolated, floor, cross


SIZE_MOVED = ("the ratio moves by more than one standard error when the smallest size is left out (a lack of fit "
              "the curve takes up by bending), so its interval spans the fit without it too")


def _without_smallest(got: dict) -> Optional[dict]:
    """``fit["lack_of_fit"]["without_smallest"]``: per size, the ratio of the fit without the smallest
    size, how many standard errors it lies from the fit's, and whether the interval spans it; ``None``
    where the fit is not repeated (too few sizes for the floor model, or one seed)."""
    z = got["size_check_z"][0]
    if np.isnan(z).all():
        return None

    def num(v: float) -> Optional[float]:
        return float(v) if math.isfinite(v) else None

    return {"ratios": [None if not math.isfinite(v) else math.exp(v) for v in got["log_ratio_without_smallest"][0]],
            "z": [num(v) for v in z], "spans": [bool(v) for v in got["spans_without_smallest"][0]],
            "threshold": SIZE_CHECK_Z}


def floor_lack_of_fit(F: float, p: float, df: tuple[int, int], widen: float, n: int) -> dict:
    """``fit["lack_of_fit"]`` of :func:`parameter_efficiency`: the floor curves' lack-of-fit test
    (:func:`lack_of_fit_test`: ``F`` with its degrees of freedom ``df`` and ``p``), ``rejected`` (``p``
    below :data:`LACK_OF_FIT_LEVEL`), ``widened_by`` (the factor on every interval of the fit: the ratios,
    the crossover) and ``note`` (what was found and done, or why there is no
    test), plus ``ratio_note`` (the ratios' note where they are widened, else ``None``)."""
    out = {"F": None, "df": [int(df[0]), int(df[1])], "p": None, "rejected": None, "widened_by": 1.0,
           "note": None, "ratio_note": None}
    if n < 2:
        out["note"] = "one seed: no pure error, so no test of the floor curves' form"
        return out
    if df[0] <= 0:
        out["note"] = ("as many parameters as sizes: no test of the floor curves' form, and the intervals assume "
                       "it")
        return out
    rejected = p < LACK_OF_FIT_LEVEL
    out.update(F=F, p=round_p(p), rejected=bool(rejected), widened_by=widen)
    test = f"lack of fit F = {F:.2f} on {df[0]} and {df[1]} degrees of freedom, p = {round_p(p):.3g}"
    if widen < 1.005:
        out["note"] = f"the floor curves fit the seeds' mean losses within their noise ({test})"
        return out
    what = "the form L = E + A N^-b is rejected" if rejected else "too little to reject the form L = E + A N^-b"
    out["note"] = (f"the floor curves miss the seeds' mean losses by more than the seeds' noise explains ({test}: "
                   f"{what}); every interval of the fit is widened x{widen:.2f}, the lack of fit's mean square in "
                   "place of the noise's")
    out["ratio_note"] = f"interval widened x{widen:.2f} for the floor curves' lack of fit"
    return out


SPANS_SHARED = ("the sizes do not place both floors (one sits at a bound of its range, in the fit or without one "
                "seed), so each ratio's interval spans the fit with one shared floor too")
FLOORS_NOT_IDENTIFIED = (
    "a parameter of the fitted curves, not a finding: {k} sizes cannot tell a lower floor from a term that fades "
    "faster than N^-b in one arm, which moves the fitted floor by about 0.1 nats while the seeds' jackknife sees "
    "only their noise (its interval covered 0.06-0.38 at 12 seeds in simulations), so no interval is given; the "
    "gap measured at the largest size, with its interval, stands in for it")


def _floor_difference(model: str, value: float, n: int, sizes: int) -> dict:
    """``fit["floor_difference"]``: the arm's floor minus the baseline's as the fit places it, a
    parameter of the fit and not a finding (``finding`` is ``False``, ``low`` and ``high`` ``None``;
    ``note`` says why), or, with one floor, ``None`` and why."""
    if model == "shared":
        return {"value": None, "low": None, "high": None, "n": n, "finding": False,
                "note": f"one floor for both arms (fewer than {SEPARATE_MIN_SIZES} sizes cannot place two): "
                        "the difference is assumed 0, not measured"}
    return {"value": value, "low": None, "high": None, "n": n, "finding": False,
            "note": FLOORS_NOT_IDENTIFIED.format(k=sizes)}


def _shared_crossover(fit: dict, loo: Optional[dict], n: int, c: float, measured: tuple[float, float],
                      confidence: float, widen: float = 1.0) -> Crossover:
    """One floor: the curves as lines ``log(L - E) = log A - b x``; Fieller's interval from their
    intercept and slope gaps and the jackknife covariance (times ``widen`` squared: the lack of fit's
    allowance, :func:`lack_of_fit_test`)."""

    def gap(f: dict) -> tuple:
        return (np.log(np.maximum(f["A_arm"], 1e-300)) - np.log(np.maximum(f["A_ref"], 1e-300)),
                f["b_ref"] - f["b_arm"])

    da, db = gap(fit)
    if loo is not None:
        jk = np.cov(*gap(loo), ddof=0) * (n - 1) * widen ** 2  # the jackknife covariance, widened
        moments = (float(da), float(db), float(jk[0, 0]), float(jk[1, 1]), float(jk[0, 1]))
    else:
        moments = (float(da), float(db), 0.0, 0.0, 0.0)
    return _crossover(*moments, n, c, measured, confidence)


_CROSS_DECADES = 3.0  # how far beyond the measured sizes a crossover of two floor curves is looked for


def _curve_crossover(fit: dict, loo: Optional[dict], n: int, c: float, measured: tuple[float, float],
                     confidence: float, widen: float = 1.0) -> Crossover:
    """Two floors: where the fitted curves meet (the gap ``L_arm - L_ref`` changes sign), looked for from
    1/1000 of the smallest size to 1000 times the largest, the crossing nearest the measured sizes; its
    interval inverts the test of a zero gap: the sizes whose gap is within t jackknife standard errors
    of 0 (times ``widen``, the lack of fit's allowance), connected to the crossing (Fieller's
    construction, which is this for straight lines), open on a side where it reaches the end of that
    range."""
    span = _CROSS_DECADES * math.log(10)
    x = np.linspace(math.log(measured[0]) - c - span, math.log(measured[1]) - c + span, 1201)

    def gap(f: dict) -> np.ndarray:
        def curve(arm: str) -> np.ndarray:
            return np.asarray(f[f"E_{arm}"])[..., None] + np.asarray(f[f"A_{arm}"])[..., None] * np.exp(
                -np.asarray(f[f"b_{arm}"])[..., None] * x)
        return curve("arm") - curve("ref")

    g = gap(fit)
    where = np.flatnonzero(np.sign(g[:-1]) * np.sign(g[1:]) <= 0)
    if where.size == 0 or not g.any():
        return Crossover(None, None, None, None, "the fitted curves do not meet between 1/1000 of the smallest size "
                                                 "and 1000 times the largest: parallel, or apart throughout")
    mid = (math.log(measured[0]) + math.log(measured[1])) / 2 - c
    i = int(where[np.argmin(np.abs(x[where] - mid))])
    lo, hi = x[i], x[i + 1]
    for _ in range(60):  # bisection on the fitted curves between the two grid points
        m = (lo + hi) / 2
        gm = float(fit["E_arm"] - fit["E_ref"] + fit["A_arm"] * math.exp(-fit["b_arm"] * m)
                   - fit["A_ref"] * math.exp(-fit["b_ref"] * m))
        lo, hi = (m, hi) if (gm > 0) == (g[i] > 0) and gm != 0 else (lo, m)
    root = math.exp((lo + hi) / 2 + c)
    outside = not measured[0] <= root <= measured[1]
    note = "extrapolated: outside the measured sizes" if outside else None
    if loo is None or n < 2:
        return Crossover(root, None, None, outside, "one seed: no interval")
    gj = gap(loo)  # (n, grid)
    se = np.sqrt((n - 1) / n * ((gj - gj.mean(0)) ** 2).sum(0)) * widen
    inside = np.abs(g) <= t_quantile(1 - (1 - confidence) / 2, n - 1) * se
    inside[i] = inside[i + 1] = True  # the crossing itself lies in its interval
    left, right = i, i + 1
    while left > 0 and inside[left - 1]:
        left -= 1
    while right < x.size - 1 and inside[right + 1]:
        right += 1
    low = None if left == 0 else math.exp(x[left] + c)
    high = None if right == x.size - 1 else math.exp(x[right] + c)
    if low is None or high is None:
        why = "the gap is not clearly away from 0 out to 1000 times beyond the sizes: the interval is unbounded"
        note = why if note is None else f"{note}; {why}"
    return Crossover(root, low, high, outside, note)


def _lack_of_fit(na: np.ndarray, la: np.ndarray, nr: np.ndarray, lr: np.ndarray, floor: dict,
                 confidence: float) -> dict:
    """Each arm's curvature of the straight log-log line over seeds, and the RMS residual of the
    seeds' mean losses around the straight lines and around the floor curves (``floor``: its fit)."""
    ma, mr = la.mean(0), lr.mean(0)
    (aa, ba), (ar, br) = fit_power_law(na, ma), fit_power_law(nr, mr)
    (A_a, b_a), (A_r, b_r) = floor["arm"], floor["reference"]
    E_a, E_r = floor["floors"]["arm"], floor["floors"]["reference"]
    return {"arm": _curvature(na, la, confidence), "reference": _curvature(nr, lr, confidence),
            "rms": {"straight_line": _rms([np.exp(aa + ba * np.log(na)), np.exp(ar + br * np.log(nr))], [ma, mr]),
                    "floor": _rms([E_a + A_a * na ** -b_a, E_r + A_r * nr ** -b_r], [ma, mr])}}


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
