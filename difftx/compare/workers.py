"""Compare's jobs in spawned worker processes (``--workers``), and how SIGINT / SIGTERM stop them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def _sigterm_stops(active: bool) -> Iterator[None]:
    """SIGTERM (a scheduler) outside training ends the models' loop with
    :class:`~difftx.compare.train.TrainingInterrupted` (exit code 130, one line), not silently (143);
    every file written so far is complete. Inside training the trainer's own handler takes over.
    Main thread only, and only when ``active``."""
    import signal
    import threading

    from .train import TrainingInterrupted

    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise TrainingInterrupted("stopped by SIGTERM outside training (an evaluation stopped at once; what was "
                                  "finished is kept); run the same command again to continue")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def refuse_in_worker_start(entry: str) -> None:
    """Called first by every public entry that can start compare's worker processes (``entry``: its name).

    A spawned worker runs the script that started the pool once more (as module ``__mp_main__``) before its
    first job, so that what the script defines at its top level (a kind, a training task) exists there too.
    A script that calls ``entry`` outside ``if __name__ == "__main__":`` would start the whole comparison again
    in every worker, writing into the same folders. Called in that run, this ends the worker at once, before
    anything is read or written, with one line on stderr that says what to change; the pool's parent then
    says that a worker ended (:func:`_run_pool`). ``_inheriting`` is the flag the standard library itself
    reads for this case (multiprocessing's ``_check_not_importing_main``): set while a spawned process is
    being prepared, so a worker of your own pool that calls ``entry`` from a job is not refused."""
    import multiprocessing as mp
    import sys

    if not getattr(mp.current_process(), "_inheriting", False):
        return
    script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the script that started it"
    print(f"difftx: {entry} was called while a worker process was starting: each worker runs {script} again, "
          f"and the call in it would start the comparison again; put the call under "
          f"`if __name__ == \"__main__\":` (definitions such as register_attention stay at the top level)",
          file=sys.stderr, flush=True)
    raise SystemExit(1)


class JobStopped(RuntimeError):
    """A worker process was asked to stop (SIGTERM) outside training; what it wrote is complete."""


class WorkerLost(RuntimeError):
    """A worker process of compare's pool ended without returning (killed, or failed while it started)."""


_STOPPING: list[str] = []  # in a worker process: the signal that stopped it (it starts no further job)
# in a worker process: in a job; its parent is gone; the parent's pid (from the parent itself, not os.getppid())
_WORKER: dict = {"running": False, "orphaned": False, "parent": None}
ORPHAN_GRACE_S = 20.0  # a worker whose parent died: the time its job has to stop (a checkpoint) before it exits
ORPHAN_POLL_S = 0.5
# tests only (tests/test_compare_orphans.py): SIGKILL compare right after the named stage of a pool's start-up
# (see _test_kill_parent), and leave PR_SET_PDEATHSIG out so that the watcher thread alone must notice
KILL_PARENT_AT = "DIFFTX_TEST_KILL_PARENT_AT"
NO_PDEATHSIG = "DIFFTX_TEST_NO_PDEATHSIG"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _parent_gone() -> bool:
    """In a worker process: its parent (the pid the parent passed) is no longer its parent. Once a
    process dies, Linux hands its children to PID 1 or a subreaper at once, so ``os.getppid()`` changes."""
    return _WORKER["parent"] is not None and os.getppid() != _WORKER["parent"]


def _die_with_parent(sig: int) -> bool:
    """Linux: ask the kernel to send ``sig`` to this process the moment its parent dies
    (``prctl(PR_SET_PDEATHSIG)``), even by SIGKILL. False where that is not available (then the
    watcher thread alone notices, within :data:`ORPHAN_POLL_S`)."""
    import sys

    if not sys.platform.startswith("linux") or os.environ.get(NO_PDEATHSIG):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError, TypeError):  # pragma: no cover - no libc prctl
        return False


def _test_kill_parent(stage: str, parent: int | None = None) -> None:
    """Tests only: when :data:`KILL_PARENT_AT` names ``stage``, SIGKILL compare (this process, or
    ``parent`` from a worker, which then waits until it is gone), as ``kill -9`` would at that moment."""
    if os.environ.get(KILL_PARENT_AT) != stage:
        return
    import signal
    import sys

    print(f"difftx test hook: SIGKILL compare after stage {stage!r}", file=sys.stderr, flush=True)
    if parent is None:
        os.kill(os.getpid(), signal.SIGKILL)
        return
    try:
        os.kill(parent, signal.SIGKILL)
    except OSError:  # the other worker was first
        pass
    end = time.monotonic() + 10
    while os.getppid() == parent and time.monotonic() < end:
        time.sleep(0.01)


def _worker_signals(parent: int | None = None, deathsig: bool = False) -> None:
    """In each worker process (the pool's initializer; ``parent``: compare's pid, passed by compare):
    Ctrl-C is the parent's to handle (it reaches the whole process group), and SIGTERM outside
    training stops the job at once (every file is written atomically); inside training the trainer's
    own handler finishes the step and writes a checkpoint first.

    A worker whose parent is already gone when it gets here (it died while this process was starting:
    importing torch takes seconds) exits at once. Later, the parent's death is noticed twice: by the
    kernel (``deathsig``: PR_SET_PDEATHSIG sends SIGTERM at once; only when the pool was started from
    the main thread, since Linux sends it when the *thread* that started the worker ends) and by a
    watcher thread (:func:`_watch_parent`). Comparing ``os.getppid()`` with the pid compare passed,
    not with the one this process first saw, is what makes a parent that died during start-up count:
    the worker would otherwise watch PID 1 (its new parent) for ever."""
    import signal
    import threading

    _WORKER["parent"] = os.getppid() if parent is None else parent

    def stop(signum, frame):
        if _parent_gone():  # PR_SET_PDEATHSIG, or the watcher: an idle worker exits, a job stops
            _WORKER["orphaned"] = True
            if not _WORKER["running"]:
                os._exit(1)
        _STOPPING.append(signal.Signals(signum).name)
        raise JobStopped(f"stopped by {_STOPPING[0]}")

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    if deathsig:
        _die_with_parent(signal.SIGTERM)
    if _parent_gone():  # after PR_SET_PDEATHSIG: a parent that dies from here on is signalled
        os._exit(1)
    try:  # no cross-process lock for the progress bars: a spawned worker shares none, and a killed one would
        from tqdm.std import TqdmDefaultWriteLock  # leave its named semaphore for the resource tracker to report

        TqdmDefaultWriteLock.mp_lock = None
    except ImportError:  # pragma: no cover - another tqdm
        pass
    _test_kill_parent("initializer", _WORKER["parent"])
    threading.Thread(target=_watch_parent, args=(_WORKER["parent"],), daemon=True,
                     name="difftx-parent-watch").start()


def _watch_parent(parent: int) -> None:
    """Once the worker's parent ``parent`` is gone (even by SIGKILL: the worker is handed to another
    parent), stop: an idle worker exits at once; a job gets SIGTERM (training finishes its step and
    writes a checkpoint, an evaluation stops), and the worker exits when it has stopped, or after
    :data:`ORPHAN_GRACE_S` at the latest. Never waits for a parent that cannot answer.

    multiprocessing's resource tracker needs no such care: it reads a pipe whose write end compare and
    its workers hold, and ends (removing what compare left registered) when the last of them has exited."""
    import signal

    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    _WORKER["orphaned"] = True
    if not _WORKER["running"]:
        os._exit(1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(1)


def _pool_job(job: Callable[..., dict], *args) -> dict:
    """``job(*args)`` (:func:`difftx.compare.run._job`) in a worker process; once a signal stopped one
    job, the worker starts no other (the pool hands each worker a job ahead, which the parent can no
    longer cancel). A worker whose parent died exits when its job ends."""
    from .train import TrainingInterrupted

    if _STOPPING or _WORKER["orphaned"] or _parent_gone():
        raise JobStopped(f"not started: stopped by {_STOPPING[0] if _STOPPING else 'the parent ending'}")
    _WORKER["running"] = True
    try:
        _test_kill_parent("job", _WORKER["parent"])
        return job(*args)
    except TrainingInterrupted:
        _STOPPING.append("SIGTERM")
        raise
    finally:
        _WORKER["running"] = False
        if _WORKER["orphaned"] or _parent_gone():
            os._exit(1)  # nobody reads the result: the pool's queues would block this process forever


def _run_pool(job: Callable[..., dict], calls: list[tuple], n_workers: int, done: dict, bar) -> None:
    """Run ``job(*args)`` (a module-level function: it is pickled by name) for each of ``calls`` in
    ``n_workers`` spawned processes, filling ``done``. A first SIGINT / SIGTERM to this process cancels
    the jobs not started and passes SIGTERM on to the workers: a model in training stops after its
    current step with a checkpoint, an evaluation stops at once; then :class:`TrainingInterrupted`
    says what to run to continue. A second signal kills the workers."""
    import multiprocessing as mp
    import signal
    import threading
    from concurrent.futures import CancelledError, ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    from .train import TrainingInterrupted

    stopped: list[str] = []

    def handle(signum, frame) -> None:
        name = signal.Signals(signum).name
        if stopped:  # the second signal: no more waiting
            for child in mp.active_children():
                child.kill()
            raise KeyboardInterrupt
        stopped.append(name)
        for fut in futs:
            fut.cancel()
        for child in mp.active_children():
            os.kill(child.pid, signal.SIGTERM)

    def tally() -> str:
        unfinished = sorted({name for names in futs.values() for name in names} - set(done))
        return f"{len(done)} model(s) done in this run, {len(unfinished)} not finished ({', '.join(unfinished)})"

    ctx = mp.get_context("spawn")
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    main_thread = threading.current_thread() is threading.main_thread()
    _test_kill_parent("pool")
    # this process's pid, passed to each worker: one that starts after this process died exits at once
    with ProcessPoolExecutor(max_workers=min(n_workers, len(calls)), mp_context=ctx,
                             initializer=_worker_signals, initargs=(os.getpid(), main_thread)) as ex:
        futs = {ex.submit(_pool_job, job, *args): [f"seed{seed}/{args[1]}" for seed in args[2]] for args in calls}
        _test_kill_parent("spawned")  # the workers are started (in submit), none has run its initializer yet
        if main_thread:
            for sig in old:
                signal.signal(sig, handle)
        try:
            for fut in as_completed(futs):
                try:
                    done.update(fut.result())
                except (CancelledError, TrainingInterrupted, JobStopped):
                    if not stopped:
                        raise
                    continue
                except BrokenProcessPool as e:
                    if stopped:
                        continue
                    raise WorkerLost(
                        f"a worker process ended abruptly, so compare stopped: {tally()}. Either the system "
                        "killed it (out of memory, for one: fewer workers or smaller stacks need less, `--workers "
                        "N`, `--set stack=1`) or it failed while starting, and what it printed is above. Finished "
                        "models are kept, and a model in training keeps its last checkpoint: run the same command "
                        "again to continue") from e
                bar.update(len(futs[fut]))
        finally:
            if main_thread:
                for sig, h in old.items():
                    signal.signal(sig, h)
    if stopped:
        raise TrainingInterrupted(f"stopped by {stopped[0]}: {tally()}; the models in training wrote a checkpoint; "
                                  f"run the same command again to continue")

