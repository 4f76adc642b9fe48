"""A compare preset's schedule and execution: composed parts with flat spellings, checked once, written flat; and
arms of your own merged one override after another."""

import json

import pytest

from difftx.compare.presets import (EXECUTION_DEFAULTS, PRESETS, SCHEDULE_DEFAULTS, ComparePreset, flat_parts,
                                    get_preset, text_overrides)


def test_schedule_and_execution_are_parts_with_flat_spellings():
    p = ComparePreset(lr=1e-3, workers=2)
    assert p.schedule == {**SCHEDULE_DEFAULTS, "lr": 1e-3} and p.execution == {**EXECUTION_DEFAULTS, "workers": 2}
    assert (p.lr, p.steps, p.workers, p.device) == (1e-3, 1500, 2, "auto")
    assert p == ComparePreset(schedule={"lr": 1e-3}, execution={"workers": 2})  # equal presets are equal
    assert ComparePreset(schedule={"lr": 0.1}, lr=1e-3).lr == 1e-3  # the flat spelling wins, as for the model
    plan = get_preset("smoke", schedule={"steps": 8}, execution={"stack": 1}).resolve()
    assert plan.schedule.steps == 8 and plan.execution.stack == 1 and plan.curve.steps[-1] == 8


def test_with_overrides_merges_a_part_into_the_presets():
    smoke = PRESETS["smoke"]
    p = smoke.with_overrides(schedule={"lr": 1e-3}, execution={"workers": 2})
    assert (p.lr, p.steps, p.warmup_steps, p.workers) == (1e-3, smoke.steps, smoke.warmup_steps, 2)
    assert p == smoke.with_overrides(lr=1e-3, workers=2)
    assert p.with_overrides(schedule={"steps": 8}).lr == 1e-3


def test_written_flat_and_read_back():
    for name, preset in PRESETS.items():
        d = preset.to_dict()
        assert "schedule" not in d and "execution" not in d, name
        assert {k: d[k] for k in SCHEDULE_DEFAULTS} == preset.schedule, name
        assert {k: d[k] for k in EXECUTION_DEFAULTS} == preset.execution, name
    p = get_preset("smoke", lr=1e-3, stack=2)
    back = ComparePreset.from_dict(json.loads(json.dumps(p.to_dict())))
    assert (back.schedule, back.execution) == (p.schedule, p.execution)


@pytest.mark.parametrize("given, error", [
    (dict(schedule={"lrr": 1}), r"ComparePreset.schedule: unknown field\(s\) \['lrr'\]; known: steps, batch_size, lr"),
    (dict(execution={"gpus": 1}), r"ComparePreset.execution: unknown field\(s\) \['gpus'\]; known: threads, workers"),
    (dict(schedule=[1]), "ComparePreset.schedule: must be a mapping"),
    (dict(schedule={"lr": float("inf")}), "ComparePreset.lr: must be a finite number, got inf"),
    (dict(workers=0), "ComparePreset.workers: must be a positive integer, got 0"),
    (dict(execution={"stack": -1}), "ComparePreset.stack: must be a non-negative integer"),
    (dict(threads=True), "ComparePreset.threads: must be a positive integer or None"),
    (dict(device="tpu"), "ComparePreset.device: must be auto, cpu or cuda"),
])
def test_each_field_checked_once_with_a_one_line_error(given, error):
    with pytest.raises(ValueError, match=error):
        ComparePreset(**given)
    with pytest.raises(ValueError, match=error):
        PRESETS["smoke"].with_overrides(**given)


def test_the_commands_read_dotted_fields_flat(capsys):
    from difftx.cli import main

    assert flat_parts({"schedule": {"lr": 1e-3}, "execution": {"workers": 2}, "steps": 4}) == \
        {"lr": 1e-3, "workers": 2, "steps": 4}
    with pytest.raises(ValueError, match="--set schedule.lr and --set lr: give it in one place"):
        flat_parts({"schedule": {"lr": 1e-3}, "lr": 1e-3})
    # the model's fields too: --set model.dim=64 --set dim=32 kept 32 silently
    with pytest.raises(ValueError, match="--set model.dim and --set dim: give it in one place"):
        flat_parts({"model": {"dim": 64}, "dim": 32})
    assert flat_parts({"model": {"dim": 64}, "n_layers": 1}) == {"model": {"dim": 64}, "n_layers": 1}
    argv = ["compare", "--preset", "smoke", "--set", "model.dim=64", "--set", "dim=32", "--out", "/nonexistent/x"]
    assert main(argv) == 2
    assert "--set model.dim and --set dim: give it in one place" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"ComparePreset.execution: unknown field\(s\) \['lr'\]"):
        flat_parts({"execution": {"lr": 1e-3}})
    with pytest.raises(ValueError, match="--set probe_every: --data trains on the text alone"):
        text_overrides({"schedule": {"probe_every": 5}}, "book.txt")
    for args, error in ((["--set", "schedule.lr=inf"], "ComparePreset.lr: must be a finite number, got inf"),
                        (["--set", "execution.workers=2", "--workers", "2"], "--workers and --set workers"),
                        (["--set", "schedule.bogus=1"], "ComparePreset.schedule: unknown field(s) ['bogus']"),
                        (["--sweep", "schedule.bogus=1,2"], "'bogus' is not a preset field that can be swept")):
        assert main(["compare", "--preset", "smoke", "--seeds", "2", "--no-progress", *args]) != 0
        assert error in capsys.readouterr().err


def test_compare_json_of_versions_2_and_3_still_reads(tmp_path):
    """A folder's compare.json as version 3 (the schedule's and execution's fields flat, as written now) and
    version 2 (the model's flat too) wrote it is the same comparison; a changed schedule field is named flat."""
    from difftx.compare.folder import COMPARE_FILE, _check_folder

    preset = get_preset("smoke")
    v3 = preset.to_dict()
    v2 = {k: v for k, v in v3.items() if k not in ("model", "primary")} | v3["model"]
    for version, old in ((3, v3), (2, v2)):
        (tmp_path / COMPARE_FILE).write_text(json.dumps({"schema_version": version, "preset": old}))
        _check_folder(tmp_path, preset.with_overrides(execution={"workers": 2}, curve_points=3))  # may change
        with pytest.raises(ValueError, match=r"differs in \['lr'\]"):
            _check_folder(tmp_path, preset.with_overrides(schedule={"lr": 1e-3}))


def test_an_arm_of_your_own_given_again_merges_its_model():
    p = PRESETS["smoke"].with_overrides(own_arms={"mine": {"from": "baseline", "model": {"n_kv_heads": 1},
                                                           "description": "one kv head"}})
    q = p.with_overrides(own_arms={"mine": {"model": {"norm_eps": 1e-6}}})
    assert q.own_arms["mine"] == {"from": "baseline", "model": {"n_kv_heads": 1, "norm_eps": 1e-6},
                                  "description": "one kv head"}
    assert q.with_overrides(own_arms={"mine": {"model": {"n_kv_heads": 2}}}).own_arms["mine"]["model"] == \
        {"n_kv_heads": 2, "norm_eps": 1e-6}  # a field given again: the later value
    assert q.with_overrides(own_arms={"mine": {"from": "diff"}}).own_arms["mine"]["from"] == "diff"
    arm = q.resolve().arms["mine"]
    assert arm.n_kv_heads == 1 and arm.norm_eps == 1e-6 and arm.attention == "standard"


def test_scale_takes_the_parts_at_every_size(capsys):
    from difftx.cli import main
    from difftx.studies.scale import plan_sizes

    plans = plan_sizes("smoke", ["16x1x1", "32x1x1"], schedule={"steps": 6}, execution={"stack": 1})
    assert [(p.preset.steps, p.preset.stack, p.preset.warmup_steps) for p in plans] == [(6, 1, 2)] * 2
    assert main(["scale", "--preset", "smoke", "--sizes", "16x1x1,32x1x1", "--no-progress",
                 "--set", "schedule.bogus=1"]) != 0
    assert "ComparePreset.schedule: unknown field(s) ['bogus']" in capsys.readouterr().err


def test_tune_takes_a_schedule_field_by_either_spelling():
    from difftx.studies.tune import parse_tune

    assert parse_tune("schedule.lr=0.001,0.003") == parse_tune("lr=0.001,0.003") == ("lr", [0.001, 0.003])
    assert parse_tune("schedule.warmup_steps=10,20") == ("warmup_steps", [10, 20])
    with pytest.raises(ValueError, match="expected FIELD=V1,V2"):
        parse_tune("execution.workers=1,2")  # how it runs is not a training field
