"""The models of one invocation: its shard, its stacks (whether it stacks, how many seeds a stack holds, what
one model needs in memory), the lock each model is done under, and a stack's common checkpoint."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

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


def stacks(plan: "ComparePlan", distributed: bool) -> bool:
    """Whether the comparison trains its models as stacks (:func:`stack_size` says
    how many together): in one process, when ``stack`` asks for K > 1, or by default (``stack=0``) on a
    CPU. Then every model, a stack's only one included, trains through the stacked path: a model's
    arithmetic does not depend on how many others share its stack, so shards that stack the models
    otherwise give the same models as one invocation (``benchmarks/shard_equality.py``)."""
    from ..training.distributed import resolve_device

    asked = plan.execution.stack
    return not distributed and (asked > 1 or asked == 0 and resolve_device(plan.execution.device).type == "cpu")


MAX_STACK = 16  # the largest automatic stack (see stack_size)


def stack_size(plan: ComparePlan, seeds: int, workers: int, distributed: bool) -> int:
    """How many seeds of one arm train as one stacked model. ``plan.execution.stack``: 1 none, K at
    most K, 0 automatic: on a CPU, each worker process holds one stack (an arm's seeds spread evenly
    over ``workers // arms`` processes), at most :data:`MAX_STACK` (the benchmark gains no more past
    5-10) and as many as fit in a quarter of the memory per worker (:func:`model_bytes`); on a GPU
    none (its presets train in bfloat16, which a stack does not). Never under torchrun (data
    parallel, one model at a time)."""
    asked = plan.execution.stack
    if not stacks(plan, distributed) or seeds <= 1:
        return 1
    if asked > 1:
        return asked
    per_arm = max(1, workers // len(plan.arms))
    fits = max(1, int(memory_bytes() / 4 / workers // max(model_bytes(plan), 1)))  # a quarter of the memory
    return max(1, min(MAX_STACK, -(-seeds // per_arm), fits))


def model_bytes(plan: ComparePlan) -> int:
    """A generous estimate of one model's training memory in a stack: weights, gradients and two AdamW
    moments (16 bytes a parameter) and float32 activations (about 24 tensors of ``dim`` per token and
    layer, 4 attention maps per head), for the largest arm."""
    from ..training.memory import training_bytes

    return max(training_bytes(cfg, plan.mixture.batch_size, cfg.max_seq_len) for cfg in plan.arms.values())


def check_fits(plan: ComparePlan, memory: Optional[int] = None) -> None:
    """Refuse (one line naming the sizes and the estimate) a comparison one of whose models alone would not fit in
    ``memory`` bytes (None: this machine's, :func:`memory_bytes`) while it trains (:func:`model_bytes`, a generous estimate): it would be killed by the kernel
    partway, with nothing said. Checked before anything is written."""
    need, memory = model_bytes(plan), memory_bytes() if memory is None else memory
    if need <= memory:
        return
    cfg = max(plan.arms.values(), key=lambda c: c.vocab_size * c.dim + c.n_layers * c.dim ** 2)
    ids = plan.space
    needle, recall = ids.block("needle"), ids.block("recall")
    parts = [f"{name} {n:,}" for name, n in (("needle", needle.vocab_size if needle else 0),
                                             ("recall (recall_vocab)", recall.vocab_size if recall else 0)) if n]
    raise ValueError(f"one model of this comparison would need about {need / 2**30:,.1f} GiB to train (vocabulary "
                     f"{cfg.vocab_size:,} ids{': ' + ', '.join(parts) if parts else ''}; dim {cfg.dim}, n_layers "
                     f"{cfg.n_layers}, batch_size {plan.mixture.batch_size} x {cfg.max_seq_len} tokens), more than "
                     f"this machine's {memory / 2**30:,.1f} GiB: give smaller values")


def memory_bytes() -> int:
    """This machine's memory in bytes (what :func:`check_fits` and :func:`stack_size` hold a comparison to)."""
    from ..training.memory import physical_bytes

    return physical_bytes()
