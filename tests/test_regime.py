"""Issue 30, items 2 and 4: where a DIFF config sits against the paper's recipe (both reports), the
held-out gap in nats along training with its paired interval, and the ratio's sensitivity."""

from __future__ import annotations

import math

import pytest

from difftx.compare.regime import PAPER_LAMBDA_MEAN, regime, regime_lines
from difftx.compare.scale import sensitivity
from difftx.compare.summary import gap_along_training
from difftx.config import ModelConfig


def _schedule(layers: int) -> list[float]:  # the paper's formula, l counted from 1
    return [0.8 - 0.6 * math.exp(-0.3 * (l - 1)) for l in range(1, layers + 1)]


def test_regime_lines_of_a_2_layer_config():
    cfg = ModelConfig(vocab_size=257, dim=48, n_layers=2, n_heads=2, max_seq_len=128)
    r = regime(cfg, 4_096_000, 55_680)
    assert r["lambda_init"] == pytest.approx(_schedule(2))
    assert r["lambda_init"] == pytest.approx([0.20, 0.3555], abs=1e-4)
    assert r["lambda_init_mean"] == pytest.approx(0.2778, abs=1e-4)
    assert (r["diff_heads"], r["head_width"], r["context"]) == (2, 12, 128)
    assert r["tokens_per_param"] == pytest.approx(4_096_000 / 55_680)
    assert (r["ffn_hidden"], r["ffn_ratio"]) == (128, pytest.approx(8 / 3))
    assert regime(cfg.replace(dim=32, n_heads=1), None, 1)["ffn_ratio"] == 4.0  # width 32: 85 rounded up to 128
    line, = regime_lines({"diff": r})
    assert ("2 layer(s), lambda_init 0.20, 0.36 (depth schedule; mean 0.28 against 0.70 over 24 layers)" in line
            and "2 DIFF head(s) of width 12; context 128; feed-forward width 128 (2.67 x dim" in line
            and "73.6 per non-embedding parameter" in line)


def test_regime_lines_of_a_24_layer_config_and_a_constant_lambda():
    cfg = ModelConfig(vocab_size=50304, dim=3072, n_layers=24, n_heads=12, max_seq_len=4096)
    r = regime(cfg, None, 2_700_000_000)
    assert r["lambda_init"] == pytest.approx(_schedule(24))
    assert r["lambda_init_mean"] == pytest.approx(PAPER_LAMBDA_MEAN)
    assert PAPER_LAMBDA_MEAN == pytest.approx(0.7036, abs=1e-4)
    assert (r["diff_heads"], r["head_width"], r["context"], r["tokens_per_param"]) == (12, 128, 4096, None)
    line, = regime_lines({"diff": r})
    assert "mean 0.70 against 0.70 over 24 layers" in line and ", ..." in line
    assert "12 DIFF head(s) of width 128" in line
    assert "training tokens not recorded" in line
    const = regime(cfg.replace(n_layers=2, lambda_init=0.8), 10, 5)
    assert const["lambda_init"] == [0.8, 0.8] and const["lambda_schedule"] == "constant 0.8"


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


def test_sensitivity_on_the_floor_fit_and_the_straight_line():
    """0.01 nats moves the ratio by exp(0.01 / |dL/dlog N|) at the matching baseline size."""
    floor = {"method": "floor", "params": [1e4, 1e5], "matched_params": [None, 5e4],
             "fit": {"floor": 1.5, "reference": [2.0, 0.5]}}
    x = sensitivity(floor, 1, 1.8)
    slope = -0.5 * 2.0 * 5e4 ** -0.5  # -b (L_B(N_B) - E)
    assert x["at_params"] == 5e4 and x["dloss_dlog_params"] == pytest.approx(slope)
    assert x["factor_per_0.01_nats"] == pytest.approx(math.exp(0.01 / abs(slope)))
    assert sensitivity(floor, 0, 1.8)["at_params"] == 1e4  # no matching size: the arm's own
    line = {"method": "loglog", "params": [1e4, 1e5], "matched_params": [2e4, 2e5],
            "loglog": {"fits": {"reference": [[1.0, -0.04], [1.1, -0.04]]}}}
    y = sensitivity(line, 0, 1.7)  # the example: b = 0.04 at L = 1.7, 0.01 nats ~ x1.16
    assert y["dloss_dlog_params"] == pytest.approx(-0.068)
    assert y["factor_per_0.01_nats"] == pytest.approx(1.158, abs=1e-3)
