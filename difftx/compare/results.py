"""A comparison's results: every stored part read back into a :class:`~.schema.CompareResult`, with the paired
comparisons."""

from __future__ import annotations

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
from .schema import CompareResult, RunRecord


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
        "needle_task": plan.space.block("needle").to_dict() if plan.space.block("needle") else None,
    }
    if plan.text is not None:  # your text: source, tokenizer, held-out text, token counts (from compare.json)
        extra["text"] = read_json(out / COMPARE_FILE, "the settings of a comparison").get("text")
    arms = {k: plan.arm(k).counted(runs[(int(seeds[0]), k)].train["parameters"]) for k in plan.arms}
    result = CompareResult(
        preset=preset.to_dict(), seeds=list(seeds), arms=arms,
        tasks={name: {"title": TASKS[name].title, "settings": settings_to_dict(st),
                      "metrics": [m.describe() for m in TASKS[name].metrics(st)]} for name, st in settings.items()},
        runs=runs, mixture=plan.mixture.to_dict(),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), versions=versions(), extra=extra)
    result.looks, result.look = record_looks(out, seeds, result.created)
    return add_comparisons(result, settings, plan.primary)


def earlier_looks(out: Path) -> list[dict]:
    """The looks recorded in ``out``'s ``results.json`` (``{"seeds", "date", "commit"}``, oldest first; none without
    the file; a file written before looks were recorded counts as one look at its seeds). A file that is there but
    unreadable (truncated, not JSON, not a comparison's) is refused with a ValueError naming it: it held the earlier
    looks, and counting afresh would leave the next look's p-values unadjusted. ``compare`` asks this before it
    trains anything."""
    import json

    path = out / "results.json"
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e}); it records the earlier looks at this "
                         f"comparison, whose number adjusts the next look's p-values: restore it (or move it away to "
                         f"count looks afresh, knowing that the p-values will not allow for the earlier ones)") from e
    recorded = old.get("looks") if isinstance(old, dict) else None
    if isinstance(recorded, list) and all(isinstance(x, dict) and isinstance(x.get("seeds"), list) for x in recorded):
        return recorded
    if isinstance(old, dict) and "looks" not in old and isinstance(old.get("seeds"), list):
        return [{"seeds": old["seeds"], "date": old.get("created"), "commit": None}]
    raise ValueError(f"{path}: not a comparison's results (no readable looks or seeds); it would record the earlier "
                     f"looks at this comparison: restore it, or move it away to count looks afresh")


def seeds_note(out: Path, seeds: Sequence[int], arms: Sequence[str], primary: tuple = PRIMARY) -> str:
    """One line where ``seeds`` cannot give a verdict when every pair of ``arms`` (:func:`.arms.pairs`) is compared on
    a primary metric, at the look of ``out`` this reading would be (:func:`record_looks`); "" where they can. Every
    verdict is Holm-adjusted over its family and the exact sign-flip test's smallest p is ``2 / 2^n``
    (:func:`difftx.eval.stats.seeds_for_verdict`): 3 arms need 7 seeds, 4 need 8. A comparison gated because
    neither arm learned leaves the family, so fewer may do then; a task with several primary metrics needs more."""
    from ..eval.stats import look_factor, seeds_for_verdict
    from .arms import pairs
    from .summary import ALPHA

    mine = sorted(int(s) for s in seeds)
    look = look_of(earlier_looks(out), mine)
    family = len(pairs(list(arms), primary))
    need = seeds_for_verdict(family * look_factor(look), ALPHA)
    if len(mine) >= need:
        return ""
    n, several = len(mine), family > 1
    when = (f" at look {look} of this folder (its p-values x{look_factor(look):.3g})" if look > 1 else
            " (seeds added after the folder is first read are a later look, which needs more)")
    return (f"{n} seed{'s' if n > 1 else ''} cannot give a verdict when {'all' if several else 'the'} {family} "
            f"comparison{'s' if several else ''} of the {len(arms)} arms {'are' if several else 'is'} made: {need} "
            f"seeds needed{when}")


def record_looks(out: Path, seeds: Sequence[int], now: str) -> tuple[list[dict], int]:
    """Every reading of the folder's comparison with another set of seeds, :func:`earlier_looks` with this one
    added when its seeds are new; and which of them this one is (1-based). Reading the same seeds again is the same
    look; the comparisons' p-values are multiplied by its factor (:func:`difftx.eval.stats.look_factor`: alpha spent
    over looks, 1.053 at the first, 32.9 at the second)."""
    from ..provenance import difftx_commit

    looks = earlier_looks(out)
    mine = sorted(int(s) for s in seeds)
    look = look_of(looks, mine)
    if look <= len(looks):
        return looks, look
    return looks + [{"seeds": mine, "date": now, "commit": difftx_commit()}], look


def look_of(looks: list[dict], seeds: Sequence[int]) -> int:
    """Which look (1-based) a reading of ``seeds`` is among ``looks``: an earlier one with the same seeds, else the
    next."""
    mine = sorted(int(s) for s in seeds)
    return next((i for i, x in enumerate(looks, start=1) if sorted(x["seeds"]) == mine), len(looks) + 1)


def add_comparisons(result: CompareResult, settings: dict, primary: tuple = PRIMARY) -> CompareResult:
    """``result`` (every model's training record and evaluations under ``runs``) with its paired comparisons, each
    keyed by its pair (``primary`` first: DIFF vs baseline; Holm over all of them) and ``token_efficiency``.
    ``settings``: ``{task: Settings}`` of the plan."""
    from .summary import all_comparisons, token_ratios

    result.comparisons = all_comparisons(result, settings, primary)  # Holm over every pair of arms
    result.token_efficiency = token_ratios(result, primary[1])
    return result
