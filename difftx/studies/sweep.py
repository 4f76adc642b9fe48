"""A budget check of a comparison: the same compare at several values of one preset field (the
learning rate first of all), each in its own folder, and one table that says how much the verdict
depends on that choice.

``run_sweep(preset, "lr", [1e-3, 3e-3, 6e-3], seeds, out)`` runs ``run_compare`` into
``out/lr=0.001`` etc. (each resumable on its own) and writes ``out/sweep.md`` and
``out/sweep.json``: per value, the primary metrics of each arm of the primary pair (mean over seeds with its
interval) and their paired difference (DIFF - baseline by default); then each of the two arms at its own best
value (by the first primary metric, held-out LM NLL where it exists) and the paired difference between those
two. Choosing the best value on the same evaluation makes that last difference optimistic for both arms alike;
it is a sensitivity check, not a tuned result.

Sweeping ``lr`` scales ``min_lr`` with it (the preset's ratio), so the schedule keeps its shape.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..io import atomic_write, dumps_strict
from ..provenance import machine
from ..eval.stats import paired_estimate
from ..compare.arms import LABELS, PRIMARY
from ..compare.presets import get_preset, lr_overrides
from .tune_report import label


def sweep_overrides(preset: str, field: str, value, overrides: dict) -> dict:
    """The overrides of one point of the sweep (``lr`` brings ``min_lr`` along, in proportion; ``model.FIELD`` sets
    that field of the preset's model)."""
    if field.startswith("model."):
        return {**overrides, "model": {**overrides.get("model", {}), field[len("model."):]: value}}
    out = {**overrides, field: value}
    if field == "lr" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise ValueError(f"--sweep lr: every value must be a number, got {value!r}")
    if field == "lr" and "min_lr" not in overrides:
        out.update(lr_overrides(get_preset(preset, **overrides), value))
    return out


def run_sweep(preset: str, field: str, values: Sequence, seeds: int | Sequence[int], out_dir: str | os.PathLike, *,
              progress: bool = True, workers: int | None = None, **overrides) -> dict:
    """Run the comparison at every value of ``field`` and summarise (see the module doc)."""
    from ..compare.run import run_compare
    from ..compare.workers import refuse_in_worker_start

    refuse_in_worker_start("run_sweep")
    if not values or len(set(values)) != len(values):
        raise ValueError(f"--sweep {field}: need distinct values, got {list(values)}")
    if field in overrides or field.startswith("model.") and field[len("model."):] in overrides.get("model", {}):
        raise ValueError(f"--sweep {field}: also given with --set; give it in one place")
    points = [(v, sweep_overrides(preset, field, v, overrides)) for v in values]
    for _, o in points:  # every point's preset is validated before the first is trained
        get_preset(preset, **o)
    out = Path(out_dir)
    results = {}
    for v, o in points:
        results[v] = run_compare(preset, seeds, out / label(field, v), progress=progress, workers=workers, **o)
    summary = summarise(field, results)
    summary["machine"] = machine(get_preset(preset, **points[0][1]).device)  # each point's results.json: its own
    atomic_write(out / "sweep.json", lambda p: Path(p).write_text(dumps_strict(summary, indent=1) + "\n"))
    atomic_write(out / "sweep.md", lambda p: Path(p).write_text(render_sweep(summary)))
    return summary


def summarise(field: str, results: dict) -> dict:
    """``{field, points: [{value, metrics: {key: {label, lower_is_better, gated, bounds, ARM: [mean, low, high]
    per arm, paired, per_seed: {ARM: values}}}}], best}`` over the primary pair's two arms (``diff`` and
    ``baseline`` by default), its second arm first (:func:`shown_arms`); ``paired``: the first minus the second
    (``results``: ``{value: CompareResult}``)."""
    points = []
    for v, res in results.items():
        metrics, shown = {}, res.primary.arms[::-1]
        for key, c in res.primary.metrics.items():
            if c["primary"]:
                metrics[key] = {"label": c["label"], "lower_is_better": c["lower_is_better"], "gated": c["gated"],
                                "bounds": c.get("bounds"), **{a: [c["means"][a], *c["cis"][a]] for a in shown},
                                "paired": c["paired"], "per_seed": {a: c["values"][a] for a in shown}}
        points.append({"value": v, "metrics": metrics})
    keys = [k for k in ("lm_nll", "needle_mean", "needle_learned_step")
            if all(k in p["metrics"] and not p["metrics"][k]["gated"] for p in points)]
    best = None
    if keys:
        key = keys[0]
        sign = 1 if points[0]["metrics"][key]["lower_is_better"] else -1
        shown = list(points[0]["metrics"][key]["per_seed"])
        pick = {a: min(points, key=lambda p: sign * p["metrics"][key][a][0]) for a in shown}
        d, b = (pick[a]["metrics"][key]["per_seed"][a] for a in shown[::-1])
        bounds = points[0]["metrics"][key].get("bounds")
        est = paired_estimate(d, b, bounds=None if bounds is None else tuple(bounds)) if len(d) == len(b) else None
        best = {"metric": key, "label": points[0]["metrics"][key]["label"],
                "value": {a: pick[a]["value"] for a in shown},
                "mean": {a: pick[a]["metrics"][key][a][0] for a in shown},
                "paired": None if est is None else est.to_dict()}
    return {"field": field, "points": points, "best": best}


def _ci(triple) -> str:
    m, lo, hi = triple
    if m is None:
        return "-"
    return f"{m:.3f}" if lo is None else f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def shown_arms(s: dict) -> tuple[str, str]:
    """The primary pair of a ``sweep.json`` (``s``) in the order it shows them, its second arm first (as each
    metric's ``per_seed`` holds them); the default pair where the sweep has no primary metric."""
    m = next((m for p in s["points"] for m in p["metrics"].values()), None)
    return tuple(PRIMARY[::-1] if m is None else m["per_seed"])


def render_sweep(s: dict) -> str:
    field = s["field"]
    second, first = shown_arms(s)
    names = {a: LABELS.get(a, a) for a in (second, first)}
    pair = f"{names[first]} - {names[second]}"
    out = [f"# Sensitivity of the comparison to `{field}`\n",
           f"Each row is a whole `difftx compare` (its folder `{field}=VALUE/` has the full report). Means over "
           f"seeds with 95% intervals where the seeds support one; {pair} paired by seed, with its "
           "unadjusted 95% interval from 6 seeds on (`docs/compare.md`, Statistics).\n"]
    for key in dict.fromkeys(k for p in s["points"] for k in p["metrics"]):
        rows = []
        for p in s["points"]:
            m = p["metrics"].get(key)
            if m is None:
                continue
            pr = m["paired"]
            diff = ("not learned: not compared" if m["gated"] else
                    f"{pr['mean']:+.3f}" + ("" if pr["low"] is None else f" [{pr['low']:+.3f}, {pr['high']:+.3f}]"))
            rows.append(f"| {p['value']:g} | {_ci(m[second])} | {_ci(m[first])} | {diff} |"
                        if isinstance(p["value"], float) else
                        f"| {p['value']} | {_ci(m[second])} | {_ci(m[first])} | {diff} |")
        label = next(p["metrics"][key]["label"] for p in s["points"] if key in p["metrics"])
        out += [f"## {label}\n", f"| {field} | {names[second]} | {names[first]} | {pair} |", "|---|---|---|---|",
                *rows, ""]
    b = s["best"]
    if b:
        pr = b["paired"]
        gap = "-" if pr is None else (f"{pr['mean']:+.3f}" + ("" if pr["low"] is None else
                                                             f" [{pr['low']:+.3f}, {pr['high']:+.3f}]"))
        out.append(f"**Each arm at its own best `{field}`** (by {b['label']}): {names[second]} at "
                   f"{b['value'][second]} ({b['mean'][second]:.3f}), {names[first]} at {b['value'][first]} "
                   f"({b['mean'][first]:.3f}); {pair} {gap} (paired by seed). The best value was chosen on the same "
                   "evaluation, for both arms alike: a sensitivity check, not a tuned result.\n")
    return "\n".join(out)
