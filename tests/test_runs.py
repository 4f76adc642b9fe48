"""``difftx runs``: run folders side by side (difftx.training.summary): folders that are not runs
refused, the plot without matplotlib, room for more columns, and the note when runs were trained
on different data. The end-to-end table of two trained runs is in tests/test_train_cli.py."""

from __future__ import annotations

import json
import sys

from difftx.cli import main
from difftx.training import checkpointing as ckpt
from difftx.training.config import TrainConfig
from test_train_cli import _fake_run, _write_text


def test_runs_refuses_folders_that_are_not_runs(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["runs", str(tmp_path / "empty")]) == 2
    assert "not a difftx run folder" in capsys.readouterr().err
    assert main(["runs", str(tmp_path / "missing")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert main(["runs", str(tmp_path / "ckpt")]) == 2
    assert "checkpoint folder" in capsys.readouterr().err


def test_runs_plot_without_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    run = _fake_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["runs", str(run), "--plot", str(tmp_path / "c.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_summary_table_has_a_place_for_more_columns(tmp_path):
    from difftx.training.summary import Column, format_table, summarize_run

    s = summarize_run(_fake_run(tmp_path))
    s.extra["heldout"] = "3.21 [3.10, 3.32]"
    table = format_table([s], extra=[Column("held-out NLL (95% CI)", lambda r: r.extra.get("heldout", "n/a"))])
    assert table.splitlines()[0].endswith("held-out NLL (95% CI)")
    assert table.splitlines()[2].endswith("3.21 [3.10, 3.32]")


def test_runs_says_when_runs_were_trained_on_different_data(tmp_path, capsys):
    from difftx.training.summary import comparability_notes, summarize_run

    a = summarize_run(_fake_run(tmp_path))
    (tmp_path / "other").mkdir()
    same = summarize_run(_fake_run(tmp_path / "other"))  # a copy of the same text at another path
    assert comparability_notes([a, same]) == []  # compared by content (issue 31), not by path
    _write_text(tmp_path / "other" / "a.txt", paragraphs=5)  # other text: its run saved anew
    run = tmp_path / "other" / "run"
    saved = TrainConfig.from_dict(json.loads((run / ckpt.TRAIN_CONFIG_NAME).read_text()))
    (run / ckpt.TRAIN_CONFIG_NAME).write_text(saved.to_json())
    b = summarize_run(run)
    assert comparability_notes([a, a]) == []
    notes = comparability_notes([a, b])
    assert len(notes) == 1 and "differ in data" in notes[0]


def test_a_compare_models_run_gives_its_rate_and_parameters(tmp_path):
    """A compare model keeps no checkpoint: runs printed the mean of the logged rates (6,752 where the report said
    31,226 tokens/s) and 'n/a' parameters. Now tokens seen / the training time the log records, and the count of
    the model beside the run."""
    import difftx
    from difftx.checkpoint import save_model
    from difftx.training.summary import summarize_run

    run = _fake_run(tmp_path).rename(tmp_path / "train")  # seedS/ARM/train
    records = [{"step": 4, "loss": 5.0, "tokens": 1000, "tokens_per_s": 11163.0, "time_s": 0.05},
               {"step": 8, "loss": 4.0, "tokens": 2000, "tokens_per_s": 4796.0, "time_s": 0.1},
               {"step": 12, "loss": 3.0, "tokens": 4272, "tokens_per_s": 4297.0, "time_s": 0.1368}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    model = difftx.Transformer(difftx.preset("tiny"))
    save_model(model, tmp_path / "model")  # seedS/ARM/model beside seedS/ARM/train
    s = summarize_run(run)
    assert abs(s.tokens_per_s - 4272 / 0.1368) < 1e-6 and s.params == model.num_parameters()
