"""``difftx compare`` interrupted before a model's first checkpoint (Ctrl-C or a kill), then run
again: it starts that model over and ends with the results of an uninterrupted run. Before the
fix every re-run was refused ("... holds the metrics.jsonl of an earlier run that wrote no
checkpoint"), and compare has no --resume to get past it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from difftx.cli import main
from test_compare import FAST, as_sets

# 40 steps, a checkpoint every 4 (10% of the steps, in whole log intervals of 2): the child is
# stopped when the first model logs step 2, before any checkpoint exists
SETTINGS = {**FAST, "steps": 40, "log_every": 2, "probe_every": 0}

CHILD = """
import os, signal, sys
from difftx.training import metrics
from difftx.cli import main
original = metrics.MetricsLogger.log
def log(self, record):
    original(self, record)
    if record.get("step") == 2 and "loss" in str(record) and not os.environ.get("DIFFTX_TEST_FIRED"):
        os.environ["DIFFTX_TEST_FIRED"] = "1"
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
metrics.MetricsLogger.log = log
sys.exit(main(sys.argv[2:]))
"""


def primary(res: dict) -> dict:
    """The DIFF-vs-baseline comparisons of a ``results.json`` object."""
    return res["comparisons"]["diff vs baseline"]["metrics"]


def _cmd(out: Path) -> list[str]:
    return ["compare", "--preset", "smoke", "--seeds", "1", "--out", str(out), "--workers", "1", "--no-progress",
            *as_sets(SETTINGS)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("clean") / "run"
    assert main(_cmd(out)) == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
def test_compare_resumes_after_an_interrupt_before_the_first_checkpoint(tmp_path, uninterrupted, sig):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", CHILD, sig, *_cmd(out)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(root), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode != 0, proc.stdout[-2000:]
    train_dirs = [p.parent for p in out.glob("seed0/*/train/metrics.jsonl")]
    assert train_dirs and not any((d / "checkpoints").is_dir() and any((d / "checkpoints").iterdir())
                                  for d in train_dirs), "the child was to stop before any checkpoint"
    assert main(_cmd(out)) == 0  # the same command again: no refusal
    got = json.loads((out / "results.json").read_text())
    for arm in ("diff", "baseline"):
        g, w = got["runs"]["0"][arm]["train"]["history"], uninterrupted["runs"]["0"][arm]["train"]["history"]
        assert [h["step"] for h in g] == [h["step"] for h in w]
        losses = sorted(k for k in w[-1] if k.endswith("_loss"))
        assert losses and [[h.get(k) for k in losses] for h in g] == [[h.get(k) for k in losses] for h in w]
    timed = {"train_tokens_per_s", "loss_at_equal_time"}
    for key, c in primary(uninterrupted).items():
        if key not in timed:
            for arm, vals in c["values"].items():
                assert primary(got)[key]["values"][arm] == pytest.approx(vals, rel=1e-5, abs=1e-7), key


def _wait_for_training(out: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until both models of seed 0 logged a training step (each in its own worker process)."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        logs = list(out.glob("seed0/*/train/metrics.jsonl"))
        if len(logs) == 2 and all('"loss"' in p.read_text() for p in logs):
            return
        assert proc.poll() is None, "compare ended before it was signalled"
        time.sleep(0.1)
    raise AssertionError("no training step logged in time")


def _two_workers(out: Path, stack: int, output) -> subprocess.Popen:
    """`compare --seeds 2 --workers 2` of 3000 steps started in its own session (``output``: where its
    stdout and stderr go)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = ["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "2", "--no-progress",
           *as_sets({**FAST, "steps": 3000, "log_every": 1, "probe_every": 0, "stack": stack})]
    entry = "import sys; from difftx.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", entry, *cmd], env=env, cwd=str(root), text=True,
                            stdout=output, stderr=output, start_new_session=True)


@pytest.mark.parametrize("sig, group, stack", [("SIGTERM", False, 1), ("SIGINT", True, 0)])
def test_a_signal_stops_the_worker_processes_with_checkpoints(tmp_path, sig, group, stack):
    """With --workers 2, SIGTERM to compare alone (a scheduler) or SIGINT to its process group (Ctrl-C
    in a terminal): the models in training stop after a step with a checkpoint, the queued ones do not
    start, no worker outlives compare, the exit code is 130 and the same command continues. Before,
    the pool waited for every model (SIGINT) or compare died and left its workers training (SIGTERM).
    ``stack=1``: one model per job, so seed 1's are queued; ``stack=0``: each worker trains one arm's
    two seeds as a stack, and all four stop with a checkpoint."""
    import time

    out = tmp_path / "run"
    proc = _two_workers(out, stack, subprocess.PIPE)
    try:
        _wait_for_training(out, proc)
        if group:
            os.killpg(proc.pid, getattr(signal, sig))
        else:
            proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert f"stopped by {sig}" in err and "run the same command again to continue" in err, err[-2000:]
    assert "--resume" not in err, err[-2000:]  # compare has none: the trainer's lines say to run compare again
    for seed in (0, 1) if stack != 1 else (0,):
        for arm in ("diff", "baseline"):
            run = out / f"seed{seed}" / arm / "train"
            last = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r][-1]
            assert (run / "checkpoints" / f"step_{last['step']:08d}").is_dir(), "stopped after a step, checkpointed"
            assert last["step"] < 3000
    if stack == 1:
        assert not list(out.glob("seed1/*/train/metrics.jsonl")), "the queued models did not start"
    sizes = {p: p.stat().st_size for p in out.glob("seed*/*/train/metrics.jsonl")}
    time.sleep(1.5)
    assert sizes == {p: p.stat().st_size for p in sizes}, "a worker outlived compare and went on training"


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads the process table from /proc")
def test_workers_end_when_compare_is_killed(tmp_path):
    """Issue 31 item 3: `kill -9` of compare --workers 2 (sent once both workers are training): no worker
    is left after 10 s, and each stopped with a checkpoint. Before, they trained on as orphans and then
    hung forever in a read of the dead parent's pipe."""
    import time

    out = tmp_path / "run"
    proc = _two_workers(out, 1, subprocess.DEVNULL)
    workers: list[int] = []
    try:
        _wait_for_training(out, proc)
        workers = _children(proc.pid)
        assert len(workers) >= 2
        proc.kill()
        proc.wait(timeout=30)
        end = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "a worker outlived its killed parent by 10 s"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    for arm in ("diff", "baseline"):  # each stopped after a step with a checkpoint: a re-run continues there
        assert list((out / "seed0" / arm / "train" / "checkpoints").glob("step_*"))


def test_sigterm_during_an_evaluation_exits_130_with_a_line(tmp_path, capsys, monkeypatch):
    """Issue 31: SIGTERM (sent from a hook as the first evaluation starts) with --workers 1 ends compare
    with exit code 130 and one line; the same command then finishes. Before, it died silently (143)."""
    from difftx.compare import run as run_mod

    original, fired = run_mod.evaluate_model, []

    def evaluate(*args, **kw):
        if not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kw)

    monkeypatch.setattr(run_mod, "evaluate_model", evaluate)
    out = tmp_path / "run"
    cmd = ["compare", "--preset", "smoke", "--seeds", "1", "--out", str(out), "--workers", "1", "--no-progress",
           *as_sets(FAST)]
    assert main(cmd) == 130 and fired
    # one line, besides the note before training that 1 seed gives no verdict
    err = "\n".join(x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("difftx compare: note:"))
    assert len(err.splitlines()) == 1 and "stopped by SIGTERM outside training" in err, err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
    monkeypatch.undo()
    assert main(cmd) == 0
