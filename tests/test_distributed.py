"""DDP and FSDP2 through torchrun (2 CPU processes, gloo) reproduce the single-process run.

The single-process control uses the global batch (2 x the per-rank batch), with the same
gradient accumulation (2 micro-steps, reduced across ranks on the last only). The torchrun
workers are this file run as a script (see ``_worker``); each also stops, saves (FSDP2: full
state dicts gathered to rank 0), and resumes, which must continue the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 4
PER_RANK_BATCH = 2


def _config(out_dir: Path, cache_dir: Path, source: Path, batch_size: int, parallel: str = "ddp", **kw):
    from difftx.training import train_preset

    return train_preset("test", out_dir=str(out_dir), cache_dir=str(cache_dir), data_source=str(source),
                        val_fraction=0.1, batch_size=batch_size, steps=STEPS, warmup_steps=1, eval_interval=2,
                        ckpt_interval=0, log_interval=1, progress=False, parallel=parallel, grad_accum=2,
                        model_overrides={"dim": 32, "n_layers": 2, "n_heads": 2}, **kw)


def _worker(mode: str, out_root: str, cache_dir: str, source: str) -> None:
    """Run under torchrun: an uninterrupted run, then a run stopped at step 2 and resumed."""
    import torch
    import torch.distributed as dist

    from difftx.training import train
    from difftx.training.distributed import exit_worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # created here, so train() leaves it alone between the runs
    root = Path(out_root)
    full = train(_config(root / "full", Path(cache_dir), Path(source), PER_RANK_BATCH, mode))
    part1 = train(_config(root / "resumed", Path(cache_dir), Path(source), PER_RANK_BATCH, mode), stop_at=2)
    part2 = train(_config(root / "resumed", Path(cache_dir), Path(source), PER_RANK_BATCH, mode), resume=True)
    # stopped here, continued by a single process with the same global batch (in the test)
    train(_config(root / "handoff", Path(cache_dir), Path(source), PER_RANK_BATCH, mode), stop_at=2)
    # an incompatible resume fails on every rank (none is left waiting in a collective)
    from difftx.checkpoint import CheckpointError

    try:
        train(_config(root / "resumed", Path(cache_dir), Path(source), PER_RANK_BATCH + 1, mode), resume=True)
    except CheckpointError as e:
        (root / f"refused.{dist.get_rank()}").write_text(str(e))
    if dist.get_rank() == 0:
        (root / "losses.json").write_text(json.dumps({
            "full": full.losses, "val": full.val_losses, "part1": part1.losses, "part2": part2.losses,
            "world_size": dist.get_world_size()}))
    dist.destroy_process_group()
    exit_worker(0)  # skips interpreter shutdown, which can abort after DDP (see its docstring)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus, prepared once into the shared cache (the workers then reuse it)."""
    from difftx.data import prepare_data

    root = tmp_path_factory.mktemp("dist")
    src = root / "corpus"
    src.mkdir()
    words = "the of and to in a is that for it as was with be by on not he this are or his from at".split()
    for i in range(6):
        text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(3000))
        (src / f"doc{i}.txt").write_text(text + "\n")
    cache = root / "cache"
    prepare_data(source=str(src), cache_dir=str(cache), val_fraction=0.1)
    return src, cache, root


def _single(corpus):
    from difftx.training import train

    src, cache, root = corpus
    out = root / "single"
    if not (out / "losses.json").exists():
        res = train(_config(out, cache, src, 2 * PER_RANK_BATCH))
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps({"full": res.losses, "val": res.val_losses}))
    return json.loads((out / "losses.json").read_text())


def _torchrun(mode: str, corpus) -> dict:
    src, cache, root = corpus
    out = root / mode
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve()), mode, str(out), str(cache), str(src)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False,
                          cwd=str(Path(__file__).resolve().parents[1]))
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((out / "losses.json").read_text())


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_parallel_matches_single_process(mode, corpus):
    import torch

    from difftx.checkpoint import load_model
    from difftx.training.checkpointing import latest_checkpoint

    single = _single(corpus)
    got = _torchrun(mode, corpus)
    assert got["world_size"] == 2
    steps = [str(s) for s in range(1, STEPS + 1)]
    assert list(got["full"]) == steps
    for s in steps:  # same data, same updates: only the reduction order differs
        assert abs(got["full"][s] - single["full"][s]) < 1e-4, (mode, s, got["full"][s], single["full"][s])
    for s, v in single["val"].items():
        assert abs(got["val"][s] - v) < 1e-4
    # the losses must move, or the comparison proves nothing
    assert got["full"][steps[-1]] < got["full"][steps[0]]
    # stopped at step 2 and resumed == uninterrupted (same world size)
    resumed = {**got["part1"], **got["part2"]}
    assert list(got["part1"]) == ["1", "2"] and list(got["part2"]) == ["3", "4"]
    for s in steps:
        assert abs(resumed[s] - got["full"][s]) < 1e-6, (mode, s, resumed[s], got["full"][s])
    src, cache, root = corpus
    for rank in (0, 1):
        assert "batch_size" in (root / mode / f"refused.{rank}").read_text()
    # a run stopped on 2 processes continues in 1 with the same global batch (2 x 2 = 1 x 4)
    from difftx.training import train

    rest = train(_config(root / mode / "handoff", cache, src, 2 * PER_RANK_BATCH), resume=True)
    assert sorted(rest.losses) == [3, 4]
    for s in (3, 4):
        assert abs(rest.losses[s] - got["full"][str(s)]) < 1e-4
    # the checkpoint (full state dict gathered to rank 0) loads in a single process
    model = load_model(latest_checkpoint(root / mode / "full"))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cli_train_under_torchrun(corpus):
    """``torchrun -m difftx train``: both workers finish with exit code 0 and rank 0 saves."""
    from difftx.training.checkpointing import latest_checkpoint

    src, cache, root = corpus
    out = root / "cli"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "difftx",
           "train", "--preset", "test", "--out", str(out), "--set", "steps=2", "--set", f"data_source={src}",
           "--set", f"cache_dir={cache}", "--set", "val_fraction=0.1", "--set", "progress=false"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False,
                          cwd=str(Path(__file__).resolve().parents[1]))
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count("done: step 2") == 1  # rank 0 alone prints
    assert latest_checkpoint(out).name.endswith("2")
    # the metrics log was closed before the worker's os._exit: nothing buffered is lost
    steps = [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 2 in steps


if __name__ == "__main__":  # torchrun entry point
    _worker(*sys.argv[1:5])
