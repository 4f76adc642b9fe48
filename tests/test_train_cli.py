"""``difftx train`` on your own text, from the command line (issue 15, training side): the README's
own-text example end to end (its ``difftx runs`` table and file modes included), ``--resume``
restoring the saved config and refusing changes it cannot make exactly, the warmup rule, the
``done:`` summary and progress output, another tokenizer than the run's refused, a failed
checkpoint write, and run folders that moved."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import stat
import sys
from pathlib import Path

import pytest

from difftx.cli import main
from difftx.training import checkpointing as ckpt
from difftx.training.config import TrainConfig, train_preset


def _write_text(path: Path, paragraphs: int = 30, seed: int = 3) -> Path:
    """A few KB of made-up prose (written here, so no corpus is needed)."""
    r = random.Random(seed)
    who = ["the miller", "a young weaver", "the old ferryman", "my neighbour", "the lighthouse keeper"]
    did = ["carried", "mended", "forgot", "painted", "counted", "sold"]
    what = ["a basket of apples", "the broken fence", "seven blue lanterns", "a map of the river", "an empty boat"]
    when = ["before the rain came", "while the town slept", "as the tide turned", "on the first of May"]
    paras = [" ".join(f"{r.choice(who).capitalize()} {r.choice(did)} {r.choice(what)} {r.choice(when)}."
                      for _ in range(r.randint(3, 6))) for _ in range(paragraphs)]
    path.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# the tiny settings the tests train with (the README's example uses the `tiny` preset)
FAST = ["--preset", "test", "--set", "steps=4", "--set", "eval_interval=2", "--set", "log_interval=2",
        "--set", "batch_size=2"]


def test_own_text_example_end_to_end(tmp_path, capsys, monkeypatch, umask022):
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    text = _write_text(tmp_path / "mytext.txt")
    assert main(["tokenizer", "train", "--input", str(text), "--vocab-size", "300", "--out", "tok"]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    for out, extra in (("runs/diff", []), ("runs/base", ["--baseline"])):
        assert main(["train", *FAST, "--data", "mytext.txt", "--tokenizer", "tok", "--out", out, "--no-progress",
                     *extra]) == 0
        done = capsys.readouterr().out.strip().splitlines()[-1]
        assert done.startswith("done: step 4/4, train loss ")
        assert "(best " in done and " at step " in done and "tokens per pass" in done
        assert "tokens/s over the run's" in done
        # the λ each DIFF layer learned closes the line (the baseline has none)
        assert bool(re.search(r", λ per layer -?\d\.\d\d, -?\d\.\d\d, checkpoint ", done)) == (not extra), done
    assert main(["runs", "runs/diff", "runs/base"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^runs/diff\s+-?\d\.\d\d, -?\d\.\d\d$", table, re.M) and re.search(r"^runs/base\s+n/a$",
                                                                                            table, re.M), table
    saved = json.loads(Path("runs/diff/train_config.json").read_text())
    # paths are saved absolute, with the path as given and relative to the run folder (a run folder that moves)
    assert saved["data_source"] == str(tmp_path / "mytext.txt") and saved["tokenizer"] == str(tmp_path / "tok")
    assert saved["saved_paths"]["data_source"] == {"as_given": "mytext.txt", "relative_to_run": "../../mytext.txt",
                                                   "bytes": text.stat().st_size, "files": 1,
                                                   "sha256": hashlib.sha256(text.read_bytes()).hexdigest()}
    assert saved["saved_paths"]["tokenizer"]["relative_to_run"] == "../../tok"

    # `--resume` alone continues the run as it was: its own data, tokenizer and model
    assert main(["train", "--out", "runs/diff", "--resume", "--set", "steps=6"]) == 0
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith("done: step 6/6")
    state = json.loads((ckpt.latest_checkpoint("runs/diff") / ckpt.STATE_NAME).read_text())
    assert state["tokens_seen"] == 6 * 2 * 32 and state["train_time_s"] > 0
    assert state["val_split_tokens"] > 0

    # `difftx eval lm --data FILE` scores every token of that file once, in windows of the training length
    held = _write_text(tmp_path / "heldout.txt", paragraphs=4, seed=11)
    assert main(["eval", "lm", "runs/diff", "--data", "heldout.txt", "--no-progress", "--json", "lm.json"]) == 0
    printed = capsys.readouterr().out
    res = json.loads(Path("lm.json").read_text())
    from difftx.data import load_tokenizer

    tok = load_tokenizer("tok")
    ids = [tok.eos_id] + tok.encode(held.read_text(encoding="utf-8"))
    assert res["tokens"] == len(ids) - 1 and res["window"] == 32
    # bits per byte over the text's own bytes: the <|endoftext|> separator is no 13 bytes of text
    assert res["heldout"]["bytes_per_token"] == pytest.approx(len(held.read_bytes()) / len(ids))
    assert f"scored heldout.txt: {res['tokens']:,} distinct tokens (all of it)" in printed
    # a part of the file: said so, with the file's own count
    assert main(["eval", "lm", "runs/diff", "--data", "heldout.txt", "--windows", "4", "--no-progress"]) == 0
    part = capsys.readouterr().out
    assert f"scored heldout.txt: 128 distinct tokens (of its {res['tokens']:,} predictable tokens) in 4 windows" in part
    assert "length extrapolation, on its own sample of" in part
    assert res["heldout"]["nll"] == pytest.approx(_independent_nll(ckpt.latest_checkpoint("runs/diff"), ids, 32),
                                                  rel=1e-5)

    assert main(["runs", "runs/diff", "runs/base", "--plot", "curves.png", "--nll", "--data", "heldout.txt"]) == 0
    table = capsys.readouterr().out
    print(table)
    lines = table.splitlines()
    header, _rule, diff_row, base_row = lines[:4]
    assert header.split() == ["run", "attention", "params", "steps", "tokens", "tok/s", "train", "loss", "val",
                              "loss", "best", "val", "@step", "val", "tok"]
    assert diff_row.split()[:2] == ["runs/diff", "diff"] and base_row.split()[:2] == ["runs/base", "standard"]
    assert " 6/6 " in diff_row and " 4/4 " in base_row
    # the held-out NLL in a table of its own: no row much wider than 100 characters (before: 154)
    at = next(i for i, line in enumerate(lines) if "held-out NLL [95% CI]" in line)
    header, _rule, diff_row, base_row = lines[at:at + 4]
    assert max(len(line) for line in lines[:4] + lines[at:at + 4]) <= 100, table
    assert diff_row.split()[0] == "runs/diff" and base_row.split()[0] == "runs/base"
    # every run against the first, window by window on the same text: base - diff; a text of a few hundred
    # tokens is too short for an interval that allows for dependent windows (tests/test_eval_lm.py has one)
    assert "- first run [95% CI]" in header and "(reference)" in diff_row
    diff_nll = float(re.findall(r"\d+\.\d{4}", diff_row)[-1])  # NLL (reference)
    base_nll, paired = (float(x) for x in re.findall(r"[-+]?\d+\.\d{4}", base_row)[-2:])
    assert paired == pytest.approx(base_nll - diff_nll, abs=2e-4)
    assert "- the NLL interval: none: windows of one text are not independent" in table
    assert Path("curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # colleagues can read what was written (umask 022): files 0644, folders 0755
    latest = ckpt.latest_checkpoint("runs/diff")
    assert _mode(latest) == 0o755
    for p in [latest / n for n in ("model.safetensors", "config.json", "optimizer.pt", "trainer_state.json",
                                   "train_config.json", "tokenizer/tokenizer.json")] + [
            Path("runs/diff/train_config.json"), Path("runs/diff/checkpoints/latest"), Path("tok/tokenizer.json")]:
        assert _mode(p) == 0o644, p
    cache_entries = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert cache_entries and all(_mode(p) == 0o755 for p in cache_entries)


def _independent_nll(folder, ids: list[int], window: int) -> float:
    """Mean NLL of every token after the first, in consecutive windows of ``window`` predictions,
    written without difftx's evaluation code."""
    import torch
    import torch.nn.functional as F

    from difftx.checkpoint import load_model

    model = load_model(folder).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window + 1]])
            total += float(F.cross_entropy(model(chunk[:, :-1])[0], chunk[0, 1:], reduction="sum"))
            count += chunk.shape[1] - 1
    return total / count


def _fake_run(tmp_path: Path, **fields) -> Path:
    """A run folder holding only its saved train_config.json (enough for --print-config)."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = train_preset("test", out_dir=str(run), data_source=str(_write_text(tmp_path / "a.txt")), steps=10,
                       warmup_steps=1, progress=False, **fields)
    (run / ckpt.TRAIN_CONFIG_NAME).write_text(cfg.to_json())
    return run


def test_resume_alone_restores_the_saved_config(tmp_path, capsys):
    run = _fake_run(tmp_path, model_overrides={"attention": "standard"}, lr=3e-3)
    assert main(["train", "--out", str(run), "--resume", "--print-config"]) == 0
    got = TrainConfig.from_dict(json.loads(capsys.readouterr().out))
    saved = TrainConfig.from_dict(json.loads((run / ckpt.TRAIN_CONFIG_NAME).read_text()))
    assert got == saved  # not the `tiny` preset's defaults: the run's own data source, model and lr
    # execution settings may change, and steps may be raised
    assert main(["train", "--out", str(run), "--resume", "--print-config", "--set", "steps=20",
                 "--set", "log_interval=1", "--set", "device=cpu", "--set", "tensorboard=false"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["steps"] == 20 and got["log_interval"] == 1 and got["data_source"] == saved.data_source
    # the same data (however spelled) and the default tokenizer named again are no change
    assert main(["train", "--out", str(run), "--resume", "--print-config", "--data", saved.data_source + "/",
                 "--tokenizer", "byte"]) == 0
    assert TrainConfig.from_dict(json.loads(capsys.readouterr().out)) == saved  # the saved spelling is kept


@pytest.mark.parametrize("flags, field", [
    (["--set", "lr=0.5"], "lr"),
    (["--data", "OTHER"], "data_source"),
    (["--tokenizer", "OTHER"], "tokenizer"),
    (["--set", "steps=5"], "steps"),
    (["--attention", "diff"], "model_overrides"),
    (["--set", "seq_len=16"], "seq_len"),
])
def test_resume_refuses_what_it_cannot_change_exactly(tmp_path, capsys, flags, field):
    run = _fake_run(tmp_path, model_overrides={"attention": "standard"})
    flags = [str(tmp_path / "b.txt") if f == "OTHER" else f for f in flags]
    assert main(["train", "--out", str(run), "--resume", "--print-config", *flags]) == 2
    err = capsys.readouterr().err
    assert f"['{field}']" in err and "saved" in err and "--init-from" in err
    assert str(run / ckpt.TRAIN_CONFIG_NAME) in err


def test_warmup_longer_than_steps_is_scaled_with_a_note_or_refused_when_explicit(tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--set", "steps=40", "--print-config"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["warmup_steps"] == 2  # the preset's 100 of 2000 steps: 5%
    assert "warmup_steps=100" in captured.err and "steps=40" in captured.err and "scaled to 2" in captured.err
    assert main(["train", "--preset", "tiny", "--set", "steps=40", "--set", "warmup_steps=50",
                 "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "warmup_steps=50" in err and "steps=40" in err


def test_unknown_train_flag_prints_the_train_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--preset", "test", "--no-such-flag"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # the train subcommand's error, not the top level's
    assert last.startswith("difftx train: error: unrecognized arguments: --no-such-flag")


def test_tensorboard_skip_is_said_once(tmp_path, capsys):
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensorboard is installed here")
    from difftx.training.metrics import MetricsLogger

    MetricsLogger(tmp_path / "m.jsonl", tmp_path / "tb").close()  # the default: TensorBoard if installed, silently
    assert "TensorBoard" not in capsys.readouterr().err
    MetricsLogger(tmp_path / "m.jsonl", tmp_path / "tb", say_if_missing=True).close()
    assert capsys.readouterr().err.count("TensorBoard logging skipped") == 1


def test_no_progress_hides_only_the_bars_and_tensorboard_is_noted_only_when_asked_for(tmp_path, capsys, monkeypatch):
    """Before: --no-progress also dropped the start line and the validation losses, and every `train`
    printed a TensorBoard-not-installed note. Now --no-progress hides the bars (the tokenizing one
    too) and nothing else; the note comes only with --set tensorboard=true."""
    import importlib.util

    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    text = _write_text(tmp_path / "mytext.txt")
    args = ["train", *FAST, "--data", str(text), "--set", "tensorboard=true"]
    assert main([*args, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    got = capsys.readouterr()
    assert "difftx train: diff model, " in got.out
    assert "step 2: val_loss " in got.out and "step 4: val_loss " in got.out
    assert "%|" not in got.err and "tokenizing" not in got.err and "it/s" not in got.err, got.err
    assert got.out.strip().splitlines()[-1].startswith("done: step 4/4")
    if importlib.util.find_spec("tensorboard") is None:
        assert got.err.count("TensorBoard logging skipped") == 1
    # the `tiny` preset's default tensorboard=true (used when installed), not asked for: no note
    tiny = ["--preset", "tiny", "--set", "model=test", "--set", "seq_len=32", "--set", "batch_size=2", "--set",
            "steps=2", "--set", "warmup_steps=0", "--set", "eval_interval=0", "--set", "device=cpu"]
    assert main(["train", *tiny, "--data", str(text), "--out", str(tmp_path / "run2"), "--no-progress"]) == 0
    assert "TensorBoard" not in capsys.readouterr().err
    saved = json.loads((tmp_path / "run2" / "train_config.json").read_text())
    assert saved["progress"] is True and saved["tensorboard"] is True  # --no-progress is this command's only


def test_a_text_too_short_for_one_validation_window_trains_without_validation(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    text = _write_text(tmp_path / "short.txt", paragraphs=3)
    assert main(["train", *FAST, "--set", "seq_len=64", "--data", str(text), "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "no validation: the held-out split has" in captured.err
    assert captured.out.strip().splitlines()[-1].startswith("done: step 4/4")


def test_resume_prints_what_changes_in_the_schedule(tmp_path, capsys, monkeypatch):
    """Raising steps on resume moves the schedule: the command says so, with the learning rate of
    the next step under the old and the new schedule (computed here independently) and the new
    warmup and decay; a resume that keeps the schedule says nothing about it."""
    import math

    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    args = ["train", "--preset", "test", "--set", "batch_size=2", "--set", "ckpt_interval=4", "--out", str(out),
            "--no-progress"]
    assert main([*args, "--set", "steps=4"]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--set", "steps=4", "--no-progress"]) == 0
    assert "schedule" not in capsys.readouterr().out
    assert main(["train", "--out", str(out), "--resume", "--set", "steps=8", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    note = [line for line in printed.splitlines() if "changes the schedule" in line]
    assert len(note) == 1, printed
    cfg = train_preset("test")  # lr 1e-3, min_lr 1e-4, warmup 2, cosine

    def lr(step, steps):
        frac = min(1.0, (step - cfg.warmup_steps) / (steps - cfg.warmup_steps))  # past the end: min_lr
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))

    assert lr(5, 4) == pytest.approx(cfg.min_lr)
    assert ("steps 4 -> 8" in note[0] and f"at step 5 goes from {lr(5, 4):.3g} to {lr(5, 8):.3g}" in note[0]
            and "no warmup (it ended at step 2)" in note[0] and "cosine decay to 0.0001 at step 8" in note[0]), note


def test_eval_with_another_tokenizer_than_the_runs_is_refused(tmp_path, capsys, monkeypatch):
    """A BPE run scored with --tokenizer byte (same vocabulary size or smaller) used to give a
    wrong bits/byte without a word; now it is one line naming both tokenizers. Naming the run's own
    tokenizer again is fine."""
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    _write_text(tmp_path / "mytext.txt")
    assert main(["tokenizer", "train", "--input", "mytext.txt", "--vocab-size", "300", "--out", "tok"]) == 0
    assert main(["train", *FAST, "--data", "mytext.txt", "--tokenizer", "tok", "--out", "run", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["eval", "lm", "run", "--tokenizer", "byte", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tokenizer byte" in err and "not the tokenizer this model was trained" \
        in err and "leave --tokenizer out" in err, err
    for own in (["--tokenizer", "tok"], []):
        assert main(["eval", "lm", "run", *own, "--no-progress"]) == 0

    # `generate` likewise (before: garbage text, exit 0); with no tokenizer saved beside the model to
    # check against, a size that differs from the model's is a warning
    capsys.readouterr()
    assert main(["generate", "run", "--tokenizer", "byte", "--max-new-tokens", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tokenizer byte (byte, 257 tokens) is not the tokenizer this model was " \
        "trained with" in err and "leave --tokenizer out" in err, err
    for own in (["--tokenizer", "tok"], []):
        assert main(["generate", "run", *own, "--max-new-tokens", "3"]) == 0
    assert "warning" not in capsys.readouterr().err
    import difftx
    from difftx.checkpoint import save_model

    save_model(difftx.Transformer(difftx.preset("test").replace(vocab_size=512)), tmp_path / "bare")
    assert main(["generate", str(tmp_path / "bare"), "--tokenizer", "tok", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "no tokenizer saved with it" in err and "512 token ids, the tokenizer 300" in err


def _file_size_limit(limit: int):
    def apply():  # in the child: writes beyond `limit` bytes fail with EFBIG instead of killing it
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_checkpoint_write_failure_names_the_file_the_cause_and_the_last_good_checkpoint(tmp_path):
    """A resume under a file-size limit that the optimizer state (about 420 KB) exceeds but the
    weights (about 200 KB) do not: one line naming optimizer.pt, the errno text and the intact
    checkpoint of step 2, which stays the latest."""
    import subprocess

    _write_text(tmp_path / "mytext.txt")
    env = {**os.environ, "DIFFTX_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    entry = "import sys; from difftx.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", entry, "train", *FAST, "--data", "mytext.txt", "--out", "run",
           "--no-progress", "--set", "ckpt_interval=2"]
    first = subprocess.run([*cmd[:-2], "--set", "steps=2"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    got = subprocess.run([*cmd, "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         preexec_fn=_file_size_limit(300_000), timeout=300)
    err = got.stderr.strip()
    assert got.returncode == 1 and len(err.splitlines()) == 1, got.stderr
    assert f"{os.path.join('run', 'checkpoints', 'step_00000004', 'optimizer.pt')}: {os.strerror(27)}" in err, err
    assert "the last good checkpoint is " + os.path.join("run", "checkpoints", "step_00000002") in err, err
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step_00000002"
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "run" / "checkpoints").iterdir())


def test_a_moved_run_folder_resumes_and_evaluates_from_any_directory(tmp_path, capsys, monkeypatch):
    """A run trained in A with relative paths, its project folder moved to B, then resumed,
    evaluated and summarised from a third folder C (before: "tokenizer 'tok/' ... no such file",
    and passing the right paths was refused as a change). A path that is gone is named with the
    config it came from and the flag that points it elsewhere; a path given anew must hold the same
    content; a copy of the same data is no change."""
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    a, c = tmp_path / "A", tmp_path / "C"
    a.mkdir()
    c.mkdir()
    monkeypatch.chdir(a)
    _write_text(a / "mytext.txt")
    assert main(["tokenizer", "train", "--input", "mytext.txt", "--vocab-size", "300", "--out", "tok/"]) == 0
    assert main(["train", *FAST, "--data", "mytext.txt", "--tokenizer", "tok/", "--out", "run", "--no-progress"]) == 0
    b = a.rename(tmp_path / "B")
    monkeypatch.chdir(c)
    capsys.readouterr()

    assert main(["train", "--out", "../B/run", "--resume", "--set", "steps=6", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("done: step 6/6")
    saved = json.loads((b / "run" / "train_config.json").read_text())
    assert saved["data_source"] == str(b / "mytext.txt") and saved["tokenizer"] == str(b / "tok")
    assert main(["eval", "lm", "../B/run", "--no-progress"]) == 0
    assert f"the validation split of {b / 'mytext.txt'}" in capsys.readouterr().out
    assert main(["runs", "../B/run", "--nll"]) == 0
    assert "held-out NLL [95% CI]" in capsys.readouterr().out

    # the text moved away as well: named, with the config it came from and how to point at it
    (b / "mytext.txt").rename(c / "moved.txt")
    assert main(["train", "--out", "../B/run", "--resume", "--set", "steps=8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"data_source '{b / 'mytext.txt'}', saved in ../B/run/train_config.json, does not exist" in err, err
    assert "--data PATH (or --set data_source=PATH)" in err and "tokenizer" not in err, err
    assert main(["eval", "lm", "../B/run", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "data_source" in err and "does not exist" in err and "--data FILE" in err, err
    # another text in its place is refused, naming both sizes; the same text at its new place is taken
    _write_text(c / "other.txt", paragraphs=5)
    assert main(["train", "--out", "../B/run", "--resume", "--set", "steps=8", "--no-progress",
                 "--data", "other.txt"]) == 2
    err = capsys.readouterr().err
    assert "--data other.txt is not the same data" in err and f"{(c / 'moved.txt').stat().st_size:,} bytes" in err
    assert main(["train", "--out", "../B/run", "--resume", "--set", "steps=8", "--no-progress",
                 "--data", "moved.txt"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("done: step 8/8")
    assert json.loads((b / "run" / "train_config.json").read_text())["data_source"] == str(c / "moved.txt")
    assert main(["eval", "lm", "../B/run", "--no-progress"]) == 0
    capsys.readouterr()
    # a copy of the same text where the saved one still exists is the same data, not a change
    (c / "copy.txt").write_bytes((c / "moved.txt").read_bytes())
    assert main(["train", "--out", "../B/run", "--resume", "--print-config", "--data", "copy.txt"]) == 0
    assert json.loads(capsys.readouterr().out)["data_source"] == str(c / "moved.txt")


def test_a_run_saved_with_relative_paths_still_resolves_after_a_move(tmp_path, capsys, monkeypatch):
    """Runs written before paths were saved absolute hold them as typed; they are found relative
    to the folder the run was started from (out_dir's depth above the run folder)."""
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    a = tmp_path / "A"
    a.mkdir()
    monkeypatch.chdir(a)
    _write_text(a / "mytext.txt")
    assert main(["train", *FAST, "--data", "mytext.txt", "--out", "runs/one", "--no-progress"]) == 0
    for f in [a / "runs/one/train_config.json", *(a / "runs/one/checkpoints").glob("*/train_config.json")]:
        old = json.loads(f.read_text())
        old.pop("saved_paths")
        f.write_text(json.dumps({**old, "data_source": "mytext.txt"}))
    b = a.rename(tmp_path / "B")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["eval", "lm", "B/runs/one", "--no-progress"]) == 0
    assert f"the validation split of {b / 'mytext.txt'}" in capsys.readouterr().out
    assert main(["train", "--out", "B/runs/one", "--resume", "--set", "steps=6", "--no-progress"]) == 0
    assert json.loads((b / "runs/one/train_config.json").read_text())["data_source"] == str(b / "mytext.txt")
