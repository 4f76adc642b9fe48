"""Every plot renders a non-trivial PNG (difftx.eval.plots)."""

import math

import pytest

pytest.importorskip("matplotlib")

from difftx.eval import plots  # noqa: E402


def _check_png(path):
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100 and float(img[..., :3].std()) > 0.02  # not blank


def test_all_plots_render(tmp_path):
    acc = {"DIFF": {"1/1": 1.0, "2/2": 0.9, "4/2": 0.8, "6/2": 0.7},
           "baseline": {"1/1": 1.0, "2/2": 0.7, "4/2": 0.5, "6/2": 0.4}}
    roles = ["bos"] + ["filler"] * 20 + ["needle"] * 2 + ["answer"] * 3 + ["needle"] + ["filler"] * 10 + ["query"] * 3
    n = len(roles)
    diff_row = [0.02] * n
    diff_row[21:26] = [0.0, 0.0, 0.3, 0.3, 0.2]
    diff_row[5] = -0.05
    base_row = [1.0 / n] * n
    outl = {"DIFF": {"attention_logits": {"top1": 38.8, "top2": 38.1, "top3": 37.9, "top10": 36.8, "top100": 34.5,
                                          "median": 1.3},
                     "hidden_states": {"top1": 1688.2, "top2": 1672.5, "top3": 1663.9, "top10": 1640.8,
                                       "top100": 1532.8, "median": 0.4}},
            "baseline": {"attention_logits": {"top1": 318.0, "top2": 308.2, "top3": 304.9, "top10": 284.7,
                                              "top100": 251.5, "median": 5.4},
                         "hidden_states": {"top1": 3608.6, "top2": 3586.2, "top3": 3562.1, "top10": 3541.2,
                                           "top100": 3478.5, "median": 0.6}}}
    quant = {"DIFF": {"full": 3.1, "row": {"16": 3.1, "8": 3.1, "6": 3.12, "4": 3.3, "3": 3.6},
                      "tensor": {"16": 3.1, "8": 3.11, "6": 3.2, "4": 3.6, "3": 4.2}},
             "baseline": {"full": 3.12, "row": {"16": 3.12, "8": 3.13, "6": 3.2, "4": 3.7, "3": 4.4},
                          "tensor": {"16": 3.12, "8": 3.15, "6": 3.4, "4": 4.3, "3": 5.0}}}
    steps = list(range(0, 500, 10))
    files = [
        plots.plot_needle_accuracy(acc, tmp_path / "needle.png"),
        plots.plot_needle_heatmap([0, 0.25, 0.5, 0.75, 1.0], [64, 128, 256],
                                  [[1.0, 0.9, 0.8], [0.9, 0.8, 0.6], [0.8, 0.6, float("nan")], [0.9, 0.7, 0.5],
                                   [1.0, 1.0, 0.9]], tmp_path / "heatmap.png"),
        plots.plot_attention_to_answer({"DIFF": diff_row, "baseline": base_row}, roles, tmp_path / "attn.png"),
        plots.plot_outliers(outl, tmp_path / "outliers.png"),
        plots.plot_quantization(quant, tmp_path / "quant.png"),
        plots.plot_loss_curves({"DIFF seed 0": (steps, [5 * 0.99 ** s + 1 for s in steps]),
                                "baseline seed 0": (steps, [5 * 0.99 ** s + 1.05 for s in steps])},
                               tmp_path / "loss.png"),
        plots.plot_nll_by_position({"DIFF": [3 - 0.3 * math.log1p(t) + 0.002 * max(0, t - 64) for t in range(256)],
                                    "baseline": [3 - 0.28 * math.log1p(t) + 0.004 * max(0, t - 64)
                                                 for t in range(256)]},
                                   tmp_path / "nll_pos.png", train_len=64),
        plots.plot_lambda_per_layer({"step 100": [0.25, 0.4, 0.5], "step 500": [0.3, 0.5, 0.7]},
                                    tmp_path / "lambda.png", lambda_init=[0.2, 0.356, 0.471]),
    ]
    for f in files:
        _check_png(f)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in files)  # no temp files left


def test_a_panel_with_nothing_drawn_warns_of_nothing(tmp_path):
    """The baseline's panel of a per-layer λ plot has no curve: no empty legend (matplotlib's warning reached the
    compare's output as 'difftx compare: warning: No artists with labels found')."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = plots.plot_seed_panels({"baseline": {}, "DIFF": {"layer 0": [([0, 100, 200], [0.2, 0.3, 0.35])]}},
                                     tmp_path / "panels.png", ylabel="λ", title="λ per layer")
    _check_png(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plots.plot_seed_curves({"DIFF": []}, tmp_path / "curves.png", ylabel="loss", title="nothing measured")
