"""``--tune FIELD=V1,...``: each arm at its own value, chosen leave-one-seed-out on a validation
loss that never reads the evaluated text; a best value at the grid's edge extends it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import numpy as np
import torch

from difftx.cli import main
from difftx.studies import tune as T
from difftx.compare.arms import Arm
from difftx.compare.schema import CompareResult, Comparison
from difftx.eval.stats import look_factor
from test_compare import FAST, as_sets

LM = {**FAST, "lm_every": 1, "icl_every": 0, "probe_every": 0}


def _strict(path: Path) -> dict:
    def refuse(c):
        raise AssertionError(f"{path}: not strict JSON ({c})")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_leave_one_seed_out_never_reads_the_evaluated_seeds_own_loss():
    """Seed 2's own validation loss at 0.01 is so low that it would flip the all-seeds choice to
    0.01; seed 2's choice reads only seeds 0 and 1, which favour 0.003, so it stays 0.003. Seeds 0
    and 1 read seed 2, and choose 0.01."""
    scores = {0.001: [3.0, 3.0, 3.0], 0.003: [2.0, 2.0, 2.5], 0.01: [2.1, 2.1, 0.5]}
    assert min(scores, key=lambda v: sum(scores[v])) == 0.01  # all seeds together: 0.01
    assert T.choose(scores, 3) == [0.01, 0.01, 0.003]
    planted = {v: row[:2] + [-100.0] for v, row in scores.items()}  # seed 2's own losses changed: its choice not
    assert T.choose(planted, 3)[2] == 0.003
    with pytest.raises(ValueError, match="at least 2 seeds"):
        T.choose({0.1: [1.0]}, 1)


def test_edge_extension_rule():
    assert T.beyond_edge([0.001, 0.003], {0.001: [2.0], 0.003: [1.0]}) == ("upper", 0.006)
    assert T.beyond_edge([0.001, 0.003], {0.001: [1.0], 0.003: [2.0]}) == ("lower", 0.0005)
    assert T.beyond_edge([1, 2, 4], {1: [2.0], 2: [1.0], 4: [3.0]}) is None
    assert T.beyond_edge([1, 2], {1: [1.0], 2: [2.0]}) is None  # 1 // 2 = 0: no smaller whole value
    assert T.beyond_edge([50, 100], {50: [1.0], 100: [2.0]}) == ("lower", 25)


def test_parse_tune():
    assert T.parse_tune("lr=1e-3, 3e-3") == ("lr", [0.001, 0.003])
    assert T.parse_tune("warmup_steps=10,20") == ("warmup_steps", [10, 20])
    for bad, why in (("lr", "FIELD=V1"), ("workers=1,2", "FIELD=V1"), ("lr=1e-3,1e-3", "distinct"),
                     ("warmup_steps=1.5,2", "whole number"), ("nope=1,2", "FIELD=V1")):
        with pytest.raises(ValueError, match=why):
            T.parse_tune(bad)
    p = T.point_preset(__import__("difftx.compare.presets", fromlist=["x"]).get_preset("smoke"), "lr", 6e-3)
    assert p.lr == 6e-3 and math.isclose(p.min_lr / p.lr, 0.1)  # min_lr follows in the preset's ratio


def test_halves_are_whole_documents_where_the_documents_are_known():
    """5 or more documents: the second half gets the last max(ceil(D / 2), 4), enough for an interval
    over documents like these; 2-4: the cut is the document start nearest the middle, and the split
    says why the second half's interval is over windows of this one text; one document or none known:
    the middle token. Each half keeps its document starts (then its length)."""
    from difftx.tasks.subject import HeldOut

    def split(offsets, n=100):
        return T.halves(HeldOut(torch.arange(n), "text", 1.0, 4, doc_offsets=offsets))

    a, b, how = split([0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100])  # 10 documents: 5 and 5
    assert how == {"by": "documents", "documents": [5, 5], "note": None}
    assert a.tokens.tolist() == list(range(50)) and b.doc_offsets == [0, 10, 20, 30, 40, 50]
    assert "second half (documents 6-10 of 10, tokens 50-100)" in b.source and "first half" in a.source
    a, b, how = split([0, 20, 40, 60, 80, 100])  # 5 documents: 1 to choose on, 4 to evaluate
    assert how["documents"] == [1, 4] and b.doc_offsets == [0, 20, 40, 60, 80] and how["note"] is None
    a, b, how = split([0, 30, 45, 80, 100])  # 4 documents: the start nearest the middle, and why not 4 in a half
    assert how["documents"] == [2, 2] and a.doc_offsets == [0, 30, 45] and b.doc_offsets == [0, 35, 55]
    assert "holds 4 documents" in how["note"] and "over windows of this one text" in how["note"]
    a, b, how = split([0, 70, 100])  # 2 documents: 1 and 1
    assert how["documents"] == [1, 1] and a.tokens.numel() == 70
    a, b, how = split(None)  # documents not known: the middle token
    assert how["by"] == "tokens" and a.tokens.numel() == 50 and b.doc_offsets is None and "not known" in how["note"]
    a, b, how = split([0, 100])  # one document
    assert how["by"] == "tokens" and b.doc_offsets == [0, 50] and "one document" in how["note"]


def _fake_scores(monkeypatch, calls: list):
    """A validation loss that falls with lr for the baseline (its best always at the upper edge) and
    is lowest at 0.003 for DIFF; the held-out part is the model's real LM evaluation on half the text."""
    real = T.score_model

    def fake(f: Path, p):
        calls.append((f.parent.parent.name, f.name))
        got = real(f, p)
        arm = f.name
        got["validation"] = -math.log(p.lr) if arm == "baseline" else abs(math.log(p.lr / 0.003)) + 0.01 * (
            f.parent.name == "seed1")
        return got

    monkeypatch.setattr(T, "score_model", fake)


def _cmd(out: Path, *extra: str, seeds: int = 2) -> list[str]:
    return ["compare", "--preset", "smoke", "--seeds", str(seeds), "--out", str(out), "--workers", "1", "--no-progress",
            "--tune", "lr=0.001,0.01", *as_sets(LM), *extra]


def test_tune_end_to_end_extends_flags_and_resumes(tmp_path, monkeypatch, capsys):
    """Every arm trains at 0.001, 0.003 (the preset's, added) and 0.01; the baseline's best is at the
    upper edge, so 0.02 and then 0.04 are added for it alone (DIFF's best is inside) and it is still
    flagged; the report opens with the tuned comparison; a second run trains and scores nothing."""
    calls = []
    _fake_scores(monkeypatch, calls)
    out = tmp_path / "t"
    assert main(_cmd(out)) == 0
    printed = capsys.readouterr().out
    tune = _strict(out / "tune.json")
    assert tune["grid"]["baseline"] == [0.001, 0.003, 0.01, 0.02, 0.04] and tune["grid"]["diff"] == [0.001, 0.003,
                                                                                                        0.01]
    assert tune["extended"] == {"baseline": [0.02, 0.04], "diff": []}
    assert tune["at_edge"] == {"baseline": "upper", "diff": None}
    assert tune["chosen"]["diff"] == {"0": 0.003, "1": 0.003} and tune["chosen"]["baseline"] == {"0": 0.04, "1": 0.04}
    assert not (out / "tune" / "lr=0.02" / "seed0" / "diff").exists()  # an extension trains the arm that needs it
    assert (out / "tune" / "lr=0.04" / "seed1" / "baseline" / "train.json").is_file()
    assert "second half" in tune["heldout_source"] and "first half" in tune["validation_source"]
    report = (out / "report.md").read_text()
    assert report.index("## Tuned `lr` (primary)") < report.index("## Verdicts at the preset's `lr`")
    opening = [line for line in report[:report.index("## Tuned `lr` (primary)")].splitlines()[1:] if line.strip()]
    assert len(opening) == 3 and opening[1].startswith("How sure: 2 paired seeds") and "Regime:" in opening[2], opening
    # the bundled validation split is 4 works: halves of 2 and 2, too few for an interval over documents
    assert tune["split"] == {"by": "documents", "documents": [2, 2], "note": tune["split"]["note"]}
    assert "holds 4 documents" in tune["split"]["note"] and "held-out LM intervals over windows of this one text" \
        in opening[2]
    assert tune["heldout_estimand"]["phrase"] == "over windows of this one text"
    assert "Why its LM intervals are not over documents" in report
    assert "at the upper edge of the grid" in report and "plots/tune_lr.png" in report
    assert (out / "plots" / "tune_lr.png").is_file() and _strict(out / "results.json")["tune"]["field"] == "lr"
    c = tune["tuned"]["diff vs baseline"]["lm_nll"]
    assert c["label"].startswith("LM NLL") and "tuned lr" in printed and "upper edge" in printed
    # the tuned comparison pairs each seed's chosen models, on the held-out half
    d = _strict(out / "seed0" / "diff" / T.SCORE_FILE)
    assert d["heldout"]["heldout"]["nll"] != _strict(out / "seed0" / "diff" / "evals" / "lm.json")["heldout"]["nll"]
    n_scored, trained = len(calls), sorted(out.rglob("train.json"))
    stamps = [p.stat().st_mtime_ns for p in trained]
    calls.clear()
    assert main(_cmd(out)) == 0  # resume: nothing trained or scored again, the same result
    assert calls == [] and [p.stat().st_mtime_ns for p in sorted(out.rglob("train.json"))] == stamps
    assert _strict(out / "tune.json")["chosen"] == tune["chosen"] and n_scored == 2 * 2 * 3 + 2 * 2


def test_tune_in_shards_then_assembled(tmp_path, monkeypatch, capsys):
    """Two shards train the grid's models between them (each model once); the run without --shard
    trains only the extensions and assembles the same choices as one process."""
    calls = []
    _fake_scores(monkeypatch, calls)
    out = tmp_path / "s"
    for k in (1, 2):
        assert main(_cmd(out, "--shard", f"{k}/2", seeds=3)) == 0
    grid_models = sorted(out.rglob("train.json"))
    assert len(grid_models) == 3 * 3 * 2 and calls == []  # 3 values x 3 seeds x 2 arms; no scoring in a shard
    stamps = [p.stat().st_mtime_ns for p in grid_models]
    assert main(_cmd(out, seeds=3)) == 0
    assert [p.stat().st_mtime_ns for p in grid_models] == stamps  # the shards' models are reused
    assert len(sorted(out.rglob("train.json"))) == 18 + 6  # + the baseline at 0.02 and 0.04
    tune = _strict(out / "tune.json")
    assert tune["chosen"]["diff"] == {"0": 0.003, "1": 0.003, "2": 0.003}
    # 3 seeds: the tuned interval allows for the choice (the jackknife over seeds, hulled with the compare's)
    c = tune["tuned"]["diff vs baseline"]["lm_nll"]
    sel = c["selection"]
    assert sel["n"] == 3 and sel["low"] is not None and sel["mean"] == pytest.approx(c["paired"]["mean"], abs=1e-9)
    assert c["paired"]["p_value"] >= sel["p_value"] and "jackknife" in c["paired"]["method"]
    assert c["paired"]["low"] is None  # under 6 seeds the comparison gives no interval, tuned or not


def test_tune_refuses_what_it_cannot_do(tmp_path, capsys):
    base = ["compare", "--preset", "smoke", "--out", str(tmp_path / "x"), "--no-progress", *as_sets(LM)]
    for extra, why in ((["--seeds", "1", "--tune", "lr=0.001"], "at least 2 seeds"),
                       (["--seeds", "2", "--tune", "lr=0.003"], "a value besides the preset's"),
                       (["--seeds", "2", "--tune", "lr=0.001", "--sweep", "lr=0.1,0.2"], "choose one"),
                       (["--seeds", "2", "--tune", "lr=0.001", "--set", "lr=0.002"], "in one place"),
                       # values the trainer would refuse: refused before anything trains (issue 41 item 5)
                       (["--seeds", "2", "--tune", "lr=inf"], "ComparePreset.lr: must be a finite number, got inf"),
                       (["--seeds", "2", "--tune", "weight_decay=-1"], "ComparePreset.weight_decay: must be a non-neg"),
                       (["--seeds", "2", "--tune", "grad_clip=0.5,inf"], "ComparePreset.grad_clip: must be a finite number"),
                       (["--seeds", "1", "--set", "lr=inf"], "ComparePreset.lr: must be a finite number, got inf"),
                       (["--seeds", "1", "--set", "weight_decay=-1"], "ComparePreset.weight_decay: must be a non-")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()
    scale = ["scale", "--preset", "smoke", "--sizes", "16x1x1,32x1x1", "--seeds", "2", "--out", str(tmp_path / "s"),
             "--no-progress", "--tune", "weight_decay=0.5,-1"]
    assert main(scale) == 2 and "weight_decay: must be a non-negative" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_scale_tuned_opens_with_the_tuned_gaps(tmp_path, monkeypatch, capsys):
    """`difftx scale --tune lr=...`: every size tuned; scale.json's `tuned` holds both comparisons'
    gaps and efficiency on the held-out half, scale.md opens with them; shards then assembly work."""
    calls = []
    _fake_scores(monkeypatch, calls)
    out = tmp_path / "sc"
    cmd = ["scale", "--preset", "smoke", "--sizes", "16x1x1,32x1x1", "--seeds", "2", "--out", str(out), "--workers",
           "1", "--no-progress", "--no-lambda-arm", "--tune", "lr=0.001,0.01",
           *as_sets({k: v for k, v in LM.items() if k not in ("probe_every", "probe_samples")})]
    assert main(cmd + ["--shard", "1/2"]) == 0 and main(cmd + ["--shard", "2/2"]) == 0
    assert len(list(out.rglob("train.json"))) == 2 * 3 * 2 * 2  # sizes x values x seeds x arms, in shards
    assert main(cmd) == 0
    s = _strict(out / "scale.json")
    t = s["tuned"]
    assert t["field"] == "lr" and set(t["sizes"]) == {"16x1x1", "32x1x1"}
    assert len(t["tuned"]["gap"]["diff"]) == 2 and "ratios" in t["tuned"]["efficiency"]["diff"]
    assert t["sizes"]["16x1x1"]["chosen"]["diff"] == {"0": 0.003, "1": 0.003}
    md = (out / "scale.md").read_text()
    assert md.index("## Tuned `lr` (primary)") < md.index("## diff vs baseline at the preset's value")
    assert "baseline at 16x1x1" in md  # flagged at the edge
    assert "gap tuned" in capsys.readouterr().out


VALUES, TRUTH = [1, 2, 3, 4, 5], {"A": [0.3, 0.15, 0.0, 0.15, 0.3], "B": [0.0] * 5}


def _models(rng, seeds: int) -> tuple[dict, dict]:
    """Each arm's validation and held-out scores ``[value index, seed]`` (see :func:`_tuned_differences`)."""
    seed = rng.normal(0, 0.02, seeds)
    val, held = {}, {}
    for arm in "AB":
        model = rng.normal(0, 0.03, (len(VALUES), seeds))
        val[arm] = np.array(TRUTH[arm])[:, None] + seed + model + rng.normal(0, 0.01, model.shape)
        held[arm] = np.array(TRUTH[arm])[:, None] + seed + model + rng.normal(0, 0.01, model.shape)
    return val, held


def _jackknife_rejections(rng, runs: int, seeds: int = 8) -> float:
    """How often :func:`selection_jackknife`'s interval excludes the true difference 0."""
    out = 0
    for _ in range(runs):
        val, held = _models(rng, seeds)
        held_at, val_at = ({arm: {v: m[arm][i].tolist() for i, v in enumerate(VALUES)} for arm in "AB"}
                           for m in (held, val))
        sel = T.selection_jackknife(held_at, val_at, "A", "B")
        out += not sel["low"] <= 0 <= sel["high"]
    return out / runs


def _tuned_differences(rng, own: bool, runs: int = 1000, seeds: int = 8) -> np.ndarray:
    """Simulated tuned comparisons of two arms with the same best loss: arm A's loss rises steeply
    away from its best value, arm B's is flat across 5 values (many near-ties). Each model has one
    noise term shared by its validation and held-out scores (the same weights score both halves), a
    seed effect shared by the arms, and independent noise per half. Returns the mean paired
    difference A - B of each run and its t statistic, choosing each seed's value leave-one-seed-out
    (``own=False``) or on all seeds including its own (``own=True``)."""
    values = VALUES
    out = []
    for _ in range(runs):
        vals, helds = _models(rng, seeds)
        diffs = np.zeros(seeds)
        for sign, arm in ((1, "A"), (-1, "B")):
            val, held = vals[arm], helds[arm]
            scores = {v: val[i].tolist() for i, v in enumerate(values)}
            if own:
                pick = [min(values, key=lambda v: sum(scores[v])) for _ in range(seeds)]
            else:
                pick = T.choose(scores, seeds)
            diffs += sign * np.array([held[values.index(v), s] for s, v in enumerate(pick)])
        out.append((diffs.mean(), diffs.mean() / (diffs.std(ddof=1) / math.sqrt(seeds))))
    return np.array(out)


def test_the_choice_biases_the_mean_unless_left_out_and_ties_the_seeds_together_unless_jackknifed():
    """The regime of the selection bias: arm B has five near-tied values, so a choice read on the
    evaluated seeds' own validation loss favours it by the luckiest draw of each model's noise, which
    its held-out score shares. Leave-one-seed-out removes that bias (the mean stays at 0), but the
    seeds' differences are no longer independent (each seed's choice reads the others), so a t test
    over them rejects a true null about twice as often as it should; the jackknife over seeds of the
    whole procedure (:func:`selection_jackknife`) holds the level (600 runs of 8 seeds each)."""
    rng = np.random.default_rng(3)
    loso, own = _tuned_differences(rng, own=False, runs=600), _tuned_differences(rng, own=True, runs=600)
    assert own[:, 0].mean() > 0.008 and abs(loso[:, 0].mean()) < 0.003  # the bias, and its removal
    crit = 2.365  # t, 7 degrees of freedom, two-sided 0.05
    level = 0.05 + 3 * math.sqrt(0.05 * 0.95 / len(loso))
    assert (np.abs(loso[:, 1]) > crit).mean() > level  # the t test over the seeds is too liberal here
    assert _jackknife_rejections(np.random.default_rng(4), runs=300) <= level


def test_selection_aware_hulls_the_interval_and_rewrites_the_verdict():
    """With 6 seeds the comparison has its own interval; the tuned one is its hull with the
    jackknife's, its p-value the larger, and the verdict is rewritten from them."""
    from difftx.eval.stats import paired_estimate
    from difftx.tasks.lm import LMSettings

    rng = np.random.default_rng(0)
    held = {arm: {v: (rng.normal(0, 0.05, 6) + (0.1 if arm == "diff" else 0.0)).tolist() for v in (1, 2)}
            for arm in ("diff", "baseline")}
    val = {arm: {v: rng.normal(0, 0.05, 6).tolist() for v in (1, 2)} for arm in ("diff", "baseline")}
    picks = {arm: T.choose(val[arm], 6) for arm in held}
    x = {arm: [held[arm][picks[arm][s]][s] for s in range(6)] for arm in held}
    paired = paired_estimate(x["diff"], x["baseline"]).to_dict()
    c = {"key": "lm_nll", "primary": True, "gated": None, "arms": ["diff", "baseline"], "paired": dict(paired)}
    results = CompareResult({}, list(range(6)), {a: Arm(a, {}, 0, a) for a in ("diff", "baseline")}, {}, {},
                            {"diff vs baseline": Comparison(("diff", "baseline"), {"lm_nll": c}, True)})
    tasks_at = {arm: {v: [{"lm": {"heldout": {"nll": y}}} for y in held[arm][v]] for v in (1, 2)} for arm in held}
    T.selection_aware(results, {"lm": LMSettings()}, tasks_at, val)
    sel = c["selection"]
    assert sel["mean"] == pytest.approx(paired["mean"])
    assert c["paired"]["low"] == min(paired["low"], sel["low"]) and c["paired"]["high"] == max(paired["high"],
                                                                                                 sel["high"])
    # one primary (Holm leaves it), the first look (alpha spent over looks: p x look_factor(1))
    assert c["paired"]["p_value"] == max(paired["p_value"], sel["p_value"])
    assert c["p_adjusted"] == pytest.approx(min(1.0, c["paired"]["p_value"] * look_factor(1)))
    assert c["look_factor"] == round(look_factor(1), 4)
    assert c["verdict"].startswith("LM NLL") and c["better"] in (None, "diff", "baseline")


def test_tuned_ratios_widen_for_the_choice():
    """scale's tuned ratio: the fit's interval hulled with a jackknife over seeds that redoes every
    choice; with 3 seeds and 3 sizes every size gets one, and it contains the fitted ratio."""
    from difftx.studies.scale import SizePlan, widen_for_the_choice
    from difftx.eval.floor_fit import parameter_efficiency

    rng = np.random.default_rng(1)
    sizes = [10_000, 40_000, 160_000]
    plans = [SizePlan(f"s{i}", 8, 1, 1, None, {"baseline": n, "diff": n}) for i, n in enumerate(sizes)]
    tunes, chosen = [], {"diff": [], "baseline": []}
    for n in sizes:
        t = {"field": "lr", "grid": {a: [0.001, 0.002] for a in ("diff", "baseline")}, "validation_nll": {},
             "heldout_nll": {}}
        for arm, shift in (("diff", 0.03), ("baseline", 0.0)):
            base = 1.6 + 3 * n ** -0.3 + shift
            held = {v: (base + rng.normal(0, 0.01, 3) + (0.02 if v == 0.002 else 0)).tolist() for v in (0.001, 0.002)}
            t["heldout_nll"][arm] = {f"lr={v:g}": held[v] for v in held}
            t["validation_nll"][arm] = {f"lr={v:g}": [x + 0.001 for x in held[v]] for v in held}
            picks = T.choose({v: t["validation_nll"][arm][f"lr={v:g}"] for v in held}, 3)
            chosen[arm].append([held[v][s] for s, v in enumerate(picks)])
        tunes.append(t)
    losses = {arm: [list(row) for row in zip(*chosen[arm])] for arm in chosen}
    eff = parameter_efficiency(sizes, losses["diff"], sizes, losses["baseline"]).to_dict()
    before = [dict(r) for r in eff["ratios"]]
    widen_for_the_choice(eff, plans, tunes, "diff", 3)
    assert len(eff["selection"]) == 3
    for r, b, sel in zip(eff["ratios"], before, eff["selection"]):
        assert sel["low"] <= r["value"] <= sel["high"]
        assert r["low"] == min(b["low"], sel["low"]) and r["high"] == max(b["high"], sel["high"])
    two = parameter_efficiency(sizes, losses["diff"], sizes, losses["baseline"]).to_dict()
    widen_for_the_choice(two, plans, tunes, "diff", 2)
    assert "needs 3 seeds" in two["selection"]["note"]


def test_the_preset_value_is_the_preset_itself():
    """At the preset's own value no min_lr is recomputed (a rounding there would make the folder's own
    comparison look like another one and refuse to reuse it)."""
    from difftx.compare.presets import get_preset

    base = get_preset("smoke", lr=0.0007, min_lr=0.00011)
    assert T.point_preset(base, "lr", 0.0007) is base
