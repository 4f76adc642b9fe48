"""Paired DIFF - baseline comparisons of every metric the registered tasks declare."""

from __future__ import annotations

import math
from typing import Optional

from ..eval.stats import mean_and_ci, paired_bootstrap, verdict
from ..tasks import TASKS


def _value(metric, result: dict) -> Optional[float]:
    if "skipped" in result:
        return None
    try:
        v = metric.get(result)
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def paired_comparisons(results: dict, settings: dict) -> dict:
    """``{metric key: {task, label, lower_is_better, unit, primary, diff: [per seed], baseline: [...],
    diff_mean/ci, baseline_mean/ci, paired, verdict}}`` over the tasks in ``settings`` (``{task:
    Settings}``); a metric missing for any model (not measured, not meaningful) is left out."""
    seeds = [str(s) for s in results["seeds"]]
    out = {}
    for name, s in settings.items():
        for m in TASKS[name].metrics(s):
            d = [_value(m, results["runs"][sd]["diff"]["tasks"][name]) for sd in seeds]
            b = [_value(m, results["runs"][sd]["baseline"]["tasks"][name]) for sd in seeds]
            if any(x is None for x in d + b):
                continue
            pair = paired_bootstrap(d, b)
            dm, dl, dh = mean_and_ci(d)
            bm, bl, bh = mean_and_ci(b)
            out[m.key] = {"task": name, **m.describe(), "diff": d, "baseline": b, "diff_mean": dm, "diff_ci": [dl, dh],
                          "baseline_mean": bm, "baseline_ci": [bl, bh], "paired": pair.to_dict(),
                          "verdict": verdict(pair, m.label, lower_is_better=m.lower_is_better, unit=m.unit)}
    return out
