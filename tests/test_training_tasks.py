"""Training tasks as a registry (difftx/compare/training_tasks, docs/training-tasks.md).

The built-in tasks draw exactly the batches they drew before they moved into the registry (a digest of every
built-in preset's first batches, computed on c452e65); the docs' example task, run from the page itself, takes
its share of the steps and its own ids, and a compare model trains on it with its loss and probe recorded."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from test_compare import FAST, as_sets
from difftx.compare.presets import PRESETS, get_preset
from difftx.compare.stream import CompareStream
from difftx.compare.training_tasks import (
    BUILTIN, TRAINING_TASKS, TrainingTask, register_training_task, unregister_training_task,
)
from difftx.tasks.subject import CompareTask, TaskSpace

DOC = Path(__file__).resolve().parents[1] / "docs" / "training-tasks.md"

# sha256 (first 16 hex digits) of the task space, the shares and the first 24 global batches (kind, tokens,
# loss mask, targets, mask total) of seeds 0 and 1, computed before the registry (commit c452e65)
DIGESTS = {"smoke": "10d5b885827cb9ed", "cpu": "30e16161e899cf45", "recall-cpu": "cf3d3b1d12c6eb9a",
           "from-cpu": "6d10751f6b86e0d0", "gpu-small": "bedd21e863612f4a", "smoke+recall": "182edb2239969219"}
MIXED = {"recall_every": 5, "recall_vocab": 32, "recall_len": 16, "recall_pairs": (2, 3)}


def _digest(plan, steps: int = 24, seeds=(0, 1)) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(plan.space.to_dict(), sort_keys=True).encode())
    h.update(json.dumps(plan.mixture.shares(), sort_keys=True).encode())
    for seed in seeds:
        loader = CompareStream(plan.mixture, plan.space, seed).make_loader(batch_size=plan.mixture.batch_size)
        for _ in range(steps):
            b = loader.next_batch()
            h.update(b.kind.encode())
            for t in (b.tokens, b.loss_mask, b.targets):
                h.update(b"-" if t is None else t.contiguous().numpy().tobytes())
            h.update(str(b.mask_total).encode())
    return h.hexdigest()[:16]


def test_every_built_in_preset_draws_the_batches_it_drew_before_the_registry():
    assert set(DIGESTS) == set(PRESETS) | {"smoke+recall"}
    for name, want in DIGESTS.items():
        plan = get_preset("smoke", **MIXED).resolve() if name == "smoke+recall" else PRESETS[name].resolve()
        assert _digest(plan) == want, name


def test_the_registry_holds_the_built_in_tasks_in_order_and_refuses_bad_registrations():
    assert tuple(TRAINING_TASKS)[:4] == BUILTIN == ("needle", "lm", "icl", "recall")
    assert [t.name for t in TRAINING_TASKS.values() if t.rest] == ["needle"]
    with pytest.raises(ValueError, match="already registered"):
        register_training_task(TRAINING_TASKS["lm"], replace=True)  # a built-in task stays
    with pytest.raises(ValueError, match="built-in"):
        unregister_training_task("recall")
    with pytest.raises(TypeError, match="TrainingTask"):
        register_training_task(object())

    class Rest(TrainingTask):
        name, rest = "other_rest", True

    with pytest.raises(ValueError, match="only one task takes the rest"):
        register_training_task(Rest())

    class Bad(TrainingTask):
        name = "not a name"

    with pytest.raises(ValueError, match="identifier"):
        register_training_task(Bad())
    assert tuple(TRAINING_TASKS) == BUILTIN


def _blocks() -> list[str]:
    """The page's Python blocks that register a task: the example, then its replacement of recall."""
    return [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "register_training_task(" in b]


def _example() -> str:
    """The page's example task: its class and its registration."""
    return _blocks()[0]


@pytest.fixture
def copy_task():
    """The docs' example task (run from the page), registered; removed afterwards."""
    exec(compile(_example(), str(DOC), "exec"), {})  # noqa: S102 - the documentation's own code
    assert "copy" in TRAINING_TASKS
    yield TRAINING_TASKS["copy"]
    unregister_training_task("copy")
    assert tuple(TRAINING_TASKS) == BUILTIN


def test_the_documented_task_takes_its_share_of_the_steps_and_its_own_ids(copy_task):
    plan = get_preset("smoke").resolve()
    assert plan.mixture.shares() == pytest.approx({"needle": 0.4, "lm": 1 / 3, "icl": 1 / 6, "recall": 0.0,
                                                   "copy": 0.1})
    ids = plan.space.ids("copy")
    assert ids == range(351, 368) and ids.start == plan.space.block("icl").vocab_size  # after every built-in task's ids
    assert plan.arms["diff"].vocab_size == plan.space.vocab_size == ids.stop
    assert plan.arms["diff"].max_seq_len >= 2 * copy_task.length
    assert CompareTask.from_dict(CompareTask(plan.space, 32).to_dict()).space == plan.space  # compare_task.json

    unregister_training_task("copy")
    try:
        before = get_preset("smoke").resolve()
    finally:
        register_training_task(copy_task)
    assert "blocks" not in before.space.to_dict() and before.space == TaskSpace(
        {n: b for n, b in plan.space.blocks.items() if n != "copy"})
    with_copy = CompareStream(plan.mixture, plan.space, 3).make_loader(batch_size=8)
    without = CompareStream(before.mixture, before.space, 3).make_loader(batch_size=8)
    for step in range(1, 13):
        b = with_copy.next_batch()
        if step < 5:  # the same batches until the task's first step (5)
            a = without.next_batch()
            assert a.kind == b.kind and torch.equal(a.tokens, b.tokens)
        assert b.kind == plan.mixture.step_kind(step) == ("copy" if step in (5, 10) else b.kind)
        if b.kind == "copy":
            assert b.tokens.shape == (8, 17) and b.loss_mask.shape == (8, 16) and b.loss_mask[:, 8:].all()
            assert int(b.tokens.min()) >= ids.start and int(b.tokens.max()) < ids.stop
            assert torch.equal(b.tokens[:, :8], b.tokens[:, 9:]) and (b.tokens[:, 8] == ids[-1]).all()


def test_a_compare_model_trains_on_the_documented_task_with_its_loss_and_probe(copy_task, tmp_path):
    from difftx.compare.train import train_models

    plan = get_preset("smoke", icl_every=0).resolve()
    record = train_models("diff", plan, [0], [tmp_path / "m"], progress=False)[0]
    copied = [h["copy_loss"] for h in record["history"] if "copy_loss" in h]
    assert len(copied) == 2 and all(0 < v < 10 for v in copied)  # copy steps 5 and 10 in the logs of 8 and 12
    probed = [p for p in record["probes"] if "copy_accuracy" in p]
    assert [p["step"] for p in probed] == [6, 12] and all(0 <= p["copy_accuracy"] <= 1 for p in probed)
    assert "accuracy" in probed[0]  # the needle probe beside it
    assert CompareTask.read(tmp_path / "m" / "model").space.ids("copy") == plan.space.ids("copy")


def test_a_comparison_with_the_documented_task_writes_its_report(copy_task, tmp_path):
    """report.md names a registered training task by its label in the training mix (before: a KeyError after the
    models and results.json were written)."""
    from difftx.compare import run_compare

    res = run_compare("smoke", 1, tmp_path / "cmp", progress=False, workers=1, icl_every=0)
    share = res.mixture["shares"]["copy"]
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert f"{100 * share:.3g}% copying" in report and share > 0
    # the training section plots the registered task's loss beside the built-in ones
    pngs = {p.name for p in (tmp_path / "cmp").rglob("*.png")}
    assert {"copy_loss.png", "needle_loss.png", "lm_loss.png"} <= pngs, pngs


def test_a_task_in_a_kinds_file_reaches_the_command_line_and_its_workers(tmp_path):
    """The page's task written to a file named by `difftx --kinds`: `compare --workers 2` (two worker processes, each
    importing the file through DIFFTX_KINDS) trains both seeds on it and the report plots its loss."""
    import subprocess
    import sys

    (tmp_path / "copytask.py").write_text(_example())
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-m", "difftx", "--kinds", str(tmp_path / "copytask.py"), "compare",
                           "--preset", "smoke", "--seeds", "2", "--workers", "2", "--out", str(out),
                           *as_sets({k: v for k, v in FAST.items() if k != "steps"})],  # smoke's 12 steps
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["mixture"]["shares"]["copy"] > 0
    for seed in ("0", "1"):
        history = results["runs"][seed]["diff"]["train"]["history"]
        assert any("copy_loss" in h for h in history), seed
    assert "copying" in (out / "report.md").read_text() and (out / "plots" / "copy_loss.png").is_file()


def test_compare_from_refuses_a_registered_task_rather_than_drop_it(copy_task, tmp_path):
    """docs/training-tasks.md: `compare --from` refuses a registered task (its ids are not in the source's
    vocabulary); it used to drop it silently when LM and recall took every step."""
    (tmp_path / "text.txt").write_text("some text\n")
    with pytest.raises(ValueError, match=r"registered training task\(s\) \['copy'\] would need ids"):
        get_preset("from-cpu", source=str(tmp_path / "src"), data=str(tmp_path / "text.txt")).resolve()


def test_a_task_whose_steps_are_all_taken_is_refused_naming_the_tasks_that_take_them(copy_task, monkeypatch):
    """Every 3rd step of smoke is an LM step: a period of 3 leaves the copy task nothing, and the error says who
    has its steps."""
    monkeypatch.setattr(copy_task, "period", 3)
    with pytest.raises(ValueError, match=r"training task 'copy': every 3-th step is already another task's \(lm\)"):
        get_preset("smoke").resolve()


def test_a_model_trained_on_a_registered_task_is_not_reused_once_the_task_changes(copy_task, tmp_path, capsys,
                                                                                   monkeypatch):
    """Each model's train.json records the registered task's code (SHA-256) and settings: a re-run with other
    settings is refused naming them; the task as it was is reused."""
    from difftx.cli import main

    monkeypatch.setenv("DIFFTX_KINDS", "")
    out = tmp_path / "cmp"
    argv = ["compare", "--preset", "smoke", "--seeds", "1", "--out", str(out), "--workers", "1", "--no-progress",
            "--set", "steps=10", "--set", "warmup_steps=1", "--set", "icl_every=0", "--set", "probe_every=0"]
    assert main(argv) == 0
    rec = json.loads((out / "seed0" / "diff" / "train.json").read_text())
    recorded = rec["request"]["tasks"]["copy"]
    assert len(recorded["sha256"]) == 64 and recorded["settings"]["length"] == "8"
    monkeypatch.setattr(copy_task, "length", 7)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "this model was trained with training tasks copy: code" in err and "'length': '8'" in err, err
    monkeypatch.setattr(copy_task, "length", 8)
    assert main(argv) == 0  # the task as it was: reused


def test_the_documented_task_replaces_recall_in_a_preset(copy_task, tmp_path, monkeypatch):
    """The page's replacement, run as written (7 seeds and its folder traded for 2 seeds of 12 steps in tmp_path):
    every step a copy step, the vocabulary the copy task's ids alone, each model's copy loss and probe recorded,
    the evaluation tasks that need a built-in task's inputs skipped with a reason, diagnostics without inputs."""
    import difftx.compare

    real, runs = difftx.compare.run_compare, []

    def small(preset, seeds, out, **kw):
        runs.append(real(preset, 2, tmp_path / "cmp", progress=False, workers=1, stack=1, steps=12, warmup_steps=2,
                         probe_every=6, **kw))
        return runs[-1]

    monkeypatch.setattr(difftx.compare, "run_compare", small)
    # the class of the page's example, defined above it; run as a script runs (the call is under the __main__ guard)
    namespace: dict = {"CopyTask": type(copy_task), "__name__": "__main__"}
    exec(compile(_blocks()[1], str(DOC), "exec"), namespace)  # noqa: S102 - the documentation's own code
    assert namespace["preset"].resolve().mixture.shares() == {"needle": 0.0, "lm": 0.0, "icl": 0.0, "recall": 0.0,
                                                              "copy": 1.0}
    assert list(namespace["preset"].resolve().space.blocks) == ["copy"]
    res = runs[0]
    for seed in res.seeds:
        for arm in res.arms:
            run = res.run(seed, arm)
            assert all("copy_loss" in h for h in run.train["history"])
            assert [p["step"] for p in run.train["probes"] if "copy_accuracy" in p] == [6, 12]
            assert "skipped" in run.tasks["recall"] and "skipped" in run.tasks["needle"]
            # the reasons name what it trained on: not "language modelling only", as they said
            assert run.train["probes_skipped"] == "the model was trained without needle batches (on copy batches)"
            assert run.tasks["needle"]["skipped"] == run.train["probes_skipped"]
            assert run.tasks["diagnostics"]["head_redundancy"] == [None, None]
    assert (tmp_path / "cmp" / "plots" / "copy_loss.png").is_file()
    # the report's '-' gives the recorded reason, not "a layer with one head" (each has 2 or 4)
    assert "'-': the model has no held-out text, needle task or recall task to take inputs from)" in \
        (tmp_path / "cmp" / "report.md").read_text()
    register_training_task(copy_task, replace=True)  # the fixture's own instance again, for its teardown
