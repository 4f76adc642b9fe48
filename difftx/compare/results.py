"""A comparison's results: every stored part read back into a :class:`~.schema.CompareResult`, with the paired
comparisons."""

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
from .arms import PRIMARY
from .schema import ArmRecord, CompareResult, RunRecord


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


def collect_results(out: Path, preset: ComparePreset, plan: ComparePlan, seeds: Sequence[int]) -> CompareResult:
    """Read every stored part back into one :class:`~.schema.CompareResult` (``results.json``, see
    ``docs/compare.md`` and :mod:`difftx.compare.schema`) and add the paired comparisons.
    ``preset`` is recorded as given; ``plan`` is what it resolved to."""
    from ..tasks import TASKS, settings_to_dict

    settings = plan.tasks
    runs: dict = {}
    for s in seeds:
        for k in plan.arms:
            f = out / f"seed{s}" / k
            evals = {e: read_eval(f / EVALS_DIR / f"{e}.json", e) for e in settings}
            runs[(int(s), k)] = RunRecord(TrainRecord.read(f).to_dict(), evals, read_machine(f))
    how = execution(plan.execution.device)
    extra = {
        # the machine that assembled this file (each model's training machine: runs.{seed}.{arm}.machine)
        "machine": machine(how["device"]),
        "execution": how,
        "needle_task": plan.space.needle.to_dict() if plan.space.needle else None,
    }
    if plan.text is not None:  # your text: source, tokenizer, held-out text, token counts (from compare.json)
        extra["text"] = read_json(out / COMPARE_FILE, "the settings of a comparison").get("text")
    arms = {}
    for k in plan.arms:
        arm = plan.arm(k)
        arms[k] = ArmRecord(k, arm.config.to_dict(), runs[(int(seeds[0]), k)].train["parameters"], arm.label,
                            arm.description, arm.source)
    result = CompareResult(
        preset=preset.to_dict(), seeds=list(seeds), arms=arms,
        tasks={name: {"title": TASKS[name].title, "settings": settings_to_dict(st),
                      "metrics": [m.describe() for m in TASKS[name].metrics(st)]} for name, st in settings.items()},
        runs=runs, mixture={**dataclasses.asdict(plan.mixture), "shares": plan.mixture.shares()},
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), versions=versions(), extra=extra)
    result.looks, result.look = record_looks(out, seeds, result.created)
    return add_comparisons(result, settings, plan.primary)


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


def add_comparisons(result: CompareResult, settings: dict, primary: tuple = PRIMARY) -> CompareResult:
    """``result`` (every model's training record and evaluations under ``runs``) with its paired comparisons, each
    keyed by its pair (``primary`` first: DIFF vs baseline; Holm over all of them) and ``token_efficiency``.
    ``settings``: ``{task: Settings}`` of the plan."""
    from .summary import all_comparisons, token_ratios

    result.comparisons = all_comparisons(result, settings, primary)  # Holm over every pair of arms
    result.token_efficiency = token_ratios(result, primary[1])
    return result
