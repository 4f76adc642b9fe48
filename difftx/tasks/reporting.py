"""What a task's report section reads: :class:`ReportContext` (typed access to a comparison's
results) and the small Markdown helpers every section uses."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from ..arm_table import ARM_LABELS as SHORT  # the built-in primary arms' labels
from ..arm_table import ARM_WORDS as NAMES  # and in words
from ..arm_table import PAPER_MODELS

# what a difference column holds: the mean with the 95% interval of the mean (a bounded metric), or the mean and the
# median seed difference with the interval of the median (an unbounded one: "median ... [...]")
DIFFERENCE = "mean [95%], or mean; median [95%]"


def fmt(v: Optional[float], digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


class ReportContext:
    """Read access to a comparison's results (:class:`difftx.compare.schema.CompareResult`) for report sections and
    plots: a task asks for its settings, its result for one seed and arm, and the paired comparison of a metric.
    ``arms``: the two arms of the comparison's primary pair in the order a section shows them (the baseline
    first); ``all_arms``: every arm."""

    def __init__(self, results) -> None:
        self.results = results
        self.seeds = [str(s) for s in results.seeds]
        self.arms = list(reversed(results.primary.arms))
        self.all_arms = list(results.arms)
        self.first = self.seeds[0]

    def name(self, arm: str) -> str:
        """An arm in words: "DIFF", "Transformer (baseline)", or its label (``--from``: converted, source)."""
        label = self.results.label(arm)
        return NAMES[arm] if arm in NAMES and label == SHORT[arm] else label

    def short(self, arm: str) -> str:
        return self.results.label(arm)

    def paper_arms(self, numbers: dict) -> list[tuple[str, object]]:
        """``(arm, the paper's numbers for it)`` for each shown arm that is one of the paper's two models
        (:data:`~difftx.config.PAPER_MODELS`), where ``numbers`` (a task's table of the paper's values, keyed
        ``DIFF`` and ``Transformer``) has them."""
        return [(a, numbers[PAPER_MODELS[a]]) for a in self.arms if PAPER_MODELS.get(a) in numbers]

    def two_maps(self) -> str:
        """The labels of the primary pair's arms of attention kind ``diff`` (two softmax maps), joined by "and"."""
        return " and ".join(self.short(a) for a in self.arms if self.results.arms[a].config.get("attention") == "diff")

    def settings(self, task: str) -> dict:
        return self.results.tasks[task]["settings"]

    def metric_keys(self, task: str) -> list[str]:
        """The keys of ``task``'s declared metrics, in declaration order."""
        return [m["key"] for m in self.results.tasks[task]["metrics"]]

    def result(self, task: str, arm: Optional[str] = None, seed: Optional[str] = None) -> dict:
        """One model's result of ``task`` (``{"skipped": reason}`` when it did not run; ``arm``: the primary pair's
        first unless given)."""
        return self.results.run(seed or self.first, arm or self.arms[-1]).tasks[task]

    def ran(self, task: str) -> bool:
        return all("skipped" not in self.result(task, a, s) for s in self.seeds for a in self.arms)

    def skipped(self, task: str) -> Optional[str]:
        r = self.result(task)
        return r.get("skipped")

    def train(self, arm: str, seed: Optional[str] = None) -> dict:
        return self.results.run(seed or self.first, arm).train

    def comparison(self, key: str) -> Optional[dict]:
        """The primary pair's comparison of metric ``key`` (its first arm vs its second)."""
        return self.results.primary.metrics.get(key)

    def comparisons(self, key: str) -> list[dict]:
        """Every pair's comparison of metric ``key``, the primary pair first."""
        return [c.metrics[key] for c in self.results.comparisons.values() if key in c.metrics]

    def comparison_rows(self, keys: Sequence[str], digits: Optional[int] = None) -> list[list[str]]:
        """``[label, second arm, first arm, first - second, verdict]`` for each compared metric of the primary pair
        (with the metric's own digits unless ``digits`` is given)."""
        b, a = self.arms
        rows = []
        for k in keys:
            c = self.comparison(k)
            if c is not None:
                d = digits if digits is not None else c.get("digits", 3)
                mark = "*" if c.get("bounds") else "†" if c["cis"][b][0] is not None else ""
                rows.append([c["label"], ci(c["means"][b], c["cis"][b], d) + mark,
                             ci(c["means"][a], c["cis"][a], d) + mark, pair(c, d), call(c, self.short)])
        return rows

    def comparison_table(self, keys: Sequence[str], digits: Optional[int] = None) -> str:
        rows = self.comparison_rows(keys, digits)
        if not rows:
            return ""
        note = ("\n\\* a distribution-free interval of the arm's mean (the hull with a betting interval): it holds for "
                "any distribution of the seeds inside the metric's range, and is conservative.\n"
                if any(r[1].endswith("*") for r in rows) else "")
        note += ("\n† the interval of the arm's mean assumes symmetric or roughly normal seed values (the hull of the "
                 "sign-flip and t intervals): an unbounded metric's mean has no interval that holds for every "
                 "distribution of seeds.\n" if any(r[1].endswith("†") for r in rows) else "")
        b, a = (self.short(x) for x in self.arms)
        return table(rows, ["metric", b, a, f"{a} - {b}: {DIFFERENCE}, Holm p", "verdict"]) + note


def ci(mean: Optional[float], bounds: Sequence[Optional[float]], digits: int = 3) -> str:
    if bounds[0] is None:
        return fmt(mean, digits)
    return f"{fmt(mean, digits)} [{fmt(bounds[0], digits)}, {fmt(bounds[1], digits)}]"


def interval_text(p: dict, digits: int = 3, unit: str = "", bounded: Optional[bool] = None) -> str:
    """A paired difference (a comparison's ``paired``) with the unadjusted interval of what it covers:
    ``+0.093 [+0.044, +0.150]``, the mean difference and its interval (a bounded metric: it holds the betting
    interval), or ``+0.093 nats; median +0.080 [+0.044, +0.150]``, the mean and the median seed difference with the
    interval of the median (an unbounded metric, whose mean no test holds for); the mean alone without an interval.
    A file written before intervals named their estimand (no ``interval_of``) keeps its interval, of the mean where
    ``bounded``, else ``shift [...]``: the t and sign-flip hull, which assumes symmetric seed differences."""
    u = f" {unit}" if unit else ""
    text = f"{p['mean']:+.{digits}f}{u}"
    of = p.get("interval_of") or ("mean" if bounded else "shift")
    low, high = (p.get("median_low"), p.get("median_high")) if of == "median" else (p.get("low"), p.get("high"))
    if low is None:
        return text
    ends = f"[{low:+.{digits}f}, {high:+.{digits}f}]"
    if of == "median":
        return f"{text}; median {p['median']:+.{digits}f} {ends}"
    return f"{text}; shift {ends}" if of == "shift" else f"{text} {ends}"


def decided_text(c: dict, first: str) -> Optional[str]:
    """A decided comparison in a few words (``first``: the first arm's name), or ``None`` where nothing is
    decided: "DIFF worse on average (lower in 7 of 7 seeds)" only where the mean difference is established
    (``mean_established``: a bounded metric's Holm-adjusted betting test); "not interchangeable: DIFF lower in 7 of
    7 seeds" where only the arms' exchangeability is rejected (``better`` set: the Holm-adjusted t and sign-flip
    tests), with ", though higher on average: ..." where most seeds and the mean disagree."""
    from ..eval.stats import mean_side, seeds_words  # here: the command line's parser imports this module, not torch

    p = c["paired"]
    seeds = None
    if c.get("better") and p.get("lower") is not None and p.get("n"):
        seeds = seeds_words(first, p["lower"], p["higher"], p["n"], p.get("mean"))
    if c.get("mean_established") and p.get("mean"):
        side = mean_side(p["mean"], bool(c.get("lower_is_better")))
        return f"{first} {side} on average" + ("" if seeds is None else f" ({seeds.removeprefix(first + ' ')})")
    if c.get("better"):
        return "not interchangeable" + ("" if seeds is None else f": {seeds}")
    return None


def pair(c: dict, digits: int = 3) -> str:
    """A comparison's first arm - its second with the unadjusted interval of what it covers (:func:`interval_text`),
    and the Holm-adjusted p-value."""
    from ..eval.stats import p_text  # here: the command line's parser imports this module, not torch

    p = c["paired"]
    if p["mean"] is None:
        return "-"
    adj = "" if c.get("p_adjusted") is None else f", p_adj {p_text(c['p_adjusted'], 2)}"
    if p["low"] is None:
        if "per stack" in (c.get("gated") or ""):  # one shared measurement: no interval to speak of
            return f"{p['mean']:+.{digits}f} (one measurement per stack)"
        from ..eval.stats import NO_SPREAD  # here: the command line's parser imports this module, not torch

        if NO_SPREAD in (p.get("note") or ""):  # every seed the same difference: a test, but no interval
            return f"{p['mean']:+.{digits}f} (no spread: no interval){adj}"
        return f"{p['mean']:+.{digits}f} (" + ("1 seed" if p["n"] == 1 else f"{p['n']} seeds: no interval") + ")"
    return interval_text(p, digits, bounded=c.get("bounds") is not None) + adj


def call(c: dict, short=None) -> str:
    """The verdict in a few words (:func:`decided_text`): "DIFF better / worse on average" only where the mean
    difference is established, "not interchangeable: DIFF lower in 7 of 7 seeds" where the adjusted test of
    exchangeability rejects (``short``: an arm's label)."""
    if c.get("gated"):
        if c["paired"]["mean"] is None:
            return "not measured in this run"
        if "per stack" in c["gated"]:
            return "one measurement per stack: no interval"
        if "different invocations" in c["gated"]:
            return "trained by different runs: not compared"
        return "not learned: not compared"
    from ..eval.stats import NO_SPREAD  # here: the command line's parser imports this module, not torch

    if c["paired"]["low"] is None and NO_SPREAD not in (c["paired"].get("note") or ""):
        return "no interval (1 seed)" if c["paired"]["n"] == 1 else \
            f"too few seeds for a verdict (needs {c.get('seeds_for_verdict', 6)})"
    a = c["arms"][0]
    decided = decided_text(c, short(a) if short else SHORT.get(a, a))
    if decided:
        return decided
    n, need = c["paired"]["n"], c.get("seeds_for_verdict")
    if need and n is not None and n < need:  # an interval, but too few seeds for a verdict in the family
        return f"too few seeds for a verdict ({n} of {need})"  # it said "no detectable difference"
    return "no detectable difference"

