"""``difftx compare --data``: the paired comparison on your own text (issue 22 item 1), and the
held-out loss curve recorded along training (item 2, the recording half)."""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

import pytest
import torch

from difftx.cli import main
from difftx.compare import get_preset
from difftx.compare.stream import CompareStream

# the smoke preset trimmed to seconds per model; lm_seq_len 32 is the window of every held-out score
FAST = ["--preset", "smoke", "--workers", "1", "--no-progress", "--set", "steps=12", "--set", "log_every=2",
        "--set", "lm_seq_len=32", "--set", "batch_size=4", "--set", "tasks.lm.extrapolation_factors=[1]",
        "--set", "tasks.outliers.tokens=64", "--set", "tasks.quant.bits=[4]", "--set", "tasks.quant.lm_windows=2"]
T = 32


def _write_text(path: Path, paragraphs: int, seed: int) -> Path:
    """Made-up prose written here (no corpus is touched)."""
    r = random.Random(seed)
    who = ["the miller", "a young weaver", "the old ferryman", "my neighbour", "the lighthouse keeper"]
    did = ["carried", "mended", "forgot", "painted", "counted", "sold"]
    what = ["a basket of apples", "the broken fence", "seven blue lanterns", "a map of the river"]
    paras = [" ".join(f"{r.choice(who).capitalize()} {r.choice(did)} {r.choice(what)}." for _ in range(4))
             for _ in range(paragraphs)]
    path.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("text")
    _write_text(d / "corpus.txt", 60, 3)
    _write_text(d / "heldout.txt", 4, 11)
    return d


@pytest.fixture(scope="module")
def run(texts, tmp_path_factory) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setenv("DIFFTX_CACHE_DIR", str(texts / "cache"))
    out = tmp_path_factory.mktemp("cmp") / "run"
    rc = main(["compare", *FAST, "--data", str(texts / "corpus.txt"), "--heldout", str(texts / "heldout.txt"),
               "--seeds", "2", "--out", str(out)])
    assert rc == 0
    yield out
    mp.undo()


def reference_nll(model: torch.nn.Module, ids: list[int], window: int) -> float:
    """Mean NLL of every token of ``ids`` after the first, in float64: disjoint windows of ``window``
    predictions (consecutive windows share their boundary token), then the shorter tail; written
    here from the definition, independently of difftx's evaluation code."""
    model = model.double().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            w = torch.tensor(ids[start:start + window + 1])
            logits = model(w[None, :-1])[0].double()  # (t, V)
            logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
            total -= float(logp[torch.arange(len(w) - 1), w[1:]].sum())
            count += len(w) - 1
    assert count == len(ids) - 1
    return total / count


def test_compare_on_my_text_end_to_end(run, texts, capsys):
    from difftx.checkpoint import load_model

    for name in ("results.json", "report.md", "compare.json"):
        assert (run / name).is_file(), name
    res = json.loads((run / "results.json").read_text())
    assert res["mixture"]["shares"] == {"needle": 0.0, "lm": 1.0, "icl": 0.0, "recall": 0.0} and res["needle_task"] is None
    assert res["text"]["source"] == str(texts / "corpus.txt") and res["text"]["tokenizer"] == "byte"
    report = (run / "report.md").read_text()
    for task in ("needle", "attention", "icl"):  # evaluations that need the synthetic tasks: skipped, with reasons
        for seed in ("0", "1"):
            for arm in ("baseline", "diff"):
                assert "without needle batches" in res["runs"][seed][arm]["tasks"][task].get("skipped", "") or \
                    "without ICL batches" in res["runs"][seed][arm]["tasks"][task].get("skipped", "")
    assert report.count("Not measured: the model was trained without") == 4  # needle, attention, ICL, recall
    assert "without recall batches" in res["runs"]["0"]["diff"]["tasks"]["recall"]["skipped"]
    assert "no needle probes during training" in report
    train = res["runs"]["0"]["diff"]["train"]
    assert train["probes"] == [] and "without needle batches" in train["probes_skipped"]
    assert res["comparisons"]["diff vs baseline"]["metrics"]["lm_nll"]["primary"]
    # held-out NLL: every token of the held-out file once, equal to an independent float64 computation
    ids = [256] + list((texts / "heldout.txt").read_bytes())  # the byte tokenizer: a document opens with end-of-text
    for seed in ("0", "1"):
        for arm in ("baseline", "diff"):
            lm = res["runs"][seed][arm]["tasks"]["lm"]
            assert lm["distinct_tokens"] == lm["tokens"] == len(ids) - 1 and lm["window"] == T
            ref = reference_nll(load_model(run / f"seed{seed}" / arm / "model"), ids, T)
            assert abs(lm["heldout"]["nll"] - ref) <= 1e-5, (seed, arm, lm["heldout"]["nll"], ref)
    # a re-run with the same arguments continues (nothing redone)
    rc = main(["compare", *FAST, "--data", str(texts / "corpus.txt"), "--heldout", str(texts / "heldout.txt"),
               "--seeds", "2", "--out", str(run)])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"{len(ids) - 1:,} distinct tokens, each scored once" in out
    again = json.loads((run / "results.json").read_text())
    assert not any(d["trained"] or d["evaluated"] for d in again["this_run"].values())


def test_the_heldout_curve_is_recorded_along_training(run):
    for seed in ("0", "1"):
        for arm in ("baseline", "diff"):
            c = json.loads((run / f"seed{seed}" / arm / "train.json").read_text())["heldout_curve"]
            assert len(c["steps"]) >= 8 and c["steps"][-1] == 12 and c["steps"] == sorted(set(c["steps"]))
            assert c["tokens"] == [s * 4 * T for s in c["steps"]]  # every step an LM batch of 4 windows of T
            assert all(math.isfinite(x) for x in c["loss"]) and c["loss"][-1] < c["loss"][0]
            assert c["windows"] == 8 and c["distinct_tokens"] == 8 * T and c["window"] == T
            assert "heldout.txt" in c["source"]
    # the same windows for both arms of a seed: at step 1 both start from the same shared weights, so
    # only the attention differs, but the curves have the same steps and tokens
    a, b = (json.loads((run / "seed0" / k / "train.json").read_text())["heldout_curve"] for k in ("diff", "baseline"))
    assert a["steps"] == b["steps"] and a["tokens"] == b["tokens"]


def test_curve_steps_are_log_spaced():
    from difftx.compare.plan import curve_steps

    s = curve_steps(4500, 10)
    assert s[0] == 45 and s[-1] == 4500 and len(s) == 10
    ratios = [b / a for a, b in zip(s, s[1:])]
    assert max(ratios) / min(ratios) < 1.05  # geometric
    assert curve_steps(12, 10) == (1, 2, 3, 4, 5, 7, 9, 12) and curve_steps(100, 0) == ()


def test_recording_the_curve_leaves_training_bit_identical(tmp_path):
    """Needle probes and the curve together (the synthetic mixture, as the cpu preset) or neither:
    the same losses, probes and weights, bit for bit."""
    from difftx.checkpoint import load_model
    from difftx.compare.train import train_model

    recs, weights = [], []
    for points in (0, 10):
        p = get_preset("smoke", steps=12, log_every=1, warmup_steps=1, probe_every=6, probe_samples=1,
                       curve_points=points)
        recs.append(train_model("diff", p.resolve(), 0, tmp_path / str(points), progress=False))
        weights.append(load_model(tmp_path / str(points) / "model").state_dict())
    strip = lambda r: [{k: v for k, v in h.items() if k != "time_s"} for h in r["history"]]  # noqa: E731
    assert strip(recs[0]) == strip(recs[1]) and recs[0]["probes"] == recs[1]["probes"]
    assert [p["step"] for p in recs[1]["probes"]] == [6, 12]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert "heldout_curve" not in recs[0] and len(recs[1]["heldout_curve"]["steps"]) == 8
    # tokens count LM batches only (smoke: every 3rd step is one)
    c = recs[1]["heldout_curve"]
    assert c["tokens"] == [(s // 3) * 8 * 32 for s in c["steps"]] and "Shakespeare" in c["source"]


def test_the_default_cpu_preset_draws_the_same_batches():
    """The batches (and arm configs) of the demo's preset are those of before `--data` existed: a hash
    taken on the code before this change."""
    plan = get_preset("cpu").resolve()
    h = hashlib.sha256(json.dumps({a: c.to_dict() for a, c in plan.arms.items()}, sort_keys=True).encode())
    loader = CompareStream(plan.mixture, plan.space, 0).make_loader(batch_size=plan.mixture.batch_size)
    for _ in range(64):
        b = loader.next_batch()
        h.update(b.kind.encode())
        h.update(b.tokens.numpy().tobytes())
        if b.loss_mask is not None:
            h.update(b.loss_mask.numpy().tobytes())
    assert h.hexdigest() == "b99f4ecd35477d89ab5b20f01200842b312fc42deb15fa4dc5cc0fee88f4d87e"


def _files(out: Path) -> dict | None:
    """Every file under ``out`` with its content (None: no such folder)."""
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else None


def _refused(capsys, args: list[str], out: Path, match: str) -> None:
    """A one-line error (exit 2), and ``out`` as it was (absent, or unchanged)."""
    before = _files(out)
    assert main(["compare", *FAST, "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert _files(out) == before


def test_bad_input_is_one_line_and_writes_nothing(texts, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "runs" / "new"
    small = tmp_path / "small.txt"
    small.write_text("too short for one batch\n")
    tiny_heldout = tmp_path / "tiny.txt"
    tiny_heldout.write_text("a few words\n")
    corpus = str(texts / "corpus.txt")
    _refused(capsys, ["--data", str(tmp_path / "missing.txt")], out, "missing.txt")
    _refused(capsys, ["--data", str(small)], out, "fewer than one batch needs: (batch 4 + 1) x lm_seq_len 32")
    _refused(capsys, ["--data", corpus, "--heldout", str(tiny_heldout)], out, "shorter than one window of 33")
    _refused(capsys, ["--data", corpus, "--tokenizer", str(tmp_path / "no-tokenizer")], out, "no-tokenizer")
    _refused(capsys, ["--tokenizer", "byte"], out, "go with --data")
    _refused(capsys, ["--data", corpus, "--set", "lm_every=4"], out, "add --synthetic")


def test_a_folder_on_other_text_is_refused(run, texts, tmp_path, capsys):
    other = _write_text(tmp_path / "other.txt", 60, 5)
    for args in (["--data", str(other), "--heldout", str(texts / "heldout.txt")],  # other training text
                 ["--data", str(texts / "corpus.txt")],  # the validation split instead of the held-out file
                 []):  # the bundled Shakespeare
        _refused(capsys, [*args, "--seeds", "2"], run, "this folder holds a comparison on")


def test_a_bpe_tokenizer_and_the_validation_split(texts, tmp_path, capsys, monkeypatch):
    """With a tokenizer trained on the text and no --heldout: the corpus's validation split, every
    token once; `difftx eval lm` on a model gives what compare stored; another tokenizer on the same
    folder is refused."""
    from difftx.data import prepare_data, train_bpe
    from difftx.tasks.runner import evaluate_checkpoint

    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    corpus = str(texts / "corpus.txt")
    train_bpe([corpus], vocab_size=300, out_dir=tmp_path / "tok")
    out = tmp_path / "bpe"
    args = ["--data", corpus, "--tokenizer", str(tmp_path / "tok"), "--set", "curve_points=0"]
    assert main(["compare", *FAST, *args, "--seeds", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    res = json.loads((out / "results.json").read_text())
    val = prepare_data(corpus, str(tmp_path / "tok"), progress=False).val
    lm = res["runs"]["0"]["diff"]["tasks"]["lm"]
    assert lm["distinct_tokens"] == lm["tokens"] == len(val) - 1 and "validation split" in lm["source"]
    assert res["text"]["tokenizer"].startswith("bpe-") and res["arms"]["diff"]["config"]["vocab_size"] == 300
    assert "heldout_curve" not in res["runs"]["0"]["diff"]["train"]
    again = evaluate_checkpoint("lm", out / "seed0" / "diff" / "model", settings=get_preset(
        "smoke").on_text(corpus).task_settings()["lm"].__class__(windows=0, extrapolation_factors=(1,)), progress=False)
    assert again["heldout"]["nll"] == lm["heldout"]["nll"]
    _refused(capsys, ["--data", corpus, "--seeds", "1"], out, "this folder holds a comparison on")


def test_a_folder_from_before_the_new_fields_still_resumes(tmp_path):
    """compare.json written before `--data` and the curve existed (no such preset fields, no text)
    is the same comparison: a re-run trains nothing."""
    from difftx.compare import run_compare

    fast = {"steps": 4, "warmup_steps": 1, "log_every": 2, "probe_every": 2, "probe_samples": 1,
            "tasks": {"needle": {"samples_per_cell": 1, "grid": ((1, 1),), "depths": (0.0,)}, "lm": {"windows": 2},
                      "attention": {"samples": 1, "cells": ((1, 1),), "depths": (0.0,)}, "outliers": {"tokens": 64},
                      "quant": {"bits": (4,), "needle_samples": 1, "cells": ((1, 1),), "depths": (0.0,)},
                      "icl": {"instances": 2, "queries": 2, "orders": 2}, "diagnostics": {"cell": (1, 1)}}}
    run_compare("smoke", 1, tmp_path, progress=False, workers=1, **fast)
    meta = json.loads((tmp_path / "compare.json").read_text())
    for key in ("data", "tokenizer", "heldout", "curve_points", "curve_windows"):
        del meta["preset"][key]
    (tmp_path / "compare.json").write_text(json.dumps(meta))
    res = run_compare("smoke", 1, tmp_path, progress=False, workers=1, **fast)
    assert not any(d["trained"] or d["evaluated"] for d in res.get("this_run").values())


def test_a_comparison_moved_with_its_text_evaluates_from_anywhere(texts, tmp_path, capsys, monkeypatch):
    """compare_task.json records your text's files also relative to the model: a comparison folder moved
    together with its text (and evaluated from another directory) finds them where they are now."""
    import shutil

    from difftx.tasks.runner import evaluate_checkpoint

    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    proj = tmp_path / "proj"
    (proj / "text").mkdir(parents=True)
    for name in ("corpus.txt", "heldout.txt"):
        shutil.copy(texts / name, proj / "text" / name)
    out = proj / "runs" / "cmp"
    assert main(["compare", *FAST, "--data", str(proj / "text" / "corpus.txt"), "--heldout",
                 str(proj / "text" / "heldout.txt"), "--set", "curve_points=0", "--seeds", "1", "--out", str(out)]) == 0
    lm = json.loads((out / "results.json").read_text())["runs"]["0"]["diff"]["tasks"]["lm"]
    moved = tmp_path / "elsewhere" / "proj2"
    moved.parent.mkdir()
    proj.rename(moved)
    monkeypatch.chdir(tmp_path / "elsewhere")
    model = moved / "runs" / "cmp" / "seed0" / "diff" / "model"
    settings = get_preset("smoke").on_text("unused.txt").task_settings()["lm"].__class__(
        windows=0, extrapolation_factors=(1,))
    again = evaluate_checkpoint("lm", model, settings=settings, progress=False)
    assert again["heldout"]["nll"] == lm["heldout"]["nll"]
    assert again["source"] == f"all of {moved / 'text' / 'heldout.txt'}"
    capsys.readouterr()
    assert main(["eval", "lm", str(model), "--no-progress"]) == 0
    # the comparison itself, continued there with the text's new paths: the same text by content, nothing retrained
    record = (model.parent / "train.json").read_text()
    assert main(["compare", *FAST, "--data", str(moved / "text" / "corpus.txt"), "--heldout",
                 str(moved / "text" / "heldout.txt"), "--set", "curve_points=0", "--seeds", "1", "--out",
                 str(moved / "runs" / "cmp")]) == 0
    assert (model.parent / "train.json").read_text() == record
    (moved / "text" / "heldout.txt").unlink()  # gone from both places: the saved path is named
    assert main(["eval", "lm", str(model), "--no-progress"]) == 2
    assert str(proj / "text" / "heldout.txt") in capsys.readouterr().err
