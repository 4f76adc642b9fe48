"""``report.md``, ``results.json`` and ``plots/`` of a comparison. The assembler writes the
opening (at most three lines: which arm, by how much, how sure, in what regime), the verdict table
and one line of method (the reasoning is in ``docs/compare.md``, "Reading a report"); every other
section and plot comes from its task (:data:`difftx.tasks.TASKS`, in registry order)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..eval.stats import look_factor
from ..io import atomic_write, own_folder
from ..tasks import TASKS
from ..tasks.reporting import DIFFERENCE, ReportContext, decided_text, fmt, interval_text, table
from .regime import regime_of, render_regime
from .schema import CompareResult, model_dotted, results_json
from .summary import NOT_MEASURED, adjusted_p_text, difference_text, short_verdict, verdict_rows


VERDICT_HEADER = ["pair", "metric", f"difference: {DIFFERENCE}", "Holm p", "verdict", "mean difference"]
METHOD_LINE = ("Method, in one line: each difference is the first arm minus the second over paired seeds, its mean "
               "with the unadjusted 95% interval of the mean (a bounded metric) or of the median seed difference (an "
               "unbounded one, whose mean no test holds for); Holm p is adjusted within the primary and within the "
               "exploratory family; a verdict needs Holm p < 0.05 and says only that the two arms of a seed are not "
               "interchangeable (t and exact sign-flip tests), and on which side most seeds lie; \"better\" or "
               "\"worse\" is said only where the last column says the mean difference is established (a bounded "
               "metric's betting test, Holm-adjusted alike). What each column means and assumes: `docs/compare.md`, "
               "\"Reading a report\".\n")


@dataclass(frozen=True)
class Section:
    """A study's own section of ``report.md``, handed to :func:`write_outputs` by the study that ran the
    comparison (compare imports no study: :mod:`difftx.studies` stands above it). ``render(plots, names)``
    is its Markdown, placed right after the opening lines (``plots``: the report's ``{label: relative
    path}``; ``names``: the arms' labels); ``plot(out)`` draws its figures under ``out/plots`` as
    ``{label: path}``, when matplotlib is there."""
    render: Callable[[dict, dict], str]
    plot: Callable[[Path], dict]


def render_report(result: CompareResult, plots: dict[str, str], section: Optional[Section] = None) -> str:
    """The Markdown report: at most three lines of answer (:func:`opening`), the verdict table, one
    line of method, then the setup, the regime, the arms, and one section per task, plots. A study's
    ``section`` (:class:`Section`) follows the opening lines."""
    ctx = ReportContext(result)
    p, tune = result.preset, result.get("tune")
    C = result.primary.metrics
    every = {key: c.metrics for key, c in result.comparisons.items()}
    names = {a: r.label for a, r in result.arms.items()}
    first, second = (names[x] for x in result.primary.arms)
    title = "A converted model vs its source, fine-tuned alike" if p.get("source") else \
        "DIFF vs parameter-matched Transformer"
    out = [f"# {title}: `{p['name']}` preset"
           + (f", each arm at its own `{tune['field']}`" if tune else "") + "\n"]
    out += opening(tune["tuned"], result, tuned=tune) if tune else opening(every, result)
    if section is not None:
        out.append(section.render(plots, names))
    out.append(f"## Verdicts at the preset's `{tune['field']}` (on the usual held-out text)\n" if tune else
               "## Verdicts\n")
    out.append(table(verdict_rows(every, names=names), VERDICT_HEADER))
    found = [k for k, c in C.items() if not c["primary"] and (c.get("better") or c.get("mean_established"))]
    explored = [c for c in C.values() if not c["primary"] and not c["gated"]]
    unmeasured = [c["gated"].replace(NOT_MEASURED + " ", f"{c['label']} ") for c in C.values() if _unmeasured(c)]
    out.append(f"{len(explored)} exploratory comparisons of {first} - {second}; {len(found)} survive Holm adjustment"
               + (" (in the table)." if found else ".")
               + _not_compared(C)
               + (f" Not measured in this run: {'; '.join(unmeasured)}." if unmeasured else "") + "\n")
    if not tune:
        out.append(METHOD_LINE)
    out.append(_setup(result, ctx))
    out.append(render_regime(result.get("regime") or regime_of(result)))
    if p.get("source"):
        from .source import render_source

        out.append(render_source(result))
    if len(result.comparisons) > 1:
        out.append(render_arms(result))
    if result.token_efficiency:
        out.append(render_token_efficiency(result))
    for name, task in TASKS.items():
        if name in result.tasks:  # a task skipped on every model: its section gives the reason
            out.append(task.report(ctx) if not _skipped(ctx, name) else
                       f"## {task.title}\n\nNot measured: {ctx.skipped(name)}.\n")
    if plots:
        out.append("## Plots\n")
        out += [f"![{name}]({path})\n" for name, path in plots.items()]
    v = result.versions
    out.append(f"\n---\ndifftx {v['difftx']}, torch {v['torch']}, Python {v['python']}, {v['platform']}. "
               "Every number is in `results.json`.\n")
    return "\n".join(out)


def opening(comparisons: dict, result: CompareResult, tuned: Optional[dict] = None) -> list[str]:
    """The report's first three lines: which arm, by how much in the metric's unit (DIFF - baseline
    on the primary metrics: the ones with a verdict, else the closest; then every other pair of arms
    with a verdict on a primary metric), how sure (seeds, Holm over
    the primary family, the seeds a verdict needs) and in what regime (model size, budget, and what
    the held-out LM interval is over). ``comparisons``: ``{pair: {key: comparison}}``; ``tuned``:
    the ``tune`` record when these are the tuned comparisons."""
    key = result.primary.key
    names = {a: r.label for a, r in result.arms.items()}
    first, second = (names[x] for x in result.primary.arms)
    primary = [c for c in (comparisons.get(key) or {}).values() if c["primary"]]
    decided = [c for c in primary if c.get("better") or c.get("mean_established")]
    compared = [c for c in primary if not c.get("gated") and c["paired"].get("mean") is not None]
    n = len(result.seeds)
    if decided:
        rest = len(primary) - len(decided)
        answer = ("**" + "; ".join(f"{c['label']}: {short_verdict(c, names)} ({first} - {second} = "
                                   f"{difference_text(c)}, Holm p {adjusted_p_text(c)}{_mean_clause(c)})"
                                   for c in decided) + ".**"
                  + (f" No verdict on the other {rest} primary metric{'s' if rest != 1 else ''}." if rest else ""))
    elif compared:
        lead = min(compared, key=lambda c: (c.get("p_adjusted") is None, c.get("p_adjusted") or 1.0))
        answer = (f"**No verdict: no primary metric separates {first} from the {second}.** Closest: "
                  f"{lead['label']}, {first} - {second} = {difference_text(lead)}, Holm p {adjusted_p_text(lead)} "
                  f"({short_verdict(lead, names)}).")
    elif primary and all("not learned" in (c.get("gated") or "") for c in primary):  # the budget failed, not seeds
        steps = (result.preset or {}).get("steps")
        answer = ("**No verdict: no model learned what the primary metrics measure**" + (
            f" in {steps:,} steps" if isinstance(steps, int) else "") + ", so more seeds cannot help: train longer "
            "(`--set steps=N`; the verdict table names each metric's gate).")
    else:
        answer = "**No verdict: no primary metric was compared** (the verdict table says why)."
    others = [c for pair_, comps in comparisons.items() if pair_ != key
              for c in comps.values() if c["primary"] and (c.get("better") or c.get("mean_established"))]
    if others:  # the other arms' verdicts on the same primary metrics (more arms: --arms)
        answer += (" Other arms: " + "; ".join(f"{c['arms'][0]} - {c['arms'][1]} on {c['label']}: "
                                               f"{difference_text(c)}, Holm p {adjusted_p_text(c)}{_mean_clause(c)} "
                                               f"({decided_text(c, names.get(c['arms'][0], c['arms'][0]))})"
                                               for c in others) + ".")
    need = max((c.get("seeds_for_verdict") or 0 for c in primary), default=0)
    family = max((c.get("family_size") or 0 for c in primary), default=0)
    sure = (f"How sure: {n} paired seed{'s' if n != 1 else ''}; p-values Holm-adjusted over {family} primary "
            f"comparison{'s' if family != 1 else ''}, a verdict at Holm p < 0.05")
    sure += _looks_clause(result, primary, n)
    if need and compared:  # a family of primaries that were compared (none: the seeds are not what is missing)
        sure += (f"; with this family a verdict needs at least {need} seeds" + (
            ", so this run can give none: run more (`--seeds`)" if n < need else ""))
    power = [(c["label"], c["seeds_for_power"]) for c in compared if "seeds_for_power" in c and not c.get("better")]
    if power and isinstance(power[0][1], int):
        sure += (f"; 80% power on {power[0][0]} needs about {power[0][1]} seeds (what that assumes: `power_plan` in "
                 "`results.json`)")
    if tuned:
        sure += (f"; each arm's `{tuned['field']}` chosen leave-one-seed-out, the intervals allowing for the choice")
    return [answer + "\n", sure + ".\n", _regime_line(result, tuned) + "\n"]


_ORDINAL = {1: "first", 2: "second", 3: "third", 4: "fourth", 5: "fifth", 6: "sixth"}


def _looks_clause(result: CompareResult, primary: list, n: int) -> str:
    """``; second look at 14 seeds (this folder was read before at 7 seeds), adjusted: p-values x32.9; a third look
    (more seeds into this folder) would test at p x132``: which reading of the folder this is, what it multiplied the
    p-values by (``look_factor`` as the comparisons recorded it; a file written before alpha was spent over looks
    multiplied them by the look's number), and what the next look would cost (:func:`difftx.eval.stats.look_factor`)."""
    look = int(result.look or 1)
    factor = next((c["look_factor"] for c in primary if c.get("look_factor")), float(look))
    ordinal = _ORDINAL.get(look, f"look {look}")
    if look > 1:
        before = ", ".join(str(len(x["seeds"])) for x in result.looks[:look - 1])
        text = (f"; {ordinal} look at {n} seeds (this folder was read before at {before} seeds), adjusted: p-values "
                f"x{factor:.3g}")
    else:
        text = "; first look at this folder" + (f", p-values x{factor:.3g} (alpha is spent over looks)"
                                                if factor != 1 else "")
    return text + (f"; a {_ORDINAL.get(look + 1, f'look {look + 1}')} look (more seeds into this folder) would test at "
                   f"p x{look_factor(look + 1):.3g}")


def _mean_clause(c: dict) -> str:
    """``; mean difference not yet established (about 11 seeds)`` beside a verdict: the second estimand, for a
    bounded metric by its betting test, for an unbounded one that no test of its mean holds (the seeds' count on
    each side is in the verdict's words, :func:`difftx.tasks.reporting.decided_text`)."""
    if c.get("gated"):
        return ""
    if c.get("mean_established") is None:
        return "; mean difference not established (no valid test of an unbounded metric's mean)" \
            if c.get("bounds") is None else ""
    if c["mean_established"]:
        return "; mean difference established"
    more = f" (about {c['seeds_for_mean']} seeds)" if c.get("seeds_for_mean") else ""
    return f"; mean difference not yet established{more}"


def _regime_line(result: CompareResult, tuned: Optional[dict]) -> str:
    """The opening's regime line: the models' size and budget and what the held-out LM interval is over."""
    p, arms = result.preset, result.arms
    cfg = arms[result.primary.arms[0]].config
    params = [a.parameters for a in arms.values()]
    low, high = (f"{x / 1e6:.2g}M" for x in (min(params), max(params)))
    size = low if low == high else f"{low}-{high}"
    layers = cfg.get("n_layers", "?")
    reg = (result.get("regime") or {}).get(result.primary.arms[0]) or {}
    per = reg.get("tokens_per_param")
    text = (f"Regime: models of {size} parameters ({layers} layer{'' if layers == 1 else 's'}, width "
            f"{cfg.get('dim', '?')}), "
            f"{p['steps']:,} steps of batch {p['batch_size']}"
            + (f", {per:.3g} text tokens per non-embedding parameter (the paper's 3B: about 330)" if per else ""))
    about = _lm_estimand(result, tuned)
    return text + (f"; {about}" if about else "") + "."


def _lm_estimand(result: CompareResult, tuned: Optional[dict]) -> Optional[str]:
    """What the compared held-out LM interval is over (:func:`difftx.tasks.lm.estimand`), in words."""
    from ..tasks.lm import estimand

    if tuned is not None:
        e, split = tuned.get("heldout_estimand"), tuned.get("split") or {}
        if not e:
            return None
        why = e.get("note") or split.get("note")
        return f"held-out LM intervals {e['phrase']}" + (f" ({why})" if why else "")
    lm = result.run(result.seeds[0], result.primary.arms[0]).tasks.get("lm")
    if lm is None:
        return None
    if "skipped" in lm or "records" not in lm:
        return None
    phrase, why = estimand(lm)
    return f"held-out LM intervals {phrase}" + (f" ({why})" if why else "")


def _as_set(p: dict) -> str:
    """`` (the preset as written; set here: steps 60, preset 1200; ...)`` where the comparison ran a named preset
    with fields changed (``--set``) and kept its description, which then speaks of the preset as written."""
    from .presets import PRESETS

    base = PRESETS.get(p.get("name"))
    if base is None or p.get("description") != base.description:
        return ""
    ref, p = model_dotted(base.to_dict()), model_dotted(p)  # model fields as --set spells them: model.dim
    changed = [k for k in {**ref, **p} if k not in ("name", "description", "tasks") and p.get(k) != ref.get(k)]
    if not changed:
        return ""
    shown = "; ".join(f"{k} {p.get(k)}, preset {ref.get(k)}" for k in changed[:6]) + ("; ..." if len(changed) > 6 else "")
    return f" (the preset as written; set here: {shown})"


def _setup(result: CompareResult, ctx: ReportContext) -> str:
    """What was trained, where, and at what scale: the section after the verdicts."""
    p, arms = result.preset, result.arms
    return ("## Setup\n\n"
            f"{p['description']}{_as_set(p)}. Seeds: {', '.join(ctx.seeds)} (paired: same seed, same batches in the same order for "
            "every model). " + "; ".join(f"{a}: {v.parameters:,} parameters" for a, v in arms.items())
            + f". {p['steps']} steps of batch {p['batch_size']}; {_mix(result)}. {_execution(result)}Wall time of "
            f"this invocation: {result.wall_s:.0f} s (parts already stored are not redone).\n\n"
            + _machine_text(result) + "\n\n"
            "**Scale.** The paper's numbers below come from 3B-parameter models; these are orders of magnitude smaller "
            "and trained for minutes: compare the *direction* of differences, not the values.\n")


def render_arms(result: CompareResult) -> str:
    """Every arm side by side (one column each, means over seeds); each pair's verdicts are in the
    report's verdict table."""
    arms = list(result.arms)
    first, second = (result.label(x) for x in result.primary.arms)
    out = ["## Arms\n", "Every arm trains on the same batches, and a parameter it shares by name and shape with "
           "another arm starts from the same values. Holm adjustment runs over the comparisons of every "
           f"pair below and {first} vs {second}. Throughput and the loss at equal wall-clock measure the machine "
           "as well: they are compared only between models trained by the same invocation (arms reused from "
           "an earlier run are not).\n",
           table([[a, f"{result.arms[a].parameters:,}", result.arms[a].description] for a in arms],
                 ["arm", "parameters", "what it is"])]
    rows = []
    for key, c in result.primary.metrics.items():
        if c.get("peer"):  # read against the other arm of a pair: no single value per arm
            continue
        means = dict(c["means"])
        for comps in result.comparisons.values():
            means.update(comps.metrics[key]["means"] if key in comps.metrics else {})
        rows.append([c["label"]] + [fmt(means.get(a), c.get("digits", 3)) for a in arms])
    out.append("Means over seeds (intervals, per-seed values and every paired difference are in `results.json`; "
               "each pair's primary verdicts, and those that survive Holm, are in the verdict table):\n")
    out.append(table(rows, ["metric", *arms]))
    return "\n".join(out)


def _machine_text(result: CompareResult) -> str:
    """The machine line of the header: where the models were trained (their ``machine.json``,
    grouped by kernel path) and, if another, where this report was assembled."""
    from ..provenance import kernel_path, machine_line

    groups: dict = {}
    unknown = 0
    for s in result.seeds:
        for arm in result.arms:
            m = result.run(s, arm).machine
            if m is None:
                unknown += 1
            else:
                groups.setdefault(kernel_path(m), [m, 0])[1] += 1
    total = len(result.seeds) * len(result.arms)
    trained = [m for m, _ in groups.values()]
    if not groups:
        text = f"**Machine.** Not recorded for the {total} models (trained by an older difftx)."
    elif len(groups) == 1 and not unknown:
        text = f"**Machine.** All {total} models were trained on: {machine_line(trained[0])}."
    else:
        parts = [f"{n} on {machine_line(m)}" for m, n in groups.values()]
        parts += [f"{unknown} by an older difftx that recorded no machine"] if unknown else []
        text = f"**Machine.** Of the {total} models, {len(trained)} setups trained them: " + "; ".join(parts) + "."
    here = result.get("machine")
    if here and (len(trained) != 1 or kernel_path(here, threads=False) != kernel_path(trained[0], threads=False)):
        text += f" This report was assembled on: {machine_line(here)}."
    return (text + " The numbers reproduce on the same CPU kernel path with the same library versions and thread "
            "counts, not across CPUs: float32 kernels differ by CPU, and thousands of training steps amplify "
            "that rounding like a change of seed (`docs/compare.md`).")


_CELL_KEY = re.compile(r"_(\d+)_(\d+)$")  # a metric measured at one needle cell N/R: needle_4_2, attn_noise_4_2, ...
_CELL_LABEL = re.compile(r",?\s*(?:at\s+)?N(?:/R)?=\d+/(?:R=)?\d+")  # "N=4/R=2", " at N/R=4/2", ", N/R=4/2"


def _short_label(label: str) -> str:
    """A metric's label without its trailing parenthesis and its needle cell: "attention to answer
    at N/R=2/2 (absolute, ...)" -> "attention to answer"."""
    return _CELL_LABEL.sub("", re.sub(r"\s*\([^()]*\)$", "", label)).strip()


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _cells_text(cells: list[tuple[int, int]], first: str = "N=%d/R=%d") -> str:
    """"N=2/R=2, 4/2 and 6/2"."""
    return _and([first % cells[0]] + ["%d/%d" % c for c in cells[1:]])


def _unmeasured(c: dict) -> bool:
    """A machine measurement without a value in this run, for no other reason (the report names it apart)."""
    return bool(c["gated"]) and c["gated"].startswith(NOT_MEASURED)


def _not_compared(C: dict) -> str:
    """The sentence(s) naming the metrics not compared for want of learning (or of one invocation),
    one per reason. Needle cells that nobody learned are named once with everything measured on them
    ("needle N=2/R=2, 4/2 and 6/2 and everything measured on them"); a cell where some metrics are
    compared names what is not ("everything measured on N/R=1/1 except needle accuracy", or the
    metrics at N/R=1/1); other metrics by their short label. A metric without a value (not measured
    in this run) is named elsewhere."""
    gated = {k: c for k, c in C.items() if c["gated"] and not _unmeasured(c)}
    if not gated:
        return ""
    cells: dict[tuple[int, int], list[str]] = {}
    for k in C:
        found = _CELL_KEY.search(k)
        if found:
            cells.setdefault((int(found[1]), int(found[2])), []).append(k)

    def reason(c: dict) -> str:  # "not learned by either model at this budget: not compared": its first part
        return c["gated"].split(": ", 1)[0]

    items: dict[str, dict] = {}  # reason -> {grouping key: cells or labels}: whole cells first, then the rest
    for cell, keys in cells.items():
        if all(k in gated for k in keys):  # nothing measured on this cell was compared
            head = f"needle_{cell[0]}_{cell[1]}"
            why = reason(gated[head if head in gated else keys[0]])
            items.setdefault(why, {}).setdefault(("whole",), []).append(cell)
    for cell, keys in cells.items():
        here = [k for k in keys if k in gated]
        if not here or len(here) == len(keys):
            continue
        compared = [k for k in keys if k not in gated]
        for k in here:
            why = reason(gated[k])
            if len(here) >= len(compared):  # say what was compared instead
                group = ("except", tuple(dict.fromkeys(_short_label(C[x]["label"]) for x in compared)))
                items.setdefault(why, {}).setdefault(group, [])
                if cell not in items[why][group]:
                    items[why][group].append(cell)
            else:
                items.setdefault(why, {}).setdefault(("at", cell), []).append(_short_label(C[k]["label"]))
    for k, c in gated.items():
        if not _CELL_KEY.search(k):
            items.setdefault(reason(c), {}).setdefault(("label", k), []).append(_short_label(c["label"]))
    out = []
    for why, groups in items.items():
        parts = []
        for group, vals in groups.items():
            if group[0] == "whole":
                them = "it" if len(vals) == 1 else "them"
                parts.append(f"needle {_cells_text(vals)} and everything measured on {them}")
            elif group[0] == "except":
                parts.append(f"everything measured on {_cells_text(vals, 'N/R=%d/%d')} except {_and(list(group[1]))}")
            elif group[0] == "at":
                parts.append(f"{_and(list(dict.fromkeys(vals)))} at {_cells_text([group[1]], 'N/R=%d/%d')}")
            else:
                parts.append(vals[0])
        out.append(f" Not compared ({why}): {'; '.join(parts)}.")
    return "".join(out)


def _skipped(ctx: ReportContext, task: str) -> bool:
    """Whether ``task`` was skipped on every model (it did not apply: e.g. the needle task without needle batches)."""
    return all("skipped" in ctx.result(task, a, s) for s in ctx.seeds for a in ctx.arms)


def render_token_efficiency(result: CompareResult) -> str:
    """The token efficiency section (paper Fig. 3b): per point of the held-out loss curve, the
    paired gap in nats, the baseline tokens that reach DIFF's loss and the ratio, with the overall
    ratio, or the first and last ratios where the curves cross."""
    out = ["## Token efficiency (paper Fig. 3b)\n",
           "Held-out loss along training, on the same fixed windows for every model. For each point of an arm's "
           "curve, the tokens at which the same seed's baseline reaches that loss (its curve made monotone and "
           "interpolated in log tokens); the ratio arm tokens / baseline tokens (< 1: the arm needs fewer tokens), "
           "a geometric mean over seeds with a 95% t interval. Outside the range both curves cover: not reached, "
           "never extrapolated (`docs/efficiency.md`). For scale: the paper's 3B DIFF at 160B tokens matches the "
           "Transformer at 251B (63.7%).\n"]
    base = result.primary.arms[1]
    for arm, e in result.token_efficiency.items():
        if "skipped" in e:
            out.append(f"**{arm} vs {base}**: not measured ({e['skipped']}).\n")
            continue
        gaps = {g["tokens"]: g for g in e.get("gap") or []}
        rows = []
        for t, r, la, lb in zip(e["tokens"], e["ratios"], e["loss"][arm], e["loss"][base]):
            rows.append([f"{t:,.0f}", fmt(lb, 4), fmt(la, 4), gap_text(gaps.get(t)), _ratio_text(r)])
        o, span = e["overall"], e.get("span")
        if e.get("crosses"):  # no single number across a crossing: first and last point instead
            first, last = span["first"], span["last"]
            head = (f"the curves cross: {_ratio_text(first)} at {first['tokens']:,.0f} tokens, {_ratio_text(last)} "
                    f"at {last['tokens']:,.0f}; no overall ratio, as an average across the crossing would read "
                    "like no difference")
        else:
            head = f"overall: {_ratio_text(o)}{'; ' + o['note'] if o.get('note') and o['value'] is not None else ''}"
            if span and span["first"]["tokens"] != span["last"]["tokens"]:
                head += (f"; from {span['first']['value']:.3f} at the first point to {span['last']['value']:.3f} "
                         "at the last")
        out.append(f"**{arm} vs {base}** ({head})\n")
        out.append(table(rows, ["tokens", f"{base} loss", f"{arm} loss", "gap, nats: mean; median [95%]",
                                "tokens ratio [95%]"]))
        if gaps:
            out.append(_gap_trend(list(gaps.values())) + "\n")
    return "\n".join(out)


def gap_text(g) -> str:
    """A paired gap in nats, an unbounded difference: ``+0.053; median +0.050 [+0.01, +0.09]``, the mean and the
    median seed difference with the interval of the median (:func:`difftx.tasks.reporting.interval_text`; a file
    written before: ``+0.053; shift [...]``), or without an interval the seeds' own differences,
    ``+0.053 (+0.043, +0.071, +0.046)``."""
    if g is None or g["mean"] is None:
        return "-"
    if g["low"] is not None:
        return interval_text(g, 3)
    return f"{g['mean']:+.3f} (" + ", ".join(f"{v:+.3f}" for v in g["values"]) + ")"


def _gap_trend(gaps: list[dict]) -> str:
    """Where the held-out gap peaks along training and where it ends."""
    peak = max(gaps, key=lambda g: abs(g["mean"]))
    last = gaps[-1]
    why = next((g["note"] for g in gaps if g.get("note")), None)
    return (f"Gap = arm - baseline held-out loss at the same tokens, paired over seeds (`difftx.eval.stats."
            f"paired_estimate`): the mean, and the median seed difference with the 95% interval of the median (a "
            f"loss has no bounds, so no interval of its mean holds for every distribution of seeds); without an "
            f"interval, the seeds' own differences in brackets"
            + (f": {why}" if why else "") + f"). It is largest at {peak['tokens']:,.0f} tokens "
            f"({peak['mean']:+.3f} nats) and {last['mean']:+.3f} at the last point ({last['tokens']:,.0f}).")


def _ratio_text(r: dict) -> str:
    if r["value"] is None:
        return r.get("note") or "-"
    text = f"{r['value']:.3f}" if r["low"] is None else f"{r['value']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"
    return text + (f" ({r['note']})" if r.get("note") and "reached in" in r["note"] else "")


def _mix(result: CompareResult) -> str:
    """The training mix in words, e.g. 'batches: 75% needle, 12.5% LM (Shakespeare bytes), 12.5% ICL'; a registered
    training task by its label (:data:`.training_tasks.TRAINING_TASKS`)."""
    from .training_tasks import TRAINING_TASKS

    shares = result.mixture["shares"]
    text = result.get("text")
    lm = "LM (Shakespeare bytes)" if not text else f"LM ({text['source']}, tokenizer {text['tokenizer']})"
    names = {"needle": "needle", "lm": lm, "icl": "ICL", "recall": "associative recall (MQAR)"}

    def name(k: str) -> str:
        return names.get(k) or (TRAINING_TASKS[k].label if k in TRAINING_TASKS else k)

    out = "batches: " + ", ".join(f"{100 * v:.3g}% {name(k)}" for k, v in shares.items() if v)
    if not shares["needle"]:
        out += "; no needle probes during training (no needle batches)"
    return out


def _execution(result: CompareResult) -> str:
    e = result.get("execution")
    return "" if not e else f"Trained on {e.get('world_size', 1)} process(es), device {e.get('device', '?')}. "


def make_plots(out: Path, result: CompareResult, section: Optional[Section] = None) -> dict[str, str]:
    """Every task's PNGs under ``out/plots``, then the study ``section``'s (none when matplotlib is missing):
    name -> relative path."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return {}
    ctx = ReportContext(result)
    made: dict[str, str] = {}
    plots = own_folder(out / "plots")
    for name, task in TASKS.items():
        if name in result.tasks and not _skipped(ctx, name):
            for label, path in task.plots(ctx, plots).items():
                made[label] = str(Path(path).relative_to(out))
    a, b = result.primary.arms
    e = result.token_efficiency.get(a)
    if e and "skipped" not in e:
        from ..eval.plots import plot_token_efficiency

        curves = {result.label(arm): [(result.run(s, arm).train["heldout_curve"]["tokens"],
                                       result.run(s, arm).train["heldout_curve"]["loss"]) for s in result.seeds]
                  for arm in (a, b)}
        matched = [(t, None if r["value"] is None else t / r["value"], loss)
                   for t, r, loss in zip(e["tokens"], e["ratios"], e["loss"][a])]
        path = plot_token_efficiency(curves, matched, plots / "token_efficiency.png", overall=e["overall"])
        made["token efficiency (paper Fig. 3b)"] = str(path.relative_to(out))
    gaps = {arm: e["gap"] for arm, e in result.token_efficiency.items() if e.get("gap")}
    if gaps:
        from ..eval.plots import plot_gap_along_training

        path = plot_gap_along_training(gaps, plots / "gap_along_training.png", reference=b)
        made["held-out loss gap along training"] = str(path.relative_to(out))
    if section is not None:
        made.update({label: str(Path(path).relative_to(out)) for label, path in section.plot(out).items()})
    return made


def write_outputs(out: Path, result: CompareResult, *, progress: bool = True,
                  section: Optional[Section] = None) -> None:
    """Write ``plots/``, ``report.md`` and ``results.json`` (strict JSON, validated, atomically); ``section``:
    the section of the study that ran this comparison (:class:`Section`)."""
    result.extra["plots"] = make_plots(out, result, section)
    result.extra["regime"] = regime_of(result)
    text = render_report(result, result.extra["plots"], section)
    data = results_json(result)
    atomic_write(out / "report.md", lambda p: Path(p).write_text(text))
    atomic_write(out / "results.json", lambda p: Path(p).write_text(data + "\n"))
