"""``run_compare``: train DIFF and its matched baseline over paired seeds, evaluate both, and
write ``results.json``, ``report.md`` and plots. Resumable: each finished part (one model's
training, one evaluation of one model) is a file in the output folder and is not redone, and an
unfinished training continues from its last checkpoint.

Under ``torchrun`` (more than one process) the models are trained one at a time, each by every
process (data parallel, :func:`difftx.training.train`); rank 0 alone evaluates and writes the
outputs while the others wait.

Layout of ``out_dir``::

    compare.json                      the preset and seeds of this folder (a re-run must match)
    seed{S}/{diff,baseline}/model/    the trained model (difftx checkpoint: load_model reads it)
    seed{S}/{diff,baseline}/train/    the trainer's run folder (metrics.jsonl; checkpoints until trained)
    seed{S}/{diff,baseline}/train.json   loss history, lambda over training, wall/CPU time
    seed{S}/{diff,baseline}/evals/{task}.json  one file per registered task (difftx.tasks.TASKS)
    results.json  report.md  plots/*.png
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..checkpoint import atomic_write
from ..training.distributed import broadcast_object, on_main
from .evaluate import evaluate_model, evaluations
from .plan import ComparePlan
from .presets import ComparePreset, get_preset
from .schema import SCHEMA, SCHEMA_VERSION, check_version, dumps_strict
from .train import train_model

# preset fields a resume may change: how a comparison runs, not what it computes, and which arms it
# trains (each arm's models live in their own folders)
EXECUTION_FIELDS = ("workers", "threads", "device", "description", "arms")


def _job(plan: ComparePlan, seed: int, kind: str, folder: str, progress: bool, position: int,
         invocation: str | None = None) -> dict:
    """Train (unless finished) and evaluate (what is missing) one model; returns what was done.
    Under torchrun every rank calls it: every rank trains, rank 0 alone evaluates."""
    if plan.execution.threads:
        import torch

        torch.set_num_threads(plan.execution.threads)
    f = Path(folder)
    done = {"trained": False, "evaluated": []}
    if broadcast_object(not (f / "train.json").is_file()):  # rank 0's view decides
        train_model(kind, plan, seed, f, progress=progress, position=position, invocation=invocation)
        done["trained"] = True
    missing = broadcast_object([e for e in evaluations() if not (f / "evals" / f"{e}.json").is_file()])
    if missing:
        # evaluation receives its part of the plan alone: the task settings (and the device)
        on_main(lambda: evaluate_model(f, plan.tasks, device=plan.execution.device, progress=progress,
                                       only=tuple(missing), position=position))
        done["evaluated"] = missing
    return done


def _check_folder(out: Path, preset: ComparePreset) -> None:
    meta = out / "compare.json"
    if meta.is_file():
        try:
            data = json.loads(meta.read_text())
            old = data["preset"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{meta}: unreadable ({e}); remove it or use another --out") from None
        check_version(data, str(meta))
        new = preset.to_dict()
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in EXECUTION_FIELDS)
        if changed:
            raise ValueError(f"{meta}: this folder holds a comparison with other settings (differs in {changed}); "
                             "use another --out to keep both")
    out.mkdir(parents=True, exist_ok=True)
    text = dumps_strict({"schema_version": SCHEMA_VERSION, "preset": preset.to_dict()}, indent=1)
    atomic_write(meta, lambda p: Path(p).write_text(text + "\n"))


def run_compare(preset: str | ComparePreset = "smoke", seeds: int | Sequence[int] = 1,
                out_dir: str | os.PathLike = "runs/compare", *, progress: bool = True,
                workers: int | None = None, **overrides) -> dict:
    """Train and evaluate DIFF and its parameter-matched baseline for each seed; write
    ``results.json``, ``report.md`` and ``plots/`` into ``out_dir``; return the results.

    preset     a name of :data:`difftx.compare.presets.PRESETS` or a :class:`ComparePreset`
    seeds      K (seeds 0..K-1) or an explicit list of seeds
    workers    models trained side by side in separate processes (default: the preset's; 1 under
               torchrun, where every process trains each model in turn)
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
        return _run_compare(p, seeds, out_dir, progress=progress, workers=workers)
    finally:
        if owns_group:
            destroy_distributed()


def _run_compare(p: ComparePreset, seeds: int | Sequence[int], out_dir: str | os.PathLike, *, progress: bool,
                 workers: int | None) -> dict:
    from tqdm.auto import tqdm

    from ..training.distributed import is_initialized

    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seed_list or (isinstance(seeds, int) and seeds <= 0):
        raise ValueError(f"seeds: need a positive count or a non-empty list, got {seeds!r}")
    if len(set(seed_list)) != len(seed_list):
        raise ValueError(f"seeds: must be distinct, got {seed_list}")
    plan = p.resolve()  # once: every later step receives its part of the plan
    n_workers = plan.execution.workers if workers is None else workers
    if n_workers <= 0:
        raise ValueError(f"workers: must be positive, got {n_workers}")
    distributed = is_initialized()
    main = not distributed or _rank() == 0
    out = Path(out_dir)
    on_main(lambda: _check_folder(out, p))
    if distributed and plan.space.lm:  # rank 0 tokenizes the bundled corpus into the cache before the others read it
        from .stream import lm_streams

        on_main(lm_streams)
    t0 = time.time()
    # the id of this invocation, kept with every model it trains (rank 0's is the one written)
    invocation = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(t0))}-{os.getpid()}"
    jobs = [(s, k, str(out / f"seed{s}" / k)) for s in seed_list for k in plan.arms]
    done: dict[str, dict] = {}
    bar = tqdm(total=len(jobs), desc=f"compare ({p.name}, {len(seed_list)} seed(s))",
               disable=not (progress and main), dynamic_ncols=True)
    if n_workers == 1 or len(jobs) == 1 or distributed:
        for s, k, f in jobs:
            done[f"seed{s}/{k}"] = _job(plan, s, k, f, progress, 1, invocation)
            bar.update()
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=min(n_workers, len(jobs)), mp_context=mp.get_context("spawn")) as ex:
            futs = {ex.submit(_job, plan, s, k, f, progress, 1 + i % n_workers, invocation): f"seed{s}/{k}"
                    for i, (s, k, f) in enumerate(jobs)}
            for fut in as_completed(futs):
                done[futs[fut]] = fut.result()
                bar.update()
    bar.close()

    def finish() -> dict:
        from .report import write_outputs

        results = collect_results(out, p, plan, seed_list)
        results["wall_s"] = time.time() - t0
        results["this_run"] = done
        write_outputs(out, results, progress=progress)
        return results

    return on_main(finish, share=True)


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
    from .summary import all_comparisons, pair_key

    settings = plan.tasks
    runs: dict = {}
    for s in seeds:
        runs[str(s)] = {}
        for k in plan.arms:
            f = out / f"seed{s}" / k
            train = _read(f / "train.json")
            runs[str(s)][k] = {"train": train, "tasks": {e: _read(f / "evals" / f"{e}.json") for e in settings}}
    first = runs[str(seeds[0])]
    results = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "execution": execution(plan.execution.device),
        "preset": preset.to_dict(),
        "seeds": list(seeds),
        "needle_task": plan.space.needle.to_dict(),
        "mixture": {**dataclasses.asdict(plan.mixture), "shares": plan.mixture.shares()},
        "arms": {k: {"config": cfg.to_dict(), "parameters": first[k]["train"]["parameters"]}
                 for k, cfg in plan.arms.items()},
        "tasks": {name: {"title": TASKS[name].title, "settings": settings_to_dict(st),
                         "metrics": [m.describe() for m in TASKS[name].metrics(st)]} for name, st in settings.items()},
        "runs": runs,
        "null_reasons": {},
    }
    comparisons = all_comparisons(results, settings)  # Holm over every pair of arms
    results["comparison"] = comparisons.pop(pair_key("diff", "baseline"))
    results["arm_comparisons"] = comparisons
    return results


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({e}); delete it to redo that part") from None
