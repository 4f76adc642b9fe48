"""``run_compare``: train DIFF and its matched baseline over paired seeds, evaluate both, and
write ``results.json``, ``report.md`` and plots. Resumable: each finished part (one model's
training, one evaluation of one model) is a file in the output folder and is not redone, and an
unfinished training continues from its last checkpoint.

Under ``torchrun`` (more than one process) the models are trained one at a time, each by every
process (data parallel, :func:`difftx.training.train`); rank 0 alone evaluates and writes the
outputs while the others wait.

On a cluster, ``shard=(K, N)`` makes invocation K of N train and evaluate only its share of the
models (every N-th, from the K-th) into the shared folder and write no report; an invocation
without ``shard`` then assembles the results (training whatever is still missing). Each model is
done under an OS lock on ``seed{S}/{arm}/.job.lock``, so no two invocations ever do the same model:
a shard skips a model another process holds; an assembling run waits for it.

Layout of ``out_dir``::

    compare.json                      the preset and seeds of this folder (a re-run must match)
    seed{S}/{diff,baseline}/model/    the trained model (difftx checkpoint: load_model reads it)
    seed{S}/{diff,baseline}/train/    the trainer's run folder (metrics.jsonl; checkpoints until trained)
    seed{S}/{diff,baseline}/train.json   the training record: loss history, lambda, wall/CPU time
    seed{S}/{diff,baseline}/evals/{task}.json  one file per registered task (difftx.tasks.TASKS)
    seed{S}/{diff,baseline}/.job.lock   held while one invocation trains or evaluates that model
    results.json  report.md  plots/*.png
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..io import atomic_write, dumps_strict, read_json
from ..training.distributed import broadcast_object, on_main
from ..tasks.subject import TRAIN_RECORD, TrainRecord
from .evaluate import EVALS_DIR, evaluate_model
from .plan import ComparePlan, resolve
from .presets import ComparePreset, get_preset
from .schema import SCHEMA, SCHEMA_VERSION, check_version
from .train import train_models

# preset fields a resume may change: how a comparison runs, not what it computes, and which arms it
# trains (each arm's models live in their own folders)
EXECUTION_FIELDS = ("workers", "threads", "device", "description", "arms", "stack")
# what a resume may change besides: what is recorded along training (the held-out curve; models trained
# before keep theirs), and the paths of your text, which is checked by its content instead (text_identity)
RECORDING_FIELDS = ("curve_points", "curve_windows", "data", "tokenizer", "heldout")
# preset fields an older difftx recorded in compare.json, with the one value they always had
REMOVED_FIELDS = {"extra": {}}
COMPARE_FILE = "compare.json"  # the preset and seeds of a comparison's folder


@contextmanager
def job_lock(folder: Path, wait: bool) -> Iterator[bool]:
    """Hold an OS lock on ``folder/.job.lock`` (rank 0 alone, under torchrun) while one model is
    trained and evaluated. Yields False, without the lock, when another process holds it and
    ``wait`` is False; with ``wait`` it blocks until the other is done. The OS releases the lock
    of a process that dies."""
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
    fd = os.open(folder / ".job.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _job(plan: ComparePlan, kind: str, seeds: tuple, folders: tuple, progress: bool, position: int,
         invocation: str | None = None, wait: bool = True) -> dict[str, dict]:
    """Train (unless finished) and evaluate (what is missing) the models of arm ``kind`` for
    ``seeds`` (in ``folders``), each under its job lock (:func:`job_lock`); the unfinished ones are
    trained as one stack (:func:`difftx.compare.train.train_models`; one stack per checkpoint step).
    Returns ``{"seed{S}/{kind}": what was done}``. Under torchrun (one seed per job) every rank
    calls it: every rank trains, rank 0 alone evaluates."""
    from contextlib import ExitStack

    names = [f"seed{s}/{kind}" for s in seeds]
    done: dict[str, dict] = {}
    with ExitStack() as locks:
        mine = [broadcast_object(locks.enter_context(job_lock(Path(f), wait))) for f in folders]
        for name, held in zip(names, mine):
            if not held:
                done[name] = {"trained": False, "evaluated": [], "skipped": "another invocation holds this model"}
        todo = [(s, Path(f), n) for s, f, n, held in zip(seeds, folders, names, mine) if held]
        if plan.execution.threads:
            import torch

            torch.set_num_threads(plan.execution.threads)
        untrained = broadcast_object([i for i, (_, f, _) in enumerate(todo) if not (f / TRAIN_RECORD).is_file()])
        for group in _by_checkpoint_step([todo[i] for i in untrained]):
            train_models(kind, plan, [s for s, _, _ in group], [f for _, f, _ in group], progress=progress,
                         position=position, invocation=invocation)
        for i, (_, f, name) in enumerate(todo):
            done[name] = {"trained": i in untrained, "evaluated": _evaluate_missing(plan, f, progress, position)}
    return done


def _by_checkpoint_step(models: list[tuple]) -> list[list[tuple]]:
    """``(seed, folder, name)`` grouped by the step of the latest checkpoint of ``folder/train`` (a
    stack moves in step): in a fresh run, one group."""
    from ..training import checkpointing as ckpt

    groups: dict = {}
    for m in models:
        run = m[1] / "train"
        latest = ckpt.latest_checkpoint(run) if ckpt.checkpoints_dir(run).is_dir() else None
        groups.setdefault(None if latest is None else latest.name, []).append(m)
    return list(groups.values())


def _evaluate_missing(plan: ComparePlan, f: Path, progress: bool, position: int) -> list[str]:
    missing = broadcast_object([e for e in plan.tasks if not (f / EVALS_DIR / f"{e}.json").is_file()])
    if missing:
        # evaluation receives its part of the plan alone: the task settings (and the device)
        on_main(lambda: evaluate_model(f, plan.tasks, device=plan.execution.device, progress=progress,
                                       only=tuple(missing), position=position))
    return missing


MAX_STACK = 16  # the largest automatic stack (see stack_size)


def stack_size(plan: ComparePlan, seeds: int, workers: int, distributed: bool) -> int:
    """How many seeds of one arm train as one stacked model. ``plan.execution.stack``: 1 none, K at
    most K, 0 automatic: on a CPU, each worker process holds one stack (an arm's seeds spread evenly
    over ``workers // arms`` processes), at most :data:`MAX_STACK` (the benchmark gains no more past
    5-10) and as many as fit in a quarter of the memory per worker (:func:`_model_bytes`); on a GPU
    none (its presets train in bfloat16, which a stack does not). Never under torchrun (data
    parallel, one model at a time)."""
    from ..training.distributed import resolve_device

    asked = plan.execution.stack
    if distributed or asked == 1 or seeds <= 1:
        return 1
    if asked > 1:
        return asked
    if resolve_device(plan.execution.device).type != "cpu":
        return 1
    per_arm = max(1, workers // len(plan.arms))
    fits = max(1, int(_memory_bytes() / 4 / workers // max(_model_bytes(plan), 1)))  # a quarter of the memory
    return max(1, min(MAX_STACK, -(-seeds // per_arm), fits))


def _model_bytes(plan: ComparePlan) -> int:
    """A generous estimate of one model's training memory in a stack: weights, gradients and two AdamW
    moments (16 bytes a parameter) and float32 activations (about 24 tensors of ``dim`` per token and
    layer, 4 attention maps per head), for the largest arm."""
    worst = 0
    for cfg in plan.arms.values():
        params = 12 * cfg.n_layers * cfg.dim ** 2 + 2 * cfg.vocab_size * cfg.dim
        T, B = cfg.max_seq_len, plan.mixture.batch_size
        acts = 4 * B * T * cfg.n_layers * (24 * cfg.dim + 4 * cfg.n_heads * T)
        worst = max(worst, 16 * params + acts)
    return worst


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 8 << 30


def plan_jobs(plan: ComparePlan, seeds: list[int], out: Path, k: int) -> list[tuple]:
    """``(arm, seeds, folders)`` per job: each arm's seeds in stacks of at most ``k``, the arms
    interleaved (so that parallel workers train the two arms of a comparison side by side)."""
    chunks = [seeds[i:i + k] for i in range(0, len(seeds), k)]
    return [(kind, tuple(c), tuple(str(out / f"seed{s}" / kind) for s in c)) for c in chunks for kind in plan.arms]


def _check_folder(out: Path, preset: ComparePreset, text: dict | None = None) -> None:
    meta, new = out / COMPARE_FILE, preset.to_dict()
    if meta.is_file():
        data = read_json(meta, "the settings of a comparison")
        try:
            old = data["preset"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{meta}: unreadable ({e}); remove it or use another --out") from None
        check_version(data, str(meta))
        _check_text(meta, data.get("text"), text)
        old = {k: v for k, v in old.items() if k not in REMOVED_FIELDS or v != REMOVED_FIELDS[k]}
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in EXECUTION_FIELDS
                         and k not in RECORDING_FIELDS)
        if changed:
            raise ValueError(f"{meta}: this folder holds a comparison with other settings (differs in {changed}); "
                             "use another --out to keep both")
    out.mkdir(parents=True, exist_ok=True)
    record = {"schema_version": SCHEMA_VERSION, "preset": new}
    text = dumps_strict({**record, "text": text} if text is not None else record, indent=1)
    atomic_write(meta, lambda p: Path(p).write_text(text + "\n"))


def _check_text(meta: Path, old: dict | None, new: dict | None) -> None:
    """Refuse a folder trained on other text (or on the bundled corpus, or on text where now there is
    none): the training and held-out tokens and the tokenizer must be the same."""
    def what(t: dict | None) -> str:
        if t is None:
            return "the bundled Shakespeare"
        held = f"--heldout {t['heldout']}" if t["heldout"] else "its validation split held out"
        return f"--data {t['source']} ({held}, tokenizer {t['tokenizer']}, {t['train_tokens']:,} training tokens)"

    keys = ("tokenizer", "train_sha256", "heldout_sha256")
    if (old is None) != (new is None) or (old and any(old.get(k) != new.get(k) for k in keys)):
        raise ValueError(f"{meta}: this folder holds a comparison on {what(old)}, not on {what(new)}; use another "
                         "--out (or the same --data, --tokenizer and --heldout to continue it)")


def text_identity(plan: ComparePlan, progress: bool = False) -> dict | None:
    """Your text as a comparison uses it, checked before anything is written: its source, tokenizer,
    held-out text and their token counts and hashes (recorded in ``compare.json``, so a resume on other
    text is refused). Raises ``ValueError`` (one line) for a corpus smaller than one batch of LM
    windows or a held-out text shorter than one window; None without ``--data``."""
    import hashlib

    import numpy as np

    t = plan.text
    if t is None:
        return None
    data = t.prepare(progress)  # tokenized once into the cache (a progress bar with progress)
    T, B = plan.mixture.lm_seq_len, plan.mixture.batch_size
    if len(data.train) < (B + 1) * T:  # the data package's rule (PackedLoader): one batch of windows must fit
        raise ValueError(f"--data {t.source}: its training split has {len(data.train):,} tokens, fewer than one batch "
                         f"needs: (batch {B} + 1) x lm_seq_len {T} = {(B + 1) * T:,} tokens; give more text")
    held, source = t.heldout_tokens()
    if len(held) < T + 1:
        where = f"--heldout {t.heldout}" if t.heldout else f"--data {t.source}: its validation split"
        raise ValueError(f"{where} has {len(held):,} tokens, shorter than one window of {T + 1} (the training length "
                         f"{T} + 1); give {'a longer file' if t.heldout else 'more text or --heldout FILE'}")

    def sha(tokens) -> str:  # in chunks: a corpus may be larger than memory
        h = hashlib.sha256()
        for i in range(0, len(tokens), 1 << 22):
            h.update(np.asarray(tokens[i:i + (1 << 22)]).astype("<u4").tobytes())
        return h.hexdigest()

    return {**t.to_dict(), "tokenizer": data.tokenizer.name, "heldout_source": source,
            "train_tokens": len(data.train), "heldout_tokens": len(held), "train_sha256": sha(data.train.tokens),
            "heldout_sha256": sha(held)}


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


def run_compare(preset: str | ComparePreset = "smoke", seeds: int | Sequence[int] = 1,
                out_dir: str | os.PathLike = "runs/compare", *, progress: bool = True,
                workers: int | None = None, shard: tuple[int, int] | None = None, shard_offset: int = 0,
                **overrides) -> dict:
    """Train and evaluate DIFF and its parameter-matched baseline for each seed; write
    ``results.json``, ``report.md`` and ``plots/`` into ``out_dir``; return the results.

    preset     a name of :data:`difftx.compare.presets.PRESETS` or a :class:`ComparePreset` (on your
               text: ``get_preset("cpu").on_text("my.txt", heldout="held.txt")``)
    seeds      K (seeds 0..K-1) or an explicit list of seeds
    workers    models trained side by side in separate processes (default: the preset's; 1 under
               torchrun, where every process trains each model in turn)
    shard      ``(K, N)``: train and evaluate only this invocation's share of the models and write
               no report; returns ``{"shard": [K, N], "this_run": ...}`` (see the module doc)
    overrides  :class:`ComparePreset` fields applied on top of the preset
    """
    from datetime import timedelta

    from ..training.distributed import destroy_distributed, init_distributed, is_initialized, under_torchrun

    p = get_preset(preset, **overrides) if isinstance(preset, str) else preset.with_overrides(**overrides)
    owns_group = under_torchrun() and not is_initialized()
    # the other ranks wait in a collective while rank 0 evaluates: allow them hours, not torch's default
    if owns_group:
        init_distributed(p.device, timeout=timedelta(hours=12))
    try:
        return _run_compare(p, seeds, out_dir, progress=progress, workers=workers, shard=shard,
                            shard_offset=shard_offset)
    finally:
        if owns_group:
            destroy_distributed()


def _run_compare(p: ComparePreset, seeds: int | Sequence[int], out_dir: str | os.PathLike, *, progress: bool,
                 workers: int | None, shard: tuple[int, int] | None = None, shard_offset: int = 0) -> dict:
    from tqdm.auto import tqdm

    from ..training.distributed import is_initialized

    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seed_list or (isinstance(seeds, int) and seeds <= 0):
        raise ValueError(f"seeds: need a positive count or a non-empty list, got {seeds!r}")
    if len(set(seed_list)) != len(seed_list):
        raise ValueError(f"seeds: must be distinct, got {seed_list}")
    plan = resolve(p)  # once: every later step receives its part of the plan
    n_workers = plan.execution.workers if workers is None else workers
    if n_workers <= 0:
        raise ValueError(f"workers: must be positive, got {n_workers}")
    distributed = is_initialized()
    main = not distributed or _rank() == 0
    out = Path(out_dir)
    # your text is tokenized (rank 0, into the cache) and checked before anything is written
    text = on_main(lambda: text_identity(plan, progress and main), share=True)
    on_main(lambda: _check_folder(out, p, text))
    if distributed and plan.space.lm:  # rank 0 tokenizes the bundled corpus into the cache before the others read it
        from .stream import lm_streams

        on_main(lambda: lm_streams(text=plan.text))
    t0 = time.time()
    # the id of this invocation, kept with every model it trains (rank 0's is the one written)
    invocation = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(t0))}-{os.getpid()}"
    k = stack_size(plan, len(seed_list), n_workers, distributed)
    jobs = shard_jobs(plan_jobs(plan, seed_list, out, k), shard, shard_offset)
    wait = shard is None  # a shard skips a model another invocation holds; an assembling run waits for it
    done: dict[str, dict] = {}
    what = "" if shard is None else f", shard {shard[0]}/{shard[1]}"
    stacked = f", stacks of up to {k} seeds" if k > 1 else ""
    bar = tqdm(total=sum(len(j[1]) for j in jobs), desc=f"compare ({p.name}, {len(seed_list)} seed(s){what}{stacked})",
               disable=not (progress and main), dynamic_ncols=True, unit="model")
    if n_workers == 1 or len(jobs) <= 1 or distributed:
        for kind, seeds_, folders in jobs:
            done.update(_job(plan, kind, seeds_, folders, progress, 1, invocation, wait))
            bar.update(len(seeds_))
    else:
        calls = [(plan, kind, seeds_, folders, progress, 1 + i % n_workers, invocation, wait)
                 for i, (kind, seeds_, folders) in enumerate(jobs)]
        _run_pool(calls, n_workers, done, bar)
    bar.close()
    if shard is not None:  # the report is assembled by an invocation without --shard
        return {"shard": list(shard), "this_run": done, "wall_s": time.time() - t0}

    def finish() -> dict:
        from .report import write_outputs

        results = collect_results(out, p, plan, seed_list)
        results["wall_s"] = time.time() - t0
        results["this_run"] = done
        write_outputs(out, results, progress=progress)
        return results

    return on_main(finish, share=True)


class JobStopped(RuntimeError):
    """A worker process was asked to stop (SIGTERM) outside training; what it wrote is complete."""


_STOPPING: list[str] = []  # in a worker process: the signal that stopped it (it starts no further job)


def _worker_signals() -> None:
    """In each worker process: Ctrl-C is the parent's to handle (it reaches the whole process group),
    and SIGTERM outside training stops the job at once (every file is written atomically); inside
    training the trainer's own handler finishes the step and writes a checkpoint first."""
    import signal

    def stop(signum, frame):
        _STOPPING.append(signal.Signals(signum).name)
        raise JobStopped(f"stopped by {_STOPPING[0]}")

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)


def _pool_job(*args) -> dict:
    """:func:`_job` in a worker process; once a signal stopped one job, the worker starts no other
    (the pool hands each worker a job ahead, which the parent can no longer cancel)."""
    from .train import TrainingInterrupted

    if _STOPPING:
        raise JobStopped(f"not started: stopped by {_STOPPING[0]}")
    try:
        return _job(*args)
    except TrainingInterrupted:
        _STOPPING.append("SIGTERM")
        raise


def _run_pool(calls: list[tuple], n_workers: int, done: dict, bar) -> None:
    """Run ``_job(*args)`` for each of ``calls`` in ``n_workers`` spawned processes, filling
    ``done``. A first SIGINT / SIGTERM to this process cancels the jobs not started and passes
    SIGTERM on to the workers: a model in training stops after its current step with a checkpoint,
    an evaluation stops at once; then :class:`TrainingInterrupted` says what to run to continue. A
    second signal kills the workers."""
    import multiprocessing as mp
    import signal
    import threading
    from concurrent.futures import CancelledError, ProcessPoolExecutor, as_completed

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

    ctx = mp.get_context("spawn")
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with ProcessPoolExecutor(max_workers=min(n_workers, len(calls)), mp_context=ctx,
                             initializer=_worker_signals) as ex:
        futs = {ex.submit(_pool_job, *args): [f"seed{seed}/{args[1]}" for seed in args[2]] for args in calls}
        main_thread = threading.current_thread() is threading.main_thread()
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
                bar.update(len(futs[fut]))
        finally:
            if main_thread:
                for sig, h in old.items():
                    signal.signal(sig, h)
    if stopped:
        unfinished = sorted({name for names in futs.values() for name in names} - set(done))
        raise TrainingInterrupted(f"stopped by {stopped[0]}: {len(done)} model(s) done in this run, {len(unfinished)} "
                                  f"not finished ({', '.join(unfinished)}); the models in training wrote a checkpoint; "
                                  f"run the same command again to continue")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def execution(device: str) -> dict:
    """How this invocation ran: processes (torchrun's world size), device and process-group backend."""
    import torch.distributed as dist

    from ..training.distributed import is_initialized, resolve_device

    group = is_initialized()
    return {"world_size": dist.get_world_size() if group else 1, "device": str(resolve_device(device)),
            "backend": dist.get_backend() if group else None}


def versions() -> dict:
    import numpy
    import torch

    from .. import __version__

    return {"difftx": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
            "python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count()}


def collect_results(out: Path, preset: ComparePreset, plan: ComparePlan, seeds: Sequence[int]) -> dict:
    """Read every stored part back into one JSON-ready dict (the ``results.json`` schema, see
    ``docs/compare.md`` and :mod:`difftx.compare.schema`) and add the paired comparisons.
    ``preset`` is recorded as given; ``plan`` is what it resolved to."""
    from ..tasks import TASKS, settings_to_dict
    from .summary import all_comparisons, pair_key, token_ratios

    settings = plan.tasks
    runs: dict = {}
    for s in seeds:
        runs[str(s)] = {}
        for k in plan.arms:
            f = out / f"seed{s}" / k
            evals = {e: read_json(f / EVALS_DIR / f"{e}.json", f"the {e} evaluation of a compare model")
                     for e in settings}
            runs[str(s)][k] = {"train": TrainRecord.read(f).to_dict(), "tasks": evals}
    first = runs[str(seeds[0])]
    results = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "execution": execution(plan.execution.device),
        "preset": preset.to_dict(),
        "seeds": list(seeds),
        "needle_task": plan.space.needle.to_dict() if plan.space.needle else None,
        "mixture": {**dataclasses.asdict(plan.mixture), "shares": plan.mixture.shares()},
        "arms": {k: {"config": cfg.to_dict(), "parameters": first[k]["train"]["parameters"]}
                 for k, cfg in plan.arms.items()},
        "tasks": {name: {"title": TASKS[name].title, "settings": settings_to_dict(st),
                         "metrics": [m.describe() for m in TASKS[name].metrics(st)]} for name, st in settings.items()},
        "runs": runs,
        "null_reasons": {},
    }
    if plan.text is not None:  # your text: source, tokenizer, held-out text, token counts (from compare.json)
        results["text"] = read_json(out / COMPARE_FILE, "the settings of a comparison").get("text")
    comparisons = all_comparisons(results, settings)  # Holm over every pair of arms
    results["comparison"] = comparisons.pop(pair_key("diff", "baseline"))
    results["arm_comparisons"] = comparisons
    results["token_efficiency"] = token_ratios(results)
    return results
