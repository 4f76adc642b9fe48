"""Errors on hostile-but-ordinary input (issue 14): every case ends in one line on stderr naming
the file or flag, a documented exit code (2 input/usage, 1 runtime failure, 130 interrupted), no
traceback, and the user's files byte-identical. One test (or a few) per pattern:

1. the CLI's error boundary (known errors, unexpected errors, Ctrl-C, output paths checked first);
2. nothing a user made is overwritten (export / import, the run-folder lock, logs, --resume);
3. bounded memory and validated sizes (generate, the needle evaluation);
4. validation at the public Python API (token ids, attention masks, generate);
5. parse errors name the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import difftx
from difftx import AttentionMask, Transformer
from difftx.checkpoint import save_model
from difftx.cli import main
from difftx.generation import CacheTooLargeError, generate, kv_cache_bytes
from difftx.training import checkpointing as ckpt

ROOT = Path(__file__).resolve().parents[1]


def snapshot(path: Path) -> dict:
    """Every file under ``path`` (or ``path`` itself) -> its SHA-1: 'byte-identical afterwards'."""
    path = Path(path)
    if path.is_file():
        return {"": hashlib.sha1(path.read_bytes()).hexdigest()}
    return {str(f.relative_to(path)): hashlib.sha1(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def run_cli(capsys, *argv) -> tuple[int, str]:
    """``difftx ARGV`` in this process: (exit code, stderr); asserts the one-line, no-traceback rule."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line or "interrupted" in line]
    assert len(lines) <= 1, err
    return code, err


def model_config(**kw):
    return difftx.preset("test").replace(vocab_size=257, **kw)  # fits the byte tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A model folder (config.json + model.safetensors) for `generate --tokenizer byte`, export."""
    folder = tmp_path_factory.mktemp("model") / "m"
    torch.manual_seed(0)
    save_model(Transformer(model_config()), folder)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    src = root / "docs"
    src.mkdir()
    words = "the king and queen of a small land walked to the sea while birds sang over hills".split()
    for i in range(4):
        (src / f"d{i}.txt").write_text(" ".join(words[(i + j * 3) % len(words)] for j in range(800)))
    return src, root / "cache"


def train_args(corpus, out: Path, steps: int = 2, *extra) -> list:
    src, cache = corpus
    return ["train", "--preset", "test", "--out", out, "--set", f"steps={steps}", "--set", "warmup_steps=0",
            "--set", "ckpt_interval=2", "--set", "eval_interval=0", "--set", f"data_source={src}",
            "--set", f"cache_dir={cache}", "--set", "val_fraction=0.1", "--set", "progress=false", *extra]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus) -> Path:
    """A finished two-step training run (a checkpoint at step 2), shared read-only."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert main([str(a) for a in train_args(corpus, out)]) == 0
    return out


# -- 1. the error boundary --------------------------------------------------------------------------
@pytest.mark.parametrize("make", ["empty folder", "garbage file", "garbage config.json", "config list"])
def test_info_on_garbage_is_one_clean_line(tmp_path, capsys, make):
    target = tmp_path / "x"
    if make == "empty folder":
        target.mkdir()
    elif make == "garbage file":
        target.write_bytes(os.urandom(200) + b"\xff")
    elif make == "garbage config.json":
        target.mkdir()
        (target / "config.json").write_bytes(b"\x89PNG\x00\xff" * 10)
    else:
        target.mkdir()
        (target / "config.json").write_text("[1, 2]")
    before = snapshot(target)
    code, err = run_cli(capsys, "info", target)
    assert code == 2 and str(target) in err and err.startswith("difftx info: error: ")
    assert snapshot(target) == before


def test_info_reads_a_run_folder_and_a_config_file(tmp_path, capsys, run_dir):
    assert main(["info", str(run_dir)]) == 0
    (tmp_path / "my.json").write_text(model_config().to_json())
    assert main(["info", str(tmp_path / "my.json")]) == 0
    assert "parameters=" in capsys.readouterr().out


def test_unexpected_error_says_how_to_get_the_traceback(capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("something internal\nwith a second line")

    monkeypatch.setattr("difftx.config.preset", boom)
    code, err = run_cli(capsys, "info", "tiny")
    assert code == 1
    assert err.strip() == ("difftx info: error: unexpected error: RuntimeError: something internal "
                           "(run with DIFFTX_DEBUG=1 for the traceback)")
    monkeypatch.setenv("DIFFTX_DEBUG", "1")
    assert main(["info", "tiny"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "something internal" in err


def test_ctrl_c_anywhere_is_exit_130_and_one_line(capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("difftx.config.preset", interrupted)  # while working
    code, err = run_cli(capsys, "info", "tiny")
    assert code == 130 and err.strip() == "difftx info: interrupted"
    monkeypatch.setattr("importlib.import_module", interrupted)  # while building the parser (imports)
    code, err = run_cli(capsys, "info", "tiny")
    assert code == 130 and err.strip() == "difftx: interrupted"


def test_ctrl_c_during_start_up_in_a_real_process():
    """SIGINT while `python -m difftx` is still importing (at several moments: Python's, torch's,
    triton's imports, the command itself): 130 and one line, never a traceback or a death by signal."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # the command line, its parser included, imports nothing heavy before its error boundary is in place
    light = subprocess.run([sys.executable, "-c", "import sys, difftx.cli; difftx.cli.build_parser(); "
                            "print('torch' in sys.modules)"], capture_output=True, text=True, env=env, check=True)
    assert light.stdout.strip() == "False"
    interrupted = 0
    # `python -m difftx`, once the interpreter itself is up (a SIGINT inside Python's own start-up, before
    # any difftx code runs, is the interpreter's to handle): the child says "up" and then runs difftx's
    # __main__ as `-m` does
    child = ("import runpy, sys, difftx; sys.stderr.write('up\\n'); sys.stderr.flush(); "
             "sys.argv = ['difftx', 'info', 'tiny']; runpy.run_module('difftx', run_name='__main__')")
    for delay in (0.0, 0.1, 0.3, 0.5, 0.8, 1.2):
        # a job started in the background inherits SIGINT ignored: give the child the default disposition
        proc = subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert proc.stderr.readline().strip() == "up"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        if proc.returncode in (0, -signal.SIGINT) and "parameters" in out:
            continue  # the command had finished (the signal came during interpreter shutdown, or after)
        frames = re.findall(r'File "[^"]*difftx[/\\][^"]*", line (\d+)', err)
        if proc.returncode == -signal.SIGINT and all(n == "0" for n in frames):
            continue  # runpy was still loading difftx/__main__.py (only its line 0 in the traceback): none of it ran
        interrupted += 1
        assert proc.returncode == 130, (delay, err)
        assert "Traceback" not in err and err.strip() in ("difftx: interrupted", "difftx info: interrupted"), err
    if not interrupted:  # pragma: no cover - a very fast machine finished first every time
        pytest.skip("the command finished before every signal")


def test_an_interrupt_inside_a_callback_python_ignores_is_raised_again_without_a_traceback():
    """Ctrl-C handled inside importlib's weakref callback (errors there are "ignored" and printed):
    the watch keeps it from printing and raises it again in code that can stop (a CI failure)."""
    child = ("import sys, time, weakref\n"
             "from difftx.cli import _InterruptWatch\n"
             "watch = _InterruptWatch(); watch.seen = True\n"
             "class Thing: pass\n"
             "def callback(_): raise KeyboardInterrupt\n"
             "thing = Thing(); ref = weakref.ref(thing, callback); del thing\n"
             "try:\n"
             "    end = time.monotonic() + 10\n"
             "    while time.monotonic() < end: pass\n"
             "    print('lost')\n"
             "except KeyboardInterrupt:\n"
             "    print('raised again')\n"
             "print(watch.finish(0, 'difftx'))\n")
    proc = subprocess.run([sys.executable, "-c", child], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.split() == ["raised", "again", "130"], proc.stdout + proc.stderr
    assert proc.stderr.strip() == "difftx: interrupted", proc.stderr


def test_usage_errors_are_one_line_naming_the_flag(capsys, tmp_path):
    code, err = run_cli(capsys, "generate")
    assert code == 2 and "checkpoint" in err and "usage:" not in err and "difftx generate --help" in err
    folder = tmp_path / "folder"
    folder.mkdir()
    code, err = run_cli(capsys, "bench", "--seq-lens", "8", "--dim", "32", "--heads", "2", "--json", folder)
    assert code == 2 and "--json" in err and "is a folder" in err
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    code, err = run_cli(capsys, "compare", "--preset", "smoke", "--out", afile)
    assert code == 2 and "--out" in err and "not a folder" in err
    code, err = run_cli(capsys, "tokenizer", "train", "--input", afile, "--out", afile)
    assert code == 2 and "--out" in err
    code, err = run_cli(capsys, "compare", "--preset", "smoke", "--seeds", "0", "--out", tmp_path / "c")
    assert code == 2 and "--seeds" in err
    assert afile.read_text() == "mine\n" and not any(folder.iterdir()) and not (tmp_path / "c").exists()


def test_eval_output_and_size_flags_are_checked_before_the_work(capsys, tmp_path, run_dir):
    folder = tmp_path / "folder"
    folder.mkdir()
    t0 = time.perf_counter()
    code, err = run_cli(capsys, "eval", "lm", run_dir, "--json", folder)
    assert code == 2 and "--json" in err and "folder" in err
    for bad in ("0", "-5"):
        code, err = run_cli(capsys, "eval", "lm", run_dir, "--seq-len", bad)
        assert code == 2 and "--seq-len" in err
    code, err = run_cli(capsys, "eval", "needle", run_dir, "--context-len", "3")
    assert code == 2 and "context_len" in err and "--context-len" in err
    assert time.perf_counter() - t0 < 60  # refused up front, not after an evaluation
    assert not any(folder.iterdir())


def test_cuda_without_cuda_is_a_clear_error(capsys, model_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, err = run_cli(capsys, "generate", model_dir, "--tokenizer", "byte", "--device", "cuda")
    assert code == 2 and "--device cuda" in err and "--device cpu" in err


def test_disk_full_while_checkpointing_is_exit_1_and_keeps_the_last_checkpoint(capsys, tmp_path, corpus,
                                                                               monkeypatch):
    out = tmp_path / "run"
    assert main([str(a) for a in train_args(corpus, out)]) == 0
    capsys.readouterr()
    before = snapshot(out / "checkpoints")

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "write_json", full)
    code, err = run_cli(capsys, *train_args(corpus, out, 4, "--resume"))
    assert code == 1 and "No space left on device" in err and "free some disk space" in err
    assert str(out / "checkpoints") in err
    assert snapshot(out / "checkpoints") == before  # the last good checkpoint and pointer are intact
    assert not (out / ckpt.LOCK_NAME).exists()  # the lock went with the failed run


# -- 2. nothing a user made is overwritten ------------------------------------------------------------
def test_export_refuses_a_non_empty_folder_unless_overwrite(capsys, tmp_path, model_dir):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}\n')
    other = tmp_path / "other_ckpt"
    save_model(Transformer(model_config(dim=48)), other)
    for target in (mine, other):
        before = snapshot(target)
        code, err = run_cli(capsys, "export", model_dir, target)
        assert code == 2 and str(target) in err and "--overwrite" in err
        assert snapshot(target) == before
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = run_cli(capsys, "export", model_dir, afile)
    assert code == 2 and "not a folder" in err and afile.read_text() == "x"
    # an empty folder is fine; --overwrite replaces a whole folder (no stale file of the old one stays)
    (tmp_path / "empty").mkdir()
    assert main(["export", str(model_dir), str(tmp_path / "empty")]) == 0
    assert main(["export", str(model_dir), str(mine), "--overwrite"]) == 0
    assert json.loads((mine / "config.json").read_text())["model_type"] == "diffllama"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_export_is_never_half_written(tmp_path, model_dir, monkeypatch):
    from difftx.interop import hf

    def crash(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "write_json", crash)  # config.json is written last
    with pytest.raises(OSError):
        hf.export_hf(model_dir, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor a temporary one
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "a.txt").write_text("old")
    with pytest.raises(OSError):
        hf.export_hf(model_dir, tmp_path / "keep", overwrite=True)
    assert (tmp_path / "keep" / "a.txt").read_text() == "old"  # the replaced folder survives a failure
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_import_refuses_an_existing_checkpoint(capsys, tmp_path, model_dir):
    pytest.importorskip("safetensors")
    hf_dir = tmp_path / "hf"
    assert main(["export", str(model_dir), str(hf_dir)]) == 0
    target = tmp_path / "ckpt"
    save_model(Transformer(model_config(dim=48)), target)
    before = snapshot(target)
    code, err = run_cli(capsys, "import", hf_dir, target)
    assert code == 2 and str(target) in err and "--overwrite" in err
    assert snapshot(target) == before
    assert main(["import", str(hf_dir), str(target), "--overwrite"]) == 0
    assert difftx.checkpoint.load_config(target) == model_config()


def test_a_run_folder_in_use_is_refused_and_a_stale_lock_taken_over(capsys, tmp_path, corpus):
    out = tmp_path / "run"
    assert main([str(a) for a in train_args(corpus, out)]) == 0
    capsys.readouterr()
    assert not (out / ckpt.LOCK_NAME).exists()  # released at the end of the run
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(out / ckpt.LOCK_NAME)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, b'pid %d host here' % os.getpid())\n"
         "print('ready', flush=True)\n"
         "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = snapshot(out)
        code, err = run_cli(capsys, *train_args(corpus, out, 4, "--resume"))
        assert code == 2 and "in use by another difftx run" in err and f"pid {holder.pid}" in err
        assert str(out / ckpt.LOCK_NAME) in err
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()
    # the holder died without cleaning up: its lock file (with its pid) stays and is taken over
    assert f"pid {holder.pid}" in (out / ckpt.LOCK_NAME).read_text()
    code, err = run_cli(capsys, *train_args(corpus, out, 4, "--resume"))
    assert code == 0, err
    assert ckpt.latest_checkpoint(out).name == "step_00000004"
    # in one process, a second run on a folder being written is refused too
    ckpt.lock_run(out)
    try:
        with pytest.raises(difftx.checkpoint.CheckpointError, match="already being written"):
            ckpt.lock_run(out)
    finally:
        ckpt.unlock_run(out)


def test_logs_without_a_checkpoint_are_not_replaced(capsys, tmp_path, corpus):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    before = snapshot(out)
    code, err = run_cli(capsys, *train_args(corpus, out, 1))
    assert code == 2 and "metrics.jsonl" in err and str(out) in err and "--resume" in err
    assert snapshot(out) == before
    afile = tmp_path / "afile"
    afile.write_text("mine")
    code, err = run_cli(capsys, *train_args(corpus, afile, 1))
    assert code == 2 and str(afile) in err and "not a folder" in err and afile.read_text() == "mine"


def test_resume_with_fewer_steps_than_the_checkpoint_changes_nothing(capsys, tmp_path, run_dir):
    out = tmp_path / "run"
    import shutil

    shutil.copytree(run_dir, out)
    before = snapshot(out)
    src = json.loads((out / "train_config.json").read_text())
    code, err = run_cli(capsys, "train", "--preset", "test", "--out", out, "--resume", "--set", "steps=1",
                        "--set", "warmup_steps=0", "--set", "ckpt_interval=2", "--set", "eval_interval=0",
                        "--set", f"data_source={src['data_source']}", "--set", f"cache_dir={src['cache_dir']}",
                        "--set", "val_fraction=0.1", "--set", "progress=false")
    assert code == 2 and "cannot change" in err and "steps" in err  # the resume rule of `difftx train`
    assert snapshot(out) == before  # train_config.json and metrics.jsonl untouched


# -- 3. bounded memory, validated sizes ------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"), ("--top-p", "0"),
    ("--top-p", "1.5"), ("--top-p", "nan"), ("--top-k", "-1"), ("--top-k", "0"), ("--max-new-tokens", "-1"),
])
def test_generate_sampling_flags_are_validated(capsys, model_dir, flag, value):
    code, err = run_cli(capsys, "generate", model_dir, "--tokenizer", "byte", flag, value)
    assert code == 2 and flag in err


def test_generate_refuses_a_kv_cache_that_cannot_fit(capsys, model_dir, monkeypatch):
    code, err = run_cli(capsys, "generate", model_dir, "--tokenizer", "byte", "--max-new-tokens", "10000000000000")
    assert code == 2 and "--max-new-tokens 10000000000000" in err and "KV cache" in err and "memory" in err
    monkeypatch.setattr("difftx.generation.available_memory", lambda device: 1 << 20)  # 1 MiB left
    code, err = run_cli(capsys, "generate", model_dir, "--tokenizer", "byte", "--max-new-tokens", "5000",
                        "--device", "cpu")
    assert code == 2 and "--max-new-tokens 5000" in err and "1.0 MiB" in err
    assert main(["generate", str(model_dir), "--tokenizer", "byte", "--max-new-tokens", "3", "--device", "cpu"]) == 0


def test_needle_context_len_too_short_is_refused_and_too_long_warned(model_dir):
    from difftx.eval.needle_text import evaluate_needles_text

    model = difftx.checkpoint.load_model(model_dir)  # max_seq_len 64
    enc = lambda s: list(s.encode())  # noqa: E731
    dec = lambda ids: bytes(i for i in ids if i < 256).decode(errors="replace")  # noqa: E731
    with pytest.raises(ValueError, match="context_len: 3 tokens cannot hold 1 needle"):
        evaluate_needles_text(model, enc, dec, context_len=3, grid=((1, 1),), depths=(0.5,), samples_per_cell=1)
    with pytest.warns(UserWarning, match=r"context_len 80 is beyond the model's max_seq_len 64.*TFLOP.*KV cache"):
        evaluate_needles_text(model, enc, dec, context_len=80, grid=((1, 1),), depths=(0.5,), samples_per_cell=1,
                              max_new_tokens=2)


def test_a_library_warning_is_one_line_in_the_cli(capsys, monkeypatch):
    import warnings

    def warn(*a, **k):
        warnings.warn("this will take long")
        return difftx.config.PRESETS["tiny"]

    monkeypatch.setattr("difftx.config.preset", warn)
    assert main(["info", "tiny"]) == 0
    assert capsys.readouterr().err == "difftx info: warning: this will take long\n"


# -- 4. validation at the Python API ------------------------------------------------------------------------
def test_token_ids_out_of_range_name_the_argument():
    model = Transformer(difftx.preset("test"))  # vocab 64
    with pytest.raises(ValueError, match=r"tokens: ids must be in \[0, vocab_size=64\), got min 0 and max 64"):
        model(torch.tensor([[0, 5, 64]]))
    with pytest.raises(ValueError, match="got min -1 and max 5"):
        model(torch.tensor([[-1, 5]]))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(1, 3))
    assert model(torch.tensor([[0, 63]])).shape == (1, 2, 64)


def test_attention_masks_are_checked():
    attn = difftx.DiffAttention(32, 2, 0)
    x = torch.randn(2, 5, 32)
    with pytest.raises(TypeError, match="difftx.AttentionMask"):
        attn(x, mask=torch.ones(2, 5, dtype=torch.bool))
    for S in (4, 6):  # shorter, longer than the sequence
        with pytest.raises(ValueError, match=rf"AttentionMask.key_valid: expected shape \(2, 5\).*got \(2, {S}\)"):
            attn(x, mask=AttentionMask(key_valid=torch.ones(2, S, dtype=torch.bool)))
    with pytest.raises(ValueError, match="AttentionMask.doc_ids"):
        attn(x, mask=AttentionMask(doc_ids=torch.zeros(3, 5, dtype=torch.long)))
    assert attn(x, mask=AttentionMask(key_valid=torch.ones(2, 5, dtype=torch.bool))).shape == x.shape


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=1.5), "max_new_tokens"),
])
def test_generate_arguments_are_checked_before_any_work(kw, match):
    model = Transformer(difftx.preset("test"))
    kw = {"max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=match):
        generate(model, [[1, 2]], **kw)


def test_generate_cache_estimate_and_refusal(monkeypatch):
    model = Transformer(difftx.preset("test"))
    # test preset: 2 DIFF layers, k 2*2 sub-heads of 8, v 2 heads of 16: 64 floats per layer and position
    assert kv_cache_bytes(model, 3, 10) == 3 * 10 * 2 * 64 * 4
    monkeypatch.setattr("difftx.generation.available_memory", lambda device: 10_000)
    with pytest.raises(CacheTooLargeError, match=r"max_new_tokens=100 .*KV cache of 1 x 102 positions"):
        generate(model, [[1, 2]], 100)


# -- 5. parse errors name the file ------------------------------------------------------------------------------
def test_a_binary_config_is_named(capsys, tmp_path):
    cfg = tmp_path / "config.bin"
    cfg.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    code, err = run_cli(capsys, "train", "--config", cfg, "--out", tmp_path / "o")
    assert code == 2 and str(cfg) in err and "not a text file" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field, value", [("step", "two"), ("step", -3), ("world_size", 0), ("tokens_seen", None)])
def test_a_bad_trainer_state_is_named(capsys, tmp_path, run_dir, field, value):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    state_file = ckpt.latest_checkpoint(out) / ckpt.STATE_NAME
    state = json.loads(state_file.read_text())
    state[field] = value
    state_file.write_text(json.dumps(state))
    before = snapshot(out)
    src = json.loads((out / "train_config.json").read_text())
    code, err = run_cli(capsys, "train", "--preset", "test", "--out", out, "--resume", "--set", "steps=4",
                        "--set", "warmup_steps=0", "--set", f"data_source={src['data_source']}",
                        "--set", f"cache_dir={src['cache_dir']}", "--set", "val_fraction=0.1",
                        "--set", "progress=false")
    assert code == 2 and str(state_file) in err and repr(field) in err
    assert snapshot(out) == before


def test_a_binary_latest_pointer_is_named(capsys, tmp_path, run_dir):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    (out / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00")
    code, err = run_cli(capsys, "generate", out, "--tokenizer", "byte")
    assert code == 2 and str(out / "checkpoints" / "latest") in err


@pytest.mark.parametrize("victim", ["tokenizer", "metrics"])
def test_binary_run_files_are_named(capsys, tmp_path, run_dir, victim):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    if victim == "tokenizer":
        bad = ckpt.latest_checkpoint(out) / ckpt.TOKENIZER_DIR / "difftx_tokenizer.json"
        bad.write_bytes(b"\x00\xffgarbage")
        code, err = run_cli(capsys, "generate", out)
    else:
        bad = out / "metrics.jsonl"
        bad.write_bytes(b"\xff\xfe{\n")
        src = json.loads((out / "train_config.json").read_text())
        code, err = run_cli(capsys, "train", "--preset", "test", "--out", out, "--resume", "--set", "steps=4",
                            "--set", "warmup_steps=0", "--set", f"data_source={src['data_source']}",
                            "--set", f"cache_dir={src['cache_dir']}", "--set", "val_fraction=0.1",
                            "--set", "progress=false")
    assert code == 2 and str(bad) in err
    assert not (out / ckpt.LOCK_NAME).exists()


def test_no_command_writes_over_a_file_of_a_run_without_overwrite(capsys, tmp_path, run_dir, model_dir):
    """`eval --json`, `bench --json` and `tokenizer train --out` onto a run's, a checkpoint's or a
    tokenizer's own file: refused with the owner named, the file byte-identical; --overwrite allows
    it; a new file beside them is fine."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = snapshot(run)
    latest = ckpt.latest_checkpoint(run)
    for target in (run / "train_config.json", latest / "model.safetensors", run / "metrics.jsonl"):
        code, err = run_cli(capsys, "eval", "lm", run, "--json", target, "--no-progress")
        assert code == 2 and "belongs to" in err and "--overwrite" in err, err
    code, err = run_cli(capsys, "bench", "--json", run / "metrics.jsonl", "--seq-lens", "8")
    assert code == 2 and "belongs to the training run" in err
    assert snapshot(run) == before
    tok = tmp_path / "tok"
    text = tmp_path / "t.txt"
    text.write_text("a small text to train a tokenizer on, repeated. " * 200)
    assert run_cli(capsys, "tokenizer", "train", "--input", text, "--vocab-size", "280", "--out", tok)[0] == 0
    first = snapshot(tok)
    code, err = run_cli(capsys, "tokenizer", "train", "--input", text, "--vocab-size", "300", "--out", tok)
    assert code == 2 and "belongs to the tokenizer" in err and snapshot(tok) == first
    assert run_cli(capsys, "tokenizer", "train", "--input", text, "--vocab-size", "300", "--out", tok,
                   "--overwrite")[0] == 0
    assert run_cli(capsys, "eval", "lm", run, "--json", run / "lm.json", "--no-progress")[0] == 0  # a new file
    assert json.loads((run / "lm.json").read_text())["tokens"] > 0


def test_export_overwrite_names_what_it_replaces_and_never_a_run(capsys, tmp_path, model_dir, run_dir):
    """--overwrite says what it replaced; a training run (checkpoints and all) is never replaced; a
    staging folder left by a killed export is removed by the next one."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = snapshot(run)
    code, err = run_cli(capsys, "export", model_dir, run, "--overwrite")
    assert code == 2 and "holds a training run" in err and snapshot(run) == before
    # nor a folder above a run, a comparison or a study (they were deleted with everything in them)
    hf = tmp_path / "hf"
    assert main(["export", str(model_dir), str(hf)]) == 0
    for holder, marker, what in (("runs", "a/train_config.json", "a training run"),
                                 ("cmp", "seed0/diff/train.json", "a comparison's model"),
                                 ("study", "size=64x1x2/compare.json", "a comparison"),
                                 ("scale", "scale.json", "a scale study"), ("map", "map.json", "a regime map")):
        folder = tmp_path / holder
        (folder / marker).parent.mkdir(parents=True, exist_ok=True)
        (folder / marker).write_text("{}")
        (folder / "config.json").write_text("{}")
        held = snapshot(folder)
        for command in (("export", model_dir, folder), ("import", hf, folder), ("convert", hf, folder)):
            code, err = run_cli(capsys, *command, "--overwrite")
            assert code == 2 and f"holds {what} ({marker})" in err, (command, err)
            assert snapshot(folder) == held
    old = tmp_path / "old_export"
    assert main(["export", str(model_dir), str(old)]) == 0
    capsys.readouterr()
    stale = tmp_path / ".old_export.tmp-killed"  # what SIGKILL during an export leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 1000)
    assert main(["export", str(model_dir), str(old), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert f"replaced {old}: 2 file(s)" in out and "config.json" in out
    assert not stale.exists()
    assert main(["export", str(run), str(tmp_path / "from_run")]) == 0
    assert f"(checkpoint {ckpt.latest_checkpoint(run).name})" in capsys.readouterr().out


def test_runs_plot_without_a_suffix_says_the_file_it_wrote(capsys, tmp_path, run_dir):
    pytest.importorskip("matplotlib")
    assert main(["runs", str(run_dir), "--plot", str(tmp_path / "curves")]) == 0
    assert f"wrote {tmp_path / 'curves.png'}" in capsys.readouterr().out and (tmp_path / "curves.png").is_file()
    before = snapshot(run_dir)
    code, err = run_cli(capsys, "runs", run_dir, "--plot", run_dir / "train_config.json")
    assert code == 2 and "belongs to the training run" in err  # said before the format: the graver reason
    assert snapshot(run_dir) == before
    # not an image: refused before the work (matplotlib refused .txt after it; bench wrote PNG bytes into it)
    for argv in (("runs", run_dir), ("bench",)):
        code, err = run_cli(capsys, *argv, "--plot", tmp_path / "curves.txt")
        assert code == 2 and f"--plot {tmp_path / 'curves.txt'}: not an image format matplotlib writes" in err
        assert not (tmp_path / "curves.txt").exists()


def test_a_needle_cell_that_cannot_fit_the_context_is_refused(capsys, run_dir):
    """`eval attention RUN --cells 50/40`: the needles alone overflow the 256-token context; before,
    the prompt grew past it and the evaluation took 8.5 GB on a 49k-parameter model."""
    code, err = run_cli(capsys, "eval", "attention", run_dir, "--cells", "50/40", "--no-progress")
    assert code == 2 and "needle cell 50/40" in err and "more than the context of 256" in err


def test_python_api_names_bad_token_input():
    model = Transformer(model_config())
    with pytest.raises(TypeError, match="must be a torch.Tensor of token ids"):
        model([[1, 2, 3]])
    with pytest.raises(ValueError, match="at least one token"):
        model(torch.zeros((2, 0), dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be \(batch, time\)"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros((1, 3)))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="model is on cpu"):
            model(torch.zeros((1, 3), dtype=torch.long, device="cuda"))


def test_a_non_number_learning_rate_is_named(capsys, tmp_path):
    """`--sweep lr=abc,0.003` and `--set lr=abc` were "unexpected error: TypeError"."""
    for args in (["--sweep", "lr=abc,0.003"], ["--set", "lr=abc"]):
        code, err = run_cli(capsys, "compare", "--preset", "smoke", "--out", tmp_path / "x", *args)
        assert code == 2 and "lr" in err and "'abc'" in err and "unexpected" not in err, err
    assert not (tmp_path / "x").exists()


def test_resume_of_nothing_and_an_empty_out_are_refused(capsys, tmp_path):
    """`train --out NON_RUN --resume` alone started a full default run; `--out ''` meant the default
    folder; a compare folder was taken for a run."""
    missing = tmp_path / "nothing"
    code, err = run_cli(capsys, "train", "--out", missing, "--resume")
    assert code == 2 and "holds no training run" in err and not missing.exists()
    code, err = run_cli(capsys, "train", "--preset", "test", "--out", "", "--set", "steps=1")
    assert code == 2 and "--out: an empty path" in err
    cmp = tmp_path / "cmp"
    cmp.mkdir()
    (cmp / "compare.json").write_text("{}")
    code, err = run_cli(capsys, "train", "--out", cmp, "--resume")
    assert code == 2 and "a `difftx compare` folder" in err


def test_tokenizer_train_prints_no_blank_lines(tmp_path):
    """The tokenizers library's progress bar wrote three blank lines to a stdout that is a pipe."""
    pytest.importorskip("tokenizers")
    text = tmp_path / "t.txt"
    text.write_text("a small text to train a tokenizer on, repeated. " * 200)
    out = subprocess.run([sys.executable, "-m", "difftx", "tokenizer", "train", "--input", str(text), "--vocab-size",
                          "280", "--out", str(tmp_path / "tok")], capture_output=True, text=True, timeout=120,
                         cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert out.startswith("wrote ") and "\n\n" not in out, repr(out)


# -- write failures outside a checkpoint name the file, the cause and the last good checkpoint ------------
def _full_disk_on_fsync(monkeypatch):
    """Every fsync fails as on a full disk (where delayed allocation reports it), with no file named."""
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_writing_train_config_or_eval_results_names_the_file(capsys, tmp_path, corpus, run_dir,
                                                                          monkeypatch):
    """Before: "[Errno 28] No space left on device" with no file; now the file written, the cause, and
    for a training run its last good checkpoint (none yet here); nothing of the run is lost."""
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        _full_disk_on_fsync(m)
        code, err = run_cli(capsys, *train_args(corpus, out))
    assert code == 1, err
    assert f"{out / 'train_config.json'}: No space left on device; no checkpoint was written yet" in err, err
    assert "free some disk space" in err
    assert not (out / "train_config.json").exists() and not (out / ckpt.LOCK_NAME).exists()

    # the evaluation once with room, so that its data cache is written (the disk below is full only for the JSON;
    # without this the test passed only where another test had filled the cache first)
    assert run_cli(capsys, "eval", "lm", run_dir, "--windows", "2", "--no-progress")[0] == 0
    before = snapshot(run_dir)
    target = tmp_path / "lm.json"
    with monkeypatch.context() as m:
        _full_disk_on_fsync(m)
        code, err = run_cli(capsys, "eval", "lm", run_dir, "--windows", "2", "--json", target, "--no-progress")
    assert code == 1 and f"{target}: No space left on device" in err, err
    assert not target.exists() and not list(tmp_path.glob(".lm.json*")) and snapshot(run_dir) == before


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_metrics_log_over_a_file_size_limit_names_it_and_the_last_good_checkpoint(tmp_path, corpus):
    """A resume whose metrics.jsonl reaches the file-size limit (the checkpoint files stay below it):
    before, "[Errno 27] File too large" named nothing; now the log, the cause and the checkpoint that
    --resume continues from, which stays the latest."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-c", "import sys; from difftx.cli import main; sys.exit(main())"]
    first = subprocess.run([*cli, *map(str, train_args(corpus, out))], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    limit = 1_000_000
    with open(out / "metrics.jsonl", "a") as f:  # a record kept by the resume that fills the log to the limit
        f.write(json.dumps({"step": 0, "note": "x" * (limit - 200 - (out / "metrics.jsonl").stat().st_size)}) + "\n")
    before = snapshot(out / "checkpoints")

    def limited():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    got = subprocess.run([*cli, *map(str, train_args(corpus, out, 4, "--resume", "--set", "log_interval=1"))],
                         env=env, capture_output=True, text=True, preexec_fn=limited, timeout=300)
    err = got.stderr.strip()
    assert got.returncode == 1 and len(err.splitlines()) == 1, got.stderr
    assert f"{out / 'metrics.jsonl'}: {os.strerror(errno.EFBIG)}; the last good checkpoint is " \
           f"{out / 'checkpoints' / 'step_00000002'}" in err, err
    assert "ulimit -f" in err
    assert snapshot(out / "checkpoints") == before


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, corpus) -> Path:
    """A four-step run with checkpoints at steps 2 and 4, shared read-only."""
    out = tmp_path_factory.mktemp("run2") / "run"
    assert main([str(a) for a in train_args(corpus, out, 4)]) == 0
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002", "step_00000004"]
    return out


@pytest.mark.parametrize("damage", ["weights cut", "optimizer cut", "trainer state", "tokenizer", "pointer"])
def test_a_damaged_latest_checkpoint_names_the_older_intact_one(capsys, tmp_path, corpus, two_checkpoints, damage):
    """Before: only the damaged file was named. Now the error also names the newest intact checkpoint
    and how to resume from it (move the damaged one aside, point `latest` at it); nothing is changed
    or deleted; doing what it says resumes."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    root = out / "checkpoints"
    bad = root / "step_00000004"
    if damage == "weights cut":
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[:len(data) // 2])
    elif damage == "optimizer cut":
        data = (bad / "optimizer.pt").read_bytes()
        (bad / "optimizer.pt").write_bytes(data[:len(data) // 2])
    elif damage == "trainer state":
        (bad / "trainer_state.json").write_text("{")
    elif damage == "tokenizer":  # the older checkpoint went unnamed for a tokenizer that does not read
        (bad / "tokenizer" / "difftx_tokenizer.json").write_text("")
    else:
        (root / "latest").write_text("step_00000009\n")
    before = snapshot(out)
    code, err = run_cli(capsys, *train_args(corpus, out, 6, "--resume"))
    assert code == 2, err
    if damage == "pointer":
        assert f"the newest intact checkpoint is {bad}: to resume from it, write step_00000004 into " \
               f"{root / 'latest'}, then --resume" in err, err
    else:
        assert f"the older checkpoint {root / 'step_00000002'} is intact: to resume from it, move {bad} out of " \
               f"{root}" in err and f"write step_00000002 into {root / 'latest'}, then --resume" in err, err
        code, err = run_cli(capsys, "eval", "lm", out, "--windows", "2", "--no-progress")
        assert (code == 0) if damage in ("optimizer cut", "trainer state") else \
            (code == 2 and f"the older checkpoint {root / 'step_00000002'} is intact" in err), err
    assert snapshot(out) == before  # nothing changed, nothing deleted
    if damage != "pointer":
        bad.rename(out / "damaged-step_00000004")
        (root / "latest").write_text("step_00000002\n")
    else:
        (root / "latest").write_text("step_00000004\n")
    assert run_cli(capsys, *train_args(corpus, out, 6, "--resume"))[0] == 0


def test_an_intact_checkpoint_refused_for_another_reason_gets_no_recovery_hint(two_checkpoints):
    latest = ckpt.latest_checkpoint(two_checkpoints)
    assert ckpt.checkpoint_problem(latest) is None
    assert ckpt.recovery_hint(f"{latest / 'config.json'}: incompatible model (checkpoint vs this run: ...)") is None


def test_a_prompt_that_is_not_utf8_is_named(capsys, model_dir):
    """`--prompt "$(cat latin1.txt)"` reaches Python with its non-UTF-8 bytes kept as lone surrogates;
    before: "'utf-8' codec can't encode character '\\udce9' ...: surrogates not allowed", naming nothing."""
    code, err = run_cli(capsys, "generate", model_dir, "--tokenizer", "byte", "--prompt", "caf\udce9 au lait")
    assert code == 2 and "--prompt: not valid UTF-8 text (byte 0xe9 at byte offset 3)" in err, err
    from difftx.training.inference import generate_text

    with pytest.raises(ValueError, match=r"^prompt: not valid UTF-8 text \(byte 0xff at byte offset 5\)"):
        generate_text(model_dir, "café\udcff", tokenizer="byte", max_new_tokens=1)
    assert run_cli(capsys, "generate", model_dir, "--tokenizer", "byte", "--prompt", "café", "--max-new-tokens",
                   "1")[0] == 0


@pytest.mark.parametrize("argv, says", [
    (["bench", "--device", "tpu"], "--device tpu: not a device torch knows"),
    (["bench", "--threads", "-1"], "argument --threads: must be a positive integer, got -1"),
    (["bench", "--batch", "0"], "argument --batch: must be a positive integer, got 0"),
    (["bench", "--batch", "-3"], "argument --batch: must be a positive integer, got -3"),
    (["demo", "--pairs", "0"], "argument --pairs: must be a positive integer, got 0"),
    (["demo", "--pairs", "-1"], "argument --pairs: must be a positive integer, got -1"),
    (["generate", "x", "--seed", "99999999999999999999"], "argument --seed: must be an integer from -2**63"),
    (["convert", "x", "y", "--seed", "-99999999999999999999"], "argument --seed: must be an integer from -2**63"),
    (["info", "--set", "dim=1000000000"], "ModelConfig.dim: a weight of 2,666,666,688,000,000,000 elements"),
])
def test_numbers_out_of_range_are_usage_errors(capsys, argv, says):
    """Each was "unexpected error: RuntimeError ..." (exit 1), or ran on an empty batch."""
    code, err = run_cli(capsys, *argv)
    assert code == 2 and says in err and "unexpected error" not in err, err


def test_info_names_a_transformers_folder_and_refuses_arms_of_a_model_that_is_not_diff(capsys, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({  # a Hub folder's config: a long unknown-field list
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": 100}))
    for path in (tmp_path / "hf", tmp_path / "hf" / "config.json"):
        code, err = run_cli(capsys, "info", path)
        assert code == 2 and "this looks like a Hugging Face transformers folder" in err
        assert f"read it with `difftx import {tmp_path / 'hf'} OUT`" in err
    assert main(["info", "tiny", "--attention", "standard", "--arms"]) == 2
    out, err = capsys.readouterr()
    assert "--arms: the arms derive from a DIFF V1 model (attention=diff), not attention=standard" in err
    assert "arms derived from" not in out  # refused before the table's header


def test_a_folder_where_a_file_is_asked_and_a_bad_record_file_are_said_before_the_work(capsys, tmp_path):
    """--config DIR and --spec DIR said "not found" for a folder that exists; map --record BAD failed only after the
    map was written (after any training)."""
    code, err = run_cli(capsys, "train", "--config", tmp_path)
    assert code == 2 and f"{tmp_path}: a folder, not a config file" in err
    code, err = run_cli(capsys, "map", "--spec", tmp_path, "--no-train")
    assert code == 2 and f"--spec {tmp_path}: a folder; give the map spec's JSON file" in err
    bad = tmp_path / "recorded.json"
    bad.write_text("garbage")
    code, err = run_cli(capsys, "map", "--no-train", "--record", bad, "--out", tmp_path / "map")
    assert code == 2 and f"recorded cells {bad}: not JSON" in err
    assert not (tmp_path / "map").exists()  # nothing written


def test_train_scale_and_map_write_only_into_their_own_folders(capsys, tmp_path, model_dir, run_dir):
    """train --out MODEL left the model's own config.json to be read as the model by every later command; scale and
    map --out wrote into a run, a comparison or any folder (compare refused them); --json X/scale.json replaced it."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    cmp = tmp_path / "cmp"
    cmp.mkdir()
    (cmp / "compare.json").write_text("{}")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    study = tmp_path / "study"
    study.mkdir()
    (study / "scale.json").write_text("{}")
    before = {p: snapshot(p) for p in (model, cmp, junk, study, run_dir)}
    for out, held in ((model, "a model (config.json)"), (cmp, "a comparison (compare.json)")):
        code, err = run_cli(capsys, "train", "--preset", "test", "--out", out, "--set", "steps=2", "--no-progress")
        assert code == 2 and f"{out} holds {held}, not a training run" in err
    scale = ("scale", "--preset", "smoke", "--seeds", "1", "--set", "steps=2", "--sizes", "32x1x2,64x1x2",
             "--no-progress")
    for out, says in ((run_dir, "holds a training run"), (model, "holds a model"), (cmp, "holds a comparison"),
                      (junk, "not empty (notes.txt) and not the folder of a scale study (no scale.json)")):
        code, err = run_cli(capsys, *scale, "--out", out)
        assert code == 2 and f"--out {out}: {says}" in err, err
    for out, says in ((study, "holds a scale study (scale.json), not a regime map"),
                      (junk, "not empty (notes.txt) and not the folder of a regime map (no map.json)")):
        code, err = run_cli(capsys, "map", "--no-train", "--out", out)
        assert code == 2 and f"--out {out}: {says}" in err, err
    code, err = run_cli(capsys, "bench", "--seq-lens", "8", "--json", study / "scale.json")
    assert code == 2 and "belongs to the scale study" in err
    assert {p: snapshot(p) for p in before} == before
