"""The trainer on CPU: exact resume, atomic checkpoints under a simulated crash, corrupt and
incompatible checkpoints, NaN stop, metrics, ``init_from``, and the train / generate CLIs."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from difftx.checkpoint import CheckpointError, load_model
from difftx.training import TrainingDivergedError, train, train_preset
from difftx.training import checkpointing as ckpt
from difftx.training.metrics import read_metrics


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small folder of text documents, prepared once (byte tokenizer)."""
    from difftx.data import prepare_data

    root = tmp_path_factory.mktemp("train")
    src = root / "docs"
    src.mkdir()
    words = ("alpha beta gamma delta the king and queen of a small land walked to the sea while "
             "birds sang over hills in spring").split()
    for i in range(8):
        (src / f"d{i}.txt").write_text(" ".join(words[(i + j * 3 + j // 7) % len(words)] for j in range(1500)))
    cache = root / "cache"
    data = prepare_data(source=str(src), cache_dir=str(cache), val_fraction=0.1)
    return src, cache, data


def _cfg(out: Path, corpus, **kw):
    src, cache, _ = corpus
    base = dict(out_dir=str(out), data_source=str(src), cache_dir=str(cache), val_fraction=0.1, steps=6,
                warmup_steps=2, batch_size=4, seq_len=32, eval_interval=3, eval_batches=2, log_interval=1,
                ckpt_interval=2, keep_last=10, progress=False)
    base.update(kw)
    return train_preset("test", **base)


def test_resume_gives_the_same_trajectory(tmp_path, corpus):
    data = corpus[2]
    full = train(_cfg(tmp_path / "full", corpus, grad_accum=2, ckpt_interval=0), data=data)
    assert sorted(full.losses) == list(range(1, 7))
    assert full.losses[6] < full.losses[1]  # it learns, so equality below is not between constants
    cfg = _cfg(tmp_path / "resumed", corpus, grad_accum=2, ckpt_interval=0)
    first = train(cfg, data=data, stop_at=3)
    assert sorted(first.losses) == [1, 2, 3] and first.last_checkpoint.name == "step_00000003"
    second = train(cfg, data=data, resume=True)
    assert second.resumed_from == 3 and sorted(second.losses) == list(range(4, 7))
    got = {**first.losses, **second.losses}
    assert got == full.losses  # bitwise: same data position, optimizer, schedule and RNG state
    assert {**first.val_losses, **second.val_losses} == full.val_losses
    # the weights at the end are identical too
    a = load_model(full.last_checkpoint).state_dict()
    b = load_model(tmp_path / "resumed").state_dict()  # a run folder: its latest checkpoint, as the CLI reads it
    assert all(torch.equal(a[k], b[k]) for k in a)
    # metrics: one record per step, no duplicates after the resume, lambda per layer logged
    recs = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    train_recs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train_recs] == list(range(1, 7))
    assert {"lr", "grad_norm", "tokens_per_s", "tokens", "lambda"} <= set(train_recs[0])
    assert len(train_recs[0]["lambda"]) == 2 and all(isinstance(x, float) for x in train_recs[0]["lambda"])
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6]


def test_crash_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path, corpus, monkeypatch):
    data = corpus[2]
    reference = train(_cfg(tmp_path / "ref", corpus, ckpt_interval=0), data=data)
    cfg = _cfg(tmp_path / "run", corpus)
    real_write = ckpt.write_json

    def crashing(path, payload):
        if path.name == ckpt.STATE_NAME and payload["step"] == 4:
            path.write_text('{"format": "difftx-tr')  # half a file, then the "power cut"
            raise OSError("simulated crash while writing the checkpoint")
        return real_write(path, payload)

    monkeypatch.setattr(ckpt, "write_json", crashing)
    with pytest.raises(OSError, match="simulated crash"):
        train(cfg, data=data)
    monkeypatch.setattr(ckpt, "write_json", real_write)
    root = tmp_path / "run" / "checkpoints"
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step_00000002"
    assert not (root / "step_00000004").exists()
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    load_model(root / "step_00000002")  # still loadable
    # a hard kill (no cleanup) leaves a temporary folder: it is never taken as a checkpoint
    shutil.copytree(root / "step_00000002", root / ".step_00000004.tmp-abc")
    (root / ".step_00000004.tmp-abc" / ckpt.STATE_NAME).write_text("{")
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step_00000002"
    resumed = train(cfg, data=data, resume=True)
    assert not (root / ".step_00000004.tmp-abc").exists()
    assert sorted(resumed.losses) == list(range(3, 7))
    assert all(resumed.losses[s] == reference.losses[s] for s in resumed.losses)


def test_a_crash_between_the_checkpoint_and_its_pointer_resumes_from_the_checkpoint(tmp_path, corpus, monkeypatch):
    """The step folder is moved into place whole, then ``latest`` is rewritten: a kill between the two left the
    pointer a checkpoint behind, and every --resume retrained to that step and stopped ("a checkpoint for step 4
    already exists")."""
    data = corpus[2]
    reference = train(_cfg(tmp_path / "ref", corpus, ckpt_interval=0), data=data)
    real_write = ckpt.atomic_write

    def killed(path, write):
        if Path(path).name == ckpt.LATEST and (Path(path).parent / "step_00000004").is_dir():
            raise KeyboardInterrupt  # the moment of the kill: step 4's folder is in place, its pointer is not
        return real_write(path, write)

    cfg = _cfg(tmp_path / "run", corpus)
    monkeypatch.setattr(ckpt, "atomic_write", killed)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, data=data)
    monkeypatch.setattr(ckpt, "atomic_write", real_write)
    root = tmp_path / "run" / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000002" and (root / "step_00000004").is_dir()
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step_00000004"
    resumed = train(cfg, data=data, resume=True)
    assert resumed.resumed_from == 4 and sorted(resumed.losses) == [5, 6]
    assert all(resumed.losses[s] == reference.losses[s] for s in resumed.losses)


def test_writing_a_checkpoint_draws_nothing_from_the_global_rng(tmp_path):
    """The meta-device shell built to save the weights drew from the global RNG after the checkpoint had recorded
    its state: a batch source or a dropout reading that RNG went another way after every checkpoint, and its
    resume was not exact."""
    from difftx.config import ModelConfig
    from difftx.model import Transformer

    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
    weights = Transformer(cfg).state_dict()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    ckpt._save_weights(weights, cfg, tmp_path / "w")
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("field, value", [("weight_decay", 0.5), ("beta1", 0.5), ("beta2", 0.5), ("eps", 1e-3)])
def test_a_resume_refuses_another_optimizer_setting(tmp_path, corpus, field, value):
    """The optimizer's saved state puts back its own settings: a resume through the Python API with another value
    went on with the old one and recorded the new one as applied (the command line refused it)."""
    data = corpus[2]
    first = train(_cfg(tmp_path / "run", corpus), data=data, stop_at=2)
    with pytest.raises(CheckpointError, match=rf"cannot resume exactly with a different \['{field}'\]"):
        train(_cfg(tmp_path / "run", corpus, **{field: value}), data=data, resume=True)
    assert ckpt.latest_checkpoint(tmp_path / "run") == first.last_checkpoint


def test_keep_last_and_latest_pointer(tmp_path, corpus):
    res = train(_cfg(tmp_path / "run", corpus, keep_last=2), data=corpus[2])
    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "run")]
    assert names == ["step_00000004", "step_00000006"]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert res.last_checkpoint == tmp_path / "run" / "checkpoints" / "step_00000006"
    saved = json.loads((res.last_checkpoint / ckpt.TRAIN_CONFIG_NAME).read_text())
    assert saved["keep_last"] == 2 and saved["data_source"] == str(corpus[0])
    assert (res.last_checkpoint / "tokenizer").is_dir()


def test_out_dir_with_checkpoints_is_not_overwritten(tmp_path, corpus):
    cfg = _cfg(tmp_path / "run", corpus, steps=2)
    train(cfg, data=corpus[2])
    before = (tmp_path / "run" / "checkpoints" / "step_00000002" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(cfg, data=corpus[2])
    assert (tmp_path / "run" / "checkpoints" / "step_00000002" / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("victim, damage", [
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])),
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-64] + bytes(64))),  # same size, bytes changed
    ("optimizer.pt", lambda p: p.write_bytes(p.read_bytes()[:200] + b"x" + p.read_bytes()[201:])),
    ("optimizer.pt", lambda p: p.write_bytes(b"not a torch file")),
    ("trainer_state.json", lambda p: p.write_text('{"format": "difftx-train", "version": 1')),
    ("config.json", lambda p: p.write_text("{")),
])
def test_corrupt_checkpoint_is_a_clear_error(tmp_path, corpus, victim, damage):
    cfg = _cfg(tmp_path / "run", corpus, steps=4, ckpt_interval=4)
    train(cfg, data=corpus[2], stop_at=2)
    path = tmp_path / "run" / "checkpoints" / "step_00000002" / victim
    damage(path)
    before = path.read_bytes()
    with pytest.raises(CheckpointError) as e:
        train(cfg, data=corpus[2], resume=True)
    assert str(path) in str(e.value)
    assert path.read_bytes() == before  # never overwritten
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step_00000002"


@pytest.mark.parametrize("change, culprit", [
    ({"model_overrides": {"dim": 64}}, "config.json"),
    ({"batch_size": 2}, "train_config.json"),
])
def test_incompatible_checkpoint_is_a_clear_error(tmp_path, corpus, change, culprit):
    train(_cfg(tmp_path / "run", corpus, steps=4), data=corpus[2], stop_at=2)
    with pytest.raises(CheckpointError) as e:
        train(_cfg(tmp_path / "run", corpus, steps=4, **change), data=corpus[2], resume=True)
    assert culprit in str(e.value) and "step_00000002" in str(e.value)


def test_nan_loss_stops_with_last_good_checkpoint(tmp_path, corpus, monkeypatch):
    from difftx import model as model_mod

    calls = {"n": 0}
    real_loss = model_mod.head_loss

    def poisoned(*args):
        calls["n"] += 1
        loss = real_loss(*args)
        return loss * float("nan") if calls["n"] >= 5 else loss  # the 5th training step

    monkeypatch.setattr(model_mod, "head_loss", poisoned)
    cfg = _cfg(tmp_path / "run", corpus, eval_interval=0)
    with pytest.raises(TrainingDivergedError) as e:
        train(cfg, data=corpus[2])
    msg = str(e.value)
    assert "loss is nan at step 5" in msg and "step_00000004" in msg
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step_00000004"
    model = load_model(tmp_path / "run" / "checkpoints" / "step_00000004")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not (tmp_path / "run" / "checkpoints" / "step_00000005").exists()


def test_init_from_starts_from_the_checkpoint_weights(tmp_path, corpus):
    from difftx import lm_loss
    from difftx.data import PackedLoader

    data = corpus[2]
    first = train(_cfg(tmp_path / "pre", corpus, steps=4), data=data)
    tuned = train(_cfg(tmp_path / "tune", corpus, steps=1, warmup_steps=0, eval_interval=0,
                       init_from=str(tmp_path / "pre")), data=data)
    # step 1's loss is the pretrained model's loss on the first batch
    model = load_model(first.last_checkpoint)
    tokens, doc_ids = PackedLoader(data.train, batch_size=4, seq_len=32, seed=0).next_batch()
    with torch.no_grad():
        expected = float(lm_loss(model(tokens[:, :-1], doc_ids=doc_ids[:, :-1]), tokens[:, 1:]))
    assert tuned.losses[1] == pytest.approx(expected, abs=1e-5)
    assert tuned.model_config == model.config
    with pytest.raises(CheckpointError, match="nowhere"):
        train(_cfg(tmp_path / "bad", corpus, init_from=str(tmp_path / "nowhere")), data=data)


def test_train_and_generate_cli(tmp_path, corpus, capsys):
    from difftx.cli import main

    src, cache, _ = corpus
    out = tmp_path / "cli"
    rc = main(["train", "--preset", "test", "--out", str(out), "--attention", "standard",
               "--set", "steps=3", "--set", f"data_source={src}", "--set", f"cache_dir={cache}",
               "--set", "val_fraction=0.1", "--set", "progress=false"])
    assert rc == 0
    assert "done: step 3" in capsys.readouterr().out
    ckpt_dir = ckpt.latest_checkpoint(out)
    assert load_model(ckpt_dir).config.attention == "standard"
    args = [str(out), "--prompt", "the king", "--max-new-tokens", "12", "--seed", "1"]
    assert main(["generate", *args]) == 0
    text = capsys.readouterr().out
    assert text.startswith("the king") and len(text) > len("the king")
    assert main(["generate", *args]) == 0
    assert capsys.readouterr().out == text  # seeded sampling is reproducible
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "missing" in capsys.readouterr().err
    # --init-from a run folder: its latest weights, architecture and tokenizer
    tuned = tmp_path / "tuned"
    assert main(["train", "--preset", "test", "--out", str(tuned), "--init-from", str(out),
                 "--set", "steps=1", "--set", "warmup_steps=0", "--set", f"data_source={src}",
                 "--set", f"cache_dir={cache}", "--set", "val_fraction=0.1", "--set", "progress=false"]) == 0
    assert load_model(ckpt.latest_checkpoint(tuned)).config == load_model(ckpt_dir).config
    assert json.loads((tuned / "train_config.json").read_text())["init_from"] == str(out)
    # resuming a finished run is a clean no-op; a corrupt pointer is named
    assert main(["train", "--preset", "test", "--out", str(out), "--resume", "--attention", "standard",
                 "--set", "steps=3", "--set", f"data_source={src}", "--set", f"cache_dir={cache}",
                 "--set", "val_fraction=0.1", "--set", "progress=false"]) == 0
    (out / "checkpoints" / "latest").write_text("step_00000099\n")
    assert main(["train", "--preset", "test", "--out", str(out), "--resume", "--set", f"data_source={src}",
                 "--set", f"cache_dir={cache}", "--set", "val_fraction=0.1"]) == 2
    assert "latest" in capsys.readouterr().err


def test_tensorboard_logging_when_installed(tmp_path, corpus):
    pytest.importorskip("torch.utils.tensorboard")
    train(_cfg(tmp_path / "run", corpus, steps=2, tensorboard=True), data=corpus[2])
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DIFFTX_TEST_COMPILE"),
                    reason="torch.compile takes ~50 s on 2 CPU cores; set DIFFTX_TEST_COMPILE=1 to run")
def test_compile_flag_trains(tmp_path, corpus):
    res = train(_cfg(tmp_path / "run", corpus, steps=3, compile=True), data=corpus[2])
    assert sorted(res.losses) == [1, 2, 3] and all(math.isfinite(v) for v in res.losses.values())
    load_model(res.last_checkpoint)  # the compiled wrapper is not in the saved names


def test_sigterm_saves_and_stops_then_resume_is_exact(tmp_path, corpus, monkeypatch):
    import signal

    data = corpus[2]
    reference = train(_cfg(tmp_path / "ref", corpus, ckpt_interval=0, eval_interval=0), data=data)
    from difftx import model as model_mod

    calls = {"n": 0}
    real_loss = model_mod.head_loss

    def preempt_during_step_3(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would; handled after the step
        return real_loss(*args)

    monkeypatch.setattr(model_mod, "head_loss", preempt_during_step_3)
    cfg = _cfg(tmp_path / "run", corpus, ckpt_interval=0, eval_interval=0)
    before = signal.getsignal(signal.SIGTERM)
    stopped = train(cfg, data=data)
    assert stopped.stopped_by == "SIGTERM" and stopped.step == 3
    assert stopped.last_checkpoint.name == "step_00000003"
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored
    monkeypatch.setattr(model_mod, "head_loss", real_loss)
    rest = train(cfg, data=data, resume=True)
    assert {**stopped.losses, **rest.losses} == reference.losses


def test_throughput_benchmark_runs(tmp_path, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "train_throughput.py"
    spec = importlib.util.spec_from_file_location("train_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--sizes", "test", "--steps", "6", "--warmup", "0", "--batch-size", "2",
                       "--seq-len", "16", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["diff"]["tokens_per_s"] > 0 and row["baseline"]["tokens_per_s"] > 0
    paired = row["diff"]["paired_ratio"]  # 6 rounds: the smallest count with a 95% interval
    assert paired["rounds"] == 6 and paired["low"] <= paired["median"] <= paired["high"]
    assert row["baseline"]["paired_ratio"] == {"median": 1.0, "low": 1.0, "high": 1.0, "rounds": 6}
    ratio = row["diff"]["tokens_per_s"] / row["baseline"]["tokens_per_s"]
    assert row["ratio_diff_over_baseline"] == pytest.approx(ratio)
    assert row["diff"]["params"] >= row["baseline"]["params"]  # DIFF adds only the lambda vectors and subln gains
    assert "| test | auto |" in capsys.readouterr().out
    # several DIFF backends: one row each against the same baseline
    assert bench.main(["--device", "cpu", "--sizes", "test", "--steps", "1", "--warmup", "0", "--batch-size", "2",
                       "--seq-len", "16", "--backends", "eager", "flex", "chunked", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert list(row["candidates"]) == ["baseline", "diff/eager", "diff/chunked"]  # flex cannot train on CPU
    assert row["diff"] == row["candidates"]["diff/eager"]
    printed = capsys.readouterr().out
    assert "| test | eager |" in printed and "| test | chunked |" in printed
    assert "skipped diff/flex: ValueError" in printed
    with pytest.raises(SystemExit):  # nothing to time: a readable refusal, not a StatisticsError
        bench.main(["--device", "cpu", "--sizes", "test", "--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("attention", ["diff_v2", "standard"])
def test_other_attention_kinds_train(tmp_path, corpus, attention):
    res = train(_cfg(tmp_path / "run", corpus, steps=2, model_overrides={"attention": attention}), data=corpus[2])
    assert res.model_config.attention == attention and all(math.isfinite(v) for v in res.losses.values())
    recs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert recs[0]["lambda"] is None  # no per-layer scalar lambda outside V1
    assert load_model(res.last_checkpoint).config.attention == attention


def test_flex_backend_is_refused_for_cpu_training_before_any_step(tmp_path, corpus):
    with pytest.raises(ValueError, match="'flex' backend has no backward pass on CPU"):
        train(_cfg(tmp_path / "flex", corpus, model_overrides={"backend": "flex"}), data=corpus[2])
    assert not (tmp_path / "flex" / "checkpoints").exists()


def test_a_stop_between_two_log_records_loses_no_step_of_the_next(tmp_path, corpus):
    """Issue 31: a run stopped between two records by SIGTERM (sent from a probe after step 6: it stops
    after step 7 with a checkpoint) and resumed writes the next record over every step since the last
    one, as an uninterrupted run does. Before, the sums of the steps before the stop were lost: that
    record averaged only the steps after the resume."""
    import os
    import signal

    data = corpus[2]
    train(_cfg(tmp_path / "full", corpus, steps=8, log_interval=4, ckpt_interval=0), data=data)
    cfg = _cfg(tmp_path / "resumed", corpus, steps=8, log_interval=4, ckpt_interval=0)
    calls = []

    def sigterm_after_step_6(model):
        calls.append(1)
        if len(calls) == 6:
            os.kill(os.getpid(), signal.SIGTERM)
        return {}

    stopped = train(cfg, data=data, probes=(1, sigterm_after_step_6))
    assert stopped.stopped_by == "SIGTERM" and stopped.step == 7
    train(cfg, data=data, resume=True)
    timed = ("tokens_per_s", "time_s")
    got, want = ([{k: v for k, v in r.items() if k not in timed} for r in read_metrics(d / "metrics.jsonl")
                  if "loss" in r] for d in (tmp_path / "resumed", tmp_path / "full"))
    assert [r["step"] for r in got] == [4, 8] and len(got[1]["grad_norms"]) == 4
    assert got == want


def test_an_out_dir_inside_the_data_folder_is_refused(tmp_path, capsys):
    """Issue 41: `train --out` inside `--data` was accepted, and the run then read its own metrics.jsonl as text and
    could never resume; refused before anything is written, like compare's."""
    from difftx.cli import main

    data = tmp_path / "texts"
    data.mkdir()
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    assert main(["train", "--data", str(data), "--out", str(data / "run"), "--set", "steps=1", "--set",
                 "warmup_steps=0"]) == 2
    err = capsys.readouterr().err
    assert "is inside the data_source folder" in err and len(err.strip().splitlines()) == 1
    assert not (data / "run").exists()
