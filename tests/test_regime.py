"""difftx.compare.regime: where a DIFF config sits against the paper's recipe (the lines both
reports print)."""

from __future__ import annotations

import math

import pytest

from difftx.compare.regime import PAPER_LAMBDA_MEAN, regime, regime_lines
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
