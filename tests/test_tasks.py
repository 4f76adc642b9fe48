"""difftx.tasks: the registry (a new task gets a results.json entry, a report section and a
`difftx eval` sub-command without touching another file), settings, and LM scoring of a file."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from difftx.cli import main
from difftx.compare import run_compare
from difftx.compare.schema import validate_results
from difftx.tasks import TASKS, Metric, Task, register, unregister
from difftx.tasks.base import positive, setting

FAST = {"steps": 4, "warmup_steps": 1, "log_every": 2, "probe_every": 0,
        "tasks": {"needle": {"samples_per_cell": 1, "grid": ((1, 1),), "depths": (0.5,), "heatmap_cell": (2, 2)},
                  "attention": {"samples": 1, "cells": ((1, 1),), "depths": (0.5,)},
                  "lm": {"windows": 1, "extrapolation_factors": (1,)},
                  "outliers": {"tokens": 32}, "quant": {"bits": (4,), "needle_samples": 1, "cells": ((1, 1),),
                                                        "depths": (0.5,), "lm_windows": 1},
                  "icl": {"instances": 2, "queries": 1, "orders": 2}, "diagnostics": {"cell": (1, 1), "samples": 1}}}


@dataclass(frozen=True)
class ToySettings:
    prompts: int = setting(2, "needle prompts whose first logit is averaged")

    def __post_init__(self) -> None:
        positive(self, "prompts")


class ToyTask(Task):
    """A task written the way a user would add one: settings, a run with per-example records,
    one metric, a report section."""

    name = "toy"
    title = "Toy task"
    help = "mean first logit at the end of needle prompts (a registry test)"
    Settings = ToySettings

    def run(self, subject, s, *, progress=False):
        from difftx.tasks.needle import probe_prompts

        probes, _ = probe_prompts(subject, (1, 1), s.prompts)
        logits = subject.model(torch.tensor([p.prompt for p in probes]))[:, -1, 0]  # (prompts,)
        return {"value": float(logits.mean()), "records": {"logit": logits.tolist()}}

    def metrics(self, s):
        return [Metric("toy_value", "toy value", False, lambda r: r["value"])]

    def report(self, ctx):
        return f"## {self.title}\n\nseed {ctx.first}: {ctx.result(self.name)['value']:.4f}\n"

    def print(self, res):
        print(f"toy value {res['value']:.4f} over {len(res['records']['logit'])} prompts")


@pytest.fixture
def toy():
    task = register(ToyTask())
    yield task
    unregister(task.name)


def test_a_registered_task_reaches_results_report_and_eval(toy, tmp_path, capsys):
    assert list(TASKS)[-1] == "toy"
    res = run_compare("smoke", 1, tmp_path / "cmp", progress=False, workers=1,
                      **{**FAST, "tasks": {**FAST["tasks"], "toy": {"prompts": 3}}})
    validate_results(json.loads((tmp_path / "cmp" / "results.json").read_text()))
    assert res.tasks["toy"]["settings"] == {"prompts": 3}
    assert [m["key"] for m in res.tasks["toy"]["metrics"]] == ["toy_value"]
    stored = res.run(0, "diff").tasks["toy"]
    assert len(stored["records"]["logit"]) == 3
    assert res.primary.metrics["toy_value"]["values"]["diff"] == [stored["value"]]
    assert "## Toy task" in (tmp_path / "cmp" / "report.md").read_text()
    out = tmp_path / "toy.json"
    assert main(["eval", "toy", str(tmp_path / "cmp" / "seed0" / "diff" / "model"), "--prompts", "3",
                 "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["value"] == pytest.approx(stored["value"], rel=1e-6)
    assert "toy value" in capsys.readouterr().out


def test_registry_refuses_duplicates_and_non_tasks(toy):
    with pytest.raises(ValueError, match="already registered"):
        register(ToyTask())
    with pytest.raises(TypeError, match="Task"):
        register(object())


def test_settings_are_validated_and_parsed():
    from difftx.tasks import settings_from_dict
    from difftx.tasks.needle import NeedleSettings

    s = settings_from_dict(NeedleSettings, {"grid": "1/1,4/2", "depths": "0,0.5", "heatmap_cell": "2/2"}, "needle")
    assert s.grid == ((1, 1), (4, 2)) and s.depths == (0, 0.5) and s.heatmap_cell == (2, 2)
    with pytest.raises(ValueError, match="needle.samplez.*unknown|unknown setting"):
        settings_from_dict(NeedleSettings, {"samplez": 1}, "needle")
    with pytest.raises(ValueError, match="NeedleSettings.samples_per_cell: must be a positive integer"):
        NeedleSettings(samples_per_cell=0)
    with pytest.raises(ValueError, match="needle.grid: expected a needle cell"):
        settings_from_dict(NeedleSettings, {"grid": "4-2"}, "needle")


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from difftx.checkpoint import save_model
    from difftx.config import ModelConfig
    from difftx.model import Transformer

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("text") / "ckpt"
    save_model(Transformer(ModelConfig(vocab_size=257, dim=32, n_layers=1, n_heads=2, max_seq_len=128)), folder)
    text = "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds."
    path = folder.parent / "heldout.txt"
    path.write_text(text)
    return folder, path, text


def _independent_nll(folder, ids: list[int], window: int) -> tuple[float, int]:
    """Mean NLL of every token after the first, scored in consecutive windows of ``window``
    predictions (the last one shorter), written without difftx's evaluation code."""
    from difftx.checkpoint import load_model

    model = load_model(folder).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window + 1]])
            logits = model(chunk[:, :-1])
            total += float(F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum"))
            count += chunk.shape[1] - 1
    return total / count, count


@pytest.mark.parametrize("seq_len", [None, 32])
def test_eval_lm_data_scores_every_token_of_the_file_once(text_model, seq_len, tmp_path, capsys):
    folder, path, text = text_model
    out = tmp_path / "lm.json"
    extra = [] if seq_len is None else ["--seq-len", str(seq_len)]
    assert main(["eval", "lm", str(folder), "--tokenizer", "byte", "--data", str(path), *extra, "--no-progress",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    ids = [256] + list(text.encode())  # the byte tokenizer: end-of-text (256) opens every document
    expected, count = _independent_nll(folder, ids, seq_len or 128)
    assert res["tokens"] == count == len(text.encode())
    assert res["heldout"]["nll"] == pytest.approx(expected, rel=1e-5)
    assert sum(res["records"]["window_tokens"]) == count
    printed = capsys.readouterr().out
    assert f"scored {path}: {count} distinct tokens (all of it)" in printed
    if seq_len is None:  # the file is shorter than 4 windows: extrapolation is skipped, not fatal
        assert "skipped: length extrapolation" in printed


def test_gradient_spikes_count_steps_far_above_the_running_median():
    from difftx.tasks.training import grad_spikes

    norms = [1.0] * 50
    norms[20], norms[30], norms[40] = 5.0, 3.9, 100.0  # two above 4x the median of the previous 10
    assert grad_spikes(norms, 4.0, 10) == 2
    assert grad_spikes(norms[:10], 4.0, 10) == 0  # no full window yet
    assert grad_spikes([1.0, None, 9.0] + [1.0] * 3, 4.0, 1) == 1  # missing values are skipped


def test_loss_at_equal_budget_reads_both_models_at_the_smaller_budget():
    """The peer metric interpolates each model's curve where both have spent the smaller budget."""
    from difftx.tasks.training import at_equal, flops_per_token, value_at

    assert value_at([0, 10, 20], [4.0, 2.0, 1.0], 15) == 1.5
    assert value_at([10, 20], [2.0, 1.0], 5) is None and value_at([10, 20], [2.0, 1.0], 20) == 1.0
    fast = {"cost": {"time_s": 20.0}, "curve": {"time_s": [10.0, 20.0], "loss": [3.0, 2.0]}}
    slow = {"cost": {"time_s": 40.0}, "curve": {"time_s": [20.0, 40.0], "loss": [3.0, 1.5]}}
    get = at_equal("time_s")
    assert get(fast, slow) == 2.0 and get(slow, fast) == 3.0  # the slow model is read at 20 s
    cfg = {"vocab_size": 10, "dim": 4, "n_layers": 2, "max_seq_len": 8}
    assert flops_per_token(cfg, 140) == 6 * 100 + 12 * 2 * 4 * 8


def test_a_single_value_of_a_list_setting_is_a_list_of_one():
    """`--set tasks.needle.depths=0.5` and `tasks.quant.bits=8` arrive as numbers (the --set grammar
    reads JSON/YAML scalars): before, "'float' object is not iterable"."""
    from difftx.tasks import TASKS, settings_from_dict

    assert settings_from_dict(TASKS["needle"].Settings, {"depths": 0.5}, "needle").depths == (0.5,)
    assert settings_from_dict(TASKS["quant"].Settings, {"bits": 8}, "quant").bits == (8,)
    assert settings_from_dict(TASKS["quant"].Settings, {"bits": "8,4"}, "quant").bits == (8, 4)


def test_a_text_models_needle_task_decodes_in_the_batches_asked(monkeypatch):
    """--batch-size (tasks.needle.batch_size) reached the synthetic form only: text models decoded 8 at a time."""
    from types import SimpleNamespace

    from difftx.eval import needle_text
    from difftx.tasks.common import run_needles

    seen = {}
    monkeypatch.setattr(needle_text, "evaluate_needles_text", lambda *a, **k: seen.update(k) or "result")
    tok = SimpleNamespace(encode=None, decode=None, eos_id=0)
    subject = SimpleNamespace(needle=None, tokenizer=tok, model=None)
    assert run_needles(subject, [(1, 1)], [0.0], 3, batch_size=1) == "result" and seen["batch_size"] == 1
