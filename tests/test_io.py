"""difftx.io, the bottom layer: atomic writes, strict JSON out, JSON in with one error wording,
eval mode for a block; what difftx writes through it (model files, checkpoints, exports) follows
the umask."""

import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch

from difftx.checkpoint import CheckpointError
from difftx.io import atomic_folder, atomic_write, dumps_strict, eval_mode, read_json, staging_is_stale
from difftx.training import checkpointing as ckpt


def test_atomic_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "f.json"  # the folder is made
    atomic_write(path, lambda p: open(p, "w").write("new"))
    assert path.read_text() == "new"
    assert [p.name for p in path.parent.iterdir()] == ["f.json"]  # no temporary file left


def test_atomic_write_leaves_the_old_file_when_the_writer_raises(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")

    def half(p):
        open(p, "w").write("half of the new")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(path, half)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_atomic_folder_is_complete_or_absent_and_removes_only_stale_staging(tmp_path):
    import os
    import socket

    out = tmp_path / "out"
    live = tmp_path / f".out.tmp-{os.getpid()}@{socket.gethostname()}@x"  # this process: still writing
    dead = tmp_path / f".out.tmp-999999999@{socket.gethostname()}@x"  # no such process
    elsewhere = tmp_path / ".out.old-1@another-host@x"  # another host's writer, a minute old
    for folder in (live, dead, elsewhere):
        folder.mkdir()
    assert [staging_is_stale(f) for f in (live, dead, elsewhere)] == [False, True, False]
    os.utime(elsewhere, (1, 1))  # ... or a day old
    assert staging_is_stale(elsewhere) and staging_is_stale(tmp_path / ".out.tmp-killed")
    with pytest.raises(RuntimeError):
        with atomic_folder(out) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("crash")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [live.name]
    with atomic_folder(out) as tmp:
        (tmp / "a.txt").write_text("new")
    with atomic_folder(out, replace=True) as tmp:
        (tmp / "b.txt").write_text("newer")
    assert [p.name for p in out.iterdir()] == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "out"])


def test_read_json_names_the_file_and_what_it_should_hold(tmp_path):
    missing, corrupt, good = tmp_path / "missing.json", tmp_path / "corrupt.json", tmp_path / "good.json"
    corrupt.write_text('{"a": 1')
    good.write_text('{"a": [1, 2]}')
    assert read_json(good, "a record") == {"a": [1, 2]}
    with pytest.raises(ValueError) as e:
        read_json(missing, "the training record of a compare model")
    assert str(e.value) == f"{missing}: not found; expected the training record of a compare model here"
    with pytest.raises(ValueError) as e:
        read_json(corrupt, "the training record of a compare model")
    assert str(e.value).startswith(f"{corrupt}: not valid JSON (")
    assert str(e.value).endswith("); expected the training record of a compare model")
    with pytest.raises(CheckpointError, match="not valid JSON"):  # the caller's error class, the same wording
        read_json(corrupt, "a model config", error=CheckpointError)
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_json(tmp_path / "bytes.json", "a record")


def test_dumps_strict_writes_null_for_what_is_not_finite_and_says_why():
    data = json.loads(dumps_strict({"a": [1.0, math.nan], "b": {"c": math.inf}, "t": (1, 2)}))
    assert data["a"] == [1.0, None] and data["b"] == {"c": None} and data["t"] == [1, 2]
    assert set(data["null_reasons"]) == {"a[1]", "b.c"}
    assert json.loads(dumps_strict([math.nan])) == [None]  # not a dict: nowhere to put the reasons


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_restores_the_mode_whatever_happens(training):
    model = torch.nn.Sequential(torch.nn.Dropout(0.5))
    model.train(training)
    with eval_mode(model) as m:
        assert m is model and not model.training and not model[0].training
    assert model.training is training and model[0].training is training
    with pytest.raises(ValueError):
        with eval_mode(model):
            raise ValueError("inside")
    assert model.training is training


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_model_files_follow_the_umask(tmp_path, mask):
    import difftx
    from difftx.checkpoint import save_model

    old = os.umask(mask)
    try:
        folder = save_model(difftx.Transformer(difftx.preset("test")), tmp_path / "m")
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert _mode(folder / name) == 0o666 & ~mask


def test_checkpoint_folders_and_exports_follow_the_umask(tmp_path):
    import difftx

    model = difftx.Transformer(difftx.preset("test"))
    old = os.umask(0o027)
    try:
        final = ckpt.save_checkpoint(tmp_path / "run", 1, model_state=model.state_dict(), model_config=model.config,
                                     optim_state={"state": {}, "param_groups": []}, trainer_state={"step": 1},
                                     train_config={}, keep_last=2)
        exported = None
        try:
            import transformers  # noqa: F401
        except ImportError:
            pass
        else:
            from difftx.interop.hf import export_hf

            exported = Path(export_hf(final, tmp_path / "hf"))
    finally:
        os.umask(old)
    assert _mode(final) == 0o750
    assert all(_mode(p) == 0o640 for p in final.iterdir() if p.is_file())
    assert _mode(tmp_path / "run" / "checkpoints" / "latest") == 0o640
    if exported is not None:
        files = [p for p in exported.rglob("*") if p.is_file()]
        assert files and all(_mode(p) == 0o640 for p in files)
    assert torch.equal(difftx.checkpoint.load_model(final).tok_embeddings.weight, model.tok_embeddings.weight)


def test_io_imports_nothing_from_difftx():
    import ast

    import difftx.io

    tree = ast.parse(Path(difftx.io.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("difftx") or m == ""], imported
    assert all(n.level == 0 for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
