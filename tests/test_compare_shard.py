"""``difftx compare --shard K/N``: invocations that each train their share of the models into one
folder, then one without ``--shard`` that assembles the report. Two shards run as two concurrent
processes give the results of one run (timings aside), and no model is trained twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftx.cli import main
from difftx.compare.run import job_lock, parse_shard, shard_jobs
from test_compare import FAST, as_sets

TIMED = {"train_tokens_per_s", "loss_at_equal_time"}  # wall-clock measurements: differ from run to run


def _cmd(out: Path) -> list[str]:
    return ["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--no-progress", "--workers", "1",
            *as_sets(FAST)]


def test_two_concurrent_shards_equal_one_run(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    sharded = tmp_path / "sharded"
    procs = [subprocess.Popen([sys.executable, "-m", "difftx", *_cmd(sharded), "--shard", f"{k}/2"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(root))
             for k in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0, f"{so[-2000:]}\n{se[-4000:]}"
        assert "of its 2 model(s) done here" in so and "without --shard" in so
    assert not (sharded / "results.json").exists()  # shards write no report
    trained = sorted(str(p.parent.relative_to(sharded)) for p in sharded.glob("seed*/*/train.json"))
    assert trained == ["seed0/baseline", "seed0/diff", "seed1/baseline", "seed1/diff"]

    assert main(_cmd(sharded)) == 0  # assembles: nothing left to train
    single = tmp_path / "single"
    assert main(_cmd(single)) == 0
    got, want = (json.loads((d / "results.json").read_text()) for d in (sharded, single))
    assert got["this_run"] == {k: {"trained": False, "evaluated": []} for k in want["this_run"]}
    assert set(got["comparison"]) == set(want["comparison"])
    # evaluations ran in processes with other thread counts: equal up to float32 summation order
    for key, c in want["comparison"].items():
        if key not in TIMED:
            for arm, vals in c["values"].items():
                assert got["comparison"][key]["values"][arm] == pytest.approx(vals, rel=1e-5, abs=1e-7), key
    for s in ("0", "1"):
        for arm in ("diff", "baseline"):
            g, w = got["runs"][s][arm]["train"], want["runs"][s][arm]["train"]
            assert [h["lm_loss"] for h in g["history"]] == pytest.approx([h["lm_loss"] for h in w["history"]],
                                                                          rel=1e-5)


def test_shard_arithmetic_and_bad_input(tmp_path, capsys):
    jobs = list(range(7))
    parts = [shard_jobs(jobs, (k, 3)) for k in (1, 2, 3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]] and shard_jobs(jobs, None) == jobs
    assert shard_jobs([10, 11], (2, 2), offset=3) == [10]  # a size's jobs continue the global count
    assert parse_shard("2/4") == (2, 4)
    for bad in ("3/2", "0/2", "x", "1/2/3"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
    out = tmp_path / "nothing"
    assert main(_cmd(out) + ["--shard", "3/2"]) == 2
    assert "--shard 3/2: need 1 <= K <= N" in capsys.readouterr().err and not out.exists()


def test_a_held_model_is_skipped_by_a_shard(tmp_path):
    folder = tmp_path / "seed0" / "diff"
    with job_lock(folder, wait=False) as first:
        assert first
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # another process: the lock is held, so a shard would skip this model
            with job_lock(folder, wait=False) as second:
                os.write(w, b"1" if second else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 1) == b"0"
    with job_lock(folder, wait=False) as again:  # released when the holder is done
        assert again
