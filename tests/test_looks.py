"""Looks at one comparison folder spend alpha with shares that sum to at most 1, and no p-value difftx computes is 0
(issue 59 items 3 and 6). The error rates over 2-6 looks are simulated in benchmarks/looks_error.py."""

import math

import numpy as np
import pytest

from difftx.compare.report import _looks_clause
from difftx.compare.schema import CompareResult
from difftx.eval.floor_fit import _curvature, _f_sf, floor_lack_of_fit
from difftx.eval.stats import (LOOK_FIRST_SHARE, NO_SPREAD, P_FLOOR, holm, look_adjusted, look_factor, look_share,
                               paired_estimate, seeds_for_verdict, t_two_sided_p, verdict)


def test_the_looks_shares_sum_to_at_most_one_and_the_first_look_keeps_seven_seeds():
    shares = [look_share(k) for k in range(1, 100_001)]
    assert shares[0] == LOOK_FIRST_SHARE and all(a > b for a, b in zip(shares, shares[1:]))
    assert 0.99999 < math.fsum(shares) <= 1.0  # the tail beyond: 0.05 * 6 / pi^2 / 100000
    assert [round(look_factor(k), 1) for k in (1, 2, 3)] == [1.1, 32.9, 131.6]
    assert look_adjusted(0.01, 1) == pytest.approx(0.01 / 0.95)
    assert look_adjusted(0.001, 2) == pytest.approx(0.001 * math.pi ** 2 / 6 / 0.05)
    assert look_adjusted(0.5, 3) == 1.0 and look_adjusted(None, 2) is None
    # the first look's factor leaves the fewest seeds of a verdict where they were: 7 for the 3 primaries, 6 for one
    assert seeds_for_verdict(3 * look_factor(1)) == seeds_for_verdict(3) == 7
    assert seeds_for_verdict(look_factor(1)) == 6 and seeds_for_verdict(3 * look_factor(2)) == 12
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="look"):
            look_adjusted(0.1, bad)


def test_the_verdict_names_the_looks_factor_and_the_seeds_it_needs():
    d = np.full(7, -0.5) + np.linspace(-0.01, 0.01, 7)
    est = paired_estimate(d, np.zeros(7))
    first = look_adjusted(holm([est.p_value, 0.5, 0.5])[0], 1)
    text = verdict(est, "NLL", lower_is_better=True, adjusted_p=first, family_size=3, look=1)
    assert "x1.05 at look 1 of this folder" in text and "not interchangeable" in text, text
    second = look_adjusted(holm([est.p_value, 0.5, 0.5])[0], 2)
    text = verdict(est, "NLL", lower_is_better=True, adjusted_p=second, family_size=3, look=2)
    assert "x32.9 at look 2 of this folder" in text and "needs at least 12 seeds" in text, text
    assert "at look" not in verdict(est, "NLL", lower_is_better=True, adjusted_p=first, family_size=3)


def _result(look: int, looks: list) -> CompareResult:
    return CompareResult(preset={}, seeds=list(range(7 * look)), arms={}, tasks={}, runs={}, look=look, looks=looks)


def test_the_report_says_what_this_look_cost_and_what_the_next_would():
    one = _looks_clause(_result(1, [{"seeds": list(range(7))}]), [{"look_factor": 1.0526}], 7)
    assert one == ("; first look at this folder, p-values x1.05 (alpha is spent over looks); a second look (more "
                   "seeds into this folder) would test at p x32.9")
    looks = [{"seeds": list(range(7))}, {"seeds": list(range(14))}]
    two = _looks_clause(_result(2, looks), [{"look_factor": 32.899}], 14)
    assert two.startswith("; second look at 14 seeds (this folder was read before at 7 seeds), adjusted: p-values "
                          "x32.9; a third look") and two.endswith("would test at p x132")
    # a results.json written when the p-values were multiplied by the look's number records no factor: it says x2
    assert "adjusted: p-values x2;" in _looks_clause(_result(2, looks), [{}], 14)


def zero_p_values(obj, where: str = "") -> list[str]:
    """Where ``obj`` (a JSON-like tree) holds a p-value of exactly 0: keys ``p``, ``p_*``, ``*_p``, ``*_p_*``."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            named = isinstance(k, str) and (k == "p" or k.startswith("p_") or k.endswith("_p") or "_p_" in k)
            if named and isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
                found.append(f"{where}.{k}")
            found += zero_p_values(v, f"{where}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += zero_p_values(v, f"{where}[{i}]")
    return found


def test_no_p_value_is_zero_at_the_edges():
    # a t statistic of about 1e15 (the tail about 1e-60: 1 - CDF cancelled to 0), an infinite one, a constant
    # difference (no t test), identical seeds (no difference at all), a bounded metric at its extremes
    assert 0 < t_two_sided_p(1e15, 4) < 1e-50 and t_two_sided_p(math.inf, 4) == P_FLOOR
    assert t_two_sided_p(1e200, 2) == P_FLOOR and t_two_sided_p(0.0, 3) == 1.0
    rng = np.random.default_rng(0)
    cases = {
        "huge t": (1.0 + 1e-15 * rng.normal(size=5), np.zeros(5), None),
        "huge t, 20 seeds": (1.0 + 1e-15 * rng.normal(size=20), np.zeros(20), None),
        "constant difference": (np.full(8, 0.25), np.zeros(8), None),
        "identical seeds": (np.full(6, 0.7), np.full(6, 0.7), (0.0, 1.0)),
        "bounded extremes": (np.ones(12), np.zeros(12), (0.0, 1.0)),
    }
    for name, (a, b, bounds) in cases.items():
        est = paired_estimate(a, b, bounds=bounds).to_dict()
        assert not zero_p_values(est), (name, est)
        assert est["p_value"] >= 2.0 / 2 ** est["n"] or est["n"] > 16, (name, est)  # the sign-flip test's floor
    assert paired_estimate(np.full(6, 0.7), np.full(6, 0.7)).p_value == 1.0  # identical seeds: the null, p = 1
    assert paired_estimate(1.0 + 1e-15 * rng.normal(size=5), np.zeros(5)).p_t > 0
    # the floor fit: two identical seeds have no spread to test their curvature against (no p, no interval)
    params = np.array([1e5, 3e5, 1e6, 3e6, 1e7])
    loss = 3.0 + 20.0 * params ** -0.3
    same = _curvature(params, np.stack([loss, loss]), 0.95)
    assert same["p"] is None and same["low"] is None and "no spread" in same["note"], same
    steep = _curvature(params, np.stack([loss, loss * (1 + 1e-13 * params / 1e7)]), 0.95)
    assert steep["p"] is None or steep["p"] > 0
    assert _f_sf(math.inf, 3, 9) == P_FLOOR and 0 < _f_sf(1e300, 3, 9) and _f_sf(0.0, 3, 9) == 1.0
    assert not zero_p_values(floor_lack_of_fit(1e300, _f_sf(1e300, 3, 9), (3, 9), 1e150, 4))


def test_seeds_that_all_differ_alike_get_their_test_and_no_interval_of_width_zero():
    from difftx.compare.summary import short_verdict
    from difftx.tasks.reporting import call, pair

    est = paired_estimate(np.full(7, -250.0), np.zeros(7))
    assert est.low is None and est.high is None and NO_SPREAD in est.note and est.p_value == 2 / 2 ** 7
    text = verdict(est, "steps", lower_is_better=True, adjusted_p=look_adjusted(3 * est.p_value, 1), family_size=3,
                   look=1)
    assert "no spread, so no interval" in text and "DIFF lower in 7 of 7 seeds" in text and "[" not in text, text
    same = paired_estimate(np.full(7, 0.5), np.full(7, 0.5))  # identical seeds: the null itself, p = 1
    assert same.low is None and same.p_value == 1.0 and "no detectable difference" in verdict(
        same, "NLL", lower_is_better=True)
    c = {"arms": ["diff", "baseline"], "paired": est.to_dict(), "p_adjusted": 0.049, "better": "diff", "gated": None}
    assert pair(c) == "-250.000 (no spread: no interval), p_adj 0.049"
    assert call(c) == "not interchangeable: DIFF lower in 7 of 7 seeds" == short_verdict(c)
    c = {**c, "paired": same.to_dict(), "p_adjusted": 1.0, "better": None}
    assert call(c) == "no detectable difference" and short_verdict(c) == "no interval: no spread"
    # a bounded metric keeps the betting interval of its mean, which has width
    bounded = paired_estimate(np.ones(7), np.zeros(7), bounds=(0.0, 1.0))
    assert bounded.low is not None and bounded.high - bounded.low > 0.1


def test_compare_says_before_training_when_its_seeds_cannot_give_a_verdict(tmp_path):
    """Every pair of the arms compared on a primary metric, Holm over the family, at the look this reading is: 4 arms
    (5 comparisons) need 8 seeds at the first look; seeds added to a folder already read need 13 (look 2)."""
    import json

    from difftx.compare.results import seeds_note

    four = ["baseline", "diff", "diff_lambda_0.8", "diff_out_0.2"]
    assert seeds_note(tmp_path, range(7), four) == ("7 seeds cannot give a verdict when all 5 comparisons of the 4 "
                                                    "arms are made: 8 seeds needed (seeds added after the folder is "
                                                    "first read are a later look, which needs more)")
    assert seeds_note(tmp_path, [0], four[:2]).startswith("1 seed cannot give a verdict when the 1 comparison of the "
                                                          "2 arms is made: 6 seeds needed")
    assert seeds_note(tmp_path, range(8), four) == ""
    assert seeds_note(tmp_path, range(7), four[:3]) == ""  # 3 arms, 3 comparisons: 7 seeds do
    (tmp_path / "results.json").write_text(json.dumps({"looks": [{"seeds": list(range(7)), "date": "d",
                                                                  "commit": "c"}]}))
    assert seeds_note(tmp_path, range(7), four[:3]) == ""  # the same seeds again: the same look
    assert seeds_note(tmp_path, range(8), four) == ("8 seeds cannot give a verdict when all 5 comparisons of the 4 "
                                                    "arms are made: 13 seeds needed at look 2 of this folder (its "
                                                    "p-values x32.9)")


def test_a_task_section_says_too_few_seeds_where_its_family_needs_more():
    """At 6 seeds in a family of 19 (10 needed) every exploratory row of the task sections said "no detectable
    difference" while results.json's sentence said a verdict needs 10 seeds; the summary's words said so already."""
    from difftx.compare.summary import short_verdict
    from difftx.tasks.reporting import call

    est = paired_estimate(np.array([0.1, -0.2, 0.3, 0.05, -0.1, 0.2]), np.zeros(6))
    assert est.low is not None
    c = {"arms": ["diff", "baseline"], "paired": est.to_dict(), "p_adjusted": 0.625, "better": None, "gated": None,
         "seeds_for_verdict": 10}
    assert call(c) == "too few seeds for a verdict (6 of 10)" and short_verdict(c) == "too few seeds: 6 of 10"
    assert call({**c, "seeds_for_verdict": 6}) == "no detectable difference"
