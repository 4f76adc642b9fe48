"""A compare preset's model: ModelConfig fields in ``model`` (``dim``, ``n_layers``, ``n_heads`` and ``init`` also
spelled flat), validated once by ModelConfig, set by one spelling (``--set model.lambda_init=0.3``) in compare,
scale, train and info; the primary pair named by the preset; folders written before both still read and reused."""

import json

import pytest

from difftx.compare import ComparePreset
from difftx.compare.presets import MODEL_DEFAULTS, get_preset
from difftx.compare.schema import preset_record


def test_the_model_sets_the_diff_arm_and_every_arm_derives_from_it():
    p = get_preset("recall-cpu", model={"lambda_init": 0.3})
    assert p.model == {**MODEL_DEFAULTS, "lambda_init": 0.3} and p.dim == 64 and p.init == "normal"
    arms = p.resolve().arms
    assert arms["diff"].lambda_init == 0.3
    assert arms["diff_lambda_0.8"].lambda_init == 0.8  # the arm's own override wins
    assert arms["baseline"].attention == "standard" and arms["baseline"].lambda_init is None
    assert get_preset("recall-cpu").resolve().arms["diff"].lambda_init is None  # the depth schedule


def test_flat_spellings_and_model_are_one_field():
    assert get_preset("smoke", dim=64) == get_preset("smoke", model={"dim": 64})
    assert get_preset("smoke", init="torch").model["init"] == "torch"
    assert get_preset("smoke", model={"dim": 64}).with_overrides(model={"n_heads": 2}).model["dim"] == 64  # merged
    assert get_preset("smoke", model={"dim": 64}, dim=128).dim == 128  # the flat spelling wins, as training's do
    # a field at ModelConfig's default is not kept: equal presets are equal
    assert get_preset("smoke", model={"lambda_init": None, "rope": True}) == get_preset("smoke")
    p = get_preset("smoke", model={"lambda_init": 0.3, "head_norm": False})
    assert ComparePreset.from_dict(json.loads(json.dumps(p.to_dict()))).to_dict() == p.to_dict()


@pytest.mark.parametrize("given, error", [
    ({"model": {"vocab_size": 3}}, r"ComparePreset\.model\.vocab_size: is the comparison's own"),
    ({"model": {"attention": "standard"}}, r"ComparePreset\.model\.attention: .*each arm's attention"),
    ({"model": {"foo": 1}}, r"ComparePreset\.model: unknown ModelConfig field\(s\) \['foo'\]; known: dim"),
    ({"dim": 65}, r"ComparePreset\.model\.dim: 65 must be divisible"),
    ({"init": "xavier"}, r"ComparePreset\.model\.init: must be one of"),
    ({"model": {"gate": "headwise"}}, r"ComparePreset\.model\.gate: applies only to attention='gated'"),
    ({"model": {"lambda_init": "high"}}, r"ComparePreset\.model\.lambda_init"),
    ({"model": [1]}, r"ComparePreset\.model: must be a mapping"),
    ({"primary": ("diff", "gated")}, r"ComparePreset\.primary: need two distinct arms of \['baseline', 'diff'\]"),
    ({"primary": ("diff", "diff")}, r"ComparePreset\.primary"),
])
def test_a_bad_model_or_primary_is_named(given, error):
    with pytest.raises(ValueError, match=error):
        get_preset("smoke", **given)


def test_the_primary_pair_is_the_presets():
    p = get_preset("recall-cpu", primary=["diff_lambda_0.8", "baseline"])
    assert p.primary == ("diff_lambda_0.8", "baseline") and p.resolve().primary == ("diff_lambda_0.8", "baseline")
    assert get_preset("smoke").resolve().primary == ("diff", "baseline")


def test_older_records_read_in_todays_form():
    new = get_preset("smoke", init="torch").to_dict()
    old = {k: v for k, v in new.items() if k not in ("model", "primary")}
    old.update(new["model"])
    assert preset_record(old) == new and preset_record(new) is new
    del old["init"]  # before init: N(0, 0.02)
    assert preset_record(old)["model"]["init"] == "normal"
    assert ComparePreset.from_dict(old).to_dict() == get_preset("smoke").to_dict()  # from_dict: the flat spellings


def test_one_spelling_in_train_info_and_sweep(capsys):
    from difftx.cli import main
    from difftx.studies.sweep import sweep_overrides
    from difftx.training.config import TrainConfig

    t = TrainConfig(model="tiny").with_overrides(["model.lambda_init=0.3"])
    assert t.model_config().lambda_init == 0.3
    assert main(["info", "tiny", "--set", "model.lambda_init=0.3"]) == 0
    assert "lambda_init=0.3" in capsys.readouterr().out
    assert sweep_overrides("smoke", "model.lambda_init", 0.5, {"model": {"dim": 64}}) == \
        {"model": {"dim": 64, "lambda_init": 0.5}}
    assert main(["compare", "--preset", "smoke", "--sweep", "model.vocab_size=8,16", "--out", "unused"]) != 0
    assert "'model.vocab_size' is not a preset field that can be swept" in capsys.readouterr().err


def test_scale_takes_the_model_and_refuses_a_shape(tmp_path):
    from difftx.studies.scale import plan_sizes

    plans = plan_sizes("smoke", ["16x1x1", "32x1x1"], model={"lambda_init": 0.4})
    assert all(p.preset.model["lambda_init"] == 0.4 and p.preset.resolve().arms["diff"].lambda_init == 0.4
               for p in plans)
    assert [p.preset.dim for p in plans] == [16, 32]
    for given in ({"dim": 64}, {"model": {"n_layers": 3}}):
        with pytest.raises(ValueError, match="each size sets the width, depth and heads"):
            plan_sizes("smoke", ["16x1x1", "32x1x1"], **given)


def test_compare_set_model_and_a_folder_of_version_2_is_reused(tmp_path, capsys):
    """`compare --set model.lambda_init=...` trains the DIFF arm at it; a folder written before the model field
    (compare.json version 2, flat model fields in it and in each model's training request) resumes with nothing
    trained again, and a changed model field is named."""
    from difftx.cli import main

    out = tmp_path / "cmp"
    args = ["compare", "--preset", "smoke", "--seeds", "1", "--no-progress", "--set", "steps=4", "--set",
            "warmup_steps=1", "--set", "probe_every=2", "--out", str(out)]
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["arms"]["diff"]["config"]["lambda_init"] is None
    meta = json.loads((out / "compare.json").read_text())
    meta["schema_version"] = 2  # as version 2 wrote it
    meta["preset"].pop("primary")
    meta["preset"].update(meta["preset"].pop("model"))
    (out / "compare.json").write_text(json.dumps(meta))
    for arm in ("baseline", "diff"):
        f = out / "seed0" / arm / "train.json"
        rec = json.loads(f.read_text())
        rec["request"]["preset"].update(rec["request"]["preset"].pop("model"))
        f.write_text(json.dumps(rec))
    capsys.readouterr()
    assert main(args) == 0
    ran = json.loads((out / "results.json").read_text())["this_run"]
    assert not any(r["trained"] or r["evaluated"] for r in ran.values())
    assert json.loads((out / "compare.json").read_text())["schema_version"] == 3
    assert main(args + ["--set", "model.lambda_init=0.3"]) != 0
    assert "differs in ['model.lambda_init']" in capsys.readouterr().err
    assert main(args[:-1] + [str(tmp_path / "b"), "--set", "model.lambda_init=0.3"]) == 0
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["arms"]["diff"]["config"]["lambda_init"] == 0.3 and res["preset"]["model"]["lambda_init"] == 0.3


def test_a_primary_pair_of_other_arms_runs_end_to_end(tmp_path):
    """The report, its verdicts and results.json answer the preset's primary pair first; the paper's rows stand
    beside the arms they are the paper's numbers of (DIFF, the baseline) only."""
    from difftx.compare import run_compare

    res = run_compare("smoke", 2, tmp_path / "p", progress=False, arms=("baseline", "diff", "diff_lambda_0.8"),
                      primary=("diff_lambda_0.8", "baseline"), steps=4, warmup_steps=1, probe_every=2)
    assert res.primary.arms == ("diff_lambda_0.8", "baseline")
    data = json.loads((tmp_path / "p" / "results.json").read_text())
    assert data["preset"]["primary"] == ["diff_lambda_0.8", "baseline"]
    assert [k for k, c in data["comparisons"].items() if c["primary"]] == ["diff_lambda_0.8 vs baseline"]
    report = (tmp_path / "p" / "report.md").read_text()
    assert "no primary metric separates diff_lambda_0.8 from the baseline" in report
    assert ", paper (" in report and not any(line.startswith("| diff_lambda_0.8, paper") for line in report.splitlines())


def test_a_from_folder_of_version_2_is_refused_in_one_line(tmp_path):
    """Before folder version 3 a comparison from a source named its arms baseline and diff; its models are not
    reused under the names source and converted, and the message says so."""
    from difftx.compare.folder import COMPARE_FILE, _check_folder

    preset = ComparePreset(source="src", data="text.txt")
    old = preset.to_dict()
    old.pop("primary")
    old.update(old.pop("model"))
    (tmp_path / COMPARE_FILE).write_text(json.dumps({"schema_version": 2, "preset": old}))
    with pytest.raises(ValueError, match=r"arms were named baseline and diff \(folder version 2\); this difftx names "
                                         r"them source and converted"):
        _check_folder(tmp_path, preset)
    (tmp_path / COMPARE_FILE).write_text(json.dumps({"schema_version": 3, "preset": preset.to_dict()}))
    _check_folder(tmp_path, preset)


def test_the_arms_need_not_hold_the_built_in_pair_but_must_hold_the_primary():
    p = get_preset("smoke", arms=("baseline", "diff_lambda_0.8"), primary=("diff_lambda_0.8", "baseline"))
    assert set(p.resolve().arms) == {"baseline", "diff_lambda_0.8"}
    with pytest.raises(ValueError, match=r"ComparePreset\.primary: need two distinct arms of \['baseline', "
                                         r"'diff_lambda_0.8'\]"):
        get_preset("smoke", arms=("baseline", "diff_lambda_0.8"))  # the default primary pair is not among them
    with pytest.raises(ValueError, match=r"ComparePreset\.arms: need two or more distinct names"):
        get_preset("smoke", arms=("diff",), primary=("diff", "diff"))


def test_arms_of_your_own_are_data():
    """own_arms: a name, the arm it derives from and ModelConfig changes; with_overrides trains the ones it is given."""
    p = get_preset("recall-cpu", own_arms={"diff_l03": {"model": {"lambda_init": 0.3}},
                                           "base_kv1": {"from": "baseline", "model": {"n_kv_heads": 1},
                                                        "description": "the baseline with one kv head"}})
    assert p.arms == ("baseline", "diff", "diff_lambda_0.8", "diff_l03", "base_kv1")
    plan = p.resolve()
    assert plan.arms["diff_l03"] == plan.arms["diff"].replace(lambda_init=0.3)
    assert plan.arms["base_kv1"] == plan.arms["baseline"].replace(n_kv_heads=1)
    assert plan.arm("diff_l03").description == "diff with lambda_init=0.3 (an arm of your own)"
    assert plan.arm("base_kv1").description == "the baseline with one kv head"
    assert ComparePreset.from_dict(json.loads(json.dumps(p.to_dict()))).to_dict() == p.to_dict()
    # given the arms too, only those are trained
    assert get_preset("smoke", own_arms={"x": {}}, arms=("baseline", "diff")).arms == ("baseline", "diff")


@pytest.mark.parametrize("own, error", [
    ({"diff": {}}, r"own_arms\.diff: 'diff' is a built-in arm or a registered kind"),
    ({"a b": {}}, r"own_arms\.a b: a name of letters, digits"),
    ({"x": {"from": "nope"}}, r"own_arms\.x\.from: must be an arm of \['baseline'"),
    ({"x": {"model": {"attention": "standard"}}}, r"own_arms\.x\.model: must be a mapping of ModelConfig fields"),
    ({"x": {"model": {"gate": "headwise"}}}, r"own_arms\.x\.model\.gate: applies only to attention='gated'"),
    ({"x": {"color": 1}}, r"own_arms\.x: must be a mapping with from, model, description"),
])
def test_a_bad_arm_of_your_own_is_named(own, error):
    with pytest.raises(ValueError, match=error):
        get_preset("smoke", own_arms=own)


def test_an_arm_of_your_own_from_the_command_line_trains_and_a_changed_one_is_not_reused(tmp_path, capsys):
    from difftx.cli import main

    out = tmp_path / "own"
    args = ["compare", "--preset", "smoke", "--seeds", "1", "--no-progress", "--set", "steps=4", "--set",
            "warmup_steps=1", "--set", "probe_every=2", "--arms", "diff_l03", "--out", str(out)]
    assert main(args + ["--set", "own_arms.diff_l03.model.lambda_init=0.3"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["arms"]) == ["baseline", "diff", "diff_l03"] and res["arms"]["diff_l03"]["config"]["lambda_init"] == 0.3
    assert res["arms"]["diff_l03"]["description"] == "diff with lambda_init=0.3 (an arm of your own)"
    capsys.readouterr()
    assert main(args + ["--set", "own_arms.diff_l03.model.lambda_init=0.4"]) != 0
    err = capsys.readouterr().err
    assert "diff_l03/train.json: this model was trained with config.lambda_init 0.3, not 0.4" in err
    assert main(["compare", "--preset", "smoke", "--arms", "nope", "--out", str(tmp_path / "x")]) != 0
    assert "an arm of your own (--set own_arms.NAME.model.FIELD=VALUE" in capsys.readouterr().err


def test_scale_trains_arms_of_your_own_beside_its_lambda_arm(tmp_path):
    from difftx.studies.scale import run_scale

    s = run_scale("smoke", ["16x1x1", "32x1x1"], 2, tmp_path / "s", progress=False, steps=4, warmup_steps=1,
                  probe_every=2, own_arms={"l03": {"model": {"lambda_init": 0.3}}})
    assert s["arms"] == ["baseline", "diff", "l03", "diff_lambda_0.8"] and list(s["gap"]) == [
        "diff", "l03", "diff_lambda_0.8"]


@pytest.mark.parametrize("given", [{"primary": ("baseline", "diff")}, {"own_arms": {"x": {}}}])
def test_a_comparison_from_a_source_refuses_a_pair_or_arms_of_its_own(tmp_path, given):
    with pytest.raises(ValueError, match=r"a comparison from a source has two arms of its own, the source and its "
                                         r"conversion \(its pair: converted vs source\)"):
        get_preset("from-cpu", source=str(tmp_path / "src"), data=str(tmp_path / "t.txt"), **given)
