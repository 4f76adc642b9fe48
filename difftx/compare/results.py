"""A comparison's results: every stored part read back into ``results.json``'s dict, with the paired comparisons."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..io import read_json
from ..provenance import machine, read_machine
from ..tasks.subject import TrainRecord
from .evaluate import EVALS_DIR, read_eval
from .folder import COMPARE_FILE
from .plan import ComparePlan
from .presets import ComparePreset
from .schema import SCHEMA, SCHEMA_VERSION


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

    settings = plan.tasks
    runs: dict = {}
    for s in seeds:
        runs[str(s)] = {}
        for k in plan.arms:
            f = out / f"seed{s}" / k
            evals = {e: read_eval(f / EVALS_DIR / f"{e}.json", e) for e in settings}
            runs[str(s)][k] = {"train": TrainRecord.read(f).to_dict(), "tasks": evals, "machine": read_machine(f)}
    first = runs[str(seeds[0])]
    how = execution(plan.execution.device)
    results = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        # the machine that assembled this file (each model's training machine: runs.{seed}.{arm}.machine)
        "machine": machine(how["device"]),
        "execution": how,
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
    results["looks"], results["look"] = record_looks(out, seeds, results["created"])
    return add_comparisons(results, settings)


def record_looks(out: Path, seeds: Sequence[int], now: str) -> tuple[list[dict], int]:
    """Every reading of the folder's comparison with another set of seeds (``{"seeds", "date", "commit"}``, oldest
    first), from the ``results.json`` already there, with this one added when its seeds are new; and which of them
    this one is (1-based). A file written before looks were recorded counts as one look at its seeds; an unreadable
    one as none. Reading the same seeds again is the same look; the comparisons' p-values are multiplied by its
    number (:func:`difftx.eval.stats.look_adjusted`)."""
    import json

    from ..provenance import difftx_commit

    looks: list[dict] = []
    try:
        old = json.loads((out / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict):
        recorded = old.get("looks")
        if isinstance(recorded, list) and all(isinstance(x, dict) and isinstance(x.get("seeds"), list)
                                              for x in recorded):
            looks = recorded
        elif isinstance(old.get("seeds"), list):
            looks = [{"seeds": old["seeds"], "date": old.get("created"), "commit": None}]
    mine = sorted(int(s) for s in seeds)
    for i, x in enumerate(looks, start=1):
        if sorted(x["seeds"]) == mine:
            return looks, i
    return looks + [{"seeds": mine, "date": now, "commit": difftx_commit()}], len(looks) + 1


def add_comparisons(results: dict, settings: dict) -> dict:
    """``results`` (every model's training record and evaluations under ``runs``) with its paired
    comparisons: ``comparison`` (DIFF vs baseline), ``arm_comparisons`` (every other pair; Holm over
    all of them) and ``token_efficiency``. ``settings``: ``{task: Settings}`` of the plan."""
    from .summary import all_comparisons, pair_key, token_ratios

    comparisons = all_comparisons(results, settings)  # Holm over every pair of arms
    results["comparison"] = comparisons.pop(pair_key("diff", "baseline"))
    results["arm_comparisons"] = comparisons
    results["token_efficiency"] = token_ratios(results)
    return results
