"""``report.md``, ``results.json`` and ``plots/`` of a comparison. The assembler writes the
header and the verdicts; every other section and plot comes from its task
(:data:`difftx.tasks.TASKS`, in registry order)."""

from __future__ import annotations

from pathlib import Path

from ..io import atomic_write
from ..tasks import TASKS
from ..tasks.reporting import ReportContext, fmt, table
from .schema import results_json


def render_report(results: dict, plots: dict[str, str]) -> str:
    """The Markdown report: header, verdicts, one section per task, plots."""
    ctx = ReportContext(results)
    p, arms = results["preset"], results["arms"]
    out = [f"# DIFF vs parameter-matched Transformer: `{p['name']}` preset\n",
           f"{p['description']}. Seeds: {', '.join(ctx.seeds)} (paired: same seed, same batches in the same order "
           f"for every model). " + "; ".join(f"{a}: {v['parameters']:,} parameters" for a, v in arms.items())
           + f". {p['steps']} steps of batch {p['batch_size']}; {_mix(results)}. "
           f"{_execution(results)}Wall time of this invocation: {results['wall_s']:.0f} s (parts already stored are "
           "not redone).\n",
           "**Scale.** The paper's numbers below come from 3B-parameter models; these models are orders of magnitude "
           "smaller and trained for minutes. Compare the *direction* of differences, not the values.\n",
           "**Statistics.** Every difference is DIFF - baseline over paired seeds: its mean and an unadjusted 95% "
           "interval, the hull of a t interval (with evaluation-set noise where the metric has per-example "
           "values) and the exact sign-flip interval, kept inside the metric's range (`docs/compare.md`). Its "
           "p-value is the larger of the two tests'. Primary metrics are declared up front; every other metric is "
           "exploratory, and p-values are Holm-adjusted within each family. 'DIFF better / worse' is said only "
           "where the adjusted test rejects at 0.05; a comparison of a task neither model learned is not made. "
           + _seeds_rule(results, len(ctx.seeds)) + "\n",
           "## Verdicts\n"]
    C = results["comparison"]
    primary = [k for k, c in C.items() if c["primary"]]
    found = [k for k, c in C.items() if not c["primary"] and c.get("better")]
    out += [f"- {C[k]['verdict']} (primary)" for k in primary] + [f"- {C[k]['verdict']}" for k in found]
    explored = [c for c in C.values() if not c["primary"] and not c["gated"]]
    gated = [c["label"] for c in C.values() if c["gated"] and c["paired"]["mean"] is not None]
    unmeasured = [c["gated"].replace("not measured in this run ", f"{c['label']} ") for c in C.values()
                  if c["gated"] and c["paired"]["mean"] is None]
    out.append(f"\n{len(explored)} exploratory comparisons; {len(found)} survive Holm adjustment"
               + (" (listed above)." if found else ".")
               + (f" Not compared (not learned by either model): {', '.join(gated)}." if gated else "")
               + (f" Not measured in this run: {'; '.join(unmeasured)}." if unmeasured else "") + "\n")
    if results.get("arm_comparisons"):
        out.append(render_arms(results))
    if results.get("token_efficiency"):
        out.append(render_token_efficiency(results))
    for name, task in TASKS.items():
        if name in results["tasks"]:  # a task skipped on every model: its section gives the reason
            out.append(task.report(ctx) if not _skipped(ctx, name) else
                       f"## {task.title}\n\nNot measured: {ctx.skipped(name)}.\n")
    if plots:
        out.append("## Plots\n")
        out += [f"![{name}]({path})\n" for name, path in plots.items()]
    v = results["versions"]
    out.append(f"\n---\ndifftx {v['difftx']}, torch {v['torch']}, Python {v['python']}, {v['platform']}. "
               "Every number is in `results.json`.\n")
    return "\n".join(out)


def render_arms(results: dict) -> str:
    """Every arm side by side (one column each, means over seeds), then each pair's verdicts: the
    primary ones and those that survive Holm adjustment over all pairs."""
    from ..config import ARMS

    arms = list(results["arms"])
    out = ["## Arms\n", "Every arm trains on the same batches, and a parameter it shares by name and shape with "
           "another arm starts from the same values. Holm adjustment runs over the comparisons of every "
           "pair below and DIFF vs baseline. Throughput and the loss at equal wall-clock measure the machine "
           "as well: they are compared only between models trained by the same invocation (arms reused from "
           "an earlier run are not).\n",
           table([[a, f"{results['arms'][a]['parameters']:,}", ARMS.get(a, "")] for a in arms],
                 ["arm", "parameters", "what it is"])]
    rows = []
    for key, c in results["comparison"].items():
        if c.get("peer"):  # read against the other arm of a pair: no single value per arm
            continue
        means = dict(c["means"])
        for comps in results["arm_comparisons"].values():
            means.update(comps[key]["means"] if key in comps else {})
        rows.append([c["label"]] + [fmt(means.get(a), c.get("digits", 3)) for a in arms])
    out.append("Means over seeds (intervals, per-seed values and every paired difference are in `results.json`):\n")
    out.append(table(rows, ["metric", *arms]))
    for pair, comps in results["arm_comparisons"].items():
        lines = [c["verdict"] + (" (primary)" if c["primary"] else "") for c in comps.values()
                 if c["primary"] or c.get("better")]
        out.append(f"**{pair}**\n\n" + "\n".join(f"- {v}" for v in lines) + "\n")
    return "\n".join(out)


def _skipped(ctx: ReportContext, task: str) -> bool:
    """Whether ``task`` was skipped on every model (it did not apply: e.g. the needle task without needle batches)."""
    return all("skipped" in ctx.result(task, a, s) for s in ctx.seeds for a in ctx.arms)


def _seeds_rule(results: dict, n: int) -> str:
    """How many seeds a verdict needs here, and whether this run has them."""
    if n == 1:
        return "With one seed there is no interval and no conclusion. "
    need = {}
    for c in results["comparison"].values():
        if c.get("seeds_for_verdict") is not None:
            need.setdefault(c["family"], (c["seeds_for_verdict"], c["family_size"]))
    order = sorted(need.items(), key=lambda x: x[0] != "primary")
    parts = [f"{k} ({size} comparisons): {s} seeds" for k, (s, size) in order]
    text = ("The sign-flip test cannot reach p < 0.05 below 6 paired seeds, and after Holm's adjustment a verdict "
            "needs more: " + "; ".join(parts) + f". This run has {n} seeds") if parts else ""
    if parts and n < min(s for s, _ in need.values()):
        text += ", too few for any verdict: run more seeds (`--seeds`) to get one"
    return text + ". " if text else ""


def render_token_efficiency(results: dict) -> str:
    """The token efficiency section (paper Fig. 3b): per point of the held-out loss curve, the
    baseline tokens that reach DIFF's loss and the ratio, with the overall ratio."""
    out = ["## Token efficiency (paper Fig. 3b)\n",
           "Held-out loss along training, on the same fixed windows for every model. For each point of an arm's "
           "curve, the tokens at which the same seed's baseline reaches that loss (its curve made monotone and "
           "interpolated in log tokens); the ratio arm tokens / baseline tokens (< 1: the arm needs fewer tokens), "
           "a geometric mean over seeds with a 95% t interval. Outside the range both curves cover: not reached, "
           "never extrapolated (`docs/efficiency.md`). For scale: the paper's 3B DIFF at 160B tokens matches the "
           "Transformer at 251B (63.7%).\n"]
    for arm, e in results["token_efficiency"].items():
        if "skipped" in e:
            out.append(f"**{arm} vs baseline**: not measured ({e['skipped']}).\n")
            continue
        rows = []
        for t, r, la, lb in zip(e["tokens"], e["ratios"], e["loss"][arm], e["loss"]["baseline"]):
            rows.append([f"{t:,.0f}", fmt(lb, 4), fmt(la, 4), _ratio_text(r)])
        o = e["overall"]
        out.append(f"**{arm} vs baseline** (overall: {_ratio_text(o)}{'; ' + o['note'] if o.get('note') else ''})\n")
        out.append(table(rows, ["tokens", "baseline loss", f"{arm} loss", "tokens ratio [95%]"]))
    return "\n".join(out)


def _ratio_text(r: dict) -> str:
    if r["value"] is None:
        return r.get("note") or "-"
    text = f"{r['value']:.3f}" if r["low"] is None else f"{r['value']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"
    return text + (f" ({r['note']})" if r.get("note") and "reached in" in r["note"] else "")


def _mix(results: dict) -> str:
    """The training mix in words, e.g. 'batches: 75% needle, 12.5% LM (Shakespeare bytes), 12.5% ICL'."""
    shares = results["mixture"]["shares"]
    text = results.get("text")
    lm = "LM (Shakespeare bytes)" if not text else f"LM ({text['source']}, tokenizer {text['tokenizer']})"
    names = {"needle": "needle", "lm": lm, "icl": "ICL"}
    out = "batches: " + ", ".join(f"{100 * v:.3g}% {names[k]}" for k, v in shares.items() if v)
    if not shares["needle"]:
        out += "; no needle probes during training (no needle batches)"
    return out


def _execution(results: dict) -> str:
    e = results.get("execution")
    return "" if not e else f"Trained on {e.get('world_size', 1)} process(es), device {e.get('device', '?')}. "


def make_plots(out: Path, results: dict) -> dict[str, str]:
    """Every task's PNGs under ``out/plots`` (none when matplotlib is missing): name -> relative path."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return {}
    ctx = ReportContext(results)
    made: dict[str, str] = {}
    for name, task in TASKS.items():
        if name in results["tasks"] and not _skipped(ctx, name):
            for label, path in task.plots(ctx, out / "plots").items():
                made[label] = str(Path(path).relative_to(out))
    e = (results.get("token_efficiency") or {}).get("diff")
    if e and "skipped" not in e:
        from ..eval.plots import plot_token_efficiency

        seeds = [str(s) for s in results["seeds"]]
        curves = {name: [(results["runs"][s][arm]["train"]["heldout_curve"]["tokens"],
                          results["runs"][s][arm]["train"]["heldout_curve"]["loss"]) for s in seeds]
                  for name, arm in (("DIFF", "diff"), ("baseline", "baseline"))}
        matched = [(t, None if r["value"] is None else t / r["value"], loss)
                   for t, r, loss in zip(e["tokens"], e["ratios"], e["loss"]["diff"])]
        path = plot_token_efficiency(curves, matched, out / "plots" / "token_efficiency.png", overall=e["overall"])
        made["token efficiency (paper Fig. 3b)"] = str(path.relative_to(out))
    return made


def write_outputs(out: Path, results: dict, *, progress: bool = True) -> None:
    """Write ``plots/``, ``report.md`` and ``results.json`` (strict JSON, validated, atomically)."""
    results["plots"] = make_plots(out, results)
    text = render_report(results, results["plots"])
    data = results_json(results)
    atomic_write(out / "report.md", lambda p: Path(p).write_text(text))
    atomic_write(out / "results.json", lambda p: Path(p).write_text(data + "\n"))
