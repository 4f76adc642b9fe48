"""difftx.compare.summary: the held-out gap in nats along training, paired by seed, with its
interval."""

from __future__ import annotations

import pytest

from difftx.compare.summary import gap_along_training


def test_gap_along_training_pairs_seeds_at_common_tokens():
    arm = [([10, 20, 40], [3.0, 2.5, 2.1]), ([10, 20, 40], [3.1, 2.4, 2.2])]
    base = [([10, 20, 40, 80], [2.9, 2.3, 2.0, 1.9]), ([10, 20, 40, 80], [3.0, 2.3, 2.1, 1.8])]
    g = gap_along_training(arm, base)
    assert [p["tokens"] for p in g] == [10, 20, 40]
    assert g[1]["values"] == pytest.approx([0.2, 0.1]) and g[1]["mean"] == pytest.approx(0.15)
    assert g[0]["n"] == 2 and g[0]["low"] is None and "sign-flip" in g[0]["note"]  # 2 seeds: no interval
    many = gap_along_training([([10, 20], [2.0 + 0.01 * s, 1.5]) for s in range(8)],
                              [([10, 20], [1.9, 1.5 - 0.001 * s]) for s in range(8)])
    assert many[0]["low"] < many[0]["mean"] < many[0]["high"] and many[0]["low"] > 0
