"""The models of one invocation: its shard, its stacks, the lock each model is done under, and a
stack's common checkpoint."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..io import atomic_write, open_lock_file
from .plan import ComparePlan


@contextmanager
def job_lock(folder: Path, wait: bool) -> Iterator[bool]:
    """Hold an OS lock on ``folder/.job.lock`` (rank 0 alone, under torchrun) while one model is
    trained and evaluated. Yields False, without the lock, when another process holds it and
    ``wait`` is False; with ``wait`` it says on stderr whom it waits for, and blocks until the other
    is done. The holder writes its pid and host into the file. The OS releases the lock of a
    process that dies."""
    from ..training.distributed import is_initialized

    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock on this platform: no cross-process guard
        yield True
        return
    if is_initialized() and _rank() != 0:
        yield True
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".job.lock"
    fd = open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "pid unknown"
            print(f"difftx compare: waiting for {folder}: another invocation holds it ({holder}; {path})",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} host {platform.node()}\n".encode(), 0)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def align_stack(runs: list[Path]) -> list[list[int]]:
    """The unfinished models of one stack (their run folders) as the groups that train together
    (indices into ``runs``): one group, after putting every run back at the newest checkpoint they
    all have (a kill while a stack writes its checkpoints, one model after the other, can leave some
    a checkpoint ahead; the stacked trainer keeps each model's previous checkpoint until every model
    wrote the new one, and holds Ctrl-C until then), so the stack resumes together. Checkpoints past
    it are deleted: they are computed again, the same; a stack killed in its first checkpoint starts
    over. Otherwise, without a checkpoint in common (a fresh stack has none; other stacks' models,
    after --workers or --set stack=... changed) one group per latest checkpoint, each a stack of its own."""
    import shutil

    from ..training import checkpointing as ckpt

    latest, usable = [], []  # per run: `latest`, and its checkpoints up to it (past it: an unfinished save)
    for run in runs:
        last = ckpt.latest_checkpoint(run) if ckpt.checkpoints_dir(run).is_dir() else None
        latest.append(None if last is None else last.name)
        usable.append({p.name for p in ckpt.list_checkpoints(run) if last is not None and p.name <= last.name})
    common = set.intersection(*usable) if usable else set()
    if not common and not _first_save_cut(runs, latest):
        groups: dict = {}
        for i, name in enumerate(latest):
            groups.setdefault(name, []).append(i)
        return list(groups.values())
    keep = max(common) if common else None  # step_00000200: zero-padded, so the names sort by step
    for run, last in zip(runs, latest):
        if keep is None:  # a stack cut in its first checkpoint: every model starts over
            shutil.rmtree(ckpt.checkpoints_dir(run), ignore_errors=True)
            continue
        if last != keep:  # the pointer first: a kill in between leaves it at an intact checkpoint
            atomic_write(ckpt.checkpoints_dir(run) / ckpt.LATEST, lambda t: Path(t).write_text(keep + "\n"))
        for p in ckpt.list_checkpoints(run):
            if p.name > keep:
                shutil.rmtree(p)
    return [list(range(len(runs)))]


def _first_save_cut(runs: list[Path], latest: list) -> bool:
    """Whether these runs are a stack killed while it wrote its first checkpoint: some have none,
    the others only that one (their first ``ckpt_interval`` step)."""
    from ..training import checkpointing as ckpt

    saved = [(run, name) for run, name in zip(runs, latest) if name is not None]
    if not saved or len(saved) == len(runs) or len({name for _, name in saved}) != 1:
        return False
    run, name = saved[0]
    try:
        every = ckpt.read_train_config(ckpt.checkpoints_dir(run) / name / ckpt.TRAIN_CONFIG_NAME)["ckpt_interval"]
    except (ValueError, KeyError, ckpt.CheckpointError):
        return False
    return all(len(ckpt.list_checkpoints(r)) == 1 for r, _ in saved) and int(name.split("_")[1]) <= every


def plan_models(plan: ComparePlan, seeds: list[int], shard: tuple[int, int] | None = None,
                offset: int = 0) -> list[tuple[int, str]]:
    """The models ``(seed, arm)`` of this invocation: every model (seed by seed, each seed's arms in
    order); with ``shard`` (K, N) every N-th of them from the K-th (:func:`shard_jobs`; ``offset``:
    where they start in a longer list, such as one size of a scale run). From the command line
    alone: every shard of N up to the number of models has work."""
    return shard_jobs([(s, arm) for s in seeds for arm in plan.arms], shard, offset)


def plan_jobs(plan: ComparePlan, seeds: list[int], out: Path, k: int, shard: tuple[int, int] | None = None,
              offset: int = 0) -> list[tuple]:
    """``(arm, seeds, folders)`` per job: the models of :func:`plan_models`, each arm's in stacks of
    at most ``k``, the arms interleaved (so that parallel workers train the two arms of a comparison
    side by side)."""
    models = plan_models(plan, seeds, shard, offset)
    chunks = {}
    for arm in plan.arms:
        mine = [s for s, a in models if a == arm]
        chunks[arm] = [mine[i:i + k] for i in range(0, len(mine), k)]
    longest = max((len(c) for c in chunks.values()), default=0)
    return [(arm, tuple(c[i]), tuple(str(out / f"seed{s}" / arm) for s in c[i]))
            for i in range(longest) for arm, c in chunks.items() if i < len(c)]


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> ``(2, 4)``: invocation 2 of 4 (1 <= K <= N)."""
    try:
        k, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"--shard: expected K/N such as 1/4, got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard {text}: need 1 <= K <= N (invocation K of N)")
    return k, n


def shard_jobs(jobs: list, shard: tuple[int, int] | None, offset: int = 0) -> list:
    """The jobs of invocation K of N: every N-th of the whole job list, from the K-th (``offset``:
    where ``jobs`` starts in a longer list, such as one size of a scale run)."""
    if shard is None:
        return jobs
    k, n = shard
    return [j for i, j in enumerate(jobs) if (offset + i) % n == k - 1]
