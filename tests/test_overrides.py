"""The ``--set KEY=VALUE`` grammar (difftx.overrides): one for train, compare, scale and info."""

from __future__ import annotations

import pytest

from difftx.overrides import dotted_items, parse_overrides, parse_value, split_override, value_text


def test_compare_and_train_share_one_set_grammar():
    from difftx.training.config import load_train_config

    got = parse_overrides(["steps=5", "lr=1e-3", "threads=null", "tasks.needle.grid=1/1,2/2",
                           "tasks.needle.depths=[0, 0.5]", "tasks.lm.windows=4"])
    assert got == {"steps": 5, "lr": 1e-3, "threads": None,
                   "tasks": {"needle": {"grid": "1/1,2/2", "depths": [0, 0.5]}, "lm": {"windows": 4}}}
    cfg = load_train_config(None, ["steps=5", "warmup_steps=1", "lr=1e-3", "model_overrides.dim=64"])
    assert (cfg.steps, cfg.lr, cfg.model_overrides["dim"]) == (5, 1e-3, 64)
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_overrides(["steps"])
    from difftx.compare import get_preset

    p = get_preset("smoke", **parse_overrides(["tasks.needle.grid=1/1,2/2", "tasks.needle.depths=[0, 0.5]"]))
    assert p.task_settings()["needle"].grid == ((1, 1), (2, 2)) and p.task_settings()["needle"].depths == (0, 0.5)
    assert p.task_settings()["needle"].samples_per_cell == 2  # the smoke preset's other needle settings stay


def test_values_keys_and_bad_input():
    assert [parse_value(t) for t in ("3", " 1e-3 ", "yes", "Off", "~", "[1, 2]", "1/1,2/2")] == \
        [3, 1e-3, True, False, None, [1, 2], "1/1,2/2"]
    assert split_override(" lr =3e-4=x") == ("lr", "3e-4=x")  # the first '=' splits; the value is kept as written
    with pytest.raises(ValueError, match="empty key"):
        split_override("=3")
    with pytest.raises(ValueError, match="empty name"):
        parse_overrides(["tasks..grid=1"])
    with pytest.raises(ValueError, match="both a value and sub-fields"):
        parse_overrides(["tasks=1", "tasks.needle.grid=1/1"])


def test_written_words_read_back():
    overrides = {"steps": 40, "init": "torch", "arms": None, "flag": False,
                 "tasks": {"needle": {"depths": [0, 0.5], "grid": "1/1,2/2"}}}
    words = [f"{k}={value_text(v)}" for k, v in dotted_items(overrides)]
    assert words == ["steps=40", "init=torch", "arms=None", "flag=false",
                     "tasks.needle.depths=[0,0.5]", "tasks.needle.grid=1/1,2/2"]
    assert parse_overrides(words) == overrides
