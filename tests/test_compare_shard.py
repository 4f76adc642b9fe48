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


def primary(res: dict) -> dict:
    """The DIFF-vs-baseline comparisons of a ``results.json`` object."""
    return res["comparisons"]["diff vs baseline"]["metrics"]


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
    assert set(primary(got)) == set(primary(want))
    # evaluations ran in processes with other thread counts: equal up to float32 summation order
    for key, c in primary(want).items():
        if key not in TIMED:
            for arm, vals in c["values"].items():
                assert primary(got)[key]["values"][arm] == pytest.approx(vals, rel=1e-5, abs=1e-7), key
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


def test_shards_partition_models_not_stacks():
    """Issue 31 item 1: the unit of a shard is a model (seed, arm), chosen from the command line alone;
    each shard stacks what it holds. Before, the jobs (stacks) were sharded: with 16 seeds and N = 8,
    shards 1 and 2 got 16 models each and shards 3-8 none; `--seeds 3 --shard 3/3` got 0."""
    from difftx.compare import get_preset
    from difftx.compare import run as run_mod

    plan = get_preset("cpu").resolve()
    seeds = list(range(16))
    parts = [run_mod.plan_models(plan, seeds, (k, 8)) for k in range(1, 9)]
    assert [len(p) for p in parts] == [4] * 8
    assert sorted(m for p in parts for m in p) == sorted((s, a) for s in seeds for a in plan.arms)
    assert parts[0] == [(0, "baseline"), (4, "baseline"), (8, "baseline"), (12, "baseline")]
    assert all(len(run_mod.plan_models(plan, seeds, (k, 32))) == 1 for k in range(1, 33))
    assert run_mod.plan_models(plan, [0, 1, 2], (3, 3)) == [(1, "baseline"), (2, "diff")]
    # the stacks of a shard hold its models only, whatever the stack size (memory, --workers)
    for k in (1, 2, 4, 16):
        jobs = run_mod.plan_jobs(plan, seeds, Path("out"), k, (1, 8))
        assert sorted((s, a) for a, ss, _ in jobs for s in ss) == parts[0] and max(len(j[1]) for j in jobs) <= k
    assert run_mod.plan_models(plan, seeds, (2, 8), offset=3) == run_mod.plan_models(plan, seeds, (7, 8))  # scale


def test_four_shards_of_eight_seeds_equal_one_run(tmp_path, capsys):
    """8 seeds x 2 arms in 4 shards (one after the other here; on a cluster, side by side): every shard
    trains 4 models (its plan printed first), and the assembled results are one run's (timings aside), bit
    for bit: the shards stack 2 models of an arm where one run stacks 8, and a model's arithmetic does not depend
    on its stack (issue 41 item 5; the partition of 16 seeds in 8 shards: test_shards_partition_models_not_stacks)."""
    def cmd(out: Path) -> list[str]:
        return ["compare", "--preset", "smoke", "--seeds", "8", "--out", str(out), "--no-progress", "--workers",
                "1", *as_sets({**FAST, "probe_every": 0})]

    sharded = tmp_path / "sharded"
    for k in range(1, 5):
        assert main(cmd(sharded) + ["--shard", f"{k}/4"]) == 0
        out = capsys.readouterr().out
        assert f"shard {k}/4: 4 of the 16 models of {sharded}: seed{(k - 1) // 2}/" in out, out
        assert f"shard {k}/4: 4 of its 4 model(s) done here" in out, out
    assert len(list(sharded.glob("seed*/*/train.json"))) == 16
    assert main(cmd(sharded)) == 0
    single = tmp_path / "single"
    assert main(cmd(single)) == 0
    got, want = (json.loads((d / "results.json").read_text()) for d in (sharded, single))
    assert not any(v["trained"] for v in got["this_run"].values())  # the assembling run trained nothing
    for key, c in primary(want).items():
        if key not in TIMED:
            for arm, vals in c["values"].items():
                assert primary(got)[key]["values"][arm] == vals, key


def test_an_assembler_waiting_for_a_held_model_says_whom_it_waits_for(tmp_path, capsys):
    """Issue 31: the holder of ``.job.lock`` writes its pid and host there, and a run that waits for it
    (the assembling run) says so on stderr. Before, it waited in silence."""
    import socket
    import threading
    import time

    folder = tmp_path / "seed0" / "diff"
    got: list = []
    with job_lock(folder, wait=False) as held:
        assert held and (folder / ".job.lock").read_text() == f"pid {os.getpid()} host {socket.gethostname()}\n"
        waiter = threading.Thread(target=lambda: got.append(job_lock(folder, wait=True).__enter__()))
        waiter.start()
        end = time.monotonic() + 30
        while "waiting for" not in (err := capsys.readouterr().err) and time.monotonic() < end:
            time.sleep(0.05)
        assert f"waiting for {folder}: another invocation holds it (pid {os.getpid()} host" in err, err
        assert not got  # still waiting while the lock is held
    waiter.join(timeout=30)
    assert got == [True]


def test_scale_shards_partition_the_models_of_every_size():
    """Issue 31 item 1, in `scale`: the offset of a size counts models, and so do the shards now. With
    scale-cpu (its sizes x 3 seeds x 2 arms) and N models every shard trains one; before, 8 of 24 got work."""
    from difftx.compare.run import plan_models
    from difftx.studies.scale import SCALE_PRESETS, plan_sizes

    sc = SCALE_PRESETS["scale-cpu"]
    plans = plan_sizes(sc.compare, list(sc.sizes), tokens_per_param=sc.tokens_per_param, **sc.overrides)
    seeds = list(range(sc.seeds))
    n = len(plans) * len(seeds) * 2
    got = []
    for k in range(1, n + 1):
        offset, mine = 0, []
        for sp in plans:  # as run_scale gives each size its offset
            mine += [(sp.name, *m) for m in plan_models(sp.preset.resolve(), seeds, (k, n), offset)]
            offset += len(seeds) * len(sp.params)
        got.append(mine)
    assert [len(m) for m in got] == [1] * n and len({m for ms in got for m in ms}) == n


def test_a_model_trained_alone_equals_it_in_a_stack(tmp_path, capsys):
    """3 shards of 3 seeds x 2 arms: each shard holds two models, each arm's alone, where one run
    stacks each arm's 3 seeds. A model alone trains through the stacked path too (a stack of one), so the
    results are one run's bit for bit (timings aside); before, a model alone took the one-model trainer,
    whose float32 sums differ, and a long run drifted by 0.5% in held-out NLL (results log, 2026-11-28)."""
    def cmd(out: Path) -> list[str]:
        return ["compare", "--preset", "smoke", "--seeds", "3", "--out", str(out), "--no-progress", "--workers",
                "1", *as_sets({**FAST, "steps": 40, "log_every": 10, "probe_every": 0})]

    sharded, single = tmp_path / "sharded", tmp_path / "single"
    for k in (1, 2, 3):
        assert main(cmd(sharded) + ["--shard", f"{k}/3"]) == 0
    assert main(cmd(sharded)) == 0 and main(cmd(single)) == 0
    capsys.readouterr()
    got, want = (json.loads((d / "results.json").read_text()) for d in (sharded, single))
    assert [r["train"].get("stacked") for r in want["runs"]["0"].values()] == [3, 3]
    assert [r["train"].get("stacked") for r in got["runs"]["0"].values()] == [None, None]
    for key, c in primary(want).items():
        if key not in TIMED:
            assert primary(got)[key]["values"] == c["values"], key
