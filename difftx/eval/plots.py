"""Plots of the evaluations (PNG, matplotlib with the Agg backend, imported lazily).

Every function takes plain data (dicts and lists, as found in ``results.json``) and a path,
writes the PNG atomically and returns the path. Models are keyed by name (``"DIFF"``,
``"baseline"``, ...); colours are stable per name.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..arm_table import PRIMARY
from ..io import atomic_write

PathLike = str | os.PathLike
_COLORS = {PRIMARY[0]: "tab:red", PRIMARY[1]: "tab:blue", "transformer": "tab:blue", "standard": "tab:blue"}
_ROLE_COLORS = {"bos": "tab:gray", "filler": "tab:blue", "needle": "tab:orange", "answer": "tab:red",
                "query": "tab:green"}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _color(name: str, i: int) -> str:
    return _COLORS.get(name.lower(), f"C{i + 2}")


def _save(fig, path: PathLike) -> Path:
    """Write ``fig`` as a PNG at ``path`` (atomically) and close it."""
    try:
        atomic_write(path, lambda p: fig.savefig(p, dpi=110, bbox_inches="tight", format="png"))
    finally:
        _plt().close(fig)
    return Path(path)


def plot_needle_accuracy(acc: Mapping[str, Mapping[str, float]], path: PathLike, *,
                         title: str = "Multi-needle retrieval") -> Path:
    """Grouped bars: ``acc[model]["N/R"]`` per-key exact match."""
    plt = _plt()
    models = list(acc)
    cells = list(next(iter(acc.values())).keys()) if acc else []
    fig, ax = plt.subplots(figsize=(1.3 * len(cells) + 2.5, 3.4))
    width = 0.8 / max(len(models), 1)
    for i, m in enumerate(models):
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(cells))]
        vals = [acc[m].get(c, math.nan) for c in cells]
        bars = ax.bar(xs, vals, width, label=m, color=_color(m, i))
        for b, v in zip(bars, vals):
            if not math.isnan(v):
                ax.text(b.get_x() + b.get_width() / 2, v + 0.01, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(cells)), [f"N={c.split('/')[0]}\nR={c.split('/')[1]}" for c in cells])
    ax.set_ylim(0, 1.25)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylabel("accuracy (per key)")
    ax.set_title(title)
    ax.legend(frameon=False, ncol=max(len(models), 1), loc="upper center")
    return _save(fig, path)


def plot_needle_heatmap(depths: Sequence[float], lengths: Sequence[int], acc: Sequence[Sequence[float]],
                        path: PathLike, *, title: str = "Needle accuracy: depth x context length") -> Path:
    """Heatmap ``acc[i][j]`` at depth ``depths[i]`` and context length ``lengths[j]``."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.0 * len(lengths) + 2.5, 0.5 * len(depths) + 1.8))
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{round(100 * d)}%" for d in depths])
    for i, row in enumerate(acc):
        for j, v in enumerate(row):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("answer depth")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046)
    return _save(fig, path)


def plot_attention_to_answer(rows: Mapping[str, Sequence[float]], roles: Sequence[str], path: PathLike, *,
                             title: str = "Attention of the first answer token") -> Path:
    """Figure-1-style: one query's (head-averaged, L1-normalised) attention row per model over the
    prompt, with the mass per segment (BOS / context / answer / query) in the legend.
    ``roles`` names each key position (``bos``, ``filler``, ``needle``, ``answer``, ``query``)."""
    plt = _plt()
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.9 * len(rows) + 0.6), squeeze=False, sharex=True)
    for ax, (name, row) in zip(axes[:, 0], rows.items()):
        total = sum(abs(v) for v in row) or 1.0
        r = [v / total for v in row]
        segs = {}
        for role in _ROLE_COLORS:
            idx = [j for j, x in enumerate(roles) if x == role]
            if not idx:
                continue
            seg = "context" if role in ("filler", "needle") else role
            segs[seg] = segs.get(seg, 0.0) + sum(r[j] for j in idx)
            ax.bar(idx, [r[j] for j in idx], width=1.0, color=_ROLE_COLORS[role], label=role)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_ylabel(name)
        ax.set_title(", ".join(f"{k} {v:.2f}" for k, v in segs.items()), fontsize=8, loc="right")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, ncol=5, fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, 0.0))
    axes[-1, 0].set_xlabel("key position")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_outliers(stats: Mapping[str, Mapping[str, Mapping[str, float]]], path: PathLike, *,
                  keys: Sequence[str] = ("top1", "top2", "top3", "top10", "top100", "median")) -> Path:
    """Bars per statistic, one panel per quantity: ``stats[model]["attention_logits"]["top1"]``."""
    plt = _plt()
    models = list(stats)
    quantities = [q for q in ("attention_logits", "hidden_states") if any(q in stats[m] for m in models)]
    fig, axes = plt.subplots(1, len(quantities), figsize=(5 * len(quantities), 3.2), squeeze=False)
    width = 0.8 / max(len(models), 1)
    for ax, q in zip(axes[0], quantities):
        for i, m in enumerate(models):
            xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(keys))]
            ax.bar(xs, [stats[m][q].get(k, math.nan) for k in keys], width, label=m, color=_color(m, i))
        ax.set_xticks(range(len(keys)), keys)
        ax.set_yscale("log")
        ax.set_title(f"|{q.replace('_', ' ')}|")
    axes[0, 0].legend(frameon=False)
    return _save(fig, path)


def plot_quantization(curves: Mapping[str, Mapping], path: PathLike, *, metric: str = "NLL",
                      title: Optional[str] = None) -> Path:
    """Metric against bits: ``curves[model]`` as returned by
    :func:`difftx.eval.quant.quantization_sweep` (``full`` drawn as a dotted line)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    styles = {"row": "-", "tensor": "--"}
    all_bits: set[int] = set()
    for i, (m, c) in enumerate(curves.items()):
        col = _color(m, i)
        for g, pts in c.items():
            if g == "full":
                ax.axhline(pts, color=col, ls=":", lw=1)
                continue
            bits = sorted(pts, key=lambda b: -int(b))
            all_bits.update(int(b) for b in bits)
            ax.plot([int(b) for b in bits], [pts[b] for b in bits], styles.get(g, "-."), marker="o", color=col,
                    label=f"{m} ({g})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(all_bits), [str(b) for b in sorted(all_bits)])
    ax.minorticks_off()
    ax.invert_xaxis()
    ax.set_xlabel("attention-logit bits")
    ax.set_ylabel(metric)
    ax.set_title(title or f"Low-bit attention logits: {metric}")
    ax.legend(frameon=False, fontsize=8)
    return _save(fig, path)


# line styles for the seeds of one model (8 distinct: `make demo` draws 5 seeds per model in one plot)
LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 2)), (0, (3, 1, 1, 1, 1, 1, 1, 1)))


def plot_loss_curves(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: PathLike, *,
                     ylabel: str = "training loss (nats)", title: str = "Loss", xlabel: str = "step") -> Path:
    """``curves[name] = (steps, losses)``; several seeds of a model may be given as
    ``"DIFF seed 1"`` etc. (colour by the first word, line style by its seed's order)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    seen: dict[str, int] = {}
    for i, (name, (steps, losses)) in enumerate(curves.items()):
        model = name.split()[0]
        style = LINE_STYLES[seen.get(model, 0) % len(LINE_STYLES)]
        seen[model] = seen.get(model, 0) + 1
        ax.plot(list(steps), list(losses), color=_color(model, i), ls=style, lw=1.2, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(frameon=False, fontsize=8)
    return _save(fig, path)


def plot_seed_curves(curves: Mapping[str, Sequence[tuple[Sequence[float], Sequence[Optional[float]]]]],
                     path: PathLike, *, ylabel: str, title: str, xlabel: str = "step", mean: bool = True,
                     color_by_model: bool = True, logx: bool = False,
                     marks: Optional[Mapping[str, float]] = None) -> Path:
    """Curves of many seeds, one colour per model: ``curves[name] = [(xs, ys) per seed]``. Every
    seed is drawn faint and, with ``mean``, the mean over seeds bold (at the x values every seed of
    that model has; a ``None`` value is left out); without ``mean`` (seeds on different x, such as
    wall-clock) the seeds alone, a little stronger. The colour is the model's (the first word of
    ``name``: "DIFF L0" is DIFF's), or with ``color_by_model=False`` one per name. The legend names
    one entry per name and sits outside the axes, so it never covers a curve. ``logx``: a log x
    axis; ``marks[name]``: an x value marked on that name's curve by a dotted line (a chosen value)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.4, 3.6))
    _seed_lines(ax, curves, mean=mean, color_by_model=color_by_model, marks=marks)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing drawn (no model has values): no legend
        ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return _save(fig, path)


def _seed_lines(ax, curves: Mapping[str, Sequence[tuple[Sequence[float], Sequence[Optional[float]]]]], *,
                mean: bool = True, color_by_model: bool = True, marks: Optional[Mapping[str, float]] = None) -> None:
    """The lines of :func:`plot_seed_curves` on ``ax``: every seed faint, the mean over seeds bold."""
    for i, (name, seeds) in enumerate(curves.items()):
        color = _color(name.split()[0], i) if color_by_model else f"C{i}"
        if marks and name in marks:
            ax.axvline(marks[name], color=color, ls=":", lw=1.2, label=f"{name}: best {_shown(marks[name])}")
        series = [[(x, y) for x, y in zip(xs, ys) if x is not None and y is not None] for xs, ys in seeds]
        series = [pts for pts in series if pts]
        if not series:
            continue
        seeds_text = f"{len(series)} seed{'s' if len(series) > 1 else ''}"
        common = sorted(set.intersection(*(set(x for x, _ in pts) for pts in series))) if mean else []
        for j, pts in enumerate(series):
            ax.plot([x for x, _ in pts], [y for _, y in pts], color=color, lw=0.8, alpha=0.25 if common else 0.55,
                    label=None if common or j else f"{name} ({seeds_text})")
        if common:
            values = [dict(pts) for pts in series]
            ax.plot(common, [sum(v[x] for v in values) / len(values) for x in common], color=color, lw=2.2,
                    label=f"{name}: mean of {seeds_text}")
    if mean and any(len(seeds) > 1 for seeds in curves.values()):
        ax.plot([], [], color="gray", lw=0.8, alpha=0.5, label="one seed (faint)")


def plot_seed_panels(panels: Mapping[str, Mapping[str, Sequence[tuple[Sequence[float], Sequence[Optional[float]]]]]],
                     path: PathLike, *, ylabel: str, title: str, xlabel: str = "step", logy: bool = False,
                     ylim: Optional[tuple[float, float]] = None) -> Path:
    """One panel per key of ``panels`` (an arm), each drawn as :func:`plot_seed_curves` draws its curves
    (``panels[panel][name] = [(xs, ys) per seed]``, a name such as a layer: one colour per name, every
    seed faint, the mean over seeds bold); the panels share the y axis. ``logy``: a log y axis."""
    plt = _plt()
    names = list(panels)
    cols = min(3, max(len(names), 1))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False, sharey=True)
    for k, name in enumerate(names):
        ax = axes[k // cols][k % cols]
        _seed_lines(ax, panels[name], color_by_model=False)
        if logy:
            ax.set_yscale("log")
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel with nothing drawn (no seed has values) has no legend
            ax.legend(frameon=False, fontsize=7)
    for k in range(len(names), rows * cols):
        axes[k // cols][k % cols].axis("off")
    for r in range(rows):
        axes[r][0].set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_nll_by_position(curves: Mapping[str, Sequence[float]], path: PathLike, *, train_len: Optional[int] = None,
                         n_bins: int = 64, title: str = "NLL by position") -> Path:
    """Mean NLL per position (``LMResult.nll_by_position``) per model, averaged in ``n_bins``
    bins; a dashed line marks the training length (beyond it: length extrapolation)."""
    from .lm import binned

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, (name, vals) in enumerate(curves.items()):
        n = len(vals)
        b = binned(vals, n_bins)
        width = n / len(b)
        ax.plot([(j + 0.5) * width for j in range(len(b))], b, color=_color(name.split()[0], i), label=name)
    if train_len is not None:
        ax.axvline(train_len, color="black", ls="--", lw=1, label="training length")
    ax.set_xlabel("position")
    ax.set_ylabel("NLL (nats)")
    ax.set_title(title)
    ax.legend(frameon=False, fontsize=8)
    return _save(fig, path)


def plot_lambda_per_layer(lambdas: Mapping[str, Sequence[float]], path: PathLike, *,
                          lambda_init: Optional[Sequence[float]] = None,
                          title: str = "Learned lambda per layer") -> Path:
    """``lambdas[label]`` one value per layer (labels such as ``"step 1000"`` or seeds)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for i, (name, vals) in enumerate(lambdas.items()):
        ax.plot(range(len(vals)), list(vals), marker="o", color=f"C{i}", label=name)
    if lambda_init is not None:
        ax.plot(range(len(lambda_init)), list(lambda_init), "k:", label="lambda_init")
    ax.set_xlabel("layer")
    ax.set_ylabel("lambda")
    ax.set_title(title)
    ax.legend(frameon=False, fontsize=8)
    return _save(fig, path)


def plot_benchmark(rows: Sequence[Mapping], path: PathLike, *, title: str = "DIFF vs baseline") -> Path:
    """Benchmark rows (dicts with ``seq_len``, ``mode``, ``name``, ``ms``, ``ratio``, as written by
    ``difftx bench --json`` and ``benchmarks/gpu_attention.py``): one column per mode, time
    against length on top (log-log) and the ratio to the baseline below: the paired per-round
    median with its 95% interval as a band where the rows have one (``paired``, ``paired_low``,
    ``paired_high``), else the ratio of medians."""
    plt = _plt()
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, axes = plt.subplots(2, len(modes), figsize=(4.2 * len(modes), 5.6), squeeze=False, sharex="col")
    for j, mode in enumerate(modes):
        top, bottom = axes[0][j], axes[1][j]
        for i, name in enumerate(names):
            pts = sorted((r["seq_len"], r["ms"], r["ratio"], r.get("paired"), r.get("paired_low"), r.get("paired_high"))
                         for r in rows if r["mode"] == mode and r["name"] == name)
            if not pts:
                continue
            T, ms, ratio, paired, low, high = zip(*pts)
            color = _color(name.split("/")[0], i)
            style = "-" if i == 0 else LINE_STYLES[i % len(LINE_STYLES)]  # the reference solid, the others apart
            top.plot(T, ms, color=color, ls=style, marker="o", ms=3, lw=1.2, label=name)
            banded = all(v is not None for v in low)
            bottom.plot(T, paired if banded else ratio, color=color, ls=style, marker="o", ms=3, lw=1.2)
            if banded:
                bottom.fill_between(T, low, high, color=color, alpha=0.15, lw=0)
        top.set_xscale("log", base=2)
        top.set_yscale("log")
        top.set_title(mode)
        top.set_ylabel("ms (median)")
        bottom.axhline(1.0, color="gray", lw=0.8)
        bottom.set_ylabel("time / baseline (band: 95%)")
        bottom.set_xlabel("sequence length T")
        top.legend(frameon=False, fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def plot_token_efficiency(curves: Mapping[str, Sequence[tuple[Sequence[float], Sequence[float]]]],
                          matched: Sequence[tuple[float, Optional[float], float]], path: PathLike, *,
                          title: str = "held-out loss along training (paper Fig. 3b)",
                          overall: Optional[Mapping] = None) -> Path:
    """Loss against training tokens (log axis), every seed faint and the seed mean bold per arm
    (``curves[name] = [(tokens, losses) per seed]``, the arm first, then the arm it is measured against, e.g. DIFF
    and the baseline); each matched point ``(t_arm, t_reference, loss)`` drawn as a horizontal segment from the
    arm's tokens to the reference's tokens of that loss (``None``: not reached, no segment). ``overall`` (a
    ``Ratio.to_dict()``) adds the overall tokens ratio and its interval to the title, or, where the curves cross
    (no overall value), the first and last ratios from its note."""
    arm, reference = list(curves)[0], list(curves)[-1]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, seeds) in enumerate(curves.items()):
        color = _color(name, i)
        for t, v in seeds:
            ax.plot(t, v, color=color, alpha=0.25, linewidth=0.8)
        t0 = seeds[0][0]
        ax.plot(t0, [sum(s[1][j] for s in seeds) / len(seeds) for j in range(len(t0))], color=color,
                linewidth=2, marker="o", markersize=3, label=f"{name} (mean of {len(seeds)} seeds)")
    for k, (td, tb, loss) in enumerate(matched):
        if tb is not None:
            ax.plot([td, tb], [loss, loss], color="black", linewidth=0.8, linestyle=":",
                    label=f"same loss: {arm} tokens -> {reference} tokens" if k == 0 else None)
            ax.plot([tb], [loss], marker="|", color="black", markersize=8)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out loss (nats/token)")
    if overall is not None and overall.get("value") is not None:
        title += f"\n{arm} tokens / {reference} tokens = {overall['value']:.3f}"
        title += (f" [{overall['low']:.3f}, {overall['high']:.3f}] (95%)" if overall.get("low") is not None
                  else " (no interval)")
    elif overall is not None and "cross" in (overall.get("note") or ""):  # no overall ratio: say why
        title += "\n" + overall["note"].split("; no overall")[0]
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_gap_along_training(gaps: Mapping[str, Sequence[Mapping]], path: PathLike, *, reference: str = PRIMARY[1],
                            title: Optional[str] = None) -> Path:
    """The paired held-out loss gap against training tokens (log axis), per arm: every seed's
    difference faint, the mean bold, and shaded where it has one the 95% interval of the median seed
    difference (a loss has no bounds, so no interval of its mean holds for every distribution of seeds; a
    file written before intervals named their estimand: its t and sign-flip hull) (``gaps[arm]``: the
    points of :func:`difftx.compare.summary.gap_along_training`, each against ``reference``); 0 marked."""
    title = title or f"held-out loss gap along training (arm - {reference})"
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, points) in enumerate(gaps.items()):
        color, t = _color(name, i), [g["tokens"] for g in points]
        for s in range(len(points[0]["values"])):
            ax.plot(t, [g["values"][s] for g in points], color=color, alpha=0.25, linewidth=0.8)
        ax.plot(t, [g["mean"] for g in points], color=color, linewidth=2, marker="o", markersize=3,
                label=f"{name} - {reference} (mean of {len(points[0]['values'])} seeds)")
        median = all(g.get("interval_of") == "median" for g in points)
        ends = ("median_low", "median_high") if median else ("low", "high")
        ci = [(x, g[ends[0]], g[ends[1]]) for x, g in zip(t, points) if g.get(ends[0]) is not None]
        if ci:
            ax.fill_between([c[0] for c in ci], [c[1] for c in ci], [c[2] for c in ci], color=color, alpha=0.15,
                            label=f"{name}: 95% interval of the median seed difference" if median else
                            f"{name}: 95% shift interval (t and sign-flip)")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out loss gap (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_parameter_efficiency(points: Mapping[str, tuple[Sequence[float], Sequence[Sequence[float]]]],
                              fits: Mapping[str, tuple], path: PathLike, *,
                              crossover: Optional[float] = None,
                              title: str = "held-out loss against model size (paper Fig. 3a)",
                              ratios: Optional[Mapping[float, Mapping]] = None,
                              lines: Optional[Mapping[str, tuple[float, float]]] = None) -> Path:
    """Loss against non-embedding parameters, log-log: per arm (``points[name] = (params,
    losses per seed)``) the seeds' points and the fitted curve from ``fits[name]``: ``(E, A, b)``
    for ``L = E + A N^-b`` (the floor fit), or ``(a, b)`` for the line ``log L = a + b log N``;
    ``lines`` (``{name: (a, b)}``) adds straight log-log lines, thin and dashed, for comparison. The
    crossover size, if given, as a vertical line. ``ratios`` (``{DIFF size: Ratio.to_dict()}``)
    writes each size's parameters ratio beside the first arm's curve."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lo = min(min(p) for p, _ in points.values())
    hi = max(max(p) for p, _ in points.values())
    grid = [lo * (hi / lo) ** (k / 50) for k in range(51)]

    def curve(f: tuple, n: float) -> float:
        return f[0] + f[1] * n ** -f[2] if len(f) == 3 else math.exp(f[0] + f[1] * math.log(n))

    def label(name: str, f: tuple) -> str:
        if len(f) == 3:
            return f"{name}: L = {f[0]:.3g} + {f[1]:.3g} N^-{f[2]:.3f}"
        return f"{name}: L = {math.exp(f[0]):.3g} N^{f[1]:.3f}"

    for i, (name, (params, seeds)) in enumerate(points.items()):
        color = _color(name, i)
        for row in seeds:
            ax.scatter(params, row, color=color, alpha=0.5, s=14)
        ax.plot(grid, [curve(fits[name], n) for n in grid], color=color, linewidth=2, label=label(name, fits[name]))
        if lines and name in lines:
            ax.plot(grid, [curve(lines[name], n) for n in grid], color=color, linewidth=0.9, linestyle="--",
                    label=f"{name}: straight log-log line")
    if ratios:
        first = fits[next(iter(points))]
        for n, r in ratios.items():
            if r.get("value") is not None:
                text = f"{r['value']:.2f}" + (f" [{r['low']:.2f}, {r['high']:.2f}]" if r.get("low") is not None else "")
                text += " (extrapolated)" if "extrapolated" in (r.get("note") or "") else ""
                ax.annotate(text, (n, curve(first, n)), textcoords="offset points", xytext=(4, 6), fontsize=7)
    if crossover is not None and lo <= crossover <= hi:
        ax.axvline(crossover, color="gray", linestyle="--", linewidth=1, label=f"curves cross at N = {crossover:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter

    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_recall_grid(curves: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]], path: PathLike, *,
                     title: str = "Associative recall: accuracy against pairs") -> Path:
    """One panel per group (``curves[arm][group] = [(pairs, mean accuracy), ...]``, a group being a variant
    and a length), one line per arm."""
    plt = _plt()
    arms = list(curves)
    groups = list(dict.fromkeys(g for arm in arms for g in curves[arm]))
    cols = min(3, max(len(groups), 1))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.8 * rows), squeeze=False, sharey=True)
    for k, g in enumerate(groups):
        ax = axes[k // cols][k % cols]
        for i, arm in enumerate(arms):
            pts = curves[arm].get(g) or []
            ax.plot([p for p, _ in pts], [a for _, a in pts], marker="o", label=arm, color=_color(arm, i))
        ax.set_xscale("log", base=2)
        ticks = sorted({p for arm in arms for p, _ in curves[arm].get(g) or []})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(0, 1.05)
        ax.set_title(g, fontsize=9)
        if k // cols == rows - 1 or k + cols >= len(groups):
            ax.set_xlabel("key-value pairs")
    for k in range(len(groups), rows * cols):
        axes[k // cols][k % cols].axis("off")
    axes[0][0].set_ylabel("accuracy (mean over seeds)")
    axes[0][0].legend(frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _shown(value) -> str:
    """A marked value in a legend: a number in ``%g``, a name (``torch``) as it is."""
    return str(value) if isinstance(value, str) else f"{value:g}"
