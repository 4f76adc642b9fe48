"""What a task's report section reads: :class:`ReportContext` (typed access to a comparison's
results) and the small Markdown helpers every section uses."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

REPORTED_ARMS = ("baseline", "diff")  # the two arms a report section compares, in the order it shows them
NAMES = {"diff": "DIFF", "baseline": "Transformer (baseline)"}
SHORT = {"diff": "DIFF", "baseline": "baseline"}
DIFF_HEADER = "DIFF - baseline [unadjusted 95%], Holm p"


def fmt(v: Optional[float], digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


class ReportContext:
    """Read access to ``results.json`` for report sections and plots: a task asks for its
    settings, its result for one seed and arm, and the paired comparison of a metric."""

    def __init__(self, results: dict) -> None:
        self.results = results
        self.seeds = [str(s) for s in results["seeds"]]
        self.arms = [a for a in REPORTED_ARMS if a in results["arms"]]
        self.first = self.seeds[0]

    def settings(self, task: str) -> dict:
        return self.results["tasks"][task]["settings"]

    def metric_keys(self, task: str) -> list[str]:
        """The keys of ``task``'s declared metrics, in declaration order."""
        return [m["key"] for m in self.results["tasks"][task]["metrics"]]

    def result(self, task: str, arm: str = "diff", seed: Optional[str] = None) -> dict:
        """One model's result of ``task`` (``{"skipped": reason}`` when it did not run)."""
        return self.results["runs"][seed or self.first][arm]["tasks"][task]

    def ran(self, task: str) -> bool:
        return all("skipped" not in self.result(task, a, s) for s in self.seeds for a in self.arms)

    def skipped(self, task: str) -> Optional[str]:
        r = self.result(task)
        return r.get("skipped")

    def train(self, arm: str, seed: Optional[str] = None) -> dict:
        return self.results["runs"][seed or self.first][arm]["train"]

    def comparison(self, key: str) -> Optional[dict]:
        return self.results["comparison"].get(key)

    def comparison_rows(self, keys: Sequence[str], digits: Optional[int] = None) -> list[list[str]]:
        """``[label, baseline, DIFF, DIFF - baseline, verdict]`` for each compared metric (with the
        metric's own digits unless ``digits`` is given)."""
        rows = []
        for k in keys:
            c = self.comparison(k)
            if c is not None:
                d = digits if digits is not None else c.get("digits", 3)
                mark = "*" if c.get("bounds") else ""
                rows.append([c["label"], ci(c["baseline_mean"], c["baseline_ci"], d) + mark,
                             ci(c["diff_mean"], c["diff_ci"], d) + mark, pair(c, d), call(c)])
        return rows

    def comparison_table(self, keys: Sequence[str], digits: Optional[int] = None) -> str:
        rows = self.comparison_rows(keys, digits)
        if not rows:
            return ""
        note = ("\n\\* a distribution-free interval (the hull with a betting interval): it holds for any "
                "distribution of the seeds inside the metric's range, and is conservative.\n"
                if any(r[1].endswith("*") for r in rows) else "")
        return table(rows, ["metric", "baseline", "DIFF", DIFF_HEADER, "verdict"]) + note


def ci(mean: Optional[float], bounds: Sequence[Optional[float]], digits: int = 3) -> str:
    if bounds[0] is None:
        return fmt(mean, digits)
    return f"{fmt(mean, digits)} [{fmt(bounds[0], digits)}, {fmt(bounds[1], digits)}]"


def pair(c: dict, digits: int = 3) -> str:
    """``mean [low, high]`` of DIFF - baseline (the unadjusted interval), with the Holm-adjusted p-value."""
    p = c["paired"]
    if p["mean"] is None:
        return "-"
    if p["low"] is None:
        if "per stack" in (c.get("gated") or ""):  # one shared measurement: no interval to speak of
            return f"{p['mean']:+.{digits}f} (one measurement per stack)"
        return f"{p['mean']:+.{digits}f} (" + ("1 seed" if p["n"] == 1 else f"{p['n']} seeds: no interval") + ")"
    adj = "" if c.get("p_adjusted") is None else f", p_adj {c['p_adjusted']:.2g}"
    return f"{p['mean']:+.{digits}f} [{p['low']:+.{digits}f}, {p['high']:+.{digits}f}]{adj}"


def call(c: dict) -> str:
    """The verdict in a word or three: DIFF better / worse only where the adjusted test rejects."""
    if c.get("gated"):
        if c["paired"]["mean"] is None:
            return "not measured in this run"
        if "per stack" in c["gated"]:
            return "one measurement per stack: no interval"
        if "different invocations" in c["gated"]:
            return "trained by different runs: not compared"
        return "not learned: not compared"
    if c["paired"]["low"] is None:
        return "no interval (1 seed)" if c["paired"]["n"] == 1 else \
            f"too few seeds for a verdict (needs {c.get('seeds_for_verdict', 6)})"
    if c.get("better") is None:
        return "no detectable difference"
    return "DIFF better" if c["better"] == "diff" else "DIFF worse"

