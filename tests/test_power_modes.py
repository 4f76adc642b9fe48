"""Power plans with modes wherever the seeds split (issue 59 item 4): an unbounded metric (an NLL where
one arm learns a task in some seeds) is planned with the far side's share at its upper 90% bound, as a
bounded one is, where :func:`seeds_split` finds its seeds in two modes; a normal pilot is planned as before.
benchmarks/power_delivered.py measures the true power at the answers over many pilots."""

from __future__ import annotations

import numpy as np
import pytest

from difftx.eval.stats import power_plan, rule_power, seeds_split, share_upper_bound


def _lottery(rng, n, share=0.7, noise=0.1):
    return np.where(rng.random(n) < share, 1.0, -0.8) + rng.normal(0.0, noise, n)


def test_seeds_split_finds_modes_and_not_normal_spread():
    one_loser = [1.1, 0.9, 1.0, 1.2, -0.8, 0.95, 1.05, 0.9]
    assert seeds_split(one_loser) and seeds_split([-x for x in one_loser])  # either direction
    assert seeds_split([1.1, 0.9, 1.0, 1.2, 0.95])  # tight, far from 0: its mirror image would be a mode
    assert not seeds_split([2.5, 0.3, 1.9, 3.1, 1.2])  # normal spread reaching towards 0
    assert not seeds_split([0.12, 0.03, 0.09, 0.15, -0.02, 0.08, 0.11, 0.06])  # a far seed next to the rest
    assert not seeds_split([0.1, -0.1]) and not seeds_split([0.3])
    with pytest.raises(ValueError, match="gap"):
        seeds_split(one_loser, gap=0.0)


def test_unbounded_lottery_is_planned_with_modes():
    rng = np.random.default_rng(3)
    truth = _lottery(rng, 100_000)  # 70% of seeds +1, 30% -0.8: about 30 seeds for 80% power
    # a 5-seed pilot that drew no losing seed: without modes about 6 seeds, at a true power far below 0.8
    lucky = 1.0 + rng.normal(0.0, 0.1, 5)
    old = power_plan(lucky, modes=False)
    assert old.seeds <= 7 and rule_power(truth, old.seeds, reps=1000, seed=1) < 0.4
    plan = power_plan(lucky)  # an unbounded metric, no bounds given: modes, because the seeds split
    assert plan.seeds is None and plan.far_seen == 0 and plan.far_share == pytest.approx(share_upper_bound(0, 5, 0.9))
    assert "37% of seeds on the far side" in plan.describe()
    # an 8-seed pilot with exactly one losing seed: the plan's answer delivers its power, or there is none
    pilot = np.array([1.05, 0.92, 1.1, 0.95, 1.0, 1.12, 0.88, -0.8])
    plan = power_plan(pilot)
    assert plan.far_seen == 1 and plan.far_share == pytest.approx(share_upper_bound(1, 8, 0.9)) and plan.far_mirror
    assert "1 of 8 lay there, and the mirror image of the near side counted as one more" in plan.describe()
    assert plan.seeds is None or rule_power(truth, plan.seeds, reps=1000, seed=1) >= 0.7
    old = power_plan(pilot, modes=False).seeds
    assert old is not None and rule_power(truth, old, reps=1000, seed=1) < 0.7  # what modes prevent


def test_normal_pilot_is_planned_without_modes():
    pilot = [2.5, 0.3, 1.9, 3.1, 1.2, 0.7, 2.2, 1.6]  # 8 seeds of an effect near 1.5 SD, spread reaching 0
    plan = power_plan(pilot)
    assert plan.far_share is None and plan.mode_confidence is None and "far side" not in plan.describe()
    assert plan.seeds == power_plan(pilot, modes=False).seeds
    assert power_plan(pilot, bounds=(-4.0, 4.0)).far_share is not None  # a bounded metric keeps its modes
