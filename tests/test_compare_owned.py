"""Folders that are never taken over, and models reused only as asked (issue 31 items 4-8): compare
refuses a non-empty folder it does not own and a `difftx train` run folder; a symlinked ``.lock`` is
not followed; a finished model whose record says it was trained otherwise is not reused; `train
--resume` on other text of the same size is refused; ``--out`` inside the ``--data`` folder is
refused before training. Every refusal is one line, exit 2, and leaves every file as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from difftx.cli import main
from difftx.compare.run import job_lock
from test_compare import FAST, as_sets
from test_compare_data import FAST as TEXT_FAST
from test_errors import snapshot


def _compare(out: Path, *extra: str, seeds: int = 1) -> list[str]:
    return ["compare", "--preset", "smoke", "--seeds", str(seeds), "--out", str(out), "--workers", "1",
            "--no-progress", *as_sets(FAST), *extra]


def _on_text(out: Path, data: Path, *extra: str) -> list[str]:
    return ["compare", *TEXT_FAST, "--seeds", "1", "--out", str(out), "--data", str(data), *extra]


def _refused(capsys, args: list[str], keep: Path, match: str) -> str:
    before = snapshot(keep)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert snapshot(keep) == before
    return err


def _text(path: Path, lines: int = 400) -> Path:
    words = ["the", "miller", "carried", "a", "basket", "of", "apples", "to", "river", "lantern", "sold", "blue"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(11)) for i in range(lines))
                    + "\n", encoding="utf-8")
    return path


def test_a_symlinked_lock_is_not_followed(tmp_path, capsys):
    precious = tmp_path / "precious.txt"
    precious.write_text("mine\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(precious)
    err = _refused(capsys, ["train", "--preset", "test", "--set", "steps=2", "--out", str(run), "--no-progress"],
                   tmp_path, "a symbolic link, which is not followed; remove it")
    assert str(run / ".lock") in err and precious.read_text() == "mine\n"
    model = tmp_path / "seed0" / "diff"  # compare's per-model lock
    model.mkdir(parents=True)
    (model / ".job.lock").symlink_to(precious)
    with pytest.raises(FileExistsError, match="symbolic link"):
        with job_lock(model, wait=False):
            pass
    assert precious.read_text() == "mine\n"


def test_compare_refuses_a_folder_it_does_not_own(tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "plots").mkdir(parents=True)
    (mine / "report.md").write_text("my notes\n")
    (mine / "results.json").write_text("{}\n")
    _refused(capsys, _compare(mine), mine, "not empty (plots, report.md, results.json) and holds no comparison")
    run = tmp_path / "run"
    assert main(["train", "--preset", "test", "--set", "steps=2", "--out", str(run), "--no-progress"]) == 0
    capsys.readouterr()
    _refused(capsys, _compare(run), run, "a `difftx train` run folder, not a comparison")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(_compare(empty)) == 0  # an empty folder is fine
    assert (empty / "compare.json").is_file()


def test_out_inside_the_data_folder_is_refused_before_training(tmp_path, capsys):
    data = tmp_path / "data"
    _text(data / "a.txt")
    _refused(capsys, _on_text(data / "cmp", data), data, "inside the --data folder")
    _refused(capsys, _on_text(data, data), data, "is --data")


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cmp") / "run"
    assert main(_compare(out)) == 0
    return out


def test_reuse_checks_each_models_record(done, tmp_path, capsys):
    rec = json.loads((done / "seed0" / "diff" / "train.json").read_text())
    assert rec["request"]["preset"]["steps"] == FAST["steps"] and rec["request"]["text"] is None
    assert rec["request"]["seed"] == 0 and rec["request"]["arm"] == "diff"
    # compare.json edited to other steps: the models' own records still say 6
    out = tmp_path / "edited"
    shutil.copytree(done, out)
    meta = json.loads((out / "compare.json").read_text())
    meta["preset"]["steps"] = 3
    (out / "compare.json").write_text(json.dumps(meta))
    _refused(capsys, _compare(out, "--set", "steps=3"), out, "trained with steps 6, not 3 as asked")
    # a seed folder copied from another comparison (seed 0's models as seed 1's)
    out = tmp_path / "copied"
    shutil.copytree(done, out)
    shutil.copytree(out / "seed0", out / "seed1")
    _refused(capsys, _compare(out, seeds=2), out, "trained with seed 0, not 1 as asked")


def test_reuse_checks_the_text_a_model_was_trained_on(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    one, two = _text(tmp_path / "one.txt"), _text(tmp_path / "two.txt", 500)
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(_on_text(a, one)) == 0
    assert main(_on_text(b, two)) == 0
    capsys.readouterr()
    shutil.rmtree(b / "seed0")
    shutil.copytree(a / "seed0", b / "seed0")  # models trained on the other text
    _refused(capsys, _on_text(b, two), b, "trained with text")


def test_train_resume_on_other_text_of_the_same_size_is_refused(tmp_path, capsys):
    book = _text(tmp_path / "book.txt")
    other = tmp_path / "other.txt"
    other.write_text(book.read_text().upper())  # the same byte length, other content
    assert other.stat().st_size == book.stat().st_size
    run = tmp_path / "run"
    assert main(["train", "--preset", "test", "--set", "steps=4", "--set", "ckpt_interval=2", "--data", str(book),
                 "--out", str(run), "--no-progress"]) == 0
    moved = book.rename(tmp_path / "book-moved.txt")  # the original is gone from where the run saved it
    capsys.readouterr()
    _refused(capsys, ["train", "--resume", "--set", "steps=6", "--data", str(other), "--out", str(run),
                      "--no-progress"], run, "has the run's size")
    # the same content under another name continues
    assert main(["train", "--resume", "--set", "steps=6", "--data", str(moved), "--out", str(run),
                 "--no-progress"]) == 0


def test_a_changed_heldout_file_is_named_as_changed(tmp_path, capsys, monkeypatch):
    """Issue 31: a held-out file changed in place (same size) was refused with two identical
    descriptions; the refusal now says that its content changed."""
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    corpus, held = _text(tmp_path / "corpus.txt"), _text(tmp_path / "held.txt", 40)
    out = tmp_path / "run"
    assert main(_on_text(out, corpus, "--heldout", str(held))) == 0
    held.write_text(held.read_text().upper())
    capsys.readouterr()
    _refused(capsys, _on_text(out, corpus, "--heldout", str(held)), out,
             "the same paths and sizes, whose held-out text changed (SHA-256)")


def test_heldout_text_that_is_training_text_is_warned_about(tmp_path, capsys, monkeypatch):
    """Issue 31: --heldout equal to the training text was accepted in silence; it now warns (leakage)."""
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    corpus = _text(tmp_path / "corpus.txt")
    assert main(_on_text(tmp_path / "run", corpus, "--heldout", str(corpus))) == 0
    assert "--heldout" in (err := capsys.readouterr().err) and "leakage" in err, err


def test_eval_lm_on_a_text_compare_model_takes_data_and_names_a_moved_heldout(tmp_path, capsys, monkeypatch):
    """Issue 31: `eval lm --data FILE` on a model of `compare --data` scores FILE (it was refused as "its
    own task vocabulary"); its held-out file gone, the error says how to point at another."""
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    corpus, held = _text(tmp_path / "corpus.txt"), _text(tmp_path / "held.txt", 40)
    other = _text(tmp_path / "other.txt", 60)
    out = tmp_path / "run"
    assert main(_on_text(out, corpus, "--heldout", str(held))) == 0
    model = out / "seed0" / "diff" / "model"
    capsys.readouterr()
    assert main(["eval", "lm", str(model), "--data", str(other), "--no-progress"]) == 0
    assert str(other) in capsys.readouterr().out
    held.rename(tmp_path / "held-moved.txt")
    assert main(["eval", "lm", str(model), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(held) in err and "--data FILE" in err, err


@pytest.mark.parametrize("bad", ["{}", '{"heldout": 3'])
def test_an_unreadable_evaluation_is_redone_and_said(done, tmp_path, capsys, bad):
    """Issue 31: an emptied or torn ``evals/lm.json`` dropped the primary LM metric from the report (or
    stopped it with a KeyError); it is now evaluated again, with a line that says so."""
    out = tmp_path / "run"
    shutil.copytree(done, out)
    path = out / "seed0" / "diff" / "evals" / "lm.json"
    want = json.loads(path.read_text())
    path.write_text(bad)
    capsys.readouterr()
    assert main(_compare(out)) == 0
    assert f"redoing an evaluation: {path}" in capsys.readouterr().err
    # the seal covers wall_s, which differs
    strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_s", "difftx_sha256")}  # noqa: E731
    assert strip(json.loads(path.read_text())) == strip(want)


def test_runs_on_the_same_text_at_other_paths_are_comparable(tmp_path):
    """Issue 31: `runs` called two runs on copies of one text "not directly comparable" by their paths;
    they are compared by the content each run recorded (SHA-256), and other text still gets the note."""
    from difftx.training.summary import comparability_notes, summarize_run

    book = _text(tmp_path / "a" / "book.txt")
    copy = tmp_path / "b" / "book.txt"
    copy.parent.mkdir()
    copy.write_bytes(book.read_bytes())
    other = _text(tmp_path / "c" / "book.txt", 500)
    runs = []
    for i, data in enumerate((book, copy, other)):
        out = tmp_path / f"run{i}"
        assert main(["train", "--preset", "test", "--set", "steps=2", "--data", str(data), "--out", str(out),
                     "--no-progress"]) == 0
        runs.append(summarize_run(out))
    assert comparability_notes(runs[:2]) == []
    assert any("differ in data" in n for n in comparability_notes([runs[0], runs[2]]))


def test_runs_nll_takes_a_compare_models_folders(done, capsys):
    """Issue 31: `runs --nll` refused both ``model/`` and ``train/`` of a compare model; ``model/`` now
    stands for its run, and the run's NLL is that of its saved model."""
    diff, base = done / "seed0" / "diff", done / "seed0" / "baseline"
    capsys.readouterr()
    assert main(["runs", str(diff / "model"), str(base / "train"), "--nll", "--windows", "4"]) == 0
    out = capsys.readouterr().out
    assert f"held-out NLL of {diff / 'train'}:" in out and f"held-out NLL of {base / 'train'}:" in out, out
