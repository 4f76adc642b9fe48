"""What ``difftx compare`` hands to the tasks, as typed objects with JSON in and out
(difftx.tasks.subject: TaskSpace, CompareTask, TrainRecord), and the probe cell clipped to the
subject's needle task (difftx.tasks.common)."""

import json
from types import SimpleNamespace

import pytest

from difftx.eval.icl import ICLBlock
from difftx.eval.needle import NeedleBlock
from difftx.tasks.common import probe_cell
from difftx.tasks.subject import TASK_FILE, TRAIN_RECORD, CompareTask, TaskSpace, TextBlock, TextData, TrainRecord

NEEDLE = NeedleBlock(n_keys=16, n_filler=20, context_len=48, max_needles=4, max_query=2)
ICL = ICLBlock(n_classes=2, n_features=8, features_per_class=2, input_len=2, n_labels=4, n_demos=4,
               first_id=NEEDLE.vocab_size + 300)


MIXED = TaskSpace({"needle": NEEDLE, "lm": TextBlock(NEEDLE.vocab_size, 300), "icl": ICL})


@pytest.mark.parametrize("space", [MIXED, TaskSpace({"needle": NEEDLE}), TaskSpace({"lm": TextBlock(0)}),
                                   TaskSpace({"lm": TextBlock(0, 1000)})])
def test_task_space_round_trips_through_json(space):
    data = json.loads(json.dumps(space.to_dict()))
    assert data["lm_offset"] == (space.block("needle").vocab_size if space.block("needle") else 0)
    back = TaskSpace.from_dict(data)
    assert back == space and back.vocab_size == space.vocab_size


def test_compare_task_round_trips_through_its_file(tmp_path):
    task = CompareTask(MIXED, 32, TextData("/data/book.txt", "byte", "/data/held.txt"))
    path = task.write(tmp_path)
    assert path == tmp_path / TASK_FILE
    assert CompareTask.read(tmp_path) == task
    plain = CompareTask(TaskSpace({"lm": TextBlock(0)}), 64)
    plain.write(tmp_path)
    assert CompareTask.read(tmp_path) == plain


def test_compare_task_reads_a_file_without_the_newer_keys(tmp_path):
    """A compare_task.json written before lm_vocab and text were always written (bytes: 257 ids)."""
    (tmp_path / TASK_FILE).write_text(json.dumps({"needle_task": NEEDLE.to_dict(), "lm": True,
                                                  "lm_offset": NEEDLE.vocab_size, "lm_seq_len": 32, "icl_task": None}))
    task = CompareTask.read(tmp_path)
    assert task.space == TaskSpace({"needle": NEEDLE, "lm": TextBlock(NEEDLE.vocab_size)})
    assert task.space.block("lm").size == 257 and task.text is None
    (tmp_path / TASK_FILE).write_text(json.dumps({"needle_task": {"n_keys": "many"}}))
    with pytest.raises(ValueError, match="does not describe a compare task"):
        CompareTask.read(tmp_path)


def _record(**kw) -> TrainRecord:
    return TrainRecord(arm="diff", seed=0, config={"dim": 8}, parameters=100, steps=4,
                       history=[{"step": 2, "lr": 1e-3, "needle_loss": 2.5}], wall_s=1.5, cpu_s=2.0, **kw)


def test_train_record_round_trips_through_its_file(tmp_path):
    rec = _record(probes=[{"step": 2, "accuracy": {"1/1": 0.5}}], device="cpu", threads=1, world_size=1,
                  invocation="x", heldout_curve={"steps": [4], "loss": [2.0]})
    path = rec.write(tmp_path)
    assert path == tmp_path / TRAIN_RECORD
    assert TrainRecord.read(tmp_path) == rec
    assert json.loads(path.read_text()) == rec.to_dict()


def test_train_record_writes_its_optional_parts_only_when_set():
    d = _record().to_dict()
    assert "probes_skipped" not in d and "heldout_curve" not in d
    assert d["invocation"] is None and d["probes"] == []  # always written
    assert _record(probes_skipped="no needles").to_dict()["probes_skipped"] == "no needles"
    assert list(d)[:6] == ["arm", "seed", "config", "parameters", "steps", "history"]


def test_train_record_refuses_what_is_not_one(tmp_path):
    old = {k: v for k, v in _record().to_dict().items() if k not in ("invocation", "world_size", "resumed_from")}
    assert TrainRecord.from_dict(old).invocation is None  # a record of an older difftx
    with pytest.raises(ValueError, match=r"missing \['history'\]"):
        TrainRecord.from_dict({k: v for k, v in old.items() if k != "history"}, "x/train.json")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['losses'\]"):
        TrainRecord.from_dict({**old, "losses": []})
    with pytest.raises(ValueError, match="not found; expected the training record"):
        TrainRecord.read(tmp_path)


def test_the_probe_cell_is_clipped_to_what_the_needle_task_can_pose():
    compare_model = SimpleNamespace(needle=NEEDLE)
    assert probe_cell(compare_model, (6, 2)) == (4, 2)
    assert probe_cell(compare_model, None) == (4, 2)
    assert probe_cell(compare_model, (3, 3)) == (3, 2)
    assert probe_cell(compare_model, (2, 1)) == (2, 1)
    assert probe_cell(SimpleNamespace(needle=NeedleBlock(n_keys=16, n_filler=20, context_len=48, max_needles=2,
                                                         max_query=1)), None) == (2, 1)
