"""Each training task owns its settings (TrainingTask.Settings): the preset takes and writes them by their
spellings (``lm_every`` is the LM task's ``every``), the mixture holds them, and the mixture names no task."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import pytest

from difftx.compare.plan import Mixture
from difftx.compare.presets import ComparePreset, get_preset
from difftx.compare.training_tasks import (
    BUILTIN, TaskSettings, TrainingTask, register_training_task, setting, unregister_training_task,
)
from difftx.tasks.subject import TaskSpace


@pytest.mark.parametrize("cls", [Mixture, TaskSpace])
def test_the_mixture_and_the_task_space_name_no_built_in_task(cls):
    source = inspect.getsource(cls)
    named = {name for name in BUILTIN if re.search(rf"\b{name}\b|\b{name}_\w+", source, re.I)}
    assert not named, f"{cls.__name__} names the training task(s) {sorted(named)}"


def test_a_preset_takes_reads_and_writes_each_setting_by_its_spelling():
    preset = ComparePreset(lm_every=3, recall_pairs="4,8", icl_every=5)
    assert preset.training == {"lm": {"every": 3}, "icl": {"every": 5}, "recall": {"pairs": (4, 8)}}
    assert (preset.lm_every, preset.lm_seq_len, preset.recall_pairs) == (3, 128, (4, 8))
    data = preset.to_dict()
    assert "training" not in data and (data["lm_every"], data["recall_pairs"], data["n_keys"]) == (3, [4, 8], 64)
    assert ComparePreset.from_dict(data) == preset
    # an old compare.json's flat fields read as before; a default given is not kept apart
    assert ComparePreset.from_dict({"name": "old", "lm_every": 4, "recall_vocab": 64}).training == \
        {"recall": {"vocab": 64}}
    nested = get_preset("smoke", training={"lm": {"every": 5}})
    assert nested.lm_every == 5 and nested.lm_seq_len == 32  # merged into the preset's LM settings
    assert get_preset("smoke", training={"lm": {"every": 5}}, lm_every=6).lm_every == 6  # the spelling wins
    assert get_preset("smoke").resolve().mixture.to_dict() == {
        "batch_size": 8, "lm_every": 3, "lm_seq_len": 32, "icl_every": 4, "recall_every": 0,
        "shares": {"needle": 0.5, "lm": 1 / 3, "icl": 1 / 6, "recall": 0.0}}


@pytest.mark.parametrize("given, error", [
    ({"lm_seq_len": 0}, r"ComparePreset\.lm_seq_len: must be a positive integer, got 0"),
    ({"recall_every": -1}, r"ComparePreset\.recall_every: must be a non-negative integer"),
    ({"recall_pairs": "4,x"}, r"ComparePreset\.recall_pairs: must be positive pair counts"),
    ({"training": {"lm": {"evry": 3}}}, r"ComparePreset\.training\.lm: unknown setting\(s\) \['evry'\]"),
    ({"training": {"nope": {}}}, r"ComparePreset\.training: unknown training task\(s\) \['nope'\]"),
])
def test_a_bad_setting_is_named_by_its_spelling(given, error):
    with pytest.raises(ValueError, match=error):
        ComparePreset(**given)


@dataclass(frozen=True)
class EchoSettings(TaskSettings):
    every: int = setting(0, "echo_every", least=0, mixture=True)
    symbols: int = setting(8, "echo_symbols", least=1)


class EchoTask(TrainingTask):
    name, label = "echo", "echo"
    Settings = EchoSettings

    def ids(self, preset):
        return preset.echo_symbols


def test_a_registered_task_with_settings_is_set_like_a_built_in_one():
    register_training_task(EchoTask())
    try:
        assert get_preset("smoke").echo_every == 0 and get_preset("smoke").resolve().space.ids("echo") is None
        preset = get_preset("smoke", echo_every=5, echo_symbols=12)
        plan = preset.resolve()
        assert preset.training["echo"] == {"every": 5, "symbols": 12} and plan.mixture.shares()["echo"] > 0
        assert len(plan.space.ids("echo")) == 12 and plan.mixture.to_dict()["echo_every"] == 5
        assert ComparePreset.from_dict(preset.to_dict()).to_dict() == preset.to_dict()
    finally:
        unregister_training_task("echo")
    with pytest.raises(ValueError, match="unknown compare preset field"):
        get_preset("smoke", echo_every=5)


def test_a_task_whose_settings_are_spelled_as_another_tasks_is_refused():
    @dataclass(frozen=True)
    class Clash(TaskSettings):
        every: int = setting(0, "lm_every", least=0)

    class ClashTask(TrainingTask):
        name, Settings = "clash", Clash

    with pytest.raises(ValueError, match=r"setting\(s\) \['lm_every'\] are spelled as another task's"):
        register_training_task(ClashTask())
