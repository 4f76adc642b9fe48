"""A script that calls ``run_compare`` without ``if __name__ == "__main__":``.

compare's workers are spawned: each runs the script that started the pool once more before its first job.
Before, the unguarded call inside that run started the comparison again in every worker (a second note, a
second progress bar, writes into the same folder), multiprocessing refused it deep inside, and the parent
ended with a bare ``BrokenProcessPool`` traceback. Now the worker stops at the call's first line with one line
that names the fix, and the parent raises :class:`~difftx.compare.workers.WorkerLost`, naming the models
left to train."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from difftx.compare.workers import refuse_in_worker_start
from test_compare import FAST

GUARD = 'put the call under `if __name__ == "__main__":`'


def test_an_unguarded_script_stops_every_worker_before_it_reads_or_writes(tmp_path):
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from difftx.compare import run_compare\n"
        f"run_compare('smoke', seeds=2, out_dir={str(out)!r}, workers=2, progress=False, **{FAST!r})\n"
        "print('the script went on')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=180)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    assert "the script went on" not in proc.stdout
    assert f"difftx: run_compare was called while a worker process was starting: each worker runs {script} " \
           "again" in err, err[-3000:]
    assert GUARD in err
    assert "difftx.compare.workers.WorkerLost: a worker process ended abruptly, so compare stopped: 0 model(s) " \
           "done in this run, 4 not finished (seed0/baseline, seed0/diff, seed1/baseline, seed1/diff)" in err
    # the parent's note before training, said once: no worker got as far as planning the comparison
    assert err.count("difftx compare: note:") == 1, err[-3000:]
    assert not any((out / f"seed{s}" / arm / "model").exists() for s in (0, 1) for arm in ("diff", "baseline"))


def test_the_refusal_is_the_worker_start_alone(monkeypatch, capsys):
    refuse_in_worker_start("run_compare")  # the main process: nothing happens
    # a job of a spawned pool of your own may call run_compare: the process has finished starting
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        assert ex.submit(refuse_in_worker_start, "run_compare").result(timeout=120) is None
    monkeypatch.setattr(mp.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(SystemExit) as e:
        refuse_in_worker_start("run_scale")
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("difftx: run_scale was called while a worker process was starting") and GUARD in err


def _killed(plan, arm, seeds, folders) -> dict:
    """A job whose worker the system kills (as the out-of-memory killer would)."""
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def test_a_killed_worker_ends_compare_with_what_is_left():
    from difftx.compare.workers import WorkerLost, _run_pool

    class Bar:
        def update(self, n):
            pass

    done: dict = {}
    calls = [(None, "diff", [0, 1], None), (None, "baseline", [0, 1], None)]
    with pytest.raises(WorkerLost, match=r"a worker process ended abruptly, so compare stopped: 0 model\(s\) done in "
                                         r"this run, 4 not finished \(seed0/baseline, seed0/diff, seed1/baseline, "
                                         r"seed1/diff\)\. Either the system killed it \(out of memory"):
        _run_pool(_killed, calls, 2, done, Bar())
    assert done == {}


def test_the_command_says_it_in_one_line(tmp_path, capsys, monkeypatch):
    """Not "out of memory: ..." (the boundary's reading of a RuntimeError that names memory), not cut at 300."""
    from difftx.cli import main
    from difftx.compare import workers
    from test_compare import as_sets

    def lost(job, calls, n_workers, done, bar):
        raise workers.WorkerLost("a worker process ended abruptly, so compare stopped: ... (out of memory, for one"
                                 ": ...) " + "x" * 300 + " run the same command again to continue")

    monkeypatch.setattr("difftx.compare.run._run_pool", lost)
    code = main(["compare", "--preset", "smoke", "--seeds", "2", "--workers", "2", "--no-progress",
                 "--out", str(tmp_path / "run"), *as_sets(FAST)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("difftx compare: error: a worker process ended abruptly, so compare stopped")
    assert err[-1].endswith("run the same command again to continue")
