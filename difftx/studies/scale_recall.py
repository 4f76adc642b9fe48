"""``difftx scale`` on comparisons that train associative recall without LM batches (``recall-scale-cpu``, or
``recall-cpu`` with ``--sizes``): the sizes are a map of depth and width, not a parameter-efficiency fit. There is
no loss to fit, so no floor fit and no rule that the sizes grow in parameters.

Per size and arm, :func:`recall_summary` reads out of the size's ``results.json`` the compare's own comparisons
(:mod:`difftx.compare.summary`) of three readings of the ``recall`` task: the frontier (mean accuracy over the
plain-MQAR cells), the step at which recall was learned (the first probe at or above ``learned_at``; a model that
never got there counts as its last probe step) and the last layer's attention mass on the binding a query asks
for. Each arm has its mean with its interval over seeds, and its paired difference from the baseline with the
interval, the Holm-adjusted p-value and the verdict of that size's compare (Holm within each size's comparison,
not across sizes). Nothing is estimated here: every number is the compare's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..compare.arms import LABELS, pairs
from ..compare.schema import CompareResult
from ..compare.summary import adjusted_p_text, difference_text, short_verdict

# (name in scale.json, the recall task's metric key, the column name in scale.md)
READINGS = (("frontier", "recall_frontier", "frontier"),
            ("learned_step", "recall_learned_step", "learned at (steps)"),
            ("attention_on_binding", "recall_attention_on_binding", "attention on the binding"))
KEEP = ("arms", "key", "label", "unit", "digits", "lower_is_better", "gated", "p_adjusted", "better", "verdict",
        "seeds_for_verdict", "family", "bounds", "mean_established", "mean_better")
METHOD = ("Each reading is the recall task's (`docs/compare.md`, \"Associative recall\"): the frontier is a model's "
          "mean accuracy over the plain-MQAR cells; learned at, the first probe during training whose accuracy "
          "reaches `learned_at` (a model that never did counts as its last probe step: censored); attention on the "
          "binding, the last layer's attention mass on the key and value a query asks for. Mean over seeds with its "
          "95% interval per arm, and the arm minus the baseline paired over seeds with its unadjusted 95% interval, "
          "Holm-adjusted p and verdict, all read out of the size's `results.json` (Holm within each size's compare, "
          "not across sizes).")
MAP = ("The sizes are a map of depth and width, not a parameter-efficiency fit: no loss is fitted, and the sizes "
       "need not grow in parameters.")


def against_reference(arms, primary: tuple) -> list[str]:
    """The arms measured against the reference, the primary pair's second arm: every other arm, the primary's first
    arm first (as :func:`difftx.compare.arms.pairs` pairs them)."""
    return [a for a, b in pairs(arms, primary) if b == primary[1]]


def primary_pair(s: dict) -> tuple[str, str]:
    """The primary pair of a ``scale.json`` (``s``): the arms measured against the reference (``gap``, or per size
    ``vs_baseline`` in a recall scale) are every arm but the reference, the primary's first arm first."""
    measured = list(s["gap"]) if "gap" in s else list(next(iter(s["recall"]["sizes"].values()))["vs_baseline"])
    return measured[0], next(a for a in s["arms"] if a not in measured)


def comparison(res: CompareResult, arm: str, key: str, against: str) -> Optional[dict]:
    """The compare's comparison of metric ``key`` for ``arm`` against the arm ``against`` (``None`` when the
    compare has none: a reading not measured for some model, or no such pair)."""
    pair = res.pair(arm, against)
    return None if pair is None else pair.metrics.get(key)


def _arm_reading(c: dict, arm: str) -> dict:
    return {"mean": c["means"][arm], "low": c["cis"][arm][0], "high": c["cis"][arm][1], "values": c["values"][arm]}


def _difference(c: dict) -> dict:
    """What scale keeps of a comparison: enough for :func:`difference_text` and :func:`short_verdict` to read it
    as they read the compare's, with the seeds' own differences."""
    a, b = c["arms"]
    paired = {k: c["paired"].get(k) for k in ("mean", "low", "high", "p_value", "n", "n_examples", "method", "note",
                                              "lower", "higher", "interval_of", "median", "median_low", "median_high")}
    values = [None if x is None or y is None else x - y for x, y in zip(c["values"][a], c["values"][b])]
    out = {**{k: c.get(k) for k in KEEP}, "paired": paired, "values": values}
    out["short_verdict"] = short_verdict(out)
    return out


def learned_steps(res: CompareResult, arm: str) -> Optional[list]:
    """Per seed, the step at which the model learned recall (``None`` for a seed that did not by its last probe);
    ``None`` without probes."""
    got = []
    for s in res.seeds:
        learning = (res.run(s, arm).tasks.get("recall") or {}).get("learning")
        if not learning:
            return None
        got.append(learning.get("learned_step"))
    return got


def _learned(res: CompareResult, arm: str) -> Optional[list]:
    """Per seed, whether the model learned recall by its last probe (``None`` without probes)."""
    steps = learned_steps(res, arm)
    return None if steps is None else [x is not None for x in steps]


def recall_by_size(names: list, results: dict) -> dict:
    """``{size: {"arms": {arm: {reading: {mean, low, high, values} | None}}, "vs_baseline": {arm: {reading:
    comparison | None}}, "learned": {arm: [bool per seed] | None}}}`` from each size's results
    (``results[size]``: its results, a :class:`~.schema.CompareResult`). ``vs_baseline``: every arm against the
    reference, the second arm of the size's primary pair (the baseline by default), the primary's first arm
    first (:func:`difftx.studies.scale.primary_pair` reads the pair back)."""
    out = {}
    for name in names:
        res = results[name]
        arms = list(res.arms)
        ref = res.primary.arms[1]
        per_arm: dict = {a: {} for a in arms}
        vs: dict = {}
        for a in against_reference(arms, res.primary.arms):
            vs[a] = {}
            for reading, key, _ in READINGS:
                c = comparison(res, a, key, ref)
                vs[a][reading] = None if c is None else _difference(c)
                if c is not None:
                    for x in (a, ref):
                        per_arm[x].setdefault(reading, _arm_reading(c, x))
        out[name] = {"arms": {a: {r: per_arm[a].get(r) for r, _, _ in READINGS} for a in arms}, "vs_baseline": vs,
                     "learned": {a: _learned(res, a) for a in arms}}
    return out


def recall_summary(sizes: list[dict], results: dict, seeds: list) -> dict:
    """``scale.json``'s content for a recall scale (``kind`` "recall"): ``sizes`` (as :mod:`difftx.studies.scale`
    writes them), ``recall`` (``readings``: each reading's metric and label; ``sizes``: :func:`recall_by_size`)."""
    from ..compare.schema import SCALE_SCHEMA, SCALE_VERSION

    names = [z["name"] for z in sizes]
    arms = list(results[names[0]].arms)
    by_size = recall_by_size(names, results)
    labels = {}
    for reading, key, _ in READINGS:
        found = next((c for z in by_size.values() for per in z["vs_baseline"].values()
                      for r, c in per.items() if r == reading and c), None)
        labels[reading] = {"metric": key, "label": found["label"] if found else None}
    return {"schema": SCALE_SCHEMA, "schema_version": SCALE_VERSION, "kind": "recall", "seeds": seeds, "arms": arms,
            "sizes": sizes, "recall": {"readings": labels, "sizes": by_size}, "note": MAP}


# -- scale.md ---------------------------------------------------------------------------------------------


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _size_title(z: dict) -> str:
    width = f" of width {z['head_width']}" if z.get("head_width") else ""
    return f"{z['name']} (dim {z['dim']}, {_count(z['n_layers'], 'layer')}, {_count(z['n_heads'], 'DIFF head')}{width})"


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def recall_opening(s: dict) -> str:
    """``scale.md``'s answer: per arm, at which sizes its frontier lies above or below the reference's (the
    primary pair's second arm, the baseline by default), with the difference and the verdict of each size's
    compare."""
    parts = []
    primary = primary_pair(s)
    ref = primary[1]
    above = f"above the {ref}'s at"
    for arm in against_reference(s["arms"], primary):
        where: dict = {above: [], "below it at": [], "equal to it at": []}
        apart: dict = {}  # why not compared: [sizes]
        for z in s["sizes"]:
            d = s["recall"]["sizes"][z["name"]]["vs_baseline"][arm]["frontier"]
            mean = None if d is None else d["paired"]["mean"]
            if d is None or d.get("gated") or mean is None:
                why = "not measured" if d is None else short_verdict(d).removeprefix("not compared: ")
                apart.setdefault(why, []).append(z["name"])
                continue
            side = above if mean > 0 else "below it at" if mean < 0 else "equal to it at"
            where[side].append(f"{z['name']} ({difference_text(d)}: {short_verdict(d)})")
        clauses = [f"{k} {_join(v)}" for k, v in where.items() if v]
        clauses += [f"not compared at {_join(v)} ({why})" for why, v in apart.items()]
        parts.append(f"{arm}'s frontier is " + "; ".join(clauses))
    n = len(s["seeds"])
    return (f"**Recall frontier against the {ref}, by size:** " + "; ".join(parts) + ". "
            f"Differences are the arm minus the {ref} in mean accuracy over the plain-MQAR cells, paired over "
            f"{_count(n, 'seed')}, with unadjusted 95% intervals; verdicts are Holm-adjusted within each size's "
            "compare, not across sizes.\n")


def _arm_text(r: Optional[dict], digits: int) -> str:
    if r is None or r["mean"] is None:
        return "-"
    d = max(digits, 0)
    ci = "" if r["low"] is None else f" [{r['low']:,.{d}f}, {r['high']:,.{d}f}]"
    return f"{r['mean']:,.{d}f}{ci}"


def size_table(s: dict, z: dict) -> str:
    """One size's table: per reading and arm, the mean [95%] and the arm minus the reference (the primary pair's
    second arm) with its verdict."""
    got, ref = s["recall"]["sizes"][z["name"]], primary_pair(s)[1]
    rows = []
    for reading, _, column in READINGS:
        digits = 0 if reading == "learned_step" else 3
        for arm in s["arms"]:
            mean = _arm_text(got["arms"][arm][reading], digits)
            learned = got["learned"].get(arm)
            if reading == "learned_step" and learned is not None:
                mean += f" (learned: {sum(learned)} of {len(learned)} seeds)"
            d = None if arm == ref else got["vs_baseline"][arm][reading]
            if arm == ref:
                cells = ["", "", ""]
            elif d is None:
                cells = ["-", "-", "not measured"]
            else:
                cells = [difference_text(d), adjusted_p_text(d), short_verdict(d)]
            rows.append(f"| {column} | {arm} | {mean} | " + " | ".join(cells) + " |")
    head = f"| reading | arm | mean [95%] | arm - {ref} [95%] | Holm p | verdict |\n|---|---|---|---|---|---|\n"
    params = ", ".join(f"{a} {n:,}" for a, n in z["params"].items())
    return (f"## {_size_title(z)}\n\nNon-embedding parameters: {params}; {z['steps']:,} training steps. "
            f"`size={z['name']}/report.md` has the whole compare (every cell of the recall grid).\n\n"
            + head + "\n".join(rows) + "\n")


def render_recall_scale(s: dict) -> str:
    """``scale.md`` of a recall scale: the answer, a table per size, the regime, the plot."""
    from ..compare.regime import regime_table

    first, ref = primary_pair(s)
    out = [f"# {LABELS.get(first, first)} vs {ref} on associative recall across depth and width\n", recall_opening(s),
           f"Each size is a whole `difftx compare` of {len(s['seeds'])} paired seed(s). {MAP} {METHOD}\n"]
    out += [size_table(s, z) for z in s["sizes"]]
    # the regime without its LM tokens per parameter: a recall scale trains none
    out.append(regime_table([{**z, "regime": {a: {**r, "tokens_per_param": None} for a, r in z["regime"].items()}}
                              for z in s["sizes"]]))
    if s.get("plot"):
        out.append(f"![recall frontier and learning step against depth]({s['plot']})\n")
    return "\n".join(x for x in out if x)


def recall_lines(s: dict) -> list[str]:
    """What ``difftx scale`` prints of a recall scale: per size and arm, the frontier against the reference's (the
    primary pair's second arm)."""
    lines, ref = [], primary_pair(s)[1]
    for z in s["sizes"]:
        got = s["recall"]["sizes"][z["name"]]
        base = _arm_text(got["arms"][ref]["frontier"], 3)
        for arm, per in got["vs_baseline"].items():
            d = per["frontier"]
            diff = "not measured" if d is None else f"{difference_text(d)}: {short_verdict(d)}"
            lines.append(f"  {arm} at {z['name']}: frontier {_arm_text(got['arms'][arm]['frontier'], 3)} ({ref} "
                         f"{base}); {arm} - {ref} {diff}")
    return lines


# -- scale.png --------------------------------------------------------------------------------------------


def plot_recall_scale(path: Path, s: dict) -> Optional[str]:
    """``scale.png`` of a recall scale: the frontier and the learned step against depth, per arm (mean over seeds
    with its 95% interval); the sizes at the most common width joined by a line, a size of another width drawn
    apart (its own marker, labelled with its width). ``None`` without matplotlib."""
    try:
        from ..eval.plots import _color, _plt, _save
        _plt()
    except ImportError:
        return None
    widths = [z["dim"] for z in s["sizes"]]
    main = max(widths, key=lambda w: (widths.count(w), -widths.index(w)))
    markers = {w: m for w, m in zip(sorted(set(widths) - {main}), "s^Dv<>p*")}
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("frontier", "recall frontier (mean accuracy, plain MQAR)"),
              ("learned_step", "steps until recall was learned (censored)"))
    drawn = False
    depths = sorted({z["n_layers"] for z in s["sizes"]})
    for ax, (reading, ylabel) in zip(axes, panels):
        for i, arm in enumerate(s["arms"]):
            color = _color(arm, i)
            shift = 2 ** (0.04 * (i - (len(s["arms"]) - 1) / 2))  # arms side by side at each depth (log axis)
            pts = []
            for z in s["sizes"]:
                r = s["recall"]["sizes"][z["name"]]["arms"][arm][reading]
                if r is not None and r["mean"] is not None:
                    pts.append((z, r))
            line = sorted(((z["n_layers"] * shift, r) for z, r in pts if z["dim"] == main), key=lambda p: p[0])
            if line:
                ax.plot([x for x, _ in line], [r["mean"] for _, r in line], marker="o", color=color,
                        label=f"{arm}, width {main}")
                drawn = True
            for z, r in pts:
                if r["low"] is not None:
                    ax.vlines(z["n_layers"] * shift, r["low"], r["high"], color=color, alpha=0.4)
                if z["dim"] != main:
                    ax.scatter([z["n_layers"] * shift], [r["mean"]], marker=markers[z["dim"]], color=color, s=46,
                               facecolors="none", label=f"{arm}, width {z['dim']} ({z['name']})")
                    drawn = True
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.minorticks_off()
        ax.set_xlim(depths[0] / 1.3, depths[-1] * 1.3)
        ax.set_xlabel("layers")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return None
    axes[0].legend(fontsize=7)
    fig.suptitle("Associative recall against depth (mean over seeds, 95% intervals)", fontsize=10)
    _save(fig, path)
    return path.name
