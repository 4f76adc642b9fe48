"""A compare model's training record names the arm it was trained as ``arm`` (``train.json`` and
``runs.{seed}.{arm}.train`` of ``results.json``); records written before call it ``kind`` and still read, and a
finished model with such a record is reused only when it was trained as asked. No model is trained here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from difftx.compare.folder import check_reuse, training_request
from difftx.compare.presets import get_preset
from difftx.compare.schema import (COMPARISON_KEYS, PAIRED_KEYS, SCHEMA, VERSION_KEYS, from_json, results_json,
                                   to_json, validate_results)
from difftx.compare.train import train_models
from difftx.tasks.subject import TRAIN_RECORD, TrainRecord, arm_record
from test_compare import FAST


@pytest.fixture(scope="module")
def preset():
    return get_preset("smoke", **FAST)


def _old_record(plan, arm: str, seed: int, request: dict) -> dict:
    """A ``train.json`` as difftx wrote it before the arm was named ``arm``: ``kind``, also in its request."""
    return {"kind": arm, "seed": seed, "config": plan.arms[arm].to_dict(), "parameters": 100,
            "steps": plan.schedule.steps, "history": [{"step": 3, "lr": 1e-3, "lm_loss": 2.0}], "probes": [],
            "probe_s": 0.0, "wall_s": 1.0, "cpu_s": 1.0, "request": {**request, "kind": arm, "seed": seed}}


def test_a_record_writes_arm_and_reads_an_older_one_with_kind(tmp_path, preset):
    plan = preset.resolve()
    old = _old_record(plan, "diff", 0, training_request(preset, None))
    (tmp_path / TRAIN_RECORD).write_text(json.dumps(old))
    rec = TrainRecord.read(tmp_path)
    assert rec.arm == "diff" and rec.request["arm"] == "diff" and "kind" not in rec.request
    new = rec.to_dict()
    assert list(new)[:2] == ["arm", "seed"] and "kind" not in new
    rec.write(tmp_path)  # written again: today's form
    assert json.loads((tmp_path / TRAIN_RECORD).read_text())["arm"] == "diff"
    assert arm_record(new) == new and list(arm_record(old))[:2] == ["arm", "seed"]
    with pytest.raises(ValueError, match=r"missing \['arm'\]"):
        TrainRecord.from_dict({k: v for k, v in old.items() if k != "kind"}, "x/train.json")


def test_an_older_record_is_reused_only_as_asked(tmp_path, preset):
    """check_reuse reads an older train.json (``kind``): the model it describes is reused when asked for the same
    arm and seed, and refused (naming the arm or the seed) when not."""
    plan, request = preset.resolve(), training_request(preset, None)
    folder = tmp_path / "seed0" / "diff"
    folder.mkdir(parents=True)
    (folder / TRAIN_RECORD).write_text(json.dumps(_old_record(plan, "diff", 0, request)))
    check_reuse(plan, [("diff", (0,), (str(folder),))], request)  # as asked: reused, nothing raised
    with pytest.raises(ValueError, match=r"trained with arm 'diff', not 'baseline' as asked \(differs in \['arm'"):
        check_reuse(plan, [("baseline", (0,), (str(folder),))], request)
    with pytest.raises(ValueError, match=r"trained with seed 0, not 1 as asked"):
        check_reuse(plan, [("diff", (1,), (str(folder),))], request)


def _results(version: int, key: str | None) -> dict:
    """The smallest ``results.json`` the schema accepts: one seed, arms diff and baseline, one metric; each model's
    training record names its arm under ``key`` (None: nowhere)."""
    train = {"seed": 0, "config": {}, "parameters": 1, "steps": 1, "history": [], "wall_s": 0.0, "cpu_s": 0.0}
    metric = {**{k: t() for k, t in COMPARISON_KEYS.items()}, "arms": ["diff", "baseline"],
              "values": {"diff": [1.0], "baseline": [2.0]}, "means": {"diff": 1.0, "baseline": 2.0},
              "paired": {k: 0.0 for k in PAIRED_KEYS}}
    return {"schema": SCHEMA, "schema_version": version, "created": "", "versions": {k: "" for k in VERSION_KEYS},
            "preset": {}, "mixture": {}, "seeds": [0],
            "arms": {a: {"config": {}, "parameters": 1} for a in ("diff", "baseline")}, "tasks": {},
            "runs": {"0": {a: {"train": {**({key: a} if key else {}), **train}, "tasks": {}}
                           for a in ("diff", "baseline")}},
            "null_reasons": {}, "wall_s": 0.0, "looks": [], "look": 1,
            "comparisons": {"diff vs baseline": {"arms": ["diff", "baseline"], "primary": True,
                                                 "metrics": {"m": metric}}}}


@pytest.mark.parametrize("version", [4, 5])
def test_results_json_with_kind_still_reads(version):
    old = _results(version, "kind")
    validate_results(old)
    res = from_json(old)
    assert res.run(0, "baseline").train["arm"] == "baseline" and "kind" not in res.run(0, "diff").train
    written = json.loads(results_json(res))  # written again: version 5, "arm"
    assert written["schema_version"] == 5 and written["runs"]["0"]["diff"]["train"]["arm"] == "diff"
    assert to_json(from_json(written)) == written
    with pytest.raises(ValueError, match=r"runs.0.diff.train lacks 'arm'"):
        validate_results(_results(version, None))


def test_an_unknown_arm_is_refused_in_one_line(tmp_path, preset):
    with pytest.raises(ValueError, match=r"^arm: must be one of \('baseline', 'diff'\), got 'nope'$"):
        train_models("nope", preset.resolve(), [0], [Path(tmp_path)], progress=False)
