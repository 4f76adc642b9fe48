"""What is on disk is what was written (issue 41, items 1 and 2): every weights file carries its
SHA-256 and every load checks it (eval, resume, export, runs, compare's reuse all read through
``difftx.checkpoint.load_state``), the optimizer state's is checked on resume, files written before
digests existed load with a one-line notice; and a resume on a training text changed in place is
refused unless ``--allow-new-data`` asks for it, which the run then records."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftx.checkpoint import (
    DIGEST_KEY, WEIGHTS_NAME, CheckpointError, file_sha256, load_model, load_state, save_model,
)
from difftx.cli import main
from difftx.config import preset
from difftx.model import Transformer
from difftx.training import checkpointing as ckpt
from difftx.training import train
from difftx.training.config import TrainConfig, train_preset

CHANGED = "the bytes changed since they were written"
FAST = ["--preset", "test", "--set", "steps=4", "--set", "eval_interval=2", "--set", "log_interval=2",
        "--set", "batch_size=2", "--set", "ckpt_interval=2", "--no-progress"]


def _flip(path: Path, at: int, n: int = 16) -> None:
    """``n`` bytes at ``at`` (negative: from the end) inverted in place; the size stays."""
    data = bytearray(path.read_bytes())
    i = at % len(data)
    data[i:i + n] = bytes(b ^ 0xFF for b in data[i:i + n])
    path.write_bytes(bytes(data))


def _header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[8:8 + int.from_bytes(data[:8], "little")]


def _write_text(path: Path, words: int = 3000, seed: int = 1) -> Path:
    r = random.Random(seed)
    path.write_text(" ".join(r.choice(["alpha", "beta", "gamma", "delta", "the", "river"]) for _ in range(words)))
    return path


@pytest.fixture
def folder(tmp_path) -> Path:
    torch.manual_seed(0)
    return save_model(Transformer(preset("test")), tmp_path / "model", {"seed": 0})


def test_the_digest_is_in_the_file_and_matches_what_was_written(folder):
    path = folder / WEIGHTS_NAME
    header = json.loads(_header(path))
    recorded = header["__metadata__"][DIGEST_KEY]
    assert recorded == file_sha256(path) and recorded != "0" * 64
    assert header["__metadata__"]["seed"] == "0" and header["__metadata__"]["format"] == "difftx"
    load_model(folder)  # no error, nothing said


@pytest.mark.parametrize("where", ["tensor data", "header", "the digest itself"])
def test_bytes_changed_in_place_are_refused_in_one_line_naming_the_file(folder, capsys, where):
    path = folder / WEIGHTS_NAME
    size = path.stat().st_size
    if where == "tensor data":
        _flip(path, -200)
    elif where == "header":  # the metadata's "difftx" -> another value of the same length
        path.write_bytes(path.read_bytes().replace(b'"format":"difftx"', b'"format":"difftY"', 1))
    else:
        data = bytearray(path.read_bytes())
        at = data.index(DIGEST_KEY.encode()) + len(DIGEST_KEY) + 3  # the first hex digit of the value
        data[at] = ord("a") if data[at] != ord("a") else ord("b")
        path.write_bytes(bytes(data))
    assert path.stat().st_size == size
    for load in (lambda: load_model(folder), lambda: load_state(folder)):
        with pytest.raises(CheckpointError) as e:
            load()
        message = str(e.value)
        assert message.startswith(f"{path}: {CHANGED}") and "\n" not in message, message
    assert main(["generate", str(folder), "--tokenizer", "byte", "--prompt", "a", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert CHANGED in err and len(err.strip().splitlines()) == 1, err


def test_export_refuses_changed_weights(folder, tmp_path, capsys):
    _flip(folder / WEIGHTS_NAME, -100)
    assert main(["export", str(folder), str(tmp_path / "hf")]) == 2
    assert CHANGED in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_file_written_before_digests_loads_with_one_notice_per_file(folder, capsys):
    path = folder / WEIGHTS_NAME
    save_file(load_file(str(path)), str(path), metadata={"format": "difftx"})  # as difftx wrote it before
    capsys.readouterr()
    load_model(folder)
    load_model(folder)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "no SHA-256 recorded" in err[0], err


# -- training checkpoints ------------------------------------------------------------------------

def _run(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    text = _write_text(tmp_path / "text.txt")
    out = tmp_path / "run"
    assert main(["train", *FAST, "--data", str(text), "--out", str(out)]) == 0
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002", "step_00000004"]
    return text, out


def _snapshot(root: Path) -> dict:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_changed_weights_of_a_run_are_refused_by_eval_runs_and_resume(tmp_path, monkeypatch, capsys):
    text, out = _run(tmp_path, monkeypatch)
    latest = ckpt.latest_checkpoint(out)
    state = json.loads((latest / ckpt.STATE_NAME).read_text())
    assert state[ckpt.DIGESTS] == {ckpt.OPTIM_NAME: file_sha256(latest / ckpt.OPTIM_NAME)}
    weights = latest / WEIGHTS_NAME
    _flip(weights, -300)
    capsys.readouterr()
    before = _snapshot(out)
    for command in (["eval", "lm", str(out), "--no-progress", "--windows", "2"],
                    ["runs", str(out), "--nll"],
                    ["train", "--out", str(out), "--resume", "--set", "steps=6", "--no-progress"]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"{weights}: {CHANGED}" in err, (command, err)
        # the older checkpoint is named as the one to go back to
        assert f"the older checkpoint {out / 'checkpoints' / 'step_00000002'} is intact" in err, err
    assert _snapshot(out) == before  # nothing rewritten
    assert ckpt.checkpoint_problem(latest).startswith(f"{weights}: {CHANGED}")


def test_a_changed_optimizer_state_is_refused_on_resume(tmp_path, monkeypatch, capsys):
    text, out = _run(tmp_path, monkeypatch)
    latest = ckpt.latest_checkpoint(out)
    optim = latest / ckpt.OPTIM_NAME
    state = torch.load(optim, weights_only=True)
    state["param_groups"][0]["lr"] = 1.0  # a valid optimizer file, but not the one written
    torch.save(state, optim)
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--set", "steps=6", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{optim}: {CHANGED}" in err and len(err.strip().splitlines()) == 1, err
    assert main(["eval", "lm", str(out), "--no-progress", "--windows", "2"]) == 0  # eval reads no optimizer state


def test_a_checkpoint_written_before_digests_resumes_with_notices(tmp_path, monkeypatch, capsys):
    text, out = _run(tmp_path, monkeypatch)
    latest = ckpt.latest_checkpoint(out)
    weights = latest / WEIGHTS_NAME
    save_file(load_file(str(weights)), str(weights), metadata={"format": "difftx"})
    state = json.loads((latest / ckpt.STATE_NAME).read_text())
    del state[ckpt.DIGESTS]
    (latest / ckpt.STATE_NAME).write_text(json.dumps(state))
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--set", "steps=6", "--no-progress"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "no SHA-256 recorded" in line]
    assert len(notes) == 2 and str(weights) in notes[0] + notes[1] and ckpt.OPTIM_NAME in notes[0] + notes[1], notes
    new = ckpt.latest_checkpoint(out)
    assert new.name == "step_00000006" and DIGEST_KEY in json.loads(_header(new / WEIGHTS_NAME))["__metadata__"]


# -- the training text on resume -------------------------------------------------------------------

def test_a_text_changed_in_place_is_refused_unless_allowed_and_then_recorded(tmp_path, monkeypatch, capsys):
    text, out = _run(tmp_path, monkeypatch)
    old = file_sha256(text)
    data = bytearray(text.read_bytes())
    data[500:505] = b"XXXXX"  # five bytes, the same size
    text.write_bytes(bytes(data))
    new = file_sha256(text)
    capsys.readouterr()
    before = _snapshot(out)
    resume = ["train", "--out", str(out), "--resume", "--set", "steps=6", "--no-progress"]
    assert main(resume) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"{text}: the training text changed" in err and old[:12] in err and new[:12] in err, err
    assert "the same size" in err and "--allow-new-data" in err, err
    assert _snapshot(out) == before  # refused before anything was written (or tokenized)

    assert main([*resume, "--allow-new-data"]) == 0
    captured = capsys.readouterr()
    assert "continuing on the new text" in captured.err and "done: step 6/6" in captured.out
    latest = ckpt.latest_checkpoint(out)
    record = json.loads((latest / ckpt.STATE_NAME).read_text())["new_data"]
    assert record == [{"step": 4, "data_source": str(text), "old_sha256": old, "new_sha256": new,
                       "old_bytes": len(data), "new_bytes": len(data)}]
    assert json.loads((latest / ckpt.TRAIN_CONFIG_NAME).read_text())["allow_new_data"] is True
    # the permission is the one command's: a later resume does not carry it, and the record stays
    assert main(["train", "--out", str(out), "--resume", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["allow_new_data"] is False
    assert main(["train", "--out", str(out), "--resume", "--set", "steps=8", "--no-progress"]) == 0
    capsys.readouterr()
    assert json.loads((ckpt.latest_checkpoint(out) / ckpt.STATE_NAME).read_text())["new_data"] == record


def test_a_text_of_another_size_is_refused_and_continues_when_allowed(tmp_path, monkeypatch, capsys):
    text, out = _run(tmp_path, monkeypatch)
    _write_text(text, words=2500, seed=2)
    capsys.readouterr()
    resume = ["train", "--out", str(out), "--resume", "--set", "steps=6", "--no-progress"]
    assert main(resume) == 2
    err = capsys.readouterr().err
    assert "the training text changed" in err and "bytes then" in err, err
    assert main([*resume, "--allow-new-data"]) == 0  # the loader continues its position over the new text
    assert "done: step 6/6" in capsys.readouterr().out


def test_allow_new_data_is_only_for_resume(tmp_path, capsys):
    assert main(["train", *FAST, "--out", str(tmp_path / "run"), "--allow-new-data"]) == 2
    assert "only with --resume" in capsys.readouterr().err
    with pytest.raises(ValueError, match="allow_new_data"):
        train_preset("test", allow_new_data="yes")


def test_the_python_api_refuses_changed_text_with_a_checkpoint_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    text = _write_text(tmp_path / "text.txt")
    cfg = train_preset("test", data_source=str(text), out_dir=str(tmp_path / "run"), steps=4, batch_size=2,
                       eval_interval=0, progress=False)
    train(cfg, stop_at=2)
    data = bytearray(text.read_bytes())
    data[10:15] = b"ZZZZZ"
    text.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="the training text changed"):
        train(cfg, resume=True)
    result = train(TrainConfig.from_dict({**cfg.to_dict(), "allow_new_data": True}), resume=True)
    assert result.step == 4


def test_a_file_changed_in_place_inside_a_data_folder_is_refused_in_the_same_process(tmp_path, monkeypatch):
    """Editing a file in place changes no folder's modification time: the folder's identity is not
    taken from a cache keyed by it."""
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    texts = tmp_path / "texts"
    texts.mkdir()
    _write_text(texts / "a.txt", seed=1)
    _write_text(texts / "b.txt", seed=2)
    cfg = train_preset("test", data_source=str(texts), out_dir=str(tmp_path / "run"), steps=4, batch_size=2,
                       eval_interval=0, progress=False)
    train(cfg, stop_at=2)
    data = bytearray((texts / "b.txt").read_bytes())
    data[10:15] = b"ZZZZZ"
    (texts / "b.txt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="the training text changed"):
        train(cfg, resume=True)
