"""Where a result was computed (difftx.provenance) in every results file; the report's machine line,
its "Not compared" sentence on realistic gated metrics, and the seed plots at 8 seeds."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch

from difftx import provenance
from difftx.cli import main
from difftx.compare.report import _not_compared, render_report
from difftx.compare.arms import Arm
from difftx.compare.schema import CompareResult, RunRecord, from_json
from difftx.compare.summary import DIFFERENT_RUNS, NOT_LEARNED, NOT_LEARNED_BY_BOTH
from difftx.tasks.reporting import ReportContext

MACHINE_KEYS = {"cpu_capability", "cpu", "arch", "torch", "numpy", "mkl", "onednn", "onednn_enabled", "blas", "lapack",
                "openmp", "threads", "interop_threads", "cpu_count", "python", "platform", "env", "cuda"}
# a one-seed smoke comparison trimmed to seconds
FAST = ["--set=steps=4", "--set=warmup_steps=1", "--set=log_every=2", "--set=probe_every=2", "--set=probe_samples=1",
        "--set=tasks.needle.samples_per_cell=1", "--set=tasks.needle.grid=1/1,2/2",
        "--set=tasks.needle.heatmap_cell=2/2",
        "--set=tasks.attention.samples=1", "--set=tasks.attention.cells=1/1", "--set=tasks.lm.windows=2",
        "--set=tasks.outliers.tokens=64", "--set=tasks.quant.bits=4", "--set=tasks.quant.needle_samples=1",
        "--set=tasks.quant.cells=1/1", "--set=tasks.icl.instances=2", "--set=tasks.icl.queries=2",
        "--set=tasks.icl.orders=2", "--set=tasks.diagnostics.cell=2/2"]


def strict(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))


def check_machine(m: dict) -> None:
    assert set(m) == MACHINE_KEYS
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and m["torch"] == torch.__version__
    assert isinstance(m["threads"], int) and m["threads"] >= 1
    assert m["cuda"] is None or m["cuda"]["device"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prov") / "run"
    assert main(["compare", "--preset", "smoke", "--seeds", "1", "--out", str(out), "--workers", "1", "--no-progress",
                 *FAST]) == 0
    return out


def test_machine_record_is_strict_json_with_the_kernel_path():
    m = provenance.machine("cpu")
    check_machine(m)
    assert strict(json.dumps(m, allow_nan=False)) == m
    assert m["cuda"] is None and provenance.machine("auto")["cuda"] == provenance._cuda("auto")
    line = provenance.machine_line(m)
    assert line.startswith(f"CPU kernel path {m['cpu_capability']}") and f"torch {m['torch']}" in line
    assert f"{m['threads']} thread" in line and provenance.machine_line(None) == "machine not recorded"


def test_library_versions_parsed_from_the_build_text():
    text = ("PyTorch built with:\n  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605\n"
            "  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80af)\n  - OpenMP 201511 (a.k.a. OpenMP 4.5)\n"
            "  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, LAPACK_INFO=mkl, TORCH_VERSION=2.13.0\n")
    assert provenance.parse_build(text) == {"mkl": "2024.2", "onednn": "3.12.0", "openmp": "201511", "blas": "mkl",
                                            "lapack": "mkl"}
    arm = "PyTorch built with:\n  - oneDNN v3.7.1\n  - Build settings: BLAS_INFO=open, LAPACK_INFO=open\n"
    assert provenance.parse_build(arm) == {"mkl": None, "onednn": "3.7.1", "openmp": None, "blas": "open",
                                           "lapack": "open"}
    assert set(provenance.parse_build("").values()) == {None}


def test_kernel_path_tells_machines_apart(monkeypatch):
    m = provenance.machine()
    other = {**m, "cpu_capability": "AVX2"}
    assert provenance.kernel_path(m) != provenance.kernel_path(other)
    assert provenance.kernel_path({**m, "threads": 7}, threads=False) == provenance.kernel_path(m, threads=False)
    for name in provenance.NUMERIC_ENV:  # CI sets OMP_NUM_THREADS: start from none of them
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert provenance.machine()["env"] == {"MKL_CBWR": "COMPATIBLE"}
    assert "MKL_CBWR=COMPATIBLE" in provenance.machine_line(provenance.machine())


def test_compare_results_record_every_models_machine(compared):
    res = strict((compared / "results.json").read_text())
    check_machine(res["machine"])
    for arm in ("diff", "baseline"):
        m = res["runs"]["0"][arm]["machine"]
        check_machine(m)
        assert strict((compared / "seed0" / arm / provenance.MACHINE_FILE).read_text()) == m
        assert m["threads"] == res["runs"]["0"][arm]["train"]["threads"]  # read in the training process
    report = (compared / "report.md").read_text()
    header = report.split("**Scale.**")[0]
    assert f"**Machine.** All 2 models were trained on: CPU kernel path {res['machine']['cpu_capability']}" in header
    assert "not across CPUs" in header


def test_the_machine_line_names_each_setup_and_older_models(compared):
    res = strict((compared / "results.json").read_text())
    res["plots"] = {}
    res["runs"]["0"]["baseline"]["machine"] = {**res["runs"]["0"]["diff"]["machine"], "cpu_capability": "AVX2"}
    text = render_report(from_json(res), {})
    assert "Of the 2 models, 2 setups trained them: 1 on CPU kernel path" in text
    assert "1 on CPU kernel path AVX2" in text
    assert "This report was assembled on" in text
    res["runs"]["0"]["baseline"]["machine"] = None
    assert "1 by an older difftx that recorded no machine" in render_report(from_json(res), {})
    res["runs"]["0"]["diff"]["machine"] = None
    assert "**Machine.** Not recorded for the 2 models (trained by an older difftx)." in render_report(from_json(res),
                                                                                                     {})
    with pytest.raises(ValueError, match="not a machine record"):
        (compared / "bad").mkdir()
        (compared / "bad" / provenance.MACHINE_FILE).write_text("[1]")
        provenance.read_machine(compared / "bad")


def test_eval_json_records_the_machine(compared, tmp_path, capsys):
    out = tmp_path / "lm.json"
    assert main(["eval", "lm", str(compared / "seed0" / "diff" / "model"), "--windows", "2", "--no-progress",
                 "--json", str(out)]) == 0
    check_machine(strict(out.read_text())["machine"])


def test_scale_json_records_the_machine(tmp_path, monkeypatch):
    from difftx.compare import run as run_mod
    from difftx.studies.scale import run_scale

    def fake_compare(preset, seeds, out, **kw):  # the fit alone: every model's held-out NLL, made up
        nll = {"diff": 2.0, "baseline": 2.1}
        scale = 1.0 / (1 + preset.dim / 64)
        runs = {(s, arm): RunRecord({}, {"lm": {"heldout": {"nll": v * (1 + scale) + 0.01 * s}}})
                for arm, v in nll.items() for s in seeds}
        return CompareResult({}, list(seeds), {a: Arm(a, {}, 0, a) for a in nll}, {}, runs)

    monkeypatch.setattr(run_mod, "run_compare", fake_compare)
    monkeypatch.setattr("difftx.studies.scale._plot", lambda path, summary: None)
    run_scale("smoke", ["32x1x1", "64x2x1"], 2, tmp_path, progress=False, lambda_arm=False)
    check_machine(strict((tmp_path / "scale.json").read_text())["machine"])


def test_train_checkpoints_record_the_machine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = random.Random(0)
    Path("t.txt").write_text(" ".join(rng.choice("the quick brown fox jumps over a lazy dog".split())
                                      for _ in range(3000)))
    assert main(["train", "--preset", "test", "--data", "t.txt", "--set", "steps=2", "--set", "eval_interval=2",
                 "--set", "ckpt_interval=2", "--out", "run", "--no-progress"]) == 0
    state = strict(next(Path("run").glob("checkpoints/step_*/trainer_state.json")).read_text())
    check_machine(state["machine"])


# -- the "Not compared" sentence -------------------------------------------------------------------

def cpu_comparison(gate) -> dict:
    """The comparison entries of the `cpu` preset's metrics (every key and label `make demo` has),
    each gated as ``gate(key, metric)`` says (None: compared)."""
    from difftx.compare.plan import resolve
    from difftx.compare.presets import get_preset
    from difftx.tasks import TASKS

    plan = resolve(get_preset("cpu"))
    out = {}
    for name, settings in plan.tasks.items():
        for m in TASKS[name].metrics(settings):
            out[m.key] = {"label": m.label, "primary": m.primary, "gated": gate(m.key, m), "paired": {"mean": 0.01}}
    return out


def demo_gates(learned: set):
    """`make demo`'s gates: the needle cells in ``learned`` learned by some seeds of one arm (compared),
    the others by neither; what needs both arms to have learned a cell is gated with "both"."""
    def gate(key, m):
        cell = key.rsplit("_", 2)[-2:] if key.startswith(("needle_", "attn_", "quant_needle_")) else None
        if cell is None or not all(x.isdigit() for x in cell):
            return None
        if f"{cell[0]}/{cell[1]}" in learned:
            return None
        return NOT_LEARNED if m.gate == "any" else NOT_LEARNED_BY_BOTH
    return gate


def test_not_compared_groups_the_demos_thirty_metrics():
    C = cpu_comparison(demo_gates({"1/1"}))
    assert sum(c["gated"] is not None for c in C.values()) == 33  # 3 cells x (needle, 4 attention, 6 quantised)
    assert _not_compared(C) == (" Not compared (not learned by either model at this budget): needle N=2/R=2, 4/2 and "
                                "6/2 and everything measured on them.")


def test_not_compared_when_nothing_was_learned_and_on_a_cell_half_compared():
    def nothing(key, m):
        g = demo_gates(set())(key, m)
        return g or (NOT_LEARNED if key in ("needle_mean", "needle_learned_step") else None)

    assert _not_compared(cpu_comparison(nothing)) == (
        " Not compared (not learned by either model at this budget): needle N=1/R=1, 2/2, 4/2 and 6/2 and everything "
        "measured on them; needle accuracy, mean over the cells learned; training steps until the first needle cell "
        "is learned.")

    def one_arm(key, m):  # 1/1 learned by one arm only: its accuracy is compared, what needs both arms is not
        return NOT_LEARNED_BY_BOTH if key.endswith("_1_1") and key != "needle_1_1" else demo_gates({"1/1"})(key, m)

    text = _not_compared(cpu_comparison(one_arm))
    assert text.startswith(" Not compared (not learned by either model at this budget): needle N=2/R=2, 4/2 and 6/2 "
                           "and everything measured on them.")
    assert text.endswith(" Not compared (not learned by both models at this budget): everything measured on N/R=1/1 "
                         "except needle accuracy.")

    def few(key, m):
        return NOT_LEARNED_BY_BOTH if key == "attn_noise_correct_1_1" else None

    assert _not_compared(cpu_comparison(few)) == (
        " Not compared (not learned by both models at this budget): attention noise, correctly answered prompts only "
        "at N/R=1/1.")


def test_not_compared_names_other_reasons_and_nothing_when_all_compared():
    C = cpu_comparison(lambda key, m: DIFFERENT_RUNS if key == "train_tokens_per_s" else None)
    assert _not_compared(C) == (" Not compared (trained by different invocations (the machine is measured within one "
                                "run)): training throughput.")
    assert _not_compared(cpu_comparison(lambda key, m: None)) == ""
    C = cpu_comparison(lambda key, m: "not measured in this run (no value for diff seed 0: this measures the "
                                      "machine's timing)" if key == "needle_mean" else None)
    C["needle_mean"]["paired"]["mean"] = None  # not measured in this run: named elsewhere
    assert _not_compared(C) == ""
    # without a value but from different invocations: that reason, with the others of its kind
    C = cpu_comparison(lambda key, m: DIFFERENT_RUNS if key in ("train_tokens_per_s", "needle_mean") else None)
    C["needle_mean"]["paired"]["mean"] = None
    assert _not_compared(C).startswith(" Not compared (trained by different invocations")
    assert "training throughput" in _not_compared(C)


# -- the seed plots at 8 seeds -----------------------------------------------------------------------

def capture_figures(monkeypatch) -> list:
    """Every figure the plot functions save: ``(file name, {"lines", "legend_outside", "labels"})``."""
    from difftx.eval import plots

    seen = []
    save = plots._save

    def spy(fig, path):
        fig.canvas.draw()
        ax = fig.axes[0]
        legend = ax.get_legend()
        box, axes = legend.get_window_extent(), ax.get_window_extent()
        seen.append((Path(path).name, {"lines": [ln for ln in ax.get_lines() if len(ln.get_xdata())],
                                       "legend_outside": box.x0 >= axes.x1 or box.y1 <= axes.y0 or box.y0 >= axes.y1,
                                       "labels": [t.get_text() for t in legend.get_texts()]}))
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", spy)
    return seen


def test_plot_seed_curves_8_seeds_faint_mean_bold_legend_outside(tmp_path, monkeypatch):
    from difftx.eval.plots import plot_seed_curves

    seen = capture_figures(monkeypatch)
    steps = list(range(250, 4750, 250))
    curves = {arm: [(steps, [min(1.0, max(0.0, 0.05 * i + 0.1 * s + shift)) for i in range(len(steps))])
                    for s in range(8)] for arm, shift in (("DIFF", 0.0), ("baseline", -0.2))}
    curves["DIFF"][3] = (steps, [None] + curves["DIFF"][3][1][1:])  # a missing value: left out of that seed
    path = plot_seed_curves(curves, tmp_path / "p.png", ylabel="accuracy", title="t")
    assert path.stat().st_size > 1000
    (_, fig), = seen
    assert fig["legend_outside"]
    assert fig["labels"] == ["DIFF: mean of 8 seeds", "baseline: mean of 8 seeds", "one seed (faint)"]
    faint = [ln for ln in fig["lines"] if ln.get_alpha() is not None and ln.get_alpha() < 0.5]
    bold = [ln for ln in fig["lines"] if ln.get_linewidth() >= 2]
    assert len(faint) == 16 and len(bold) == 2 and {ln.get_linestyle() for ln in fig["lines"]} == {"-"}
    mean = bold[0].get_ydata()
    assert len(bold[0].get_xdata()) == len(steps) - 1  # the steps every seed has
    assert mean[-1] == pytest.approx(sum(curves["DIFF"][s][1][-1] for s in range(8)) / 8)


def test_training_plots_at_8_seeds(compared, tmp_path, monkeypatch):
    from difftx.tasks import TASKS

    res = from_json(strict((compared / "results.json").read_text()))
    res.seeds = list(range(8))
    rng = random.Random(1)
    for s in range(8):
        for arm in ("diff", "baseline"):
            res.runs[(s, arm)] = run = copy.deepcopy(res.run(0, arm))
            rec = run.tasks["training"]["records"]
            rec["probe_accuracy"] = [rng.random() for _ in rec["probe_accuracy"]]
    figures = capture_figures(monkeypatch)
    made = TASKS["training"].plots(ReportContext(res), tmp_path)
    seen = dict(figures)
    assert "needle accuracy during training" in made and "needle_probe.png" in seen
    for name, fig in seen.items():
        assert fig["legend_outside"], name
        assert len(fig["labels"]) <= 4, (name, fig["labels"])  # one entry per model, not per seed
    probe = seen["needle_probe.png"]
    assert probe["labels"] == ["baseline: mean of 8 seeds", "DIFF: mean of 8 seeds", "one seed (faint)"]
    assert len(probe["lines"]) == 18
