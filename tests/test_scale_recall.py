"""``difftx scale`` on recall without LM batches (``recall-scale-cpu``): the sizes are a map of depth and width
(any order, no loss fit), and scale.json / scale.md give per size and arm the frontier, the learned step and the
attention on the binding against the baseline, read out of each size's compare."""

from __future__ import annotations

import json

import pytest

from difftx.cli import main
from difftx.studies.scale import SCALE_PRESETS, plan_sizes, recall_without_lm
from difftx.compare.arms import Arm
from difftx.compare.schema import CompareResult, Comparison, RunRecord
from difftx.studies.scale_recall import READINGS, recall_by_size, recall_summary, render_recall_scale
from test_compare_recall import RECALL, _sets
from test_scale import no_size_plots  # noqa: F401  (a fixture: each size's compare without its PNGs)


def test_recall_scale_end_to_end(tmp_path, capsys, no_size_plots):
    """2 tiny sizes (the wider one first: a recall scale takes sizes in any order), 2 seeds, 3 arms."""
    out = tmp_path / "scale"
    cmd = ["scale", "--preset", "smoke", "--sizes", "64x1x2,32x2x1", "--seeds", "2", "--out", str(out),
           "--workers", "1", "--no-progress", *_sets(RECALL)]
    assert main(cmd) == 0
    printed = capsys.readouterr().out
    assert "diff at 64x1x2: frontier" in printed and "diff_lambda_0.8 at 32x2x1: frontier" in printed
    s = json.loads((out / "scale.json").read_text())
    assert s["schema_version"] == 3 and s["kind"] == "recall" and "efficiency" not in s
    assert [z["name"] for z in s["sizes"]] == ["64x1x2", "32x2x1"] and [z["head_width"] for z in s["sizes"]] == [16, 16]
    assert s["arms"] == ["baseline", "diff", "diff_lambda_0.8"]
    for name in ("64x1x2", "32x2x1"):
        res = json.loads((out / f"size={name}" / "results.json").read_text())
        got = s["recall"]["sizes"][name]
        for arm in ("diff", "diff_lambda_0.8"):
            comps = res["comparisons"][f"{arm} vs baseline"]["metrics"]
            f = got["vs_baseline"][arm]["frontier"]
            c = comps["recall_frontier"]
            assert f["paired"]["mean"] == c["paired"]["mean"] and f["verdict"] == c["verdict"]  # the compare's own
            assert f["paired"]["n"] == 2 and len(f["values"]) == 2
            assert got["arms"][arm]["frontier"]["values"] == c["values"][arm]
            assert got["arms"]["baseline"]["frontier"]["values"] == c["values"]["baseline"]
            learned = comps.get("recall_learned_step")
            assert (got["vs_baseline"][arm]["learned_step"] is None) == (learned is None)
            assert got["vs_baseline"][arm]["attention_on_binding"]["key"] == "recall_attention_on_binding"
        assert all(len(v) == 2 for v in got["learned"].values())
    md = (out / "scale.md").read_text()
    first = [x for x in md.splitlines()[1:] if x.strip()][0]
    assert first.startswith("**Recall frontier against the baseline, by size:** diff's frontier is ")
    assert "## 64x1x2 (dim 64, 1 layer, 2 DIFF heads of width 16)" in md
    assert "| reading | arm | mean [95%] | arm - baseline [95%] | Holm p | verdict |" in md
    assert md.count("| frontier | diff_lambda_0.8 |") == 2 and "learned: " in md
    assert "not a parameter-efficiency fit" in md and "## Regime" in md
    assert s["plot"] == "scale.png" and (out / "scale.png").stat().st_size > 0


def _comparison(a: str, key: str, va: list, vb: list, mean, low, high, *, better=None, gated=None, p_adj=None,
                digits=3) -> dict:
    return {"arms": [a, "baseline"], "key": key, "label": key, "unit": "steps" if digits == 0 else None,
            "digits": digits, "lower_is_better": digits == 0, "values": {a: va, "baseline": vb},
            "means": {a: sum(va) / len(va), "baseline": sum(vb) / len(vb)},
            "cis": {a: [min(va), max(va)], "baseline": [min(vb), max(vb)]},
            "bounds": [0.0, 1.0] if digits else None,
            "paired": {"mean": mean, "low": low, "high": high, "p_value": 0.01, "n": len(va), "n_examples": 1,
                       "method": "t", "note": None, "interval_of": "mean" if digits else "median",
                       "lower": sum(x < y for x, y in zip(va, vb)), "higher": sum(x > y for x, y in zip(va, vb))},
            "gated": gated, "p_adjusted": p_adj, "better": better, "verdict": f"{key}: the whole sentence",
            "seeds_for_verdict": 2, "family": "primary", "mean_established": (better == "baseline") if digits else None}


def _results(frontier: dict, learned: dict) -> CompareResult:
    """A size's results as far as scale reads them: the comparisons and each model's recall learning."""
    arms = ("baseline", "diff", "diff_lambda_0.8")
    runs = {(s, a): RunRecord({}, {"recall": {"learning": {"learned_step": 300 if s < learned[a] else None}}})
            for a in arms for s in range(2)}
    comps = {}
    for arm, (va, vb, mean, low, high, better, gated) in frontier.items():
        comps[arm] = {
            "recall_frontier": _comparison(arm, "recall_frontier", va, vb, mean, low, high, better=better, gated=gated,
                                           p_adj=None if gated else 0.02),
            "recall_learned_step": _comparison(arm, "recall_learned_step", [300.0, 500.0], [400.0, 500.0], -50.0,
                                               None, None, digits=0)}
    pairs = [Comparison(("diff", "baseline"), comps["diff"], True),
             Comparison(("diff_lambda_0.8", "baseline"), comps["diff_lambda_0.8"]),
             Comparison(("diff", "diff_lambda_0.8"), {})]
    return CompareResult({}, [0, 1], {a: Arm(a, {}, 0, a) for a in arms}, {}, runs, {c.key: c for c in pairs})


def test_the_recall_summary_reads_each_sizes_comparisons():
    plans = plan_sizes("smoke", ["32x2x1", "32x1x1", "64x1x2"], **{k: v for k, v in RECALL.items()})
    assert recall_without_lm(plans[0].preset) and [p.params["baseline"] for p in plans][1] < plans[0].params["baseline"]
    from difftx.studies.scale import size_entries

    results = {
        "32x2x1": _results({"diff": ([0.2, 0.3], [0.5, 0.6], -0.3, -0.4, -0.2, "baseline", None),
                            "diff_lambda_0.8": ([0.7, 0.8], [0.5, 0.6], 0.2, 0.1, 0.3, "diff_lambda_0.8", None)},
                           {"baseline": 2, "diff": 0, "diff_lambda_0.8": 1}),
        "32x1x1": _results({"diff": ([0.6, 0.7], [0.5, 0.6], 0.1, -0.1, 0.3, None, None),
                            "diff_lambda_0.8": ([0.1, 0.1], [0.1, 0.1], 0.0, None, None, None,
                                                "not learned by either model at this budget")},
                           {"baseline": 2, "diff": 2, "diff_lambda_0.8": 2}),
        "64x1x2": _results({"diff": ([0.4, 0.5], [0.5, 0.6], -0.1, -0.2, 0.0, None, None),
                            "diff_lambda_0.8": ([0.6, 0.7], [0.5, 0.6], 0.1, 0.0, 0.2, None, None)},
                           {"baseline": 1, "diff": 1, "diff_lambda_0.8": 1}),
    }
    s = recall_summary(size_entries(plans), results, [0, 1])
    assert s["kind"] == "recall" and s["arms"] == ["baseline", "diff", "diff_lambda_0.8"]
    assert [z["head_width"] for z in s["sizes"]] == [16, 16, 16]
    got = s["recall"]["sizes"]["32x2x1"]
    f = got["vs_baseline"]["diff"]["frontier"]
    assert f["paired"]["mean"] == -0.3 and f["p_adjusted"] == 0.02
    assert f["short_verdict"] == "DIFF worse on average (lower in 2 of 2 seeds)"
    assert f["values"] == pytest.approx([-0.3, -0.3]) and f["verdict"] == "recall_frontier: the whole sentence"
    assert got["arms"]["baseline"]["frontier"] == {"mean": 0.55, "low": 0.5, "high": 0.6, "values": [0.5, 0.6]}
    assert got["arms"]["diff"]["learned_step"]["mean"] == 400.0
    assert got["vs_baseline"]["diff"]["attention_on_binding"] is None  # no comparison of it: not measured
    assert got["learned"] == {"baseline": [True, True], "diff": [False, False], "diff_lambda_0.8": [True, False]}
    assert s["recall"]["sizes"]["32x1x1"]["vs_baseline"]["diff_lambda_0.8"]["frontier"]["short_verdict"] \
        .startswith("not compared: not learned")
    assert [r for r, _, _ in READINGS] == list(s["recall"]["readings"])
    assert recall_by_size(["64x1x2"], results)["64x1x2"] == s["recall"]["sizes"]["64x1x2"]
    md = render_recall_scale(s)
    opening = md.splitlines()[2]
    assert opening.startswith("**Recall frontier against the baseline, by size:** diff's frontier is above the "
                              "baseline's at 32x1x1 (+0.100 [-0.100, +0.300]: no detectable difference); below it at "
                              "32x2x1 (-0.300 [-0.400, -0.200]: DIFF worse on average (lower in 2 of 2 seeds)) and "
                              "64x1x2")
    assert ("diff_lambda_0.8's frontier is above the baseline's at 32x2x1 (+0.200 [+0.100, +0.300]: "
            "not interchangeable: diff_lambda_0.8 higher in 2 of 2 seeds) and 64x1x2") in opening
    assert "not compared at 32x1x1 (not learned by either model at this budget)" in opening
    assert ("| frontier | diff | 0.250 [0.200, 0.300] | -0.300 [-0.400, -0.200] | 0.02 | DIFF worse on average (lower "
            "in 2 of 2 seeds) |") in md
    assert "| learned at (steps) | diff | 400 [300, 500] (learned: 0 of 2 seeds) | -50.0 steps | - |" in md
    assert "| attention on the binding | diff | - | - | - | not measured |" in md
    assert "| 32x2x1 | diff | 2 |" in md and "| 0 |" not in md  # the regime: no LM tokens per parameter


def test_the_recall_scale_preset_is_a_depth_and_width_map():
    """recall-scale-cpu: recall-cpu at width 64 (2, 4, 8 layers) and 128 (2 layers, 4 heads), heads of one width,
    7 seeds, 3 arms; its widest size has fewer parameters than its deepest, which a recall scale allows."""
    sc = SCALE_PRESETS["recall-scale-cpu"]
    assert sc.compare == "recall-cpu" and sc.seeds == 7 and sc.sizes == ("64x2x2", "64x4x2", "64x8x2", "128x2x4")
    plans = plan_sizes(sc.compare, list(sc.sizes), **sc.overrides)
    assert {p.regime["diff"]["head_width"] for p in plans} == {16}
    assert all(set(p.params) == {"baseline", "diff", "diff_lambda_0.8"} for p in plans)
    assert plans[3].params["baseline"] < plans[2].params["baseline"]
    with pytest.raises(ValueError, match="--tokens-per-param: counts LM tokens"):
        plan_sizes(sc.compare, list(sc.sizes), tokens_per_param=10.0)
    with pytest.raises(ValueError, match="from small to large"):  # with LM batches, the order rule stays
        plan_sizes("recall-cpu", ["64x8x2", "128x2x4"], lm_every=2)


def test_a_recall_scale_refuses_tune_before_training(tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["scale", "--preset", "recall-scale-cpu", "--out", str(out), "--tune", "lr=0.001,0.003"]) == 2
    err = capsys.readouterr().err
    assert "--tune: a recall scale" in err and len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
    assert not out.exists()
