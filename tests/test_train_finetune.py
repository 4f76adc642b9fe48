"""``difftx train --init-from`` (issue 51, item 4): the ``finetune`` preset is its default (low lr, short warm-up),
an explicit preset still wins, ``--preset finetune`` needs a checkpoint, the run records the checkpoint's
architecture as its model, and such a run resumes (also one saved before the model was recorded)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from difftx import Transformer, preset
from difftx.checkpoint import load_config, save_model
from difftx.cli import main
from difftx.training import TRAIN_PRESETS, load_train_config
from difftx.training import checkpointing as ckpt

FINETUNE, TINY = TRAIN_PRESETS["finetune"], TRAIN_PRESETS["tiny"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> dict:
    """A small pretrained-looking model (dim 32, 2 layers) saved with save_model, a text and a token cache."""
    root = tmp_path_factory.mktemp("finetune")
    torch.manual_seed(0)
    model = Transformer(preset("test", dim=32, n_layers=2, n_heads=2, max_seq_len=64, vocab_size=257))
    save_model(model, root / "src")
    r = random.Random(5)
    words = ["the", "miller", "carried", "a", "lantern", "river", "before", "rain", "and", "of"]
    (root / "text.txt").write_text("\n\n".join(" ".join(r.choice(words) for _ in range(40)) for _ in range(60)))
    return {"root": root, "model": root / "src", "text": root / "text.txt", "cache": root / "cache"}


def _args(src: dict, out: Path, *extra: str, steps: int = 4) -> list[str]:
    return ["train", "--out", str(out), "--data", str(src["text"]), "--no-progress", "--set", f"steps={steps}",
            "--set", f"cache_dir={src['cache']}", "--set", "seq_len=32", "--set", "batch_size=2",
            "--set", "eval_interval=0", "--set", "ckpt_interval=2", "--set", "tensorboard=false", *extra]


def _saved(run: Path) -> dict:
    return json.loads((run / "train_config.json").read_text())


def test_init_from_takes_the_finetune_preset_and_records_the_source_model(src, tmp_path, capsys):
    assert FINETUNE.lr < TINY.lr and FINETUNE.warmup_steps < TINY.warmup_steps  # what the default changes
    assert main(["train", "--init-from", str(src["model"]), "--print-config"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["lr"], shown["min_lr"], shown["warmup_steps"], shown["steps"]) == \
        (FINETUNE.lr, FINETUNE.min_lr, FINETUNE.warmup_steps, FINETUNE.steps)
    assert shown["model"] == load_config(src["model"]).to_dict() and shown["out_dir"] == "runs/finetune"
    run = tmp_path / "run"
    assert main(_args(src, run, "--init-from", str(src["model"]))) == 0
    assert "done: step 4/4" in capsys.readouterr().out
    saved = _saved(run)
    assert (saved["lr"], saved["min_lr"]) == (FINETUNE.lr, FINETUNE.min_lr)
    # the model trained is the source's architecture, and the run says so (not the preset's placeholder "tiny")
    assert saved["model"] != "tiny" and saved["model"] == load_config(src["model"]).to_dict()
    assert saved["init_from"] == str(src["model"])
    last = ckpt.latest_checkpoint(run)
    assert json.loads((last / "train_config.json").read_text())["model"] == saved["model"]
    assert load_config(last) == load_config(src["model"])


def test_an_explicit_preset_wins_and_the_model_is_still_the_source(src, tmp_path, capsys):
    run = tmp_path / "tiny"
    assert main(_args(src, run, "--preset", "tiny", "--init-from", str(src["model"]), steps=2)) == 0
    saved = _saved(run)
    assert (saved["lr"], saved["min_lr"]) == (TINY.lr, TINY.min_lr)
    assert saved["model"] == load_config(src["model"]).to_dict()
    capsys.readouterr()
    # a file names its preset (or takes tiny's): the finetune default is only for a command that names neither
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"seed": 1}))
    assert main(["train", "--config", str(conf), "--init-from", str(src["model"]), "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["lr"] == TINY.lr


def test_the_finetune_preset_without_a_checkpoint_is_refused(src, tmp_path, capsys):
    out = tmp_path / "none"
    conf = tmp_path / "ft.json"
    conf.write_text(json.dumps({"preset": "finetune"}))
    for cmd in (["train", "--preset", "finetune", "--out", str(out)],
                ["train", "--config", str(conf), "--out", str(out), "--print-config"]):
        assert main(cmd) == 2, cmd
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the finetune preset fine-tunes a model: give --init-from CHECKPOINT" in err[0]
        assert not out.exists()
    # init_from given another way is enough
    assert main(["train", "--preset", "finetune", "--set", f"init_from={src['model']}", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["lr"] == FINETUNE.lr
    assert load_train_config(None, None, init_from=str(src["model"])).lr == FINETUNE.lr  # the Python API's default
    with pytest.raises(ValueError, match="give --init-from CHECKPOINT"):
        load_train_config(None, None, "finetune")


def test_a_finetune_run_resumes(src, tmp_path, capsys):
    run = tmp_path / "run"
    start = _args(src, run, "--init-from", str(src["model"]), steps=2)
    assert main(start) == 0
    capsys.readouterr()
    # --resume alone: the saved config (its recorded model) continues the run
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--set", "steps=4"]) == 0
    assert "done: step 4/4" in capsys.readouterr().out
    # the command that started it, re-run with --resume (a preemptible job), continues too
    assert main([*_args(src, run, "--init-from", str(src["model"]), steps=6), "--resume"]) == 0
    assert "done: step 6/6" in capsys.readouterr().out
    assert _saved(run)["model"] == load_config(src["model"]).to_dict()


def test_a_run_saved_with_the_preset_model_name_resumes_as_its_checkpoint(src, tmp_path, capsys):
    """A fine-tuning run saved before the model was recorded names its preset's model ("tiny") beside
    init_from; its checkpoint holds the source's architecture, which the resume continues and records."""
    run = tmp_path / "old"
    assert main(_args(src, run, "--init-from", str(src["model"]), steps=2)) == 0

    def name_the_preset_model():
        for path in (run / "train_config.json", ckpt.latest_checkpoint(run) / "train_config.json"):
            data = json.loads(path.read_text())
            path.write_text(json.dumps({**data, "model": "tiny"}))

    name_the_preset_model()
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--no-progress", "--set", "steps=3"]) == 0
    assert "done: step 3/3" in capsys.readouterr().out
    assert _saved(run)["model"] == load_config(src["model"]).to_dict()
    name_the_preset_model()  # and re-running a command that names the preset
    assert main([*_args(src, run, "--preset", "finetune", "--init-from", str(src["model"])), "--resume"]) == 0
    assert "done: step 4/4" in capsys.readouterr().out
    assert _saved(run)["model"] == load_config(src["model"]).to_dict()


def test_a_resume_refuses_a_model_change_of_a_finetune_run(src, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_args(src, run, "--init-from", str(src["model"]), steps=2)) == 0
    capsys.readouterr()
    for change in ("model.dim=64", "model_overrides.n_layers=3"):
        assert main(["train", "--out", str(run), "--resume", "--set", "steps=3", "--set", change]) == 2, change
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot change" in err[0] and "model" in err[0], err
    other = tmp_path / "other"  # the command that started it, with another checkpoint
    save_model(Transformer(preset("test", dim=32, n_layers=1, n_heads=2, max_seq_len=64, vocab_size=257)), other)
    assert main([*_args(src, run, "--init-from", str(other), steps=3), "--preset", "finetune", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "cannot change ['init_from']" in err and len(err.strip().splitlines()) == 1
    assert ckpt.latest_checkpoint(run).name == "step_00000002"


@pytest.mark.parametrize("flags, says", [
    (["--attention", "standard"], "--attention standard would change the model's parameters"),
    (["--baseline"], "--baseline would change the model's parameters"),
    (["--set", "model_overrides.dim=64"], "--set model_overrides.dim=64 would change the model's parameters"),
])
def test_init_from_with_a_flag_that_changes_the_architecture_blames_the_flag(flags, says, src, tmp_path, capsys):
    """The weights fit their own architecture: the flag that changes it is named, before anything is written."""
    out = tmp_path / "run"
    assert main(_args(src, out, "--init-from", str(src["model"]), *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err and "weights do not fit" not in err, err
    assert not out.exists()
    assert main(_args(src, tmp_path / "ok", "--init-from", str(src["model"]), "--set", "model_overrides.backend=eager",
                      steps=2)) == 0  # an override that keeps every parameter passes


def test_init_from_refuses_a_tokenizer_other_than_the_checkpoints(src, tmp_path, capsys):
    """generate and eval refused another tokenizer than the one saved with a model ("its text would be garbage");
    a fine-tune took it silently and trained the model on ids that mean other text."""
    import shutil

    from difftx.data import load_tokenizer
    from difftx.data.tokenizer import byte_tokenizer_json

    model = tmp_path / "model"
    shutil.copytree(src["model"], model)
    load_tokenizer("byte").save(model / "tokenizer")
    other = tmp_path / "tokenizer.json"
    other.write_text(byte_tokenizer_json())  # another tokenizer of the same size
    assert main(_args(src, tmp_path / "run", "--init-from", str(model), "--tokenizer", str(other))) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {other} (bpe-" in err and "is not the tokenizer this model was trained with (byte" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert main(_args(src, tmp_path / "run", "--init-from", str(model), "--tokenizer", "byte", steps=2)) == 0


def test_the_same_finetune_command_with_a_model_setting_resumes(src, tmp_path, capsys):
    """`--set model.X` of a fine-tune lands in model_overrides; a re-run of the same command with --resume put X in
    the saved source's mapping and was refused as a model change ("cannot change ['model']")."""
    run = tmp_path / "run"
    same = ("--init-from", str(src["model"]), "--set", "model.lambda_init=0.3")
    assert main(_args(src, run, *same, steps=2)) == 0
    assert _saved(run)["model_overrides"] == {"lambda_init": 0.3}
    assert main(_args(src, run, *same, "--resume", steps=4)) == 0
    assert "done: step 4/4" in capsys.readouterr().out
    other = ("--init-from", str(src["model"]), "--set", "model.lambda_init=0.4")
    assert main(_args(src, run, *other, "--resume", steps=6)) == 2  # a model change is still refused
    assert "cannot change ['model_overrides']" in capsys.readouterr().err
