"""difftx.eval.efficiency: the paper's Fig. 3 ratios recovered from synthetic curves and power laws
with seed noise and a known answer; coverage of their intervals by simulation; bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from difftx.eval.efficiency import NOT_REACHED, token_efficiency, tokens_to_reach
from difftx.eval.floor_fit import fit_power_law, floor_ratios, parameter_efficiency


def _loss(t):
    return 1.5 + 40.0 * np.asarray(t, dtype=np.float64) ** -0.25  # a held-out loss curve of the baseline


def test_tokens_to_reach_interpolates_in_log_tokens_and_never_extrapolates():
    t = [100.0, 1000.0, 10000.0]
    v = [4.0, 3.0, 2.5]
    assert tokens_to_reach(t, v, 3.0) == pytest.approx(1000.0)
    assert 100.0 < tokens_to_reach(t, v, 3.5) < 1000.0
    assert tokens_to_reach(t, [4.0, 3.0, 2.0], 3.5) == pytest.approx(math.sqrt(100.0 * 1000.0))  # a line in log t
    assert tokens_to_reach(t, v, 2.4) is None and tokens_to_reach(t, v, 4.5) is None
    # a curved loss curve sampled at 3 points per decade: the monotone cubic finds the tokens within 0.5%
    grid = np.geomspace(1e4, 1e7, 10)
    for true in (3e4, 2e5, 1.3e6):
        assert tokens_to_reach(grid, _loss(grid), float(_loss(true))) == pytest.approx(true, rel=5e-3)
    # a bump: the curve made monotone (the best loss so far)
    assert tokens_to_reach([1, 2, 3, 4], [4.0, 3.0, 3.5, 2.0], 3.0) == pytest.approx(2.0)


def test_token_ratio_of_a_curve_scaled_by_0_6_is_recovered():
    """DIFF reaches at t the loss the baseline reaches at t / 0.6: the ratio is 0.6 at every point
    both curves cover, inside the interval, and "not reached" beyond the baseline's last point."""
    rng = np.random.default_rng(0)
    t = np.geomspace(1e4, 1e7, 10)
    arm, ref = [], []
    for _ in range(3):
        noise = lambda: np.exp(rng.normal(0, 0.001, t.size))  # noqa: E731
        arm.append((t, _loss(t / 0.6) * noise()))
        ref.append((t, _loss(t) * noise()))
    eff = token_efficiency(arm, ref)
    assert eff.overall.low < 0.6 < eff.overall.high and eff.overall.value == pytest.approx(0.6, rel=0.05)
    reached = [r for r in eff.ratios if r.value is not None]
    assert len(reached) >= 6 and all(abs(r.value - 0.6) < 0.06 for r in reached)
    assert eff.ratios[-1].value is None and eff.ratios[-1].note == NOT_REACHED  # t / 0.6 > the last point
    json.dumps(eff.to_dict(), allow_nan=False)


SIZES = np.array([1e5, 2e5, 4e5, 8e5, 1.6e6])  # a 16x span, as a scale sweep has


def _power_law_seeds(rng, seeds: int, ratio: float, slope_arm: float = 0.12, slope_ref: float = 0.12,
                     cross: float | None = None):
    """Per seed, the final losses of each size: ``L = c N^-b`` times seed noise (a seed effect shared
    by the sizes and noise per size). The arm's line is the reference's at ``N / ratio``, or, with
    ``cross``, a line of another slope meeting it at ``cross``."""
    c = 30.0
    ref = lambda n: c * n ** -slope_ref  # noqa: E731
    if cross is None:
        arm = lambda n: ref(n / ratio)  # noqa: E731
    else:
        arm = lambda n: ref(cross) * (n / cross) ** -slope_arm  # noqa: E731
    rows = {"arm": [], "ref": []}
    for _ in range(seeds):
        for key, f in (("arm", arm), ("ref", ref)):
            rows[key].append(f(SIZES) * np.exp(rng.normal(0, 0.01) + rng.normal(0, 0.005, SIZES.size)))
    return rows


SCALE = np.array([32928.0, 55536.0, 160192.0, 332448.0])  # the former scale-cpu sizes: 4 over 10x
SCALE_NOW = np.array([13944.0, 55536.0, 83280.0, 187128.0, 249480.0])  # scale-cpu's scaled copies: 5 over 18x


def _floor_seeds(rng, runs: int, seeds: int, floor: float, b: float, drop: float, sd: float, ratio: float = 0.62,
                 sizes: np.ndarray = SCALE, dfloor: float = 0.0, b_arm: float | None = None):
    """``runs`` experiments of ``seeds`` paired seeds at :data:`SCALE`: the baseline's loss ``E + A N^-b``
    (``A`` such that it lies ``drop`` above the floor at the smallest size), DIFF's the baseline's at
    ``N / ratio`` (so the true ratio is ``ratio`` at every size), plus Gaussian noise: ``sd`` per model
    and size, a seed effect of 0.01 shared by both arms (their data order) and 0.005 per arm. Returns
    the losses of each arm shaped (runs, seeds, sizes). ``dfloor`` moves DIFF's floor (DIFF minus the
    baseline) and ``b_arm`` gives DIFF its own exponent (the excess ``drop (N / (ratio N_0))^-b_arm``):
    then the true ratio varies with size (:func:`_true_log_ratio`)."""
    shared = rng.normal(0, 0.01, (runs, seeds, 1))
    out = []
    for scale, shift, bb in ((ratio, dfloor, b if b_arm is None else b_arm), (1.0, 0.0, b)):
        A = drop * sizes[0] ** bb
        clean = floor + shift + A * (sizes / scale) ** -bb
        noise = rng.normal(0, 0.005, (runs, seeds, 1)) + rng.normal(0, sd, (runs, seeds, sizes.size))
        out.append(clean + shared + noise)
    return out


def _true_log_ratio(floor: float, b: float, drop: float, ratio: float = 0.62, sizes: np.ndarray = SCALE,
                    dfloor: float = 0.0, b_arm: float | None = None) -> np.ndarray:
    """The true ``log(N_D / N_B)`` per size of :func:`_floor_seeds`' curves: the baseline size whose loss
    is DIFF's (``-inf`` where DIFF's loss lies below the baseline's floor)."""
    q = dfloor / drop + (sizes / (ratio * sizes[0])) ** -(b if b_arm is None else b_arm)  # (N_B / N_0)^-b
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(q > 0, np.log(sizes) - np.log(sizes[0]) + np.log(np.where(q > 0, q, 1.0)) / b, -np.inf)


def _loglog_log_ratios(arm, ref):
    """The straight log-log line per seed (the paper's fit), vectorised: per-seed log ratios (runs, seeds, sizes)."""
    x = np.log(SCALE)
    X = np.stack([np.ones_like(x), x], 1)

    def coef(y):  # (a, b) per experiment and seed
        return np.linalg.lstsq(X, np.log(y).reshape(-1, x.size).T, rcond=None)[0].reshape(2, *y.shape[:2])

    (a, b), (ar, br) = coef(arm), coef(ref)
    return x - (a[..., None] + b[..., None] * x - ar[..., None]) / br[..., None]


# the truths of the coverage test: power laws with a floor (E = 1.0-1.69, as the issue measured) and
# exact power laws (E = 0; b = 0.042 is the straight line fitted to scale-cpu), at realistic seed noise
TRUTHS = {"floor 1.69, b 0.34, sd 0.01": (1.69, 0.34, 0.8, 0.01), "floor 1.0, b 0.1, sd 0.02": (1.0, 0.1, 0.8, 0.02),
          "power law, b 0.042, sd 0.01": (0.0, 0.042, 1.8, 0.01), "power law, b 0.3, sd 0.005": (0.0, 0.3, 3.0, 0.005)}


@pytest.mark.parametrize("seeds", [3, 5])
@pytest.mark.parametrize("truth", list(TRUTHS))
def test_floor_ratio_interval_covers_the_true_ratio_at_every_size(truth, seeds):
    """The floor fit's interval (each arm its own floor) covers the true ratio of 0.62 in at least 93%
    of 800 simulated sweeps at every one of the 4 sizes, with a floor or without one. Measured
    (benchmarks/floor_coverage.py) in docs/efficiency.md."""
    floor, b, drop, sd = TRUTHS[truth]
    rng = np.random.default_rng(seeds * 100 + list(TRUTHS).index(truth))
    arm, ref = _floor_seeds(rng, 800, seeds, floor, b, drop, sd)
    got = floor_ratios(SCALE, arm, SCALE, ref)
    cover = _cover(got, math.log(0.62))  # a missing ratio does not cover; an unbounded interval does
    assert (cover >= 0.93).all(), cover
    # each arm its own floor (4 sizes): where the sizes barely bend (b 0.1), the baseline's floor, without one
    # seed, can rise above DIFF's loss at the largest size; then the interval is unbounded, and says so
    assert not np.isnan(got["half"]).any() and np.isinf(got["log_high"]).mean() <= (0.05 if b < 0.2 else 0.002)
    # one experiment through parameter_efficiency reads the same numbers
    one = parameter_efficiency(SCALE, arm[0], SCALE, ref[0])
    assert [r.value for r in one.ratios] == pytest.approx(np.exp(got["log_ratio"][0]).tolist(), rel=1e-9)
    assert one.ratios[0].high == pytest.approx(math.exp(got["log_high"][0, 0]), rel=1e-9)
    assert one.method == "floor" and one.extrapolated[-1] and "extrapolated" in one.ratios[-1].note


@pytest.mark.parametrize("truth", ["floor 1.69, b 0.34, sd 0.01", "power law, b 0.042, sd 0.01"])
def test_floor_ratio_interval_covers_at_the_present_scale_cpu_sizes(truth):
    """The same coverage at the sizes scale-cpu trains now (5 scaled copies over 18x), 3 seeds."""
    floor, b, drop, sd = TRUTHS[truth]
    arm, ref = _floor_seeds(np.random.default_rng(11), 800, 3, floor, b, drop, sd, sizes=SCALE_NOW)
    got = floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref)
    cover = _cover(got, math.log(0.62))
    assert (cover >= 0.93).all(), cover


def test_the_straight_line_misses_a_floor_and_its_lack_of_fit_shows():
    """With a floor (E = 1.69), the straight log-log line's ratio drifts across the sizes and its t
    interval misses the truth at the end sizes (the issue's finding); the curvature of log L flags the
    bend in most sweeps at 5 seeds, and in about 5% of exact power laws."""
    rng = np.random.default_rng(7)
    arm, ref = _floor_seeds(rng, 400, 5, 1.69, 0.34, 0.8, 0.01)
    lr = _loglog_log_ratios(arm, ref)
    h = 2.776 * lr.std(1, ddof=1) / math.sqrt(5)
    cover = (np.abs(lr.mean(1) - math.log(0.62)) <= h).mean(0)
    assert cover[0] < 0.5 and cover[-1] < 0.5, cover
    drift = np.exp(lr.mean((0, 1)))
    assert drift[0] < 0.58 and drift[-1] > 0.68, drift
    flagged = [_curvature_p(r) < 0.05 for r in ref[:100]]
    assert np.mean(flagged) > 0.8
    assert parameter_efficiency(SCALE, ref[0], SCALE, ref[0]).lack_of_fit["reference"]["p"] == _curvature_p(ref[0])
    arm, ref = _floor_seeds(rng, 300, 5, 0.0, 0.042, 1.8, 0.01)
    false = [_curvature_p(r) < 0.05 for r in ref]
    assert np.mean(false) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 300)


def _curvature_p(losses):
    """The straight line's curvature test as parameter_efficiency reports it (``lack_of_fit``), without the fit."""
    from difftx.eval.floor_fit import _curvature

    return _curvature(SCALE, losses, 0.95)["p"]


def test_floor_fit_recovers_an_exact_curve_and_stays_in_bounds():
    """Exact curves give back E, b and the ratio; a loss that does not fall with size gives no ratio
    and says so; each arm's E never leaves [0, its lowest loss]; 2-D numpy losses and nested lists read
    alike."""
    ref = 1.5 + 0.35 * (SCALE / SCALE[0]) ** -0.3
    arm = 1.5 + 0.35 * (SCALE / 0.62 / SCALE[0]) ** -0.3
    eff = parameter_efficiency(SCALE, np.array([arm, arm]), SCALE, np.array([ref, ref]))
    assert eff.fit["floor"] == pytest.approx(1.5, abs=1e-4) and eff.fit["reference"][1] == pytest.approx(0.3, rel=1e-3)
    assert all(r.value == pytest.approx(0.62, rel=1e-4) for r in eff.ratios)
    assert eff.lack_of_fit["rms"]["floor"] < 1e-5 < eff.lack_of_fit["rms"]["straight_line"]
    assert eff.lack_of_fit["reference"]["value"] > 0  # the straight line bends up toward the floor
    assert parameter_efficiency(SCALE, [arm.tolist()], SCALE, [ref.tolist()]).ratios[1].value == \
        pytest.approx(eff.ratios[1].value)
    flat = parameter_efficiency(SCALE, [[2.0, 2.01, 2.0, 2.02]], SCALE, [ref])
    assert all(r.value is None and "does not fall" in r.note for r in flat.ratios)
    rng = np.random.default_rng(3)
    for _ in range(20):  # noisy, non-monotone sweeps: the floor stays in its bounds, the output is strict JSON
        a, r = (1.7 + rng.normal(0, 0.05, (3, 4)) for _ in range(2))
        e = parameter_efficiency(SCALE, a, SCALE, r)
        floors = e.fit["floors"]  # each arm its own floor (4 sizes), within its own bounds
        assert 0.0 <= floors["arm"] <= a.mean(0).min() and 0.0 <= floors["reference"] <= r.mean(0).min()
        json.dumps(e.to_dict(), allow_nan=False)
    two = parameter_efficiency(SCALE[:2], [arm[:2]], SCALE[:2], [ref[:2]])
    assert two.method == "loglog" and two.fit is None and two.ratios[0].value is not None


def _crossovers(arm, ref):
    """Each experiment's crossover as :func:`parameter_efficiency` reads it (5 sizes: each arm its own floor), from
    one vectorised :func:`floor_ratios` over all of them: the same fit, jackknife and lack-of-fit widening."""
    from difftx.eval.floor_fit import _curve_crossover, _falls

    got = floor_ratios(SIZES, arm, SIZES, ref, size_check=False)  # the size check moves ratios, not the crossover
    n, out = arm.shape[1], []
    for e in range(arm.shape[0]):
        fit = {k: float(v[e]) for k, v in got["fit"].items()}
        cross = _curve_crossover(fit, {k: v[e] for k, v in got["loo"].items()}, n, got["center"],
                                 (SIZES[0], SIZES[-1]), 0.95, float(got["widen"][e]))
        out.append(cross if _falls(fit, "arm") and _falls(fit, "ref") else None)
    return out


def test_crossover_interval_covers_where_the_lines_meet():
    """A steeper arm line meeting the reference's at N = 5e5: Fieller's interval covers that size in at
    least 93% of 500 simulations at 5 seeds (95.2-96.4% measured with three generator seeds; a Monte Carlo SE of
    0.009), and a crossing
    beyond the sizes is marked as extrapolation. The 500 are fitted at once; the first read through
    parameter_efficiency give the same crossovers."""
    rng = np.random.default_rng(11)
    runs = [_power_law_seeds(rng, 5, 1.0, slope_arm=0.16, cross=5e5) for _ in range(500)]
    arm, ref = np.array([r["arm"] for r in runs]), np.array([r["ref"] for r in runs])
    crosses = _crossovers(arm, ref)
    for e in range(2):
        one = parameter_efficiency(SIZES, arm[e], SIZES, ref[e]).crossover
        assert (one.params, one.low, one.high) == pytest.approx((crosses[e].params, crosses[e].low, crosses[e].high))
    hits = bounded = 0
    for c in crosses:
        if c is not None and c.low is not None:
            bounded += 1
            hits += c.low <= 5e5 <= (c.high or math.inf)  # widened for a lack of fit, it may be open above
        else:
            hits += c is not None  # an unbounded interval covers everything
    assert hits / 500 >= 0.93 and bounded > 400
    far = _power_law_seeds(rng, 5, 1.0, slope_arm=0.16, cross=1e8)
    c = parameter_efficiency(SIZES, far["arm"], SIZES, far["ref"]).crossover
    assert c.extrapolated and "extrapolated" in (c.note or "")


def test_parallel_lines_have_a_constant_ratio_and_no_crossover():
    n = SIZES
    ref = [30.0 * n ** -0.12]
    arm = [30.0 * (n / 0.65) ** -0.12]
    eff = parameter_efficiency(n, arm, n, ref)
    assert all(r.value == pytest.approx(0.65, rel=1e-5) for r in eff.ratios)
    assert all(r["value"] == pytest.approx(0.65) for r in eff.loglog["ratios"])
    assert eff.extrapolated == [False, False, False, False, True]  # 1.6e6 / 0.65 lies beyond the sizes
    assert eff.fit["floor"] == 0.0 and "no floor is visible" in eff.fit["note"]
    assert eff.crossover.params is None and "parallel" in eff.crossover.note
    a, b = fit_power_law(n, ref[0])
    assert b == pytest.approx(-0.12) and a == pytest.approx(math.log(30.0))
    json.dumps(eff.to_dict(), allow_nan=False)


@pytest.mark.parametrize("call,match", [
    (lambda: parameter_efficiency([1e5], [[3.0]], [1e5], [[3.0]]), "at least 2 sizes"),
    (lambda: parameter_efficiency([2e5, 1e5], [[3.0, 2.9]], [2e5, 1e5], [[3.0, 2.9]]), "increasing"),
    (lambda: parameter_efficiency([1e5, 2e5], [[3.0, 2.9]], [1e5, 2e5], []), "same seeds"),
    (lambda: token_efficiency([([1, 2], [3.0, float("nan")])], [([1, 2], [3.0, 2.0])]), "finite"),
    (lambda: token_efficiency([([1, 2], [3.0, 2.0])], []), "one curve per seed"),
    (lambda: tokens_to_reach([0, 1], [3.0, 2.0], 2.5), "positive and increasing"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_plots_like_figure_3(tmp_path):
    pytest.importorskip("matplotlib")
    from difftx.eval.plots import plot_parameter_efficiency, plot_token_efficiency

    t = np.geomspace(1e4, 1e7, 6)
    a = plot_token_efficiency({"DIFF": [(t, _loss(t / 0.6))], "baseline": [(t, _loss(t))]},
                              [(t[0], t[0] / 0.6, float(_loss(t[0] / 0.6))), (t[-1], None, 2.0)], tmp_path / "b.png",
                              overall={"value": 0.6, "low": 0.58, "high": 0.62})
    rows = _power_law_seeds(np.random.default_rng(0), 2, 0.65)
    b = plot_parameter_efficiency({"DIFF": (SIZES, rows["arm"]), "baseline": (SIZES, rows["ref"])},
                                  {"DIFF": (3.4, -0.12), "baseline": (3.3, -0.12)}, tmp_path / "a.png", crossover=5e5,
                                  ratios={SIZES[2]: {"value": 0.65, "low": 0.6, "high": 0.7}})
    c = plot_parameter_efficiency({"DIFF": (SIZES, rows["arm"]), "baseline": (SIZES, rows["ref"])},
                                  {"DIFF": (1.0, 40.0, 0.2), "baseline": (1.0, 42.0, 0.2)}, tmp_path / "f.png",
                                  lines={"DIFF": (3.4, -0.12), "baseline": (3.3, -0.12)})
    crossing = {"value": None, "low": None, "high": None, "n": 2,
                "note": "the curves cross: the ratio runs from 1.51 at 10,000 tokens to 0.66 at 1,000,000; no overall"}
    d = plot_token_efficiency({"DIFF": [(t, _loss(t / 0.6))], "baseline": [(t, _loss(t))]}, [], tmp_path / "x.png",
                              overall=crossing)
    assert a.read_bytes()[:4] == b.read_bytes()[:4] == c.read_bytes()[:4] == d.read_bytes()[:4] == b"\x89PNG"


def test_a_point_only_some_seeds_reach_is_not_summarised_and_one_seed_says_so():
    """Seed 1's baseline stops earlier, so DIFF's late points are reached by seed 0 only: those points
    carry no ratio (a subset of seeds would be a biased average) and say how many seeds reached them."""
    t = np.geomspace(1e4, 1e7, 10)
    arm = [(t, _loss(t / 0.6)), (t, _loss(t / 0.6))]
    ref = [(t, _loss(t)), (t[:6], _loss(t[:6]))]
    eff = token_efficiency(arm, ref)
    partial = [r for r in eff.ratios if r.note and r.note.startswith("reached in 1 of 2")]
    assert partial and all(r.value is None and r.n == 1 for r in partial)
    assert any(eff.per_seed[0][i] is not None and eff.per_seed[1][i] is None for i in range(t.size))
    one = token_efficiency(arm[:1], ref[:1])
    assert one.overall.low is None and "one seed" in one.overall.note
    assert one.overall.value == pytest.approx(0.6, rel=5e-3)
    json.dumps(eff.to_dict(), allow_nan=False)


def test_crossing_token_curves_get_no_overall_ratio():
    """DIFF's token ratio running from 1.5 early to 0.66 late (curves that cross): no overall ratio,
    which would read about 1.0, but the first and last points and ``crosses``; a ratio of 0.6 at every
    point does not cross and keeps its overall ratio."""
    rng = np.random.default_rng(1)
    t = np.geomspace(1e4, 1e7, 10)
    r = np.geomspace(1.5, 0.66, t.size)
    arm = [(t, _loss(t / r) * np.exp(rng.normal(0, 0.001, t.size))) for _ in range(3)]
    ref = [(t, _loss(t) * np.exp(rng.normal(0, 0.001, t.size))) for _ in range(3)]
    eff = token_efficiency(arm, ref)
    assert eff.crosses and eff.overall.value is None and "the curves cross" in eff.overall.note
    assert eff.span["first"]["low"] > 1 and eff.span["last"]["high"] < 1
    assert eff.span["first"]["tokens"] < eff.span["last"]["tokens"]
    json.dumps(eff.to_dict(), allow_nan=False)
    same = token_efficiency([(t, _loss(t / 0.6))] * 2, [(t, _loss(t))] * 2)
    assert not same.crosses and same.overall.value == pytest.approx(0.6, rel=5e-3)
    from difftx.compare.report import render_token_efficiency
    from difftx.compare.schema import CompareResult, Comparison

    loss = {"diff": [1.0] * t.size, "baseline": [1.0] * t.size}

    def result(e):
        return CompareResult(preset={}, seeds=[], arms={}, tasks={}, runs={},
                             comparisons={"diff vs baseline": Comparison(("diff", "baseline"), {}, primary=True)},
                             token_efficiency={"diff": {**e.to_dict(), "loss": loss}})

    text = render_token_efficiency(result(eff))
    assert "the curves cross" in text and "no overall ratio" in text
    assert "overall: 0.599" in render_token_efficiency(result(same))


def test_a_line_that_does_not_fall_gives_no_ratio():
    """Untrained models (losses flat in size, noise deciding each seed's slope) once gave "matching
    baseline N 0" and ratios up to 1e83: a straight line that does not fall has no ratio, and says why."""
    rng = np.random.default_rng(0)
    flat = [5.5 + rng.normal(0, 0.01, (3, 2)) for _ in range(2)]
    eff = parameter_efficiency([1e4, 3e4], flat[0], [1e4, 3e4], flat[1])
    assert eff.method == "loglog" and all(r.value is None and "does not fall" in r.note for r in eff.ratios)
    assert eff.matched_params == [None, None]
    four = parameter_efficiency([1e4, 3e4, 1e5, 3e5], 5.5 + rng.normal(0, 0.01, (3, 4)), [1e4, 3e4, 1e5, 3e5],
                                5.5 + rng.normal(0, 0.01, (3, 4)))
    assert all(r.value is None for r in four.ratios)


# -- issue 38: floors that differ ---------------------------------------------------------------------------

def _cover(got, truth):
    """Per size, the share of runs whose interval in use holds the truth (an unbounded one does; a
    missing ratio or interval does not)."""
    with np.errstate(invalid="ignore"):
        return ((got["log_low"] <= truth) & (truth <= got["log_high"])).mean(0)


@pytest.mark.parametrize("truth,seeds", [("floor 1.69, b 0.34, sd 0.01", 5), ("floor 1.69, b 0.34, sd 0.01", 12),
                                         ("floor 1.0, b 0.1, sd 0.02", 12)])
def test_each_arm_its_own_floor_covers_when_the_floors_differ(truth, seeds):
    """DIFF's floor 0.05 nats below the baseline's at scale-cpu's sizes: the fit in use (each arm its
    own floor from 4 sizes on) covers the true ratio at every size, and the floor difference where it
    gives one; one floor shared by both (the fit before issue 38) misses at the largest size, and more
    seeds make it worse. Where the curve barely bends (b 0.1) the sizes rarely place the floors: there
    the interval spans the one-floor fit too (alone, each arm's own floor covered 0.91 at 12 seeds).
    200 runs: the fit in use covers 0.96-0.98 over 400 (a Monte Carlo SE of 0.014 at 200), one floor 0.53.
    benchmarks/floor_coverage.py measures all of it over 1,000 runs."""
    floor, b, drop, sd = TRUTHS[truth]
    true = _true_log_ratio(floor, b, drop, sizes=SCALE_NOW, dfloor=-0.05)
    arm, ref = _floor_seeds(np.random.default_rng(seeds + 38), 200, seeds, floor, b, drop, sd, sizes=SCALE_NOW,
                            dfloor=-0.05)
    got = floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref)
    assert got["model"] == "separate"
    cover = _cover(got, true)
    assert (cover >= 0.92).all(), cover
    given = ~np.isnan(got["floor_half"])
    assert (given == got["floors_placed"]).all() and (got["spans_shared"] == ~got["floors_placed"]).all()
    d_cover = np.mean(np.abs(got["floor_difference"][given] + 0.05) <= got["floor_half"][given])
    assert d_cover >= 0.92, d_cover
    if b > 0.3:
        assert given.all()  # a curve that bends places both floors in every run
    if seeds == 12 and b > 0.3:
        shared = _cover(floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref, model="shared", lack_of_fit=False,
                                     size_check=False), true)  # as before issue 48: no allowance for its misfit
        assert shared[-1] < 0.7, shared


def test_a_term_in_one_arm_moves_the_fitted_floors_so_their_difference_is_no_finding():
    """A term 0.3 N_0 / N that fades faster than N^-b in DIFF's loss only, equal floors: the fitted floors'
    difference comes out near +0.09 nats, and the jackknife's interval, which sees only the seeds' noise,
    covers the truth (0) in far fewer than 95% of runs at 8 seeds (0.56 over 300 runs, 0.31 at 12:
    benchmarks/floor_coverage.py --one-arm). So the output gives the difference as a fit parameter without an
    interval, never as a finding."""
    arm, ref = _floor_seeds(np.random.default_rng(59), 100, 8, 1.69, 0.34, 0.8, 0.01, sizes=SCALE_NOW)
    arm = arm + 0.3 * SCALE_NOW[0] * 0.62 / SCALE_NOW
    got = floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref, size_check=False)
    d, half = got["floor_difference"], got["floor_half"]
    assert np.median(d) > 0.05 and np.mean(np.abs(d) <= half) < 0.8, (np.median(d), np.mean(np.abs(d) <= half))
    f = parameter_efficiency(SCALE_NOW, arm[0], SCALE_NOW, ref[0]).fit["floor_difference"]
    assert f["value"] == pytest.approx(d[0]) and f["low"] is None and f["high"] is None and f["finding"] is False
    assert "not a finding" in f["note"] and "5 sizes cannot tell a lower floor" in f["note"]


def test_each_arm_its_own_floor_recovers_exact_curves_and_names_the_model():
    """Exact curves with floors 1.45 (DIFF) and 1.5 (baseline) and different exponents: each floor, the
    difference and the true ratio at every size come back; the report names the model. With 3 sizes
    the fit falls back to one floor and says the difference is not measured."""
    ref = 1.5 + 0.35 * (SCALE_NOW / SCALE_NOW[0]) ** -0.3
    arm = 1.45 + 0.35 * (SCALE_NOW / 0.62 / SCALE_NOW[0]) ** -0.25
    truth = np.exp(_true_log_ratio(1.5, 0.3, 0.35, sizes=SCALE_NOW, dfloor=-0.05, b_arm=0.25))
    eff = parameter_efficiency(SCALE_NOW, np.array([arm, arm]), SCALE_NOW, np.array([ref, ref]))
    f = eff.fit
    assert f["model"] == "separate" and f["floor"] == f["floors"]["reference"]
    assert f["floors"]["reference"] == pytest.approx(1.5, abs=1e-4)
    assert f["floors"]["arm"] == pytest.approx(1.45, abs=1e-4)
    assert f["floor_difference"]["value"] == pytest.approx(-0.05, abs=2e-4)
    assert f["arm"][1] == pytest.approx(0.25, rel=1e-3) and f["reference"][1] == pytest.approx(0.3, rel=1e-3)
    assert [r.value for r in eff.ratios] == pytest.approx(truth.tolist(), rel=1e-3)
    assert eff.lack_of_fit["rms"]["floor"] < 1e-5
    json.dumps(eff.to_dict(), allow_nan=False)
    three = parameter_efficiency(SCALE_NOW[:3], [arm[:3]] * 2, SCALE_NOW[:3], [ref[:3]] * 2)
    assert three.fit["model"] == "shared" and three.fit["floor_difference"]["value"] is None
    assert "assumed 0" in three.fit["floor_difference"]["note"]
    assert not f["interval_spans_shared"] and f["floor_difference"]["low"] is None  # a fit parameter, not a finding
    assert f["floor_difference"]["finding"] is False and "not a finding" in f["floor_difference"]["note"]
    forced = parameter_efficiency(SCALE_NOW, [arm] * 2, SCALE_NOW, [ref] * 2, floor_model="shared")
    assert forced.fit["model"] == "shared" and forced.fit["floors"]["arm"] == forced.fit["floors"]["reference"]
    with pytest.raises(ValueError, match="floor model"):
        parameter_efficiency(SCALE_NOW, [arm], SCALE_NOW, [ref], floor_model="two")


def test_a_loss_below_the_baseline_floor_has_no_ratio_and_says_so():
    """DIFF's loss at its largest sizes under the baseline's floor: no baseline size reaches it, so no
    ratio (not a huge or negative one), and the output stays strict JSON."""
    ref = 1.5 + 0.35 * (SCALE_NOW / SCALE_NOW[0]) ** -0.3
    arm = 1.2 + 0.5 * (SCALE_NOW / SCALE_NOW[0]) ** -0.6
    assert arm[-1] < 1.5 < arm[0]
    eff = parameter_efficiency(SCALE_NOW, [arm, arm + 0.001], SCALE_NOW, [ref, ref + 0.001])
    below = [r for r in eff.ratios if r.note and "below the baseline's fitted floor" in r.note]
    assert below and all(r.value is None for r in below) and eff.ratios[0].value is not None
    json.dumps(eff.to_dict(), allow_nan=False)


def test_crossover_of_curves_with_their_own_floors():
    """A DIFF curve with a lower floor and a steeper fall meets the baseline's inside the sizes: the
    crossover is found where the exact curves meet, and with seed noise its interval covers it."""
    n0 = SCALE_NOW[0]
    ref = lambda n: 1.5 + 0.5 * (n / n0) ** -0.4  # noqa: E731
    arm = lambda n: 1.4 + 0.88 * (n / n0) ** -0.5  # noqa: E731
    grid = np.geomspace(SCALE_NOW[0], SCALE_NOW[-1], 2001)
    meet = grid[np.argmin(np.abs(arm(grid) - ref(grid)))]
    assert SCALE_NOW[1] < meet < SCALE_NOW[-2]
    exact = parameter_efficiency(SCALE_NOW, [arm(SCALE_NOW)] * 2, SCALE_NOW, [ref(SCALE_NOW)] * 2).crossover
    assert exact.params == pytest.approx(meet, rel=5e-3) and not exact.extrapolated
    rng = np.random.default_rng(5)
    hits = 0
    for _ in range(60):
        noise = lambda: rng.normal(0, 0.01, (5, 1)) + rng.normal(0, 0.005, (5, SCALE_NOW.size))  # noqa: E731
        shared = rng.normal(0, 0.01, (5, 1))
        c = parameter_efficiency(SCALE_NOW, arm(SCALE_NOW) + shared + noise(), SCALE_NOW,
                                 ref(SCALE_NOW) + shared + noise()).crossover
        hits += c.params is not None and (c.low or 0) <= meet <= (c.high or math.inf)
    assert hits >= 54


def test_floors_the_sizes_do_not_place_widen_the_interval_to_both_models():
    """Exact power laws with seed noise: the floors sit at 0 (a bound), so the sizes do not place them.
    The ratio still comes from each arm's own floor, its interval spans the one-floor fit's too, the
    report says so, and the floor difference has a value but no interval (it never has one)."""
    rows = _power_law_seeds(np.random.default_rng(2), 4, 0.65)
    auto = parameter_efficiency(SIZES, rows["arm"], SIZES, rows["ref"])
    sep = parameter_efficiency(SIZES, rows["arm"], SIZES, rows["ref"], floor_model="separate")
    one = parameter_efficiency(SIZES, rows["arm"], SIZES, rows["ref"], floor_model="shared")
    assert auto.fit["model"] == "separate" and auto.fit["interval_spans_shared"]
    assert "spans the fit with one shared floor" in auto.fit["note"] and not sep.fit["interval_spans_shared"]
    for a, s, o in zip(auto.ratios, sep.ratios, one.ratios):
        # at least both (the fit without the smallest size may widen it further: issue 48)
        assert a.value == s.value and a.low <= min(s.low, o.low) and a.high >= max(s.high, o.high)
    d = auto.fit["floor_difference"]
    assert d["value"] is not None and d["low"] is None and not d["finding"]
    json.dumps(auto.to_dict(), allow_nan=False)
