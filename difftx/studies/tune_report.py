"""What ``--tune`` shows (:mod:`difftx.studies.tune`): the section after ``report.md``'s opening
lines (the tuned verdict table, one line of method, the choices), the lines the command prints and
``plots/tune_FIELD.png``, all read from the ``tune`` record. :func:`tune_section` hands the section and
its plot to the compare report (:class:`difftx.compare.report.Section`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..io import own_folder
from ..tasks.reporting import DIFFERENCE
from ..compare.arms import LABELS
from ..compare.report import Section


def label(field: str, value) -> str:
    """A value's folder name: ``lr=0.003``, ``init=torch``."""
    return f"{field}={shown(value)}"


def shown(value) -> str:
    """A tuned value as printed: a float in ``%g`` (``0.003``), anything else as it is (``torch``)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _gap(c: dict) -> str:
    from ..compare.summary import difference_text

    return difference_text(c)


TUNE_METHOD = ("Method, in one line: for seed s, each arm's value is the one with the lowest mean validation loss over "
               "the other seeds; both comparisons are scored on held-out text the choice never read; the tuned "
               "interval is the hull of the comparison's own and a jackknife over seeds that redoes every choice, its "
               "Holm p the larger of the two. Why, and what each column means: `docs/compare.md`, \"Tuning each arm\" "
               "and \"Reading a report\".\n")


def render_tune(tune: dict, plots: dict, names: Optional[dict] = None) -> str:
    """The tuned comparison (primary): its verdict table beside the difference at the preset's value,
    one line of method, where the choice and the evaluation read, each arm's values and choices, and
    the figure. The report's opening lines (:func:`difftx.compare.report.opening`) come before it. ``names``: the
    arms' labels."""
    names = names or {}
    from ..compare.summary import adjusted_p_text, short_verdict

    field, shared = tune["field"], tune["shared_value"]
    lines = [f"## Tuned `{field}` (primary)\n",
             f"| pair | metric | at the preset's `{field}` = {shown(shared)} | tuned: {DIFFERENCE} | Holm p "
             "| verdict |",
             "|---|---|---|---|---|---|"]
    for pair, metrics in tune["tuned"].items():
        for key, c in metrics.items():
            s = tune["shared"].get(pair, {}).get(key)
            a, b = (names.get(x) or LABELS.get(x, x) for x in c["arms"])
            lines.append(f"| {a} - {b} | {c['label']} | {'-' if s is None else _gap(s)} | {_gap(c)} | "
                         f"{adjusted_p_text(c)} | {short_verdict(c, names or None)} |")
    split = tune.get("split") or {}
    lines += ["", TUNE_METHOD,
              f"Validation loss (chooses): {tune['validation_source']}. Held-out evaluation (compared): "
              f"{tune['heldout_source']}." + (f" Why its LM intervals are not over documents: {split['note']}."
                                               if split.get("note") else "") + "\n",
              f"| arm | values of `{field}` | best (mean over seeds) | chosen per seed (seed: value) |",
              "|---|---|---|---|"]
    for arm, grid in tune["grid"].items():
        ext = tune["extended"].get(arm) or []
        note = f" (added at the edge: {', '.join(shown(v) for v in ext)})" if ext else ""
        edge = tune["at_edge"].get(arm)
        best = shown(tune['best'][arm]) + (f" **at the {edge} edge of the grid: the true best may lie beyond**"
                                           if edge else "")
        picks = ", ".join(f"{s}: {shown(v)}" for s, v in tune["chosen"][arm].items())
        lines.append(f"| {arm} | {', '.join(shown(v) for v in grid)}{note} | {best} | {picks} |")
    lines.append("")
    if plots.get("tuning sensitivity"):
        lines.append(f"![validation loss against {field}]({plots['tuning sensitivity']})\n")
    return "\n".join(lines) + "\n"


def tune_summary(tune: dict) -> str:
    """What the command line prints: each arm's choices and the tuned primary verdicts."""
    lines = [f"  tuned {tune['field']} (validation loss, leave-one-seed-out):"]
    for arm, picks in tune["chosen"].items():
        edge = tune["at_edge"].get(arm)
        lines.append(f"    {arm}: " + ", ".join(f"seed {s} {shown(v)}" for s, v in picks.items())
                     + (f" (best at the {edge} edge of the grid)" if edge else ""))
    for pair, metrics in tune["tuned"].items():
        for c in metrics.values():
            lines.append(f"  tuned, {pair}: {c['verdict']}")
    return "\n".join(lines)


def plot_tune(out: Path, tune: dict) -> Optional[Path]:
    """``plots/tune_FIELD.png``: validation loss against the value, per arm (seeds faint, means bold),
    each arm's best value marked."""
    from ..eval.plots import plot_seed_curves

    field = tune["field"]
    curves = {}
    for arm, grid in tune["grid"].items():
        per_value = [tune["validation_nll"][arm][label(field, v)] for v in grid]
        curves[arm] = [(grid, [row[i] for row in per_value]) for i in range(len(per_value[0]))]
    logx = field in ("lr", "min_lr", "weight_decay") and all(v > 0 for g in tune["grid"].values() for v in g)
    path = own_folder(out / "plots") / f"tune_{field}.png"
    return plot_seed_curves(curves, path, ylabel="validation NLL", xlabel=field,
                            title=f"validation loss against {field} (best marked)", color_by_model=False,
                            logx=logx, marks=tune["best"])


def tune_section(tune: dict) -> Section:
    """The tuned comparison's section of ``report.md`` (:func:`render_tune`) and its figure (:func:`plot_tune`),
    as the compare report takes a study's section."""
    return Section(render=lambda plots, names: render_tune(tune, plots, names),
                   plot=lambda out: {"tuning sensitivity": plot_tune(out, tune)})
