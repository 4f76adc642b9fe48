"""Run files read through one strict reader (issue 41 item 6): a hand-edited file of the wrong type is
a one-line error naming the file and the field (train_config.json, trainer_state.json, metrics.jsonl,
train.json), never an AttributeError or a table printing ``20/many``; an evaluation file changed
since difftx wrote it (its seal does not match) is redone, like a torn one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from difftx.cli import main
from difftx.io import check_record, seal, unsealed
from test_compare import FAST, as_sets
from test_errors import run_cli, snapshot


def test_check_record_names_the_field():
    data = {"steps": "many", "history": [{"step": 1, "lm_loss": 0.5}, {"step": 2, "lm_loss": "x"}], "h": None}
    for fields, message in (({"steps": "posint"}, "field 'steps' is \"many\", expected a positive integer"),
                            ({"history[].lm_loss": "number?"}, "field 'history[1].lm_loss' is \"x\", expected a "
                                                               "number or null"),
                            ({"nope": "int"}, "field 'nope' is missing"),
                            ({"h": "int~"}, "field 'h' is null, expected a non-negative integer"),
                            ({"history[].step.x": "int"}, "field 'history[0].step' is 1, expected an object")):
        with pytest.raises(ValueError, match="^F.json: ") as got:
            check_record(data, fields, "F.json")
        assert message in str(got.value), got.value
    assert check_record(data, {"history": "list", "nope": "int?", "gone": "int~", "h.x": "int"}, "F.json") is data
    with pytest.raises(ValueError, match="F.json: not a record"):
        check_record([1], {}, "F.json")


def test_a_seal_tells_a_changed_file():
    sealed = seal({"nll": 1.25, "windows": [1, 2]})
    assert unsealed(json.loads(json.dumps(sealed)), "f") == {"nll": 1.25, "windows": [1, 2]}
    with pytest.raises(ValueError, match="f: changed since difftx wrote it"):
        unsealed({**sealed, "nll": "1.25"}, "f")
    assert unsealed({"nll": 2.0}, "f") == {"nll": 2.0}  # no seal: returned as it is


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "run"
    assert main(["train", "--preset", "test", "--set", "steps=4", "--set", "log_interval=2", "--out", str(run),
                 "--no-progress"]) == 0
    return run


def _edited(tmp_path: Path, run: Path, name: str, edit) -> Path:
    copy = tmp_path / "r"
    shutil.copytree(run, copy)
    path = copy / name if (copy / name).exists() else next(copy.glob(f"checkpoints/step_*/{name}"))
    if name.endswith(".jsonl"):
        lines = path.read_text().splitlines()
        lines[0] = json.dumps(edit(json.loads(lines[0])))
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return path


@pytest.mark.parametrize("name, field, value", [("train_config.json", "steps", "many"),
                                                ("trainer_state.json", "step", "x"),
                                                ("trainer_state.json", "loaders", "none"),
                                                ("metrics.jsonl", "loss", "low")])
def test_runs_reports_a_malformed_file(capsys, tmp_path, trained_run, name, field, value):
    path = _edited(tmp_path, trained_run, name, lambda d: {**d, field: value})
    before = snapshot(tmp_path / "r")
    code, err = run_cli(capsys, "runs", str(trained_run), str(tmp_path / "r"))
    assert code == 2 and str(path) in err and repr(field) in err, err
    assert snapshot(tmp_path / "r") == before
    if name == "metrics.jsonl":
        assert "line 1" in err


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[Path, list]:
    out = tmp_path_factory.mktemp("cmp") / "c"
    cmd = ["compare", "--preset", "smoke", "--seeds", "1", "--out", str(out), "--workers", "1", "--no-progress",
           *as_sets(FAST)]
    assert main(cmd) == 0
    return out, cmd


def test_compare_names_a_malformed_training_record(capsys, tmp_path, compared):
    out, cmd = compared
    copy = tmp_path / "c"
    shutil.copytree(out, copy)
    record = copy / "seed0" / "baseline" / "train.json"
    for field, value, expected in (("history", "abc", "expected a list"), ("steps", "many", "a positive integer"),
                                   ("wall_s", None, "expected a number")):
        data = json.loads((out / "seed0" / "baseline" / "train.json").read_text())
        record.write_text(json.dumps({**data, field: value}))
        before = snapshot(copy)
        code, err = run_cli(capsys, *[str(copy) if a == str(out) else a for a in cmd])
        assert code == 2 and f"{record}: field {field!r}" in err and expected in err, err
        assert snapshot(copy) == before


def test_a_changed_evaluation_is_redone(capsys, tmp_path, compared):
    out, cmd = compared
    copy = tmp_path / "c"
    shutil.copytree(out, copy)
    lm = copy / "seed0" / "diff" / "evals" / "lm.json"
    data = json.loads(lm.read_text())
    data["heldout"]["nll"] = str(data["heldout"]["nll"])  # a number made text by hand
    lm.write_text(json.dumps(data))
    capsys.readouterr()
    assert main([str(copy) if a == str(out) else a for a in cmd]) == 0
    err = capsys.readouterr().err
    assert f"redoing an evaluation: {lm}: changed since difftx wrote it" in err
    again, first = (json.loads(p.read_text()) for p in (lm, out / "seed0" / "diff" / "evals" / "lm.json"))
    timed = ("wall_s", "difftx_sha256")  # the evaluation's time, and so its seal, differ
    assert isinstance(again["heldout"]["nll"], float)
    assert {k: v for k, v in again.items() if k not in timed} == {k: v for k, v in first.items() if k not in timed}
