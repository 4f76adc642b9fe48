"""The floor fit owns its lack of fit (issue 48, item 4): where the floor curves miss the seeds' mean
losses, the ratios' intervals widen by it, and where the ratio moves without the smallest size, they
span that fit too; a fit of the right form keeps its interval. Coverage over many runs:
``benchmarks/floor_coverage.py --lack-of-fit``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from difftx.eval.floor_fit import SIZE_MOVED, floor_ratios, parameter_efficiency
from test_efficiency import SCALE_NOW, _floor_seeds


def _sweep(seed: int, seeds: int, sd: float, extra: float = 0.0, runs: int = 1):
    """``runs`` sweeps at scale-cpu's 5 sizes: floor 1.69, b 0.34, DIFF the baseline at ``N / 0.62``, plus
    ``extra N_0 / N`` in both arms' truths (DIFF's at ``N / 0.62``: the true ratio stays 0.62)."""
    arm, ref = _floor_seeds(np.random.default_rng(seed), runs, seeds, 1.69, 0.34, 0.8, sd, sizes=SCALE_NOW)
    return arm + extra * SCALE_NOW[0] * 0.62 / SCALE_NOW, ref + extra * SCALE_NOW[0] / SCALE_NOW


def test_a_fit_of_the_right_form_keeps_its_interval():
    """Seed noise around ``E + A N^-b``: the test finds no lack of fit (F < 1), nothing widens or spans,
    and every interval is the jackknife's as before issue 48; the result says what was tested."""
    arm, ref = _sweep(2, 6, 0.01)
    got = floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref)
    before = floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref, lack_of_fit=False, size_check=False)
    assert got["lack_of_fit_F"][0] < 1 and got["widen"][0] == 1.0 and not got["spans_without_smallest"].any()
    assert got["lack_of_fit_df"] == (4, 20)  # 2 x 5 sizes less 6 parameters; (6 - 1) seeds x 4
    np.testing.assert_array_equal(got["log_low"], before["log_low"])
    np.testing.assert_array_equal(got["log_high"], before["log_high"])
    eff = parameter_efficiency(SCALE_NOW, arm[0], SCALE_NOW, ref[0])
    lack = eff.fit["lack_of_fit"]
    assert lack["widened_by"] == 1.0 and lack["rejected"] is False and lack["df"] == [4, 20]
    assert 0.5 < lack["p"] <= 1 and "within their noise" in lack["note"]
    assert lack["without_smallest"]["spans"] == [False] * 5 and lack["without_smallest"]["threshold"] == 1.0
    assert eff.fit["note"] is None  # nothing to report in scale.md
    assert all("lack of fit" not in (r.note or "") and "smallest" not in (r.note or "") for r in eff.ratios)
    json.dumps(eff.to_dict(), allow_nan=False)


def test_a_misfit_widens_every_interval_and_says_why():
    """A second term ``0.3 N_0 / N`` with little noise (0.001 nats): the test rejects the form, every
    ratio's half-width is the jackknife's times sqrt(F), and the ratio moves without the smallest size,
    so the interval spans that fit too; the fit's note and each ratio's say so."""
    arm, ref = _sweep(1, 6, 0.001, extra=0.3)
    got = floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref)
    F, p = got["lack_of_fit_F"][0], got["lack_of_fit_p"][0]
    assert F > 5 and p < 0.001 and got["widen"][0] == pytest.approx(math.sqrt(F))
    widened = floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref, size_check=False)
    before = floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref, lack_of_fit=False, size_check=False)
    half, half0 = (widened["log_high"] - widened["log_ratio"])[0], (before["log_high"] - before["log_ratio"])[0]
    np.testing.assert_allclose(half, half0 * math.sqrt(F), rtol=1e-9)
    spans = got["spans_without_smallest"][0]
    assert spans[-1] and (got["size_check_z"][0, spans] > 1).all()
    part = floor_ratios(SCALE_NOW[1:], arm[..., 1:], SCALE_NOW[1:], ref[..., 1:], size_check=False)
    assert got["log_low"][0, -1] <= min(widened["log_low"][0, -1], part["log_low"][0, -1])
    assert got["log_high"][0, -1] >= max(widened["log_high"][0, -1], part["log_high"][0, -1])
    assert math.log(0.62) <= got["log_high"][0, -1] and got["log_low"][0, -1] <= math.log(0.62)

    eff = parameter_efficiency(SCALE_NOW, arm[0], SCALE_NOW, ref[0])
    lack = eff.fit["lack_of_fit"]
    assert lack["rejected"] is True and lack["widened_by"] == pytest.approx(math.sqrt(F))
    assert "the form L = E + A N^-b is rejected" in lack["note"] and "widened x" in lack["note"]
    assert lack["note"] in eff.fit["note"] and SIZE_MOVED in eff.fit["note"]
    last = eff.ratios[-1]
    assert "lack of fit" in last.note and "without the smallest size" in last.note
    assert "extrapolated" in last.note  # the extrapolation mark stays, for the report's "(extrapolated)"
    assert last.low == pytest.approx(math.exp(got["log_low"][0, -1]))
    assert lack["without_smallest"]["spans"][-1] and lack["without_smallest"]["z"][0] is not None
    json.dumps(eff.to_dict(), allow_nan=False)


def test_the_test_is_calibrated_where_the_form_holds():
    """300 sweeps of 4 seeds around ``E + A N^-b``: F on 4 and 12 degrees of freedom has mean 12/10,
    and the test rejects about 5%; the median run is not widened."""
    arm, ref = _sweep(5, 4, 0.01, runs=300)
    got = floor_ratios(SCALE_NOW, arm, SCALE_NOW, ref, size_check=False)
    assert got["lack_of_fit_df"] == (4, 12)
    assert abs(got["lack_of_fit_F"].mean() - 1.2) < 0.15
    assert abs((got["lack_of_fit_p"] < 0.05).mean() - 0.05) < 3 * math.sqrt(0.05 * 0.95 / 300)
    assert np.median(got["widen"]) == 1.0


def test_no_test_without_pure_error_or_degrees_of_freedom():
    """One seed: no pure error; each arm its own floor on 3 sizes: as many parameters as sizes. The
    intervals are as before (none with one seed), and the result says why there is no test; 4 sizes
    with each arm its own floor are not refitted without the smallest (3 would take one floor)."""
    arm, ref = _sweep(3, 3, 0.01)
    one = parameter_efficiency(SCALE_NOW, arm[0, :1], SCALE_NOW, ref[0, :1]).fit["lack_of_fit"]
    assert one["F"] is None and one["widened_by"] == 1.0 and "one seed" in one["note"]
    three = parameter_efficiency(SCALE_NOW[:3], arm[0, :, :3], SCALE_NOW[:3], ref[0, :, :3], floor_model="separate")
    lack = three.fit["lack_of_fit"]
    assert lack["F"] is None and lack["df"][0] == 0 and "as many parameters as sizes" in lack["note"]
    four = parameter_efficiency(SCALE_NOW[:4], arm[0, :, :4], SCALE_NOW[:4], ref[0, :, :4])
    assert four.fit["model"] == "separate" and four.fit["lack_of_fit"]["without_smallest"] is None
    assert four.fit["lack_of_fit"]["df"] == [2, 4]


def test_the_report_reads_the_fit_with_and_without_the_new_field():
    """scale.md's floor-fit line carries the lack of fit through the fit's note, and a fit from an older
    scale.json (no ``lack_of_fit`` in it) still renders."""
    from difftx.studies.scale import _floor_fit_text

    arm, ref = _sweep(1, 6, 0.001, extra=0.3)
    fit = parameter_efficiency(SCALE_NOW, arm[0], SCALE_NOW, ref[0]).to_dict()["fit"]
    text = _floor_fit_text(fit, "diff")
    assert "lack of fit F = " in text and "widened x" in text
    old = {k: v for k, v in fit.items() if k != "lack_of_fit"}
    old["note"] = None
    assert "lack of fit" not in _floor_fit_text(old, "diff")
