"""difftx.eval.efficiency: the paper's Fig. 3 ratios recovered from synthetic curves and power laws
with seed noise and a known answer; coverage of their intervals by simulation; bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from difftx.eval.efficiency import (NOT_REACHED, fit_power_law, parameter_efficiency, token_efficiency,
                                    tokens_to_reach)


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


@pytest.mark.parametrize("seeds", [3, 5])
def test_parameter_ratio_interval_covers_the_true_ratio(seeds):
    """Synthetic power laws with seed noise and a known ratio of 0.65: the interval covers it in at
    least 93% of 500 simulations."""
    rng = np.random.default_rng(seeds)
    hits, runs = 0, 500
    for _ in range(runs):
        rows = _power_law_seeds(rng, seeds, 0.65)
        eff = parameter_efficiency(SIZES, rows["arm"], SIZES, rows["ref"])
        r = eff.ratios[2]  # the middle size: its match lies inside the measured range
        hits += r.low <= 0.65 <= r.high
        assert not eff.extrapolated[2]
    assert hits / runs >= 0.93, hits / runs


def test_crossover_interval_covers_where_the_lines_meet():
    """A steeper arm line meeting the reference's at N = 5e5: Fieller's interval covers that size in at
    least 93% of 500 simulations at 5 seeds, and a crossing beyond the sizes is marked as extrapolation."""
    rng = np.random.default_rng(11)
    hits = bounded = 0
    for _ in range(500):
        rows = _power_law_seeds(rng, 5, 1.0, slope_arm=0.16, cross=5e5)
        c = parameter_efficiency(SIZES, rows["arm"], SIZES, rows["ref"]).crossover
        if c.low is not None:
            bounded += 1
            hits += c.low <= 5e5 <= c.high
        else:
            hits += 1  # an unbounded interval covers everything
    assert hits / 500 >= 0.93 and bounded > 400
    far = _power_law_seeds(rng, 5, 1.0, slope_arm=0.16, cross=1e8)
    c = parameter_efficiency(SIZES, far["arm"], SIZES, far["ref"]).crossover
    assert c.extrapolated and "extrapolated" in (c.note or "")


def test_parallel_lines_have_a_constant_ratio_and_no_crossover():
    n = SIZES
    ref = [30.0 * n ** -0.12]
    arm = [30.0 * (n / 0.65) ** -0.12]
    eff = parameter_efficiency(n, arm, n, ref)
    assert all(r.value == pytest.approx(0.65) for r in eff.ratios)
    assert eff.extrapolated == [False, False, False, False, True]  # 1.6e6 / 0.65 lies beyond the sizes
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
    assert a.read_bytes()[:4] == b.read_bytes()[:4] == b"\x89PNG"


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
