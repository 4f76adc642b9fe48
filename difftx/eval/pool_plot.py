"""The forest plot of ``difftx runs --pool`` (PNG, matplotlib with the Agg backend, imported lazily as in
:mod:`.plots`): one row per compare folder with its provenance, its estimate (the marker's area: its weight) and
its 95% t interval over seeds; each subgroup's pooled diamond with ``--by``; the pooled diamond (HKSJ) and, under
it, the prediction interval for a new comparison."""

from __future__ import annotations

from .plots import PathLike, _plt, _save
from .stats import t_quantile


def _diamond(ax, y: float, p: dict, color: str) -> None:
    if p.get("low") is None:  # one comparison: a point
        ax.plot([p["mean"]], [y], marker="D", color=color, ms=6)
        return
    ax.fill([p["low"], p["mean"], p["high"], p["mean"]], [y, y + 0.3, y, y - 0.3], color=color, zorder=3)


def plot_forest(analysis: dict, path: PathLike, describe=None) -> "PathLike":
    """Write the forest plot of :func:`difftx.cli.runs.pool_folders`'s ``analysis`` to ``path``; returns it.
    ``describe``: a folder's row (a dict) to the provenance line under its path (default: none)."""
    plt = _plt()
    rows = analysis["folders"]
    groups = (analysis.get("subgroups") or {}).get("groups") or {}
    labels, y = [], 0.0
    fig_rows = len(rows) + 2 * len(groups) + 2
    fig, ax = plt.subplots(figsize=(10, 0.42 * fig_rows + 1.2))
    order = [(g, [r for r in rows if r["path"] in p["folders"]]) for g, p in groups.items()] or [(None, rows)]
    ticks = []
    for g, members in order:
        for r in members:
            half = t_quantile(0.975, r["seeds"] - 1) * r["se"]
            ax.plot([r["estimate"] - half, r["estimate"] + half], [y, y], color="tab:gray", lw=1.2)
            ax.plot([r["estimate"]], [y], "s", color="tab:blue", ms=4 + 14 * r["weight"] ** 0.5)
            ticks.append(y)
            labels.append(f"{r['path']} ({r['seeds']} seeds)" + (f"\n{describe(r)}" if describe else ""))
            y -= 1
        if g is not None:
            _diamond(ax, y, groups[g], "tab:purple")
            ticks.append(y)
            labels.append(f"{analysis['by']} = {g}: pooled ({groups[g]['k']})")
            y -= 1.4
    p = analysis["pooled"]
    _diamond(ax, y, p, "tab:red")
    ticks.append(y)
    labels.append(f"pooled ({p['interval'] or 'one folder'}), tau {p['tau'] or 0:.3g}, I^2 "
                  f"{100 * (p['i2'] or 0):.0f}%")
    if p.get("pi_low") is not None:
        y -= 1
        ax.plot([p["pi_low"], p["pi_high"]], [y, y], color="tab:red", lw=2, ls="--")
        ticks.append(y)
        labels.append("prediction interval, a new comparison")
    ax.axvline(0.0, color="black", lw=0.8)
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_ylim(y - 0.8, 0.8)
    unit = f" ({analysis['unit']})" if analysis["unit"] else ""
    better = "lower" if analysis["lower_is_better"] else "higher"
    ax.set_xlabel(f"{analysis['names'][0]} - {analysis['names'][1]}: {analysis['label']}{unit}; {better} is better "
                  f"for {analysis['names'][0]}", fontsize=8)
    ax.set_title(f"{analysis['metric']} pooled over {len(rows)} comparisons", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)
