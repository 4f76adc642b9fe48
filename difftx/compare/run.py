"""``run_compare``: train DIFF and its matched baseline over paired seeds, evaluate both, and
write ``results.json``, ``report.md`` and plots. Resumable: each finished part (one model's
training, one evaluation of one model) is a file in the output folder and is not redone, and an
unfinished training continues from its last checkpoint.

Under ``torchrun`` (more than one process) the models are trained one at a time, each by every
process (data parallel, :func:`difftx.training.train`); rank 0 alone evaluates and writes the
outputs while the others wait.

It writes only into a new or empty folder or its own (``compare.json``; :func:`.folder.check_owned`), and
reuses a finished model only if its ``train.json`` says it was trained as asked (:func:`.folder.check_reuse`).

On a cluster, ``shard=(K, N)`` makes invocation K of N train and evaluate only its share of the
models (every N-th (seed, arm), from the K-th: :func:`.jobs.plan_models`; it stacks its own) into the
shared folder and write no report; an invocation without ``shard`` then assembles the results
(training whatever is still missing). Each model is done under an OS lock on
``seed{S}/{arm}/.job.lock``, so no two invocations ever do the same model: a shard skips a model
another process holds; an assembling run waits for it.

Layout of ``out_dir``::

    compare.json                      the preset and seeds of this folder (a re-run must match)
    seed{S}/{diff,baseline}/model/    the trained model (difftx checkpoint: load_model reads it)
    seed{S}/{diff,baseline}/train/    the trainer's run folder (metrics.jsonl; checkpoints until trained)
    seed{S}/{diff,baseline}/train.json   the training record: loss history, lambda, wall/CPU time, request
    seed{S}/{diff,baseline}/machine.json the machine that trained it (difftx.provenance.machine)
    seed{S}/{diff,baseline}/evals/{task}.json  one file per registered task (difftx.tasks.TASKS)
    seed{S}/{diff,baseline}/.job.lock   held while one invocation trains or evaluates that model (its pid, host)
    results.json  report.md  plots/*.png

Beside this module: :mod:`.folder` (what the folder holds and may reuse), :mod:`.jobs` (the models of an
invocation, their stacks and locks), :mod:`.workers` (``--workers`` processes and signals) and
:mod:`.results` (``results.json``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..io import own_folder
from ..training.distributed import broadcast_object, on_main
from ..tasks.subject import TRAIN_RECORD
from .evaluate import EVALS_DIR, evaluate_model, read_eval
from .folder import (COMPARE_FILE, EXECUTION_FIELDS, NOT_TRAINING_FIELDS, RECORDING_FIELDS, REMOVED_FIELDS,
                     TRAIN_RUN_FILES, _check_folder, _record_folder, check_owned, check_reuse, kinds_code,
                     tasks_code, text_identity, training_request)
from .jobs import (MAX_STACK, _rank, align_stack, check_fits, job_lock, parse_shard, plan_jobs, plan_models, shard_jobs,
                   stack_size)
from .plan import ComparePlan, resolve
from .presets import ComparePreset, get_preset
from .results import add_comparisons, collect_results, earlier_looks, execution, seeds_note, versions
from .schema import CompareResult
from .train import train_models
from .workers import JobStopped, _run_pool, _sigterm_stops, refuse_in_worker_start

# this module's names, and those that moved to the modules beside it, importable from here as before
__all__ = [
    "COMPARE_FILE", "EXECUTION_FIELDS", "JobStopped", "MAX_STACK", "NOT_TRAINING_FIELDS", "RECORDING_FIELDS",
    "REMOVED_FIELDS", "TRAIN_RUN_FILES", "add_comparisons", "align_stack", "check_owned", "check_reuse",
    "collect_results", "execution", "job_lock", "parse_shard", "plan_jobs", "plan_models", "run_compare",
    "shard_jobs", "stack_size", "text_identity", "training_request", "versions",
]


def _job(plan: ComparePlan, arm: str, seeds: tuple, folders: tuple, progress: bool, position: int,
         invocation: str | None = None, wait: bool = True, request: dict | None = None) -> dict[str, dict]:
    """Train (unless finished) and evaluate (what is missing) the models of ``arm`` for
    ``seeds`` (in ``folders``), each under its job lock (:func:`job_lock`); the unfinished ones are
    trained as one stack (:func:`difftx.compare.train.train_models`), first put back at their newest
    common checkpoint (:func:`align_stack`). ``request`` (:func:`training_request`) goes into each
    record. Returns ``{"seed{S}/{arm}": what was done}``. Under torchrun (one seed per job) every
    rank calls it: every rank trains, rank 0 alone evaluates."""
    from contextlib import ExitStack

    names = [f"seed{s}/{arm}" for s in seeds]
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
        runs = [todo[i][1] / "train" for i in untrained]
        groups = on_main(lambda: align_stack(runs), share=True) if untrained else []
        for group in groups:
            train_models(arm, plan, [todo[untrained[g]][0] for g in group], [todo[untrained[g]][1] for g in group],
                         progress=progress, position=position, invocation=invocation, request=request)
        for i, (_, f, name) in enumerate(todo):
            done[name] = {"trained": i in untrained, "evaluated": _evaluate_missing(plan, f, progress, position)}
    return done


def _evaluate_missing(plan: ComparePlan, f: Path, progress: bool, position: int) -> list[str]:
    """Run the evaluations of ``f`` whose file is missing, or unreadable (then redone, with a line that says
    so: an evaluation gives the same result again); returns their names."""
    def usable(task: str) -> bool:
        path = f / EVALS_DIR / f"{task}.json"
        if not path.is_file():
            return False
        try:
            read_eval(path, task)
        except ValueError as e:
            print(f"difftx compare: redoing an evaluation: {e}", file=sys.stderr, flush=True)
            return False
        return True

    on_main(lambda: own_folder(f / EVALS_DIR))  # a link there is replaced, never read as this model's results
    missing = broadcast_object(on_main(lambda: [e for e in plan.tasks if not usable(e)], share=True))
    if missing:
        # evaluation receives its part of the plan alone: the task settings (and the device)
        on_main(lambda: evaluate_model(f, plan.tasks, device=plan.execution.device, progress=progress,
                                       only=tuple(missing), position=position))
    return missing


def run_compare(preset: str | ComparePreset = "smoke", seeds: int | Sequence[int] = 1,
                out_dir: str | os.PathLike = "runs/compare", *, progress: bool = True,
                workers: int | None = None, shard: tuple[int, int] | None = None, shard_offset: int = 0,
                report: bool = True, only_arms: Sequence[str] | None = None,
                **overrides) -> CompareResult | dict:
    """Train and evaluate DIFF and its parameter-matched baseline for each seed; write
    ``results.json``, ``report.md`` and ``plots/`` into ``out_dir``; return the results
    (:class:`~.schema.CompareResult`).

    preset     a name of :data:`difftx.compare.presets.PRESETS` or a :class:`ComparePreset` (on your
               text: ``get_preset("cpu").on_text("my.txt", heldout="held.txt")``)
    seeds      K (seeds 0..K-1) or an explicit list of seeds
    workers    models trained side by side in separate processes (default: the preset's; 1 under
               torchrun, where every process trains each model in turn)
    shard      ``(K, N)``: train and evaluate only this invocation's share of the models and write
               no report; returns ``{"shard": [K, N], "this_run": ...}`` (see the module doc)
    report     False: train and evaluate, write no report; returns ``{"this_run": ...}``
    only_arms  train and evaluate only these arms' models (no report; ``--tune`` adds a value for one
               arm this way)
    overrides  :class:`ComparePreset` fields applied on top of the preset
    """
    from datetime import timedelta

    from ..training.distributed import destroy_distributed, init_distributed, is_initialized, under_torchrun

    refuse_in_worker_start("run_compare")
    p = get_preset(preset, **overrides) if isinstance(preset, str) else preset.with_overrides(**overrides)
    if p.source is not None and under_torchrun():
        raise ValueError("compare --from runs in one process (each model's starting weights are written into its "
                         "folder when it starts); run it without torchrun")
    owns_group = under_torchrun() and not is_initialized()
    # the other ranks wait in a collective while rank 0 evaluates: allow them hours, not torch's default
    if owns_group:
        init_distributed(p.device, timeout=timedelta(hours=12))
    try:
        return _run_compare(p, seeds, out_dir, progress=progress, workers=workers, shard=shard,
                            shard_offset=shard_offset, report=report and only_arms is None, only_arms=only_arms)
    finally:
        if owns_group:
            destroy_distributed()


def check_arms_run(plan) -> None:
    """One forward and backward pass of a one-layer model of every arm whose attention kind is not built in (a
    kinds file's), on a few tokens, before any model trains: a kind that raises there is named with its file and
    line in one ValueError, not found after the other arms have trained."""
    import torch

    from ..attention.registry import error_site, kind_code
    from ..model import Transformer

    for arm, cfg in plan.arms.items():
        code = kind_code(cfg.attention)
        if code is None:  # built in: tested
            continue
        small = cfg.replace(n_layers=1)
        try:
            with torch.random.fork_rng(devices=[]):  # the models' own draws come later, as without the check
                torch.manual_seed(0)
                model = Transformer(small)
                tokens = torch.randint(0, small.vocab_size, (2, min(9, small.max_seq_len)))
                model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        except Exception as e:  # noqa: BLE001 - one line naming the kind's file and line, then the error
            at = error_site(e, code["file"]) if code["file"] else "its code"
            first = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(f"arm {arm!r}: attention kind {cfg.attention!r} fails in one training step of a "
                             f"one-layer model ({at}: {type(e).__name__}: {first}); fix the kind, or leave the arm "
                             f"out (--arms)") from e


def _run_compare(p: ComparePreset, seeds: int | Sequence[int], out_dir: str | os.PathLike, *, progress: bool,
                 workers: int | None, shard: tuple[int, int] | None = None, shard_offset: int = 0,
                 report: bool = True, only_arms: Sequence[str] | None = None) -> CompareResult | dict:
    from tqdm.auto import tqdm

    from ..training.distributed import is_initialized

    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seed_list or (isinstance(seeds, int) and seeds <= 0):
        raise ValueError(f"seeds: need a positive count or a non-empty list, got {seeds!r}")
    if len(set(seed_list)) != len(seed_list):
        raise ValueError(f"seeds: must be distinct, got {seed_list}")
    plan = resolve(p)  # once: every later step receives its part of the plan
    check_fits(plan)
    n_workers = plan.execution.workers if workers is None else workers
    if n_workers <= 0:
        raise ValueError(f"workers: must be positive, got {n_workers}")
    distributed = is_initialized()
    main = not distributed or _rank() == 0
    out = Path(out_dir)
    on_main(lambda: check_owned(out, plan))  # a folder compare does not own is refused before any work
    check_arms_run(plan)  # a kinds file's kind that cannot train one step is named before any arm trains
    if report:  # the report counts the earlier looks: a damaged record of them is refused before any training
        on_main(lambda: earlier_looks(out))
    # your text is tokenized (rank 0, into the cache) and checked before anything is written
    text = on_main(lambda: text_identity(plan, progress and main), share=True)
    on_main(lambda: _check_folder(out, p, text))
    if only_arms is not None and not set(only_arms) <= set(plan.arms):
        raise ValueError(f"only_arms: {sorted(set(only_arms) - set(plan.arms))} are not arms of this comparison")
    models = [m for m in plan_models(plan, seed_list, shard, shard_offset) if only_arms is None or m[1] in only_arms]
    most = max((sum(a == arm for _, a in models) for arm in plan.arms), default=0)  # one arm's models here
    k = stack_size(plan, most, n_workers, distributed)  # how this invocation trains its models, not which
    jobs = [j for j in plan_jobs(plan, seed_list, out, k, shard, shard_offset)
            if only_arms is None or j[0] in only_arms]
    source = None
    if plan.source is not None:  # the source's content decides the weights too (a path can be trained again)
        from .source import source_identity

        source = on_main(lambda: source_identity(plan.source), share=True)
    request = training_request(p, text, source, kinds=kinds_code(plan), tasks=tasks_code(plan))
    on_main(lambda: check_reuse(plan, jobs, request))  # a finished model is reused only as asked
    on_main(lambda: _record_folder(out, p, text))
    on_main(lambda: [own_folder(f, below=out) for j in jobs for f in j[2]])  # seedS/ARM: real folders, not links
    if distributed and plan.space.block("lm") is not None:  # rank 0 tokenizes the bundled corpus into the cache before the others read it
        from .stream import lm_streams

        on_main(lambda: lm_streams(text=plan.text))
    if report and main and shard is None:  # every check passed: said before the hours of training, not only after
        note = seeds_note(out, seed_list, list(plan.arms), plan.primary)
        if note:
            print(f"difftx compare: note: {note}", file=sys.stderr, flush=True)
    t0 = time.time()
    # the id of this invocation, kept with every model it trains (rank 0's is the one written)
    invocation = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(t0))}-{os.getpid()}"
    if shard is not None and main:  # the plan of this shard: from the command line alone
        names = ", ".join(f"seed{s}/{a}" for s, a in models[:8]) + (", ..." if len(models) > 8 else "")
        print(f"shard {shard[0]}/{shard[1]}: {len(models)} of the {len(seed_list) * len(plan.arms)} models of {out}"
              + (f": {names}" if models else ""), flush=True)
    wait = shard is None  # a shard skips a model another invocation holds; an assembling run waits for it
    done: dict[str, dict] = {}
    what = "" if shard is None else f", shard {shard[0]}/{shard[1]}"
    stacked = f", stacks of up to {k} seeds" if k > 1 else ""
    bar = tqdm(total=sum(len(j[1]) for j in jobs), desc=f"compare ({p.name}, {len(seed_list)} seed(s){what}{stacked})",
               disable=not (progress and main), dynamic_ncols=True, unit="model")
    if n_workers == 1 or len(jobs) <= 1 or distributed:
        with _sigterm_stops(not distributed):
            for arm, seeds_, folders in jobs:
                done.update(_job(plan, arm, seeds_, folders, progress, 1, invocation, wait, request))
                bar.update(len(seeds_))
    else:
        calls = [(plan, arm, seeds_, folders, progress, 1 + i % n_workers, invocation, wait, request)
                 for i, (arm, seeds_, folders) in enumerate(jobs)]
        _run_pool(_job, calls, n_workers, done, bar)
    bar.close()
    if shard is not None:  # the report is assembled by an invocation without --shard
        return {"shard": list(shard), "this_run": done, "wall_s": time.time() - t0}
    if not report:
        return {"this_run": done, "wall_s": time.time() - t0}

    def finish() -> CompareResult:
        from .report import write_outputs

        result = collect_results(out, p, plan, seed_list)
        result.wall_s = time.time() - t0
        result.extra["this_run"] = done
        write_outputs(out, result, progress=progress)
        return result

    return on_main(finish, share=True)
