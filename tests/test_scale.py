"""``difftx scale``: a whole compare per size, the parameter-efficiency fit over them, scale.md /
scale.json / scale.png; bad input refused in one line with nothing written."""

from __future__ import annotations

import json
import math

import pytest

from difftx.cli import main
from difftx.studies.scale import plan_sizes, sensitivity, shape
from difftx.compare.arms import Arm
from difftx.compare.schema import CompareResult, RunRecord
from test_compare import FAST, as_sets

LM = {**FAST, "lm_every": 1, "icl_every": 0, "probe_every": 0}


@pytest.fixture
def no_size_plots(monkeypatch):
    """Each size's compare without its per-task PNGs (most of an end-to-end scale test's time; test_compare draws
    them): scale's own outputs, scale.png included, are still written."""
    monkeypatch.setattr("difftx.compare.report.make_plots", lambda out, result, section=None: {})


def _cmd(out, sizes="16x1x1,32x1x1,48x2x1", seeds=2, *extra: str) -> list[str]:
    return ["scale", "--preset", "smoke", "--sizes", sizes, "--seeds", str(seeds), "--out", str(out), "--workers",
            "1", "--no-progress", *extra, *as_sets(LM)]


def test_scale_end_to_end(tmp_path, capsys, no_size_plots):
    """Three sizes, two seeds, DIFF and the baseline (the lambda arm: test_scale_on_your_own_text and the
    planning tests), trained, fitted and written; a second run reuses every size."""
    out = tmp_path / "scale"
    cmd = _cmd(out, "16x1x1,32x1x1,48x2x1", 2, "--no-lambda-arm")
    assert main(cmd) == 0
    printed = capsys.readouterr().out
    assert "N_diff / N_baseline" in printed
    s = json.loads((out / "scale.json").read_text())
    assert [z["name"] for z in s["sizes"]] == ["16x1x1", "32x1x1", "48x2x1"] and s["arms"] == ["baseline", "diff"]
    assert all(z["params"]["baseline"] > 0 for z in s["sizes"])
    eff = s["efficiency"]["diff"]
    assert s["schema_version"] == 3 and s["kind"] == "lm" and eff["method"] == "floor"
    assert len(eff["ratios"]) == 3 and all(r["value"] is None or r["value"] > 0 for r in eff["ratios"])
    assert len(eff["loglog"]["ratios"]) == 3 and len(eff["loglog"]["fits"]["arm"]) == 2  # the straight line, per seed
    assert 0 <= eff["fit"]["floor"] and set(eff["lack_of_fit"]) == {"arm", "reference", "rms"}
    assert len(s["heldout_nll"]["diff"]) == 2 and len(s["heldout_nll"]["diff"][0]) == 3
    md = (out / "scale.md").read_text()
    # the answer first: three lines (arm, gap and ratio at the largest size; how sure; regime), then the table
    head = [x for x in md[:md.index("## Answer by size")].splitlines()[1:] if x.strip()]
    assert len(head) == 3 and head[0].startswith("**diff vs baseline at the largest size, 48x2x1")
    assert "held-out gap" in head[0] and "parameter ratio" in head[0] and head[1].startswith("How sure: 2 paired seeds")
    assert head[2].startswith("Regime: 3 sizes")
    assert "| size | arm | gap, nats: mean; median [95%] (per seed) | p (unadjusted) | parameter ratio [95%] |" in md
    assert "ratio, floor fit [95%]" in md and "ratio, straight line [95%]" in md and "62.2%" in md
    assert "Lack of fit of the straight log-log line" in md and "Floor fit: E = " in md
    assert "floor fit L = E + A N^-b" in printed
    # issue 30: the gap in nats per size beside the ratio, the ratio's sensitivity, the regime
    gap = s["gap"]["diff"]
    assert len(gap) == 3 and all(g["n"] == 2 and len(g["values"]) == 2 for g in gap)
    assert all(abs(g["mean"] - (sum(s["heldout_nll"]["diff"][k][i] for k in range(2))
                                - sum(s["heldout_nll"]["baseline"][k][i] for k in range(2))) / 2) < 1e-9
               for i, g in enumerate(gap))
    assert all(x["fit"] == "floor" and x["at_params"] > 0 for x in eff["sensitivity"])
    assert [z["regime"]["diff"]["n_layers"] for z in s["sizes"]] == [1, 1, 2]
    assert all(z["regime"]["diff"]["tokens_per_param"] > 0 for z in s["sizes"])
    assert "gap, nats: mean; median [95%] (per seed)" in md and "0.01 nats =" in md
    assert "## Regime (against the paper's recipe)" in md
    for size in ("16x1x1", "32x1x1", "48x2x1"):
        assert (out / f"size={size}" / "results.json").is_file()
    # a second run reuses every size: nothing is trained again
    assert main(cmd) == 0
    again = json.loads((out / "size=16x1x1" / "results.json").read_text())
    assert all(not d["trained"] for d in again["this_run"].values())


@pytest.mark.parametrize("sizes,match", [
    ("16x1x1", "at least 2 sizes"),
    ("32x1x1,16x1x1", "from small to large"),
    ("16x1x1,16x1x1", "each size once"),
    ("30x1x4,32x1x1", "size 30x1x4"),
    ("tiny,32x1x1", "unknown size 'tiny'"),
])
def test_bad_sizes_are_one_line_and_write_nothing(tmp_path, capsys, sizes, match):
    out = tmp_path / "scale"
    assert main(_cmd(out, sizes)) == 2
    err = capsys.readouterr().err
    assert match in err and len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
    assert not out.exists()


def test_shard_out_of_range_is_refused(tmp_path, capsys):
    assert main(_cmd(tmp_path / "s") + ["--shard", "3/2"]) == 2
    assert "need 1 <= K <= N" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_named_shapes_and_tokens_per_param():
    assert shape("m") == (48, 3, 2) and shape("64x3x2") == (64, 3, 2)
    plans = plan_sizes("smoke", ["16x1x1", "32x1x1"], tokens_per_param=20.0)
    assert plans[1].preset.steps > plans[0].preset.steps  # proportional budgets
    assert plans[0].params["baseline"] < plans[1].params["baseline"]


def test_named_sizes_are_scaled_copies_with_the_feed_forward_ratio_fixed():
    """Every named size has a feed-forward width of exactly 8/3 of its width and DIFF heads of one
    width per family (24 on CPU, 128 on GPU); each preset's sizes grow in depth as well as width and
    span at least 10x in non-embedding parameters."""
    from difftx.compare.regime import non_embedding_parameters
    from difftx.compare import get_preset
    from difftx.studies.scale import SCALE_PRESETS, SHAPES, recall_without_lm
    from difftx.config import ModelConfig

    for name, (dim, layers, heads) in SHAPES.items():
        cfg = ModelConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=heads, attention="diff")
        assert cfg.hidden_dim * 3 == 8 * dim, name
        assert dim // heads == (24 if dim < 384 else 128), name
    for sc in SCALE_PRESETS.values():
        if recall_without_lm(get_preset(sc.compare, **sc.overrides)):  # a map, not a fit: test_scale_recall.py
            continue
        shapes = [SHAPES[n] for n in sc.sizes]
        assert len(shapes) >= 5 and shapes[-1][1] > shapes[0][1] and shapes[-1][0] > shapes[0][0]
        n = [non_embedding_parameters(ModelConfig(vocab_size=256, dim=d, n_layers=L, n_heads=h, attention="diff"))
             for d, L, h in shapes]
        assert n == sorted(n) and n[-1] >= 10 * n[0]


def test_scale_adds_the_constant_lambda_arm_unless_told_not_to(monkeypatch, tmp_path):
    """`scale` trains diff_lambda_0.8 beside DIFF by default (opt-out), and a depth sweep at fixed
    width is one --sizes list."""
    from difftx.studies.scale import LAMBDA_ARM, plan_sizes

    plans = plan_sizes("smoke", ["32x1x1", "32x2x1", "32x4x1"], arms=("baseline", "diff", LAMBDA_ARM))
    assert [p.n_layers for p in plans] == [1, 2, 4] and LAMBDA_ARM in plans[0].params
    assert [round(p.regime["diff"]["lambda_init_mean"], 2) for p in plans] == [0.2, 0.28, 0.4]
    assert plans[0].regime[LAMBDA_ARM]["lambda_init"] == [0.8]
    seen = []
    monkeypatch.setattr("difftx.studies.scale.plan_sizes",
                        lambda preset, sizes, **kw: seen.append(kw.get("arms")) or (_ for _ in ()).throw(KeyError))
    from difftx.studies.scale import run_scale

    for flag in (True, False):
        with pytest.raises(KeyError):
            run_scale("smoke", ["xs", "s"], 1, tmp_path / "x", lambda_arm=flag)
    assert seen == [("baseline", "diff", LAMBDA_ARM), None]


def test_scale_on_your_own_text(tmp_path, capsys, no_size_plots):
    """`difftx scale --data FILE`: every size trains on the text the test writes, LM only."""
    text = tmp_path / "t.txt"
    words = "the river turned slowly past the old mill while seven herons waited on the stones".split()
    text.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(300)))
    out = tmp_path / "scale"
    sets = as_sets({k: v for k, v in FAST.items() if k not in ("probe_every", "probe_samples")})
    cmd = ["scale", "--preset", "smoke", "--sizes", "16x1x1,32x1x1", "--seeds", "2", "--out", str(out), "--workers",
           "1", "--no-progress", "--data", str(text), *sets]
    assert main(cmd) == 0
    s = json.loads((out / "scale.json").read_text())
    r = json.loads((out / "size=16x1x1" / "results.json").read_text())
    assert r["text"]["source"].endswith("t.txt") and "ratios" in s["efficiency"]["diff"]
    assert s["arms"] == ["baseline", "diff", "diff_lambda_0.8"] and "ratios" in s["efficiency"]["diff_lambda_0.8"]
    assert s["efficiency"]["diff"]["method"] == "loglog"  # two sizes: no floor can be fitted
    assert "Two sizes: a floor needs at least 3" in (out / "scale.md").read_text()
    along = s["gap_along_training"]["diff"]  # per size, the gap at every point of the training curve
    assert len(along) == 2 and along[0][-1]["tokens"] > along[0][0]["tokens"]
    assert "## The gap along training" in (out / "scale.md").read_text()
    assert main(["scale", "--preset", "smoke", "--sizes", "16x1x1,32x1x1", "--out", str(tmp_path / "x"),
                 "--heldout", str(text)]) == 2
    assert "apply with --data" in capsys.readouterr().err


def _made_up(nll: dict) -> CompareResult:
    """A comparison's results as far as scale reads them: each model's held-out NLL (``{(seed, arm): nll}``)."""
    arms = {a: Arm(a, {}, 0, a) for _, a in nll}
    return CompareResult({}, sorted({s for s, _ in nll}), arms, {},
                         {k: RunRecord({}, {"lm": {"heldout": {"nll": v}}}) for k, v in nll.items()})


def test_run_scale_from_python_resolves_a_scale_preset(tmp_path, monkeypatch):
    """`run_scale("scale-cpu", out=...)`: the scale preset's compare preset, sizes, seeds and settings,
    as `difftx scale` uses them (the compare itself stubbed: only the resolution is tested)."""
    from difftx.compare import run as run_mod
    from difftx.studies.scale import SCALE_PRESETS, run_scale

    calls = []

    def fake_compare(preset, seeds, out, **kw):
        calls.append((preset, list(seeds), out))
        return _made_up({(s, arm): v / (1 + preset.dim / 64) + 0.01 * s for s in seeds
                         for arm, v in (("diff", 2.0), ("baseline", 2.1), ("diff_lambda_0.8", 2.05))})

    monkeypatch.setattr(run_mod, "run_compare", fake_compare)
    monkeypatch.setattr("difftx.studies.scale._plot", lambda path, summary: None)
    sc = SCALE_PRESETS["scale-cpu"]
    res = run_scale("scale-cpu", out=tmp_path / "s", progress=False)
    assert [z["name"] for z in res["sizes"]] == list(sc.sizes)
    assert [out for _, _, out in calls] == [tmp_path / "s" / f"size={n}" for n in sc.sizes]
    assert all(seeds == list(range(sc.seeds)) for _, seeds, _ in calls)
    first = calls[0][0]
    assert first.name == sc.compare and first.steps == sc.overrides["steps"] and first.lm_every == 1
    assert (tmp_path / "s" / "scale.json").is_file()
    calls.clear()
    run_scale("scale-cpu", ["xs", "s"], 1, tmp_path / "t", progress=False, steps=700)  # given values win
    assert [c[0].steps for c in calls] == [700, 700] and [c[1] for c in calls] == [[0], [0]]
    with pytest.raises(ValueError, match="--sizes: needed with the compare preset 'cpu'"):
        run_scale("cpu", out=tmp_path / "u")
    with pytest.raises(ValueError, match="unknown; choose a scale preset"):
        run_scale("nope", out=tmp_path / "u")
    assert not (tmp_path / "u").exists()


def test_crossover_text_reads_every_kind_of_interval():
    from difftx.studies.scale import _crossover_text

    base = {"params": 2.5e4, "extrapolated": True, "note": None}
    assert "interval unbounded" in _crossover_text({**base, "low": None, "high": None}, "floor curves")
    assert "[< 1, 2.28e+04]" in _crossover_text({**base, "low": 3.8e-188, "high": 2.28e4}, "straight lines")
    assert "[1e+04, 5e+04]" in _crossover_text({**base, "low": 1e4, "high": 5e4}, "lines")
    assert "none (they do not cross)" in _crossover_text({"params": None, "note": "they do not cross"}, "lines")


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


def test_the_floor_fit_line_names_the_model_and_gives_no_floor_difference_as_a_finding():
    """scale.md says which floor model the ratios come from and gives each arm's floor, but not their
    difference as a finding (the sizes cannot place it: a term that fades fast in one arm moves it while
    the jackknife sees only seed noise); in its place, the gap measured at the largest size with its
    interval. scale.json keeps the difference, labelled a fit parameter. With 3 sizes: assumed 0."""
    import numpy as np

    from difftx.studies.scale import FLOOR_METHOD_SEPARATE, _floor_fit_text
    from difftx.eval.floor_fit import parameter_efficiency

    n = np.array([13944.0, 55536.0, 83280.0, 187128.0, 249480.0])
    rng = np.random.default_rng(0)
    ref = 1.5 + 0.35 * (n / n[0]) ** -0.3 + rng.normal(0, 0.005, (4, 5))
    arm = 1.45 + 0.35 * (n / 0.62 / n[0]) ** -0.3 + rng.normal(0, 0.005, (4, 5))
    fit = parameter_efficiency(n, arm, n, ref).to_dict()["fit"]
    sizes = [{"name": f"s{i}"} for i in range(5)]
    gap = {"mean": -0.021, "low": -0.03, "high": -0.01, "interval_of": "median", "median": -0.02,
           "median_low": -0.028, "median_high": -0.012, "n": 4, "values": [-0.02] * 4}
    text = _floor_fit_text(fit, "diff", sizes, gap)
    d = fit["floor_difference"]
    assert fit["model"] == "separate" and "each arm its own floor" in text and "with one seed left out" in text
    assert d["value"] == pytest.approx(fit["floors"]["arm"] - fit["floors"]["reference"])
    assert d["finding"] is False and d["low"] is None and d["high"] is None and "not a finding" in d["note"]
    assert "floor difference" not in text and f"{d['value']:+.4f}" not in text
    assert "not a finding" in text and "5 sizes cannot tell a lower floor" in text
    assert "the gap at the largest size, s4: -0.021; median -0.020 [-0.028, -0.012] nats" in text
    assert "its own floor" in FLOOR_METHOD_SEPARATE
    three = parameter_efficiency(n[:3], arm[:, :3], n[:3], ref[:, :3]).to_dict()["fit"]
    text = _floor_fit_text(three, "diff")
    assert text.startswith("Floor fit: E = ") and "shared by both arms" in text and "assumed 0" in text


def test_four_sizes_fit_each_arm_its_own_floor_through_run_scale(tmp_path, monkeypatch):
    """From 4 sizes `difftx scale` gives each arm its own floor: scale.json records the model, both floors
    and their difference, and scale.md names them (every model's held-out NLL made up: no training)."""
    import numpy as np

    from difftx.compare import run as run_mod
    from difftx.studies.scale import run_scale

    def fake_compare(preset, seeds, out, **kw):  # DIFF: its own, lower floor; per-seed noise
        x = preset.dim * preset.n_layers / 24
        nll = {"diff": 1.45 + 0.8 * x ** -0.4, "baseline": 1.5 + 0.8 * x ** -0.35}
        rng = np.random.default_rng(int(x * 10))
        return _made_up({(s, arm): v + rng.normal(0, 0.003) for s in seeds for arm, v in nll.items()})

    monkeypatch.setattr(run_mod, "run_compare", fake_compare)
    monkeypatch.setattr("difftx.studies.scale._plot", lambda path, summary: None)
    run_scale("smoke", ["24x1x1", "48x1x1", "48x2x1", "72x2x1"], 3, tmp_path, progress=False, lambda_arm=False)
    s = json.loads((tmp_path / "scale.json").read_text())
    fit = s["efficiency"]["diff"]["fit"]
    assert fit["model"] == "separate" and set(fit["floors"]) == {"arm", "reference"}
    assert fit["floor_difference"]["value"] == pytest.approx(fit["floors"]["arm"] - fit["floors"]["reference"])
    md = (tmp_path / "scale.md").read_text()
    assert "Floor fit, each arm its own floor: E = " in md and "not a finding" in md
    assert "floor difference (diff minus baseline)" not in md
    assert "with its own floor E" in md
