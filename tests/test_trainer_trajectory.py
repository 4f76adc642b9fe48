"""The trainer's trajectory is pinned: a run recorded before ``_train`` was split into named steps
(issue #23) must come out the same after it, bitwise on CPU.

Two small runs, each stopped half-way and resumed: packed text (validation, two micro-batches per
step) and a batch source (loss masks, batch kinds, probes). What is compared: every record of
``metrics.jsonl`` except the wall-clock fields, and a hash of the final weights.

Float results can differ between CPUs (other vector units, other kernels) and torch versions, so
the comparison is bitwise only where this machine's arithmetic is the recording machine's, and to rel
1e-5 elsewhere. The arithmetic is identified by a key (:func:`arithmetic_key`): the bits of one
forward and backward pass of both runs' models on fixed tokens, one thread. Two AVX-512 CPUs can
round differently (the 7th digit of a gradient norm), so a CPU flag is not such a key. Re-record
with ``python tests/test_trainer_trajectory.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import torch

from difftx.config import ModelConfig
from difftx.training import TrainConfig, train, train_preset
from difftx.training.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).parent))
from test_train_batches import VOCAB, ToySource  # noqa: E402

RECORD = Path(__file__).parent / "data" / "trainer_trajectory.json"
CLOCK_FIELDS = ("tokens_per_s", "time_s", "probe_s")


def _weights_hash(out_dir: Path) -> str:
    from difftx.checkpoint import load_model
    from difftx.training import checkpointing as ckpt

    state = load_model(ckpt.latest_checkpoint(out_dir)).state_dict()
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _records(out_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in CLOCK_FIELDS} for r in read_metrics(out_dir / "metrics.jsonl")]


def _text_run(root: Path) -> dict:
    src = root / "text"
    src.mkdir()
    words = "the river ran past a mill where seven owls kept count of every grain and star".split()
    for i in range(4):
        (src / f"d{i}.txt").write_text(" ".join(words[(i * 5 + j * 7 + j // 11) % len(words)] for j in range(900)))
    cfg = train_preset("test", out_dir=str(root / "text_run"), data_source=str(src), cache_dir=str(root / "cache"),
                       val_fraction=0.1, steps=8, warmup_steps=2, batch_size=4, seq_len=32, grad_accum=2,
                       eval_interval=4, eval_batches=2, log_interval=1, ckpt_interval=0, progress=False)
    train(cfg, stop_at=4)
    train(cfg, resume=True)
    return {"metrics": _records(root / "text_run"), "weights": _weights_hash(root / "text_run")}


def _probe(model) -> dict:
    x = torch.arange(1, 13).remainder(VOCAB).unsqueeze(0)
    return {"logit_sum": float(model(x).float().sum())}


def _source_run(root: Path) -> dict:
    model = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
    cfg = TrainConfig(out_dir=str(root / "source_run"), steps=10, warmup_steps=3, batch_size=4, seq_len=12,
                      eval_interval=0, log_interval=2, ckpt_interval=0, progress=False, lr=3e-3, seed=5)
    train(cfg, data=ToySource(), model_config=model, probes=(3, _probe), stop_at=5)
    train(cfg, data=ToySource(), model_config=model, probes=(3, _probe), resume=True)
    return {"metrics": _records(root / "source_run"), "weights": _weights_hash(root / "source_run")}


def arithmetic_key() -> str:
    """SHA-256 of the loss and every gradient of one forward and backward pass of the two runs' models (seeded,
    fixed tokens): equal keys mean the same floating-point arithmetic for these models (the kernels the CPU and
    torch pick, their reduction orders). Call with one thread, as :func:`record` runs."""
    from difftx import Transformer, preset

    h = hashlib.sha256(torch.__version__.encode())
    for cfg in (preset("test"), ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, max_seq_len=16)):
        torch.manual_seed(0)
        model = Transformer(cfg)
        tokens = torch.arange(17).remainder(cfg.vocab_size).view(1, 17)
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[0, 1:])
        loss.backward()
        for t in (loss, *(p.grad for p in model.parameters())):
            h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def record(root: Path) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {"text": _text_run(root), "source": _source_run(root)}
        key = arithmetic_key()
    finally:
        torch.set_num_threads(threads)
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "arithmetic": key,
            "runs": runs}


def _close(a, b, path: str) -> None:
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_trajectory_equals_the_recorded_one(tmp_path):
    want = json.loads(RECORD.read_text())
    got = record(tmp_path)
    assert [len(r["metrics"]) for r in got["runs"].values()] == [len(r["metrics"]) for r in want["runs"].values()]
    if got["arithmetic"] == want["arithmetic"]:  # this machine's arithmetic is the recording one's
        for name in want["runs"]:
            assert got["runs"][name]["metrics"] == want["runs"][name]["metrics"], name  # bitwise
            assert got["runs"][name]["weights"] == want["runs"][name]["weights"], name
    else:  # another CPU or torch: the same trajectory up to float reordering
        for name in want["runs"]:
            _close(got["runs"][name]["metrics"], want["runs"][name]["metrics"], name)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(record(Path(d)), indent=1) + "\n")
    print(f"wrote {RECORD}")
