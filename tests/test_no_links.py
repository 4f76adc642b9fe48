"""No writes through links (issue 41 item 4): every folder difftx names inside an output folder
(plots/, evals/, model/, seedS/ARM, train/checkpoints/, tune/FIELD=V, size=NAME) is made a real folder
by one helper, :func:`difftx.io.own_folder`; a symbolic link there is replaced, its target (a user's
folder) left byte for byte as it was. Files are replaced by a rename, so a link at a file's name is
replaced too. The output folder the user names may itself be a link: that one is followed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from difftx.cli import main
from difftx.io import own_folder
from test_compare import FAST, as_sets
from test_errors import snapshot


def _mine(root: Path, name: str, files: dict) -> Path:
    """A user's folder with ``files`` ({name: text}) in it."""
    folder = root / name
    folder.mkdir(parents=True)
    for f, text in files.items():
        (folder / f).write_text(text)
    return folder


def _link(at: Path, target: Path) -> None:
    if at.is_symlink() or at.is_file():
        at.unlink()
    elif at.exists():
        shutil.rmtree(at)
    at.symlink_to(target, target_is_directory=True)


def test_own_folder_replaces_a_link_and_keeps_its_target(tmp_path, capsys):
    mine = _mine(tmp_path, "mine", {"lm_loss.png": "my picture\n"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "plots").symlink_to(mine)
    assert own_folder(out / "plots") == out / "plots"
    assert (out / "plots").is_dir() and not (out / "plots").is_symlink() and not any((out / "plots").iterdir())
    assert snapshot(mine) == {"lm_loss.png": snapshot(mine / "lm_loss.png")[""]}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out / 'plots'}: was a symbolic link (to {mine})" in err
    # every level below the given folder; the given folder (a link the user chose) is followed
    linked_out = tmp_path / "linked_out"
    linked_out.symlink_to(out, target_is_directory=True)
    (out / "seed0").symlink_to(mine)
    got = own_folder(linked_out / "seed0" / "diff", below=linked_out)
    assert got.is_dir() and not (out / "seed0").is_symlink() and linked_out.is_symlink()
    assert sorted(p.name for p in mine.iterdir()) == ["lm_loss.png"]
    own_folder(out / "seed0" / "diff")  # already real: nothing happens
    (out / "evals").write_text("a file\n")
    with pytest.raises(FileExistsError, match="a file where difftx writes a folder"):
        own_folder(out / "evals")
    with pytest.raises(ValueError, match="is not inside"):
        own_folder(tmp_path / "elsewhere", below=out)


def test_compare_rerun_replaces_linked_folders(tmp_path, capsys):
    """A finished comparison re-run with plots/, a model's evals/, and a whole seedS/ARM folder linked
    to a user's folders: the comparison writes real folders, the user's files stay as they were."""
    out = tmp_path / "c"
    cmd = ["compare", "--preset", "smoke", "--seeds", "1", "--out", str(out), "--workers", "1", "--no-progress",
           *as_sets(FAST)]
    assert main(cmd) == 0
    plots = sorted(p.name for p in (out / "plots").iterdir())
    evals = sorted(p.name for p in (out / "seed0" / "diff" / "evals").iterdir())
    assert plots and evals
    user_plots = _mine(tmp_path, "user_plots", {name: "my own figure\n" for name in plots})
    user_evals = _mine(tmp_path, "user_evals", {name: "{\"mine\": true}\n" for name in evals})
    user_model = _mine(tmp_path, "user_model", {"notes.txt": "keep\n"})
    before = {p: snapshot(p) for p in (user_plots, user_evals, user_model)}
    _link(out / "plots", user_plots)
    _link(out / "seed0" / "diff" / "evals", user_evals)
    _link(out / "seed0" / "baseline", user_model)  # the whole model folder: trained again, into a real folder
    capsys.readouterr()
    assert main(cmd) == 0
    err = capsys.readouterr().err
    for p in (user_plots, user_evals, user_model):
        assert snapshot(p) == before[p], p
    for folder in (out / "plots", out / "seed0" / "diff" / "evals", out / "seed0" / "baseline"):
        assert folder.is_dir() and not folder.is_symlink(), folder
        assert f"{folder}: was a symbolic link" in err
    assert sorted(p.name for p in (out / "plots").iterdir()) == plots
    assert (out / "seed0" / "baseline" / "train.json").is_file() and (out / "seed0" / "baseline" / "model").is_dir()
    assert "mine" not in (out / "seed0" / "diff" / "evals" / evals[0]).read_text()


def test_train_resume_replaces_a_linked_checkpoints_folder(tmp_path, capsys):
    """`train --resume` with checkpoints/ linked to a user's copy: resumes from it (reading follows the
    link), writes its new checkpoints into a real folder, and never prunes or changes the copy."""
    run = tmp_path / "run"
    args = ["train", "--preset", "test", "--out", str(run), "--no-progress"]
    assert main([*args, "--set", "steps=2", "--set", "ckpt_interval=1"]) == 0
    copy = tmp_path / "user_checkpoints"
    shutil.copytree(run / "checkpoints", copy)
    (copy / "notes.txt").write_text("mine\n")
    before = snapshot(copy)
    _link(run / "checkpoints", copy)
    capsys.readouterr()
    assert main([*args, "--resume", "--set", "steps=4", "--set", "ckpt_interval=1"]) == 0
    assert snapshot(copy) == before
    assert (run / "checkpoints").is_dir() and not (run / "checkpoints").is_symlink()
    assert (run / "checkpoints" / "latest").read_text().strip().endswith("4")
    assert "was a symbolic link" in capsys.readouterr().err


def test_tune_and_scale_own_their_subfolders(tmp_path, monkeypatch):
    """The folders `--tune` (tune/FIELD=V) and `scale` (size=NAME) name inside the output folder are
    real when the comparison there starts, whatever link stood at their names."""
    import difftx.compare.run as run_mod

    mine = _mine(tmp_path, "mine", {"keep.txt": "mine\n"})
    before = snapshot(mine)
    seen = []

    def fake_compare(preset, seeds, out, **kw):
        seen.append((Path(out), Path(out).is_symlink() or any(p.is_symlink() for p in Path(out).parents
                                                                  if tmp_path in p.parents)))
        if len(seen) == 2:
            raise KeyboardInterrupt  # enough: the second comparison's folder was seen
        return {}

    monkeypatch.setattr(run_mod, "run_compare", fake_compare)
    from difftx.studies.scale import run_scale
    from difftx.studies.tune import run_tuned

    out = tmp_path / "t"
    out.mkdir()
    (out / "tune").symlink_to(mine)
    with pytest.raises(KeyboardInterrupt):
        run_tuned("smoke", 2, out, ("lr", (0.001,)), progress=False)
    assert seen[1] == (out / "tune" / "lr=0.001", False) and snapshot(mine) == before
    seen.clear()
    scale_out = tmp_path / "s"
    scale_out.mkdir()
    (scale_out / "size=xs").symlink_to(mine)
    with pytest.raises(KeyboardInterrupt):
        run_scale("smoke", ["xs", "s"], 1, scale_out, progress=False)
    assert seen[0] == (scale_out / "size=xs", False) and snapshot(mine) == before
