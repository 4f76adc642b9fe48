"""What ``--tune`` shows (:mod:`difftx.compare.tune`): the section that opens ``report.md``, the
lines the command prints and ``plots/tune_FIELD.png``, all read from the ``tune`` record."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def label(field: str, value) -> str:
    """A value's folder name: ``lr=0.003``."""
    return f"{field}={value:g}" if isinstance(value, float) else f"{field}={value}"


def _gap(c: dict) -> str:
    p = c["paired"]
    if p["mean"] is None:
        return "-"
    ci = "" if p["low"] is None else f" [{p['low']:+.4f}, {p['high']:+.4f}]"
    return f"{p['mean']:+.4f}{ci}" + (f", Holm p {c['p_adjusted']:.3g}" if c.get("p_adjusted") is not None else "")


def render_tune(tune: dict, plots: dict) -> str:
    """The report's first section: the tuned comparison (primary) beside the one at the preset's value."""
    field, shared = tune["field"], tune["shared_value"]
    lines = [f"## Tuned `{field}` (primary)\n",
             f"Every arm trained at every value of `{field}` for every seed; for seed s, each arm's value is the one "
             f"with the lowest mean validation loss over the other seeds (leave-one-seed-out), so no seed's reported "
             f"difference was chosen on its own noise. Validation loss: {tune['validation_source']}. Held-out "
             f"evaluation (what is compared below): {tune['heldout_source']}. Both comparisons below are scored on "
             "it; the rest of this report is the comparison at the preset's value on its usual held-out text. Each "
             "seed's choice reads the other seeds, so the seeds' tuned differences are not independent: the tuned "
             "interval is the hull of the comparison's own and a jackknife over seeds of the whole procedure (the "
             "choices redone without each seed in turn; from 3 seeds), its p-value the larger of the two, "
             "Holm-adjusted over the tuned primary comparisons.\n",
             f"| arm | values of `{field}` | best (mean over seeds) | chosen per seed (seed: value) |",
             "|---|---|---|---|"]
    for arm, grid in tune["grid"].items():
        ext = tune["extended"].get(arm) or []
        note = f" (added at the edge: {', '.join(f'{v:g}' for v in ext)})" if ext else ""
        edge = tune["at_edge"].get(arm)
        best = f"{tune['best'][arm]:g}" + (f" **at the {edge} edge of the grid: the true best may lie beyond**"
                                           if edge else "")
        picks = ", ".join(f"{s}: {v:g}" for s, v in tune["chosen"][arm].items())
        lines.append(f"| {arm} | {', '.join(f'{v:g}' for v in grid)}{note} | {best} | {picks} |")
    lines += ["", f"| pair | metric | at the preset's `{field}` = {shared:g} | tuned | verdict (tuned) |",
              "|---|---|---|---|---|"]
    for pair, metrics in tune["tuned"].items():
        for key, c in metrics.items():
            s = tune["shared"].get(pair, {}).get(key)
            lines.append(f"| {pair} | {c['label']} | {'-' if s is None else _gap(s)} | {_gap(c)} | {c['verdict']} |")
    lines.append("")
    if plots.get("tuning sensitivity"):
        lines.append(f"![validation loss against {field}]({plots['tuning sensitivity']})\n")
    return "\n".join(lines) + "\n"


def tune_summary(tune: dict) -> str:
    """What the command line prints: each arm's choices and the tuned primary verdicts."""
    lines = [f"  tuned {tune['field']} (validation loss, leave-one-seed-out):"]
    for arm, picks in tune["chosen"].items():
        edge = tune["at_edge"].get(arm)
        lines.append(f"    {arm}: " + ", ".join(f"seed {s} {v:g}" for s, v in picks.items())
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
    logx = all(v > 0 for g in tune["grid"].values() for v in g) and field in ("lr", "min_lr", "weight_decay")
    return plot_seed_curves(curves, out / "plots" / f"tune_{field}.png", ylabel="validation NLL", xlabel=field,
                            title=f"validation loss against {field} (best marked)", color_by_model=False,
                            logx=logx, marks=tune["best"])
