"""``difftx runs --pool`` and ``difftx.eval.pool``: the random-effects estimators against values computed by hand
on a small fixed dataset, their edge cases (one and two comparisons, tau^2 = 0, equal SEs), and the command end to
end on hand-written compare folders (results.json files of the schema, no training). The coverage of the intervals
is simulated by benchmarks/pool_coverage.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from difftx.compare.schema import SCHEMA, SCHEMA_VERSION, validate_results
from difftx.compare.summary import ONE_PER_STACK
from difftx.eval import pool as P
from difftx.eval.stats import t_quantile

# five comparisons: estimates and standard errors (a fixed, heterogeneous dataset)
Y = np.array([0.10, 0.30, -0.05, 0.40, 0.20])
SE = np.array([0.10, 0.15, 0.08, 0.20, 0.12])


def _by_hand_dl(y, se):
    """DerSimonian-Laird, HKSJ and the prediction interval, written out step by step."""
    w = [1 / s ** 2 for s in se]
    sw = sum(w)
    mu_fe = sum(wi * yi for wi, yi in zip(w, y)) / sw
    q = sum(wi * (yi - mu_fe) ** 2 for wi, yi in zip(w, y))
    k = len(y)
    tau2 = max(0.0, (q - (k - 1)) / (sw - sum(wi ** 2 for wi in w) / sw))
    ws = [1 / (s ** 2 + tau2) for s in se]
    mu = sum(wi * yi for wi, yi in zip(ws, y)) / sum(ws)
    qh = sum(wi * (yi - mu) ** 2 for wi, yi in zip(ws, y)) / (k - 1)
    se_mu = math.sqrt(qh / sum(ws))
    return q, tau2, mu, se_mu, max(0.0, (q - (k - 1)) / q)


def test_dersimonian_laird_and_hksj_match_the_hand_computation():
    q, tau2, mu, se_mu, i2 = _by_hand_dl(Y, SE)
    assert q == pytest.approx(8.2378198, rel=1e-6)  # Cochran's Q of this dataset
    assert float(P.q_statistic(Y, SE ** 2)) == pytest.approx(q)
    assert float(P.tau2_dl(Y, SE ** 2)) == pytest.approx(tau2)
    p = P.pool(Y, SE, "dl", floor=False)
    t = t_quantile(0.975, 4)
    assert (p.mean, p.se, p.tau2, p.i2) == pytest.approx((mu, se_mu, tau2, i2))
    assert (p.low, p.high) == pytest.approx((mu - t * se_mu, mu + t * se_mu))
    t2 = t_quantile(0.975, 3)
    half = t2 * math.sqrt(tau2 + se_mu ** 2)
    assert (p.pi_plugin_low, p.pi_plugin_high) == pytest.approx((mu - half, mu + half))
    assert p.q_p == pytest.approx(0.083245, rel=1e-4)  # chi-square tail of Q on 4 df
    assert sum(p.weights) == pytest.approx(1.0)


def test_paule_mandel_sets_the_generalised_q_to_its_expectation():
    tau2 = float(P.tau2_pm(Y, SE ** 2))
    assert tau2 > 0
    assert float(P.q_statistic(Y, SE ** 2, tau2)) == pytest.approx(4.0, abs=1e-9)  # k - 1
    # with Q(tau^2) = k - 1 HKSJ's factor is 1: its SE is the ordinary random-effects one
    p = P.pool(Y, SE, "pm")
    w = 1 / (SE ** 2 + tau2)
    assert p.se == pytest.approx(1 / math.sqrt(w.sum())) and p.re_se == pytest.approx(p.se)


def test_prediction_interval_from_taus_confidence_distribution():
    """The interval, recomputed one grid point at a time with a plain bisection."""
    k, grid, draws = len(Y), 20, 10
    v = SE ** 2
    rng = np.random.default_rng(0)
    t, z = rng.standard_t(k - 1, size=(grid, draws)), rng.standard_normal((grid, draws))
    thetas = []
    for j in range(grid):
        u = P.chi2_quantile((j + 0.5) / grid, k - 1)
        lo, hi = 0.0, 10.0
        if float(P.q_statistic(Y, v, 0.0)) <= u:
            tau2 = 0.0
        else:
            for _ in range(100):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if float(P.q_statistic(Y, v, mid)) > u else (lo, mid)
            tau2 = (lo + hi) / 2
        w = 1 / (v + tau2)
        mu = (w * Y).sum() / w.sum()
        se = math.sqrt(max(1.0, (w * (Y - mu) ** 2).sum() / (k - 1)) / w.sum())
        thetas += [mu + t[j, i] * se + z[j, i] * math.sqrt(tau2) for i in range(draws)]
    want = np.quantile(thetas, [0.025, 0.975])
    assert P.prediction_interval_cd(Y, v, grid=grid, draws=draws) == pytest.approx(tuple(want), rel=1e-9)
    p = P.pool(Y, SE)
    assert p.pi_low < p.low < p.mean < p.high < p.pi_high
    assert (p.pi_low, p.pi_high) == P.prediction_interval_cd(Y, v)  # a fixed seed: the same every time
    assert p.to_dict()["prediction"] == "tau^2's confidence distribution"


def test_q_profile_interval_of_tau():
    lo, hi = P.tau2_interval(Y, SE ** 2)
    assert float(lo) == 0.0  # Q(0) = 8.24 < chi2_{4, 0.975} = 11.14: the lower end is 0
    assert float(P.q_statistic(Y, SE ** 2, hi)) == pytest.approx(P.chi2_quantile(0.025, 4), rel=1e-9)
    assert P.chi2_quantile(0.025, 4) == pytest.approx(0.484419, rel=1e-5)
    assert P.chi2_quantile(0.975, 1) == pytest.approx(5.023886, rel=1e-6)
    p = P.pool(Y, SE)
    assert p.tau_low == 0.0 and p.tau_high == pytest.approx(math.sqrt(float(hi)))
    assert p.tau_low <= p.tau <= p.tau_high


def test_no_heterogeneity_gives_tau_zero_and_the_fixed_effect_mean():
    y, se = np.array([1.0, 1.1, 0.9]), np.array([0.5, 0.5, 0.5])  # all SEs equal, Q = 0.08 < k - 1
    for method in P.METHODS:
        p = P.pool(y, se, method)
        assert p.tau2 == 0.0 and p.i2 == 0.0
        assert p.mean == pytest.approx(1.0) and p.weights == pytest.approx([1 / 3] * 3)
    plain, floored = P.pool(y, se, floor=False), P.pool(y, se)
    assert plain.se < floored.se == pytest.approx(0.5 / math.sqrt(3))  # floored: never below the ordinary SE
    same = P.pool([0.2, 0.2, 0.2], [0.1, 0.1, 0.1])  # identical estimates: plain HKSJ would give a zero width
    assert same.high - same.low > 0 and P.pool([0.2] * 3, [0.1] * 3, floor=False).se == pytest.approx(0.0, abs=1e-12)


def test_one_and_two_comparisons():
    one = P.pool([0.3], [0.1])
    assert one.k == 1 and one.mean == 0.3 and one.low is None and one.tau is None and "nothing to pool" in one.notes[0]
    two = P.pool([0.1, 0.5], [0.1, 0.1])
    assert two.df == 1 and two.pi_low is None and "needs at least 3" in two.notes[0]
    assert two.high - two.low > 2 * 12.7 * 0.1  # t on 1 df
    with pytest.raises(ValueError, match="at least 3"):
        P.prediction_interval(0.0, 1.0, 0.0, 2)
    with pytest.raises(ValueError, match="variance must be > 0"):
        P.pool([0.1, 0.2], [0.1, 0.0])
    with pytest.raises(ValueError, match="at least 2 seeds"):
        P.study_estimate([0.1])
    assert P.study_estimate([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1 / math.sqrt(3), 3))


def test_estimators_broadcast_over_runs():
    y = np.stack([Y, Y[::-1], Y + 1])
    v = np.stack([SE ** 2] * 3)
    for f in (P.tau2_dl, P.tau2_pm):
        got = f(y, v)
        assert got.shape == (3,) and got[0] == pytest.approx(float(f(Y, SE ** 2)))
        assert got[2] == pytest.approx(got[0])  # shifting every estimate moves nothing but the mean


def test_subgroup_test():
    a, b = P.pool([0.0, 0.1, 0.05], [0.05] * 3), P.pool([0.5, 0.6], [0.05] * 2)
    t = P.subgroup_test({"normal": a, "torch": b})
    w = np.array([1 / a.re_se ** 2, 1 / b.re_se ** 2])
    mu = np.array([a.mean, b.mean])
    m = (w * mu).sum() / w.sum()
    assert t["df"] == 1 and t["q_between"] == pytest.approx(float((w * (mu - m) ** 2).sum()))
    assert t["p"] == pytest.approx(P.chi2_sf(t["q_between"], 1)) and t["p"] < 0.001
    assert P.subgroup_test({"one": a})["p"] is None


# -- end to end: hand-written compare folders --


def write_folder(path, diffs, *, metric="lm_nll", unit="nats", lower=True, init="normal", text=None,
                 pair=("diff", "baseline"), base=3.0, commit="abc1234def", gated=None):
    """A compare folder holding only a results.json of the schema, whose pair ``pair`` has ``metric`` with per-seed
    differences ``diffs`` (arm a = base + d, arm b = base)."""
    seeds = list(range(len(diffs)))
    a, b = pair
    train = {"kind": "x", "seed": 0, "config": {}, "parameters": 1, "steps": 1, "history": [], "wall_s": 0.0,
             "cpu_s": 0.0}
    cfg = {"dim": 64, "n_layers": 2, "attention": "diff", "init": init}
    values = {a: [base + d for d in diffs], b: [base] * len(diffs)}
    comp = {"task": "lm", "label": "LM NLL (held-out)", "lower_is_better": lower, "unit": unit, "primary": True,
            "arms": [a, b], "values": values, "means": {x: float(np.mean(v)) for x, v in values.items()},
            "paired": {**{k: None for k in ("low", "high", "p_value", "sign_flip_p")}, "mean": float(np.mean(diffs)),
                       "n": len(diffs), "n_examples": 1, "confidence": 0.95, "method": "t",
                       "unadjusted_excludes_zero": False},
            "family": "primary", "verdict": "-", "gated": gated}
    data = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "created": "2026-12-06T00:00:00Z",
            "versions": {"difftx": "0", "torch": "0", "python": "3", "platform": "p"},
            "machine": {"cpu": "AMD EPYC", "cpu_capability": "AVX512", "cuda": None},
            "preset": {"name": "cpu", "init": init, "dim": 64, "n_layers": 2}, "seeds": seeds, "mixture": {},
            "arms": {x: {"config": cfg, "parameters": 180_000, "label": x} for x in pair},
            "tasks": {}, "runs": {str(s): {x: {"train": train, "tasks": {}, "machine": None} for x in pair}
                                  for s in seeds},
            "null_reasons": {}, "looks": [{"seeds": seeds, "date": "2026-12-06", "commit": commit}], "look": 1,
            "comparisons": {f"{a} vs {b}": {"arms": [a, b], "primary": True, "metrics": {metric: comp}}},
            "regime": {a: {"init": init, "lambda_schedule": "depth schedule", "lambda_init_mean": 0.28}},
            "text": text, "wall_s": 1.0}
    validate_results(data)
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps(data))
    return path


def _folders(tmp_path):
    rng = np.random.default_rng(3)
    good = {name: list(mu + 0.03 * rng.standard_normal(n))
            for name, mu, n in (("a", 0.04, 5), ("b", 0.01, 7), ("c", 0.06, 3))}
    for name, d in good.items():
        write_folder(tmp_path / name, d, init="torch" if name != "a" else "normal")
    write_folder(tmp_path / "steps", [1.0, 2.0, 3.0], unit="steps")
    write_folder(tmp_path / "higher", [0.1, 0.2, 0.3], lower=False)
    write_folder(tmp_path / "one_seed", [0.1])
    write_folder(tmp_path / "other_pair", [0.1, 0.2, 0.3], pair=("diff_lambda_0.8", "baseline"))
    write_folder(tmp_path / "other_tok", [0.1, 0.2, 0.3], text={"source": "/x/books.txt", "tokenizer": "bpe-1"})
    write_folder(tmp_path / "stacked", [0.1, 0.2, 0.3], gated=ONE_PER_STACK)
    write_folder(tmp_path / "ties", [0.1, 0.1, 0.1])
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "results.json").write_text('{"schema": ')
    return good


def test_runs_pool_end_to_end(tmp_path, capsys):
    from difftx.cli import main

    good = _folders(tmp_path)
    bad = ["steps", "higher", "one_seed", "other_pair", "other_tok", "stacked", "ties", "damaged", "missing"]
    folders = [str(tmp_path / n) for n in [*good, *bad]] + [str(tmp_path / "a")]
    out = tmp_path / "pool.json"
    assert main(["runs", "--pool", *folders, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    got = json.loads(out.read_text())
    assert got["metric"] == "lm_nll" and got["pair"] == "diff vs baseline"  # the defaults: primary pair and metric
    est = [P.study_estimate(d) for d in good.values()]
    assert [r["estimate"] for r in got["folders"]] == pytest.approx([e[0] for e in est])
    assert [r["se"] for r in got["folders"]] == pytest.approx([e[1] for e in est])
    assert [r["seeds"] for r in got["folders"]] == [5, 7, 3]
    ref = P.pool([e[0] for e in est], [e[1] for e in est])
    for k in ("mean", "low", "high", "tau", "tau_low", "tau_high", "i2", "pi_low", "pi_high"):
        assert got["pooled"][k] == pytest.approx(getattr(ref, k)), k
    assert got["pooled"]["tau2_method"] == "Paule-Mandel" and got["pooled"]["interval"] == "HKSJ, q >= 1"
    refused = {r["path"]: r["why"] for r in got["refused"]}
    assert len(got["refused"]) == len(bad) + 1
    assert "unit 'steps'" in refused[str(tmp_path / "steps")]
    assert "higher is better" in refused[str(tmp_path / "higher")]
    assert "1 seed" in refused[str(tmp_path / "one_seed")]
    assert "no pair 'diff vs baseline'" in refused[str(tmp_path / "other_pair")]
    assert "tokenizer" in refused[str(tmp_path / "other_tok")]
    assert "once per stack" in refused[str(tmp_path / "stacked")]
    assert "SE 0" in refused[str(tmp_path / "ties")]
    assert "damaged" in refused[str(tmp_path / "damaged")] and "results.json" in refused[str(tmp_path / "damaged")]
    assert "no results.json" in refused[str(tmp_path / "missing")]
    assert "counted once" in refused[str(tmp_path / "a")]
    lines = text.splitlines()
    assert any(line.startswith(f"  {tmp_path / 'steps'}: ") for line in lines)  # one line per refused folder
    assert "pooled (HKSJ, q >= 1; tau^2 Paule-Mandel)" in text and "prediction interval for a new comparison: [" in text
    assert "AMD EPYC AVX512, abc1234, init torch" in text  # the provenance of each row
    assert "each folder's SE is taken as exact; from 3 seeds" in text and "2 seeds in" not in text


def test_runs_pool_subgroups_choices_and_plot(tmp_path, capsys):
    from difftx.cli import main

    good = _folders(tmp_path)
    folders = [str(tmp_path / n) for n in good]
    out = tmp_path / "pool.json"
    assert main(["runs", "--pool", *folders, "--by", "init", "--tau-method", "dl", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    groups = got["subgroups"]["groups"]
    assert set(groups) == {"normal", "torch"} and groups["torch"]["k"] == 2 and groups["normal"]["k"] == 1
    assert got["subgroups"]["test"]["df"] == 1 and 0 <= got["subgroups"]["test"]["p"] <= 1
    assert "difference between subgroups: Q_between" in capsys.readouterr().out
    assert main(["runs", "--pool", *folders, "--by", "preset.name", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["subgroups"]["groups"]) == ["cpu"]
    assert "one subgroup: nothing to test" in capsys.readouterr().out
    assert main(["runs", "--pool", *folders, "--by", "colour"]) == 2
    assert "--by: one of init" in capsys.readouterr().err
    assert main(["runs", "--pool", *folders, "--metric", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--metric" in err and "lm_nll" in err  # the metrics there are, listed
    assert main(["runs", "--pool", *folders, "--pair", "x vs y"]) == 2
    assert "'diff vs baseline'" in capsys.readouterr().err
    assert main(["runs", folders[0], "--metric", "lm_nll", "--hksj", "plain"]) == 2
    assert "--metric, --hksj: apply with --pool" in capsys.readouterr().err
    assert main(["runs", "--pool", *folders, "--hksj", "plain", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["pooled"]["interval"] == "HKSJ"
    assert main(["runs", "--pool", str(tmp_path / "damaged")]) == 2
    assert "no folder left to pool" in capsys.readouterr().err
    from difftx.eval import pool as pool_mod  # every folder refused: the metric pooled by default is named

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pool_mod, "study_estimate", lambda d: (_ for _ in ()).throw(ValueError("no spread")))
        assert main(["runs", "--pool", *folders]) == 2
    err = capsys.readouterr().err
    assert "no folder left to pool lm_nll of diff vs baseline (the first folder's first primary metric; --metric " \
           "KEY pools another)" in err, err
    pytest.importorskip("matplotlib")
    assert main(["runs", "--pool", *folders, "--by", "init", "--plot", str(tmp_path / "forest.png")]) == 0
    assert (tmp_path / "forest.png").stat().st_size > 1000


def test_coverage_benchmark_runs(capsys):
    """benchmarks/pool_coverage.py at a tiny size (the real run: its docstring)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import pool_coverage

    assert pool_coverage.main(["--runs", "200", "--k", "3,5", "--ratios", "0,1"]) == 0
    out = capsys.readouterr().out
    assert "PM+HKSJ>=1" in out and out.count("\n") > 12
    with pytest.raises(ValueError, match="--k"):
        pool_coverage.main(["--k", "2"])


def test_runs_pool_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import sys

    from difftx.cli import main

    folders = [str(tmp_path / n) for n in _folders(tmp_path)]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["runs", "--pool", *folders, "--plot", str(tmp_path / "f.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err and not (tmp_path / "f.png").exists()
