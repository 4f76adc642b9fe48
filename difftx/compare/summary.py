"""Paired comparisons of every metric the registered tasks declare, for DIFF vs the baseline and
for every other arm (vs the baseline, and DIFF vs it): intervals over seeds (and examples, where a
metric has per-example values), learning gates, and Holm adjustment over all pairs within the
primary and the exploratory family (``docs/compare.md``, "Statistics")."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..eval.stats import (NO_SPREAD, holm, look_adjusted, look_factor, mean_interval, p_text, paired_estimate,
                          power_plan, seeds_for_mean, seeds_for_verdict, t_mean_interval, verdict)
from ..tasks import TASKS
from ..tasks.reporting import decided_text, interval_text
from .arms import LABELS, PRIMARY, pairs
from .schema import CompareResult, Comparison, pair_key

ALPHA = 0.05
POWER_MIN_SEEDS = 4  # the fewest seeds whose differences are resampled for the power sentence
NOT_LEARNED = "not learned by either model at this budget: not compared"
NOT_LEARNED_BY_BOTH = "not learned by both models at this budget: not compared"
# a machine measurement some model has no value for in this run (its training time too short)
NOT_MEASURED = "not measured in this run"
# models of one arm reused from an earlier invocation (or finished by a later one) against the other's
DIFFERENT_RUNS = "trained by different invocations (the machine is measured within one run): not compared"
# seeds trained as one stacked model share one clock: a machine measurement is one value per stack
ONE_PER_STACK = ("measured once per stack, as seeds trained as one stacked model share its clock: one measurement, "
                 "not a sample of seeds; reported per stack, not compared over seeds")


def _value(get, result: dict):
    if "skipped" in result:
        return None
    try:
        return get(result)
    except (KeyError, TypeError, ZeroDivisionError, IndexError):
        return None


def _finite(v) -> Optional[float]:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _examples(metric, results: list[dict]) -> Optional[tuple[np.ndarray, list[str]]]:
    """``(seeds, examples)`` values of one arm and the examples' gate keys, if the metric has them
    and every seed has the same number."""
    if metric.per_example is None:
        return None
    rows = [_value(metric.per_example, r) for r in results]
    if any(r is None for r in rows) or len({len(r) for r in rows}) != 1 or not rows[0]:
        return None
    groups = _value(metric.groups, results[0]) if metric.groups else None
    return np.asarray(rows, dtype=np.float64), (groups or [metric.key] * len(rows[0]))


def all_comparisons(result: CompareResult, settings: dict, primary: tuple = PRIMARY,
                    power: bool = True) -> dict[str, Comparison]:
    """``{"A vs B": Comparison}`` for every pair of :func:`.arms.pairs` of the arms in ``result`` (``primary``
    first), each metric of a pair with its per-seed values of both arms (``values``), each arm's mean with its interval
    (``means``, ``cis``), the paired estimate of A - B (``paired``), the learning gate (``gated``:
    ``None`` or why it was not compared), the Holm-adjusted p-value within its family over *every*
    pair (``family``: primary or exploratory; times the factor of this reading of the folder, ``look_factor``:
    :func:`difftx.eval.stats.look_adjusted`, 1.053 at the first look, 32.9 at the second) and the verdict. A bounded metric also gets the mean's
    betting p-value adjusted alike (``mean_p_adjusted``), ``mean_established`` and, for a primary not established,
    ``seeds_for_mean`` (:func:`difftx.eval.stats.seeds_for_mean`).
    A metric missing for any model (not measured, not meaningful) is left out. With ``power``, each
    compared primary metric also gets ``seeds_for_power`` (:func:`difftx.eval.stats.seeds_for_power`) and
    ``power_plan``, the effect and spread it was planned for (:func:`difftx.eval.stats.power_plan`), and a bounded
    one whose mean is not established ``seeds_for_power_mean`` and ``power_plan_mean``, the same for the test of its
    mean; both planned at this look's level."""
    out = {pair_key(a, b): Comparison((a, b), _pair(result, settings, a, b), (a, b) == tuple(primary))
           for a, b in pairs(list(result.arms), primary)}
    everything = [c for comps in out.values() for c in comps.metrics.values()]
    look = int(result.look or 1)  # which reading of the folder this is: p-values x look_factor(look)
    factor = look_factor(look)
    sizes = {}
    for family in ("primary", "exploratory"):
        chosen = [c for c in everything if c["family"] == family and c["gated"] is None
                  and c["paired"]["p_value"] is not None]
        sizes[family] = len(chosen)
        for c, p in zip(chosen, holm([c["paired"]["p_value"] for c in chosen])):
            c["p_adjusted"], c["look_factor"] = look_adjusted(p, look), round(factor, 4)
        # the second estimand, the mean difference of a bounded metric: its betting p, Holm-adjusted over the same
        # family (the metrics of the family that have one)
        bounded = [c for c in chosen if c["paired"].get("betting_p") is not None]
        for c, p in zip(bounded, holm([c["paired"]["betting_p"] for c in bounded])):
            c["mean_p_adjusted"] = look_adjusted(p, look)
            c["mean_established"] = c["mean_p_adjusted"] < ALPHA
    for c in everything:
        m, est = c.pop("_metric"), c.pop("_est")
        a, b = c["arms"]
        names = (result.label(a), result.label(b))
        c["family_size"] = sizes[c["family"]]
        c["seeds_for_verdict"] = seeds_for_verdict(sizes[c["family"]] * factor, ALPHA)
        # the seeds at which the rule reaches 80% power, planned for the pessimistic end of what these seeds show
        # (primary metrics only: a simulation per comparison; from POWER_MIN_SEEDS seeds on, as fewer say too
        # little about the spread); the effect and spread planned for are kept and printed with the number
        powered = power and c["primary"] and not c["gated"] and est is not None and est.n >= POWER_MIN_SEEDS
        plan = mean_plan = None
        unsure = c["primary"] and c.get("mean_established") is False
        d = np.subtract(*(c["values"][x] for x in (a, b))) if powered or unsure else None
        if powered:  # at this look's level
            plan = power_plan(d, sizes["primary"] * factor, ALPHA, bounds=c["bounds"])
            c["seeds_for_power"], c["power_plan"] = plan.seeds, plan.to_dict()
        if unsure:  # how many seeds the mean needs, as observed
            need = seeds_for_mean(d, c["bounds"], sizes["primary"] * factor, ALPHA)  # at this look's level, and more
            c["seeds_for_mean"] = None if need is None else max(need, d.size + 1)  # than there are
            if powered:  # and planned for the pessimistic end of what these seeds show, as the verdict's
                mean_plan = power_plan(d, sizes["primary"] * factor, ALPHA, bounds=c["bounds"], estimand="mean")
                c["seeds_for_power_mean"], c["power_plan_mean"] = mean_plan.seeds, mean_plan.to_dict()
        c["verdict"] = (f"{m.label}: {c['gated']}" if c["gated"] else
                        verdict(est, m.label, lower_is_better=m.lower_is_better, adjusted_p=c["p_adjusted"],
                                alpha=ALPHA, unit=m.unit, digits=max(m.digits, 1), names=names,
                                family_size=sizes[c["family"]], power_seeds=c.get("seeds_for_power"),
                                power_checked=powered, power_plan=plan, mean_p=c.get("mean_p_adjusted"),
                                mean_seeds=c.get("seeds_for_mean"), mean_plan=mean_plan, look=look))
        ahead = None if est is None else a if (est.mean < 0) == m.lower_is_better else b  # the side of the mean
        c["better"] = None if c["gated"] or c["p_adjusted"] is None or c["p_adjusted"] >= ALPHA else ahead
        # the arm whose mean is better, where a valid test establishes the mean difference (bounded metrics only)
        c["mean_better"] = ahead if c.get("mean_established") else None
    return out


def _pair(result: CompareResult, settings: dict, a: str, b: str) -> dict:
    """The comparisons of arm ``a`` against arm ``b`` before the Holm adjustment."""
    seeds = [str(s) for s in result.seeds]
    found: list = []
    unmeasured: dict = {}
    for name, s in settings.items():
        for m in TASKS[name].metrics(s):
            per = {arm: [result.run(sd, arm).tasks[name] for sd in seeds] for arm in (a, b)}
            if m.peer:  # read against the other model of the same seed
                peers = {a: per[b], b: per[a]}
                vals = {arm: [_finite(_value(lambda r, q=q: m.get(r, q), r)) for r, q in zip(rs, peers[arm])]
                        for arm, rs in per.items()}
            else:
                vals = {arm: [_finite(_value(m.get, r)) for r in rs] for arm, rs in per.items()}
            apart = m.same_run and any(ra.get("invocation") != rb.get("invocation") for ra, rb in zip(per[a], per[b]))
            if any(v is None for arm in vals for v in vals[arm]):
                if m.same_run:  # a measurement of the machine: present, with why it has no value here
                    unmeasured[m.key] = _unmeasured(name, m, vals, seeds, a, b, DIFFERENT_RUNS if apart else None)
                continue
            ex = {arm: _examples(m, rs) for arm, rs in per.items()}
            someone = m.learned is None or any(_value(m.learned, r) for rs in per.values() for r in rs)
            stacked = m.same_run and any((r.get("stacked") or 1) > 1 for rs in per.values() for r in rs)
            bounds = _bounds(m, [r for rs in per.values() for r in rs])
            found.append((name, m, vals, ex if all(ex.values()) else None, someone,
                          DIFFERENT_RUNS if apart else ONE_PER_STACK if stacked else None, bounds))
    # learning gates first: a metric with a floor is compared only where some arm's mean clears it by its
    # t interval (about 2 SE: a screen for "learned", not a printed interval)
    learned = {"any": {}, "all": {}}
    for _, m, vals, ex, _, _, _ in found:
        if m.floor is not None:
            lows = [t_mean_interval(vals[x], None if ex is None else ex[x][0])[1] for x in (a, b)]
            above = [lo is not None and lo > m.floor for lo in lows]
            learned["any"][m.key], learned["all"][m.key] = any(above), all(above)
    out = {}
    for name, m, vals, ex, someone, machine, bounds in found:
        gated = None if learned["any"].get(m.key, True) and someone else NOT_LEARNED
        missing = NOT_LEARNED if m.gate == "any" else NOT_LEARNED_BY_BOTH
        if m.gated_by is not None and not learned[m.gate].get(m.gated_by, True):
            gated = missing
        if ex is not None and gated is None:
            keep = [learned[m.gate].get(g, True) for g in ex[a][1]]
            if not any(keep):
                gated = missing
            elif not all(keep):  # leave out the examples of cells no model learned; re-derive the seed values
                ex = {x: (ex[x][0][:, keep], [g for g, k in zip(ex[x][1], keep) if k]) for x in ex}
                vals = {x: ex[x][0].mean(1).tolist() for x in ex}
        if machine:
            gated = machine
        arrays = {x: None if ex is None else ex[x][0] for x in (a, b)}
        est = paired_estimate(vals[a], vals[b], diff_examples=arrays[a], baseline_examples=arrays[b],
                              bounds=bounds)
        arm_ci = {x: mean_interval(vals[x], arrays[x], bounds=bounds) for x in (a, b)}
        if gated == ONE_PER_STACK:  # no interval from one shared measurement
            arm_ci = {x: (arm_ci[x][0], None, None) for x in (a, b)}
            est.low = est.high = est.p_value = est.sign_flip_p = est.p_t = est.betting_p = None
            est.note = ONE_PER_STACK
        c = {"task": name, **m.describe(), "bounds": None if bounds is None else list(bounds),
             "arms": [a, b], "values": vals,
             "means": {x: arm_ci[x][0] for x in (a, b)}, "cis": {x: list(arm_ci[x][1:]) for x in (a, b)},
             "paired": est.to_dict(), "gated": gated, "family": "primary" if m.primary else "exploratory",
             "examples_used": est.n_examples, "p_adjusted": None, "_est": est, "_metric": m}
        out[m.key] = c
    return {**out, **unmeasured}


def _bounds(m, results: list[dict]) -> Optional[tuple[float, float]]:
    """The metric's range: its fixed ``bounds``, or the hull of every model's ``bounds_of``."""
    if m.bounds_of is None:
        return m.bounds
    got = [_value(m.bounds_of, r) for r in results]
    if not got or any(g is None for g in got):
        return m.bounds
    low, high = min(g[0] for g in got), max(g[1] for g in got)
    return (low, high) if high > low else m.bounds


def _unmeasured(task: str, m, vals: dict, seeds: list[str], a: str, b: str, why: Optional[str] = None) -> dict:
    """The comparison entry of a machine measurement some model has no value for in this run
    (e.g. the loss at equal wall-clock when the shorter training time ends before the other
    model's first logged loss): every number null, ``gated`` saying why (``why``: a reason that
    holds whatever the values, such as arms trained by different invocations). Whether the key
    exists, and what it says, then never depend on the machine's speed."""
    if why is None:
        missing = [f"{arm} seed {s}" for arm in (a, b) for s, v in zip(seeds, vals[arm]) if v is None]
        why = f"{NOT_MEASURED} (no value for {', '.join(missing)}: this measures the machine's timing)"
    c = {"task": task, **m.describe(), "arms": [a, b], "values": vals, "means": {a: None, b: None},
         "cis": {a: [None, None], b: [None, None]}, "gated": why, "family": "primary" if m.primary else "exploratory",
         "examples_used": 0, "p_adjusted": None, "_est": None, "_metric": m,
         "paired": {"mean": None, "low": None, "high": None, "p_value": None, "sign_flip_p": None, "n": len(seeds),
                    "n_examples": 1, "confidence": 0.95, "method": "not measured", "unadjusted_excludes_zero": False,
                    "note": why}}
    return c


def token_ratios(result: CompareResult, base: str = PRIMARY[1]) -> dict:
    """The token efficiency (paper Fig. 3b) of every arm against ``base`` (the baseline), from each model's
    held-out loss along training (``train.heldout_curve``), paired by seed:
    ``{arm: TokenEfficiency.to_dict() with the curves' tokens and mean losses}``, or ``{arm:
    {"skipped": why}}`` when a model has no curve (no LM batches, or ``curve_points = 0``)."""
    from ..eval.efficiency import token_efficiency

    curves = {arm: [result.run(s, arm).train.get("heldout_curve") for s in result.seeds] for arm in result.arms}
    out: dict = {}
    for arm in (a for a in result.arms if a != base):
        if any(c is None or len(c.get("tokens") or []) < 2 for c in curves[arm] + curves[base]):
            out[arm] = {"skipped": "no held-out loss curve (it needs LM batches and curve_points > 0)"}
            continue
        pts = {a: [_by_tokens(c) for c in curves[a]] for a in (arm, base)}
        try:
            eff = token_efficiency(pts[arm], pts[base])
        except ValueError as e:  # curves not sampled alike (e.g. models of different runs)
            out[arm] = {"skipped": f"curves cannot be paired: {e}"}
            continue
        out[arm] = {**eff.to_dict(), "loss": {a: np.mean([p[1] for p in pts[a]], 0).tolist() for a in pts},
                    "gap": gap_along_training(pts[arm], pts[base])}
    return out


def gap_along_training(arm: list[tuple[list, list]], baseline: list[tuple[list, list]]) -> list[dict]:
    """The held-out loss gap arm - baseline at every point of the curves (``(tokens, losses)`` per
    seed, paired by position) that every seed of both arms has: ``[{"tokens": t, "values": per-seed
    differences, **paired estimate}]`` (:func:`difftx.eval.stats.paired_estimate` over the seeds, as
    every compared metric: ``low`` / ``high`` the t and sign-flip hull, ``median_low`` / ``median_high`` the interval
    of the median seed difference, the one printed), so a gap that shrinks with tokens is read off with its
    interval."""
    common = set(arm[0][0])
    for tokens, _ in arm + baseline:
        common &= set(tokens)
    out = []
    for t in sorted(common):
        a = [losses[tokens.index(t)] for tokens, losses in arm]
        b = [losses[tokens.index(t)] for tokens, losses in baseline]
        est = paired_estimate(a, b).to_dict()
        out.append({"tokens": t, "values": [x - y for x, y in zip(a, b)],
                    **{k: est[k] for k in ("mean", "low", "high", "p_value", "n", "note", "interval_of", "median",
                                           "median_low", "median_high")}})
    return out


def _by_tokens(curve: dict) -> tuple[list, list]:
    """A curve as ``(tokens, losses)`` with one point per token count: with needle or ICL batches
    mixed in, the LM tokens stay put for some steps, and the last point of each count is kept (no
    point before the first LM batch)."""
    last: dict = {}
    for t, v in zip(curve["tokens"], curve["loss"]):
        if t and t > 0:
            last[t] = v
    tokens = sorted(last)
    return tokens, [last[t] for t in tokens]


# -- what a report prints of a comparison (the reasoning behind each word: docs/compare.md, "Reading a report") --


def short_verdict(c: dict, names: Optional[dict] = None) -> str:
    """A comparison's verdict in a few words: "DIFF worse on average (lower in 7 of 7 seeds)" (the first arm's name)
    only where the mean difference is established (a bounded metric's Holm-adjusted betting test), "not
    interchangeable: DIFF lower in 7 of 7 seeds" where the Holm-adjusted test of exchangeability rejects at
    ``ALPHA`` (:func:`difftx.tasks.reporting.decided_text`), "no detectable difference", "too few seeds: N of M"
    (fewer seeds than a verdict in its family needs), "no interval: N seeds", or why it was not compared. The whole
    sentence stays in ``results.json`` (``verdict``). ``names``: the arms' labels."""
    if c.get("gated"):
        return NOT_MEASURED if c["gated"].startswith(NOT_MEASURED) else f"not compared: {c['gated'].split(': ')[0]}"
    p = c["paired"]
    n, need = p.get("n"), c.get("seeds_for_verdict")
    if p.get("mean") is None:
        return NOT_MEASURED
    a = c["arms"][0]
    decided = decided_text(c, (names or LABELS).get(a, a))
    if decided:
        return decided
    if need and n is not None and n < need:
        return f"too few seeds: {n} of {need}"
    if p.get("low") is None:
        return "no interval: no spread" if NO_SPREAD in (p.get("note") or "") else \
            f"no interval: {n} seed{'s' if n != 1 else ''}"
    return "no detectable difference"


def difference_text(c: dict) -> str:
    """``+0.093 [+0.044, +0.150]``: a comparison's mean difference with the unadjusted 95% interval of the mean (a
    bounded metric), or ``+0.093 nats; median +0.080 [+0.044, +0.150]``: the mean and the median seed difference with
    the interval of the median (an unbounded metric; :func:`difftx.tasks.reporting.interval_text`); the mean alone
    where there is none; ``-`` where nothing was measured or compared."""
    p = c["paired"]
    if p.get("mean") is None or c.get("gated"):  # not compared: no difference to read
        return "-"
    d = max(int(3 if c.get("digits") is None else c["digits"]), 1)  # a whole-number metric (digits 0): one decimal
    return interval_text(p, d, c.get("unit") or "", bounded=c.get("bounds") is not None)


def mean_text(c: dict) -> str:
    """The second estimand in a few words: "established", "not yet: about N seeds" (as observed,
    :func:`difftx.eval.stats.seeds_for_mean`), "not yet" (a bounded metric); "no valid test" for a compared metric
    without bounds (no test of its mean holds for every distribution of seeds); "-" for one not compared."""
    if c.get("gated") or c["paired"].get("mean") is None:
        return "-"
    if c.get("mean_established") is None:
        return "no valid test" if c.get("bounds") is None and c["paired"].get("low") is not None else "-"
    if c["mean_established"]:
        return "established"
    return f"not yet: about {c['seeds_for_mean']} seeds" if c.get("seeds_for_mean") else "not yet"


def adjusted_p_text(c: dict) -> str:
    return "-" if c.get("p_adjusted") is None else p_text(c["p_adjusted"])


def verdict_rows(comparisons: dict, pairs_: Optional[list] = None, names: Optional[dict] = None) -> list[list[str]]:
    """Rows ``[pair, metric, difference [95%], Holm p, verdict, mean]`` of a verdict table: every primary
    comparison of each pair (``comparisons``: ``{pair: {key: comparison}}``), then the exploratory
    ones that survive Holm (or whose mean difference is established). ``names``: the arms' labels."""
    names = names or LABELS
    rows = []
    for pair in pairs_ or list(comparisons):
        comps = comparisons[pair]
        chosen = [c for c in comps.values() if c["primary"]] + [
            c for c in comps.values() if not c["primary"] and (c.get("better") or c.get("mean_established"))]
        for c in chosen:
            a, b = (names.get(x, x) for x in c["arms"])
            rows.append([f"{a} - {b}", c["label"] + ("" if c["primary"] else " (exploratory)"), difference_text(c),
                         adjusted_p_text(c), short_verdict(c, names), mean_text(c)])
    return rows
