"""The studies above compare (scale, its recall map, sweep) with a primary pair other than DIFF vs the baseline:
each reads the pair from the comparison (``ComparePreset.primary``, ``CompareResult.primary``), measures every
other arm against its second arm and names the pair in what it writes."""

from __future__ import annotations

import json
import math

from difftx.cli import main
from difftx.compare.arms import Arm
from difftx.compare.schema import CompareResult, Comparison, RunRecord
from difftx.studies.scale import against_reference, plan_sizes, primary_pair
from difftx.studies.scale_recall import recall_by_size, render_recall_scale, recall_summary
from test_compare import as_sets
from test_scale import LM, no_size_plots  # noqa: F401  (a fixture: each size's compare without its PNGs)
from test_scale_recall import _comparison

ARMS = ("baseline", "diff", "diff_lambda_0.8")


def test_the_arms_measured_against_the_reference_put_the_primary_first():
    assert against_reference(ARMS, ("diff", "baseline")) == ["diff", "diff_lambda_0.8"]
    assert against_reference(ARMS, ("diff_lambda_0.8", "baseline")) == ["diff_lambda_0.8", "diff"]
    assert against_reference(ARMS, ("diff_lambda_0.8", "diff")) == ["diff_lambda_0.8", "baseline"]
    s = {"arms": list(ARMS), "gap": dict.fromkeys(["diff_lambda_0.8", "baseline"])}
    assert primary_pair(s) == ("diff_lambda_0.8", "diff")


def test_plan_sizes_budgets_and_orders_by_the_primary_pairs_second_arm():
    """``--tokens-per-param`` counts the reference's parameters and the sizes must grow in them; the head width
    is the primary's first arm's."""
    plans = plan_sizes("smoke", ["16x1x1", "32x1x1"], tokens_per_param=50, arms=ARMS,
                       primary=("diff_lambda_0.8", "baseline"))
    assert all(sp.preset.primary == ("diff_lambda_0.8", "baseline") for sp in plans)
    for sp in plans:
        per_step = sp.preset.batch_size * sp.preset.lm_seq_len
        assert sp.preset.steps == max(1, math.ceil(50 * sp.params["baseline"] / per_step))
        assert sp.regime["diff_lambda_0.8"]["lambda_init"] == [0.8]
    other = plan_sizes("smoke", ["16x1x1", "32x1x1"], tokens_per_param=50, arms=ARMS,
                       primary=("diff_lambda_0.8", "diff"))
    for sp in other:
        assert sp.preset.steps == max(1, math.ceil(50 * sp.params["diff"] / sp.preset.batch_size
                                                   / sp.preset.lm_seq_len))


def test_scale_with_another_primary_pair_runs_end_to_end_and_names_it(tmp_path, capsys, no_size_plots):
    out = tmp_path / "scale"
    cmd = ["scale", "--preset", "smoke", "--sizes", "16x1x1,32x1x1", "--seeds", "2", "--out", str(out),
           "--workers", "1", "--no-progress", "--set", 'primary=["diff_lambda_0.8","baseline"]', *as_sets(LM)]
    assert main(cmd) == 0
    printed = capsys.readouterr().out
    assert "diff_lambda_0.8 at 32x1x1: gap" in printed and "N_diff_lambda_0.8 / N_baseline" in printed
    s = json.loads((out / "scale.json").read_text())
    assert s["arms"] == list(ARMS) and list(s["gap"]) == ["diff_lambda_0.8", "diff"]
    assert list(s["efficiency"]) == ["diff_lambda_0.8", "diff"] and primary_pair(s) == ("diff_lambda_0.8", "baseline")
    res = json.loads((out / "size=32x1x1" / "results.json").read_text())
    assert res["preset"]["primary"] == ["diff_lambda_0.8", "baseline"]
    assert s["gap"]["diff_lambda_0.8"][1]["mean"] == \
        res["comparisons"]["diff_lambda_0.8 vs baseline"]["metrics"]["lm_nll"]["paired"]["mean"]
    md = (out / "scale.md").read_text()
    assert md.startswith("# diff_lambda_0.8 vs baseline across model sizes")
    head = [x for x in md[:md.index("## Answer by size")].splitlines()[1:] if x.strip()]
    assert head[0].startswith("**diff_lambda_0.8 vs baseline at the largest size, 32x1x1")
    assert "## diff_lambda_0.8 vs baseline" in md and "## diff vs baseline" in md


def _results(primary: tuple) -> CompareResult:
    """One size's recall results whose primary pair is ``primary``: each other arm compared with its second."""
    runs = {(s, a): RunRecord({}, {"recall": {"learning": {"learned_step": 300}}}) for a in ARMS for s in range(2)}
    first, ref = primary
    pairs = []
    for arm, va in ((first, [0.7, 0.8]), *((a, [0.2, 0.3]) for a in ARMS if a not in primary)):
        c = json.dumps(_comparison("@arm", "recall_frontier", va, [0.5, 0.6], sum(va) / 2 - 0.55, None, None))
        c = json.loads(c.replace('"baseline"', json.dumps(ref)).replace('"@arm"', json.dumps(arm)))  # arm vs ref
        pairs.append(Comparison((arm, ref), {"recall_frontier": c}, arm == first))
    return CompareResult({}, [0, 1], {a: Arm(a, {}, 0, a) for a in ARMS}, {}, runs, {c.key: c for c in pairs})


def test_the_recall_map_measures_against_the_primary_pairs_second_arm():
    plans = plan_sizes("smoke", ["32x1x1", "64x1x2"], arms=ARMS, primary=("diff_lambda_0.8", "diff"))
    from difftx.studies.scale import size_entries

    results = {sp.name: _results(("diff_lambda_0.8", "diff")) for sp in plans}
    got = recall_by_size(["32x1x1"], results)["32x1x1"]
    assert list(got["vs_baseline"]) == ["diff_lambda_0.8", "baseline"]
    assert got["arms"]["diff"]["frontier"]["values"] == [0.5, 0.6]
    s = recall_summary(size_entries(plans), results, [0, 1])
    assert primary_pair(s) == ("diff_lambda_0.8", "diff")
    md = render_recall_scale(s)
    assert md.startswith("# diff_lambda_0.8 vs diff on associative recall")
    assert "**Recall frontier against the diff, by size:** diff_lambda_0.8's frontier is above the diff's at" in md
    assert "| reading | arm | mean [95%] | arm - diff [95%] | Holm p | verdict |" in md


def test_a_sweep_with_another_primary_pair_names_it(tmp_path, no_size_plots):
    """The sweep's table, each arm's best value and the paired difference are the primary pair's (here one without
    the baseline: DIFF with lambda_init 0.8 against DIFF)."""
    from difftx.studies.sweep import run_sweep

    out = tmp_path / "sweep"
    s = run_sweep("smoke", "lr", [0.001, 0.004], 2, out, progress=False, workers=1, arms=ARMS,
                  primary=("diff_lambda_0.8", "diff"), **{**LM, "steps": 4})
    assert json.loads((out / "sweep.json").read_text())["best"] == s["best"]
    lm = {p["value"]: p["metrics"]["lm_nll"] for p in s["points"]}
    assert list(lm[0.001]["per_seed"]) == ["diff", "diff_lambda_0.8"] and "baseline" not in lm[0.001]
    assert list(s["best"]["value"]) == ["diff", "diff_lambda_0.8"]
    for arm in ("diff", "diff_lambda_0.8"):
        assert s["best"]["mean"][arm] == min(lm[v][arm][0] for v in lm)
    res = json.loads((out / "lr=0.001" / "results.json").read_text())
    assert lm[0.001]["paired"] == res["comparisons"]["diff_lambda_0.8 vs diff"]["metrics"]["lm_nll"]["paired"]
    md = (out / "sweep.md").read_text()
    assert "| lr | DIFF | diff_lambda_0.8 | diff_lambda_0.8 - DIFF |" in md
    assert "diff_lambda_0.8 - DIFF paired by seed" in md and "): DIFF at " in md
