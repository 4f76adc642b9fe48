"""Multi-needle retrieval (paper section 3.4): per-key exact match over N/R x depth cells, the
error classes of wrong answers, accuracy by depth and a depth x length heatmap. A compare
model runs the synthetic token-level form; a text model the natural-language (LWM) form."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..needle_cells import DEFAULT_DEPTHS, DEFAULT_GRID
from .base import Metric, Task, parse_cell, parse_cells, positive, setting
from .common import DEFAULT_CELL, check_context, fitting_cells, no_needle_task, run_needles
from .common import probe_prompts  # noqa: F401 - where tasks written before difftx.tasks.common import it from
from .reporting import ReportContext, call, ci, fmt, pair, table
from .subject import BlockKind, register_block

PAPER = {"scale": "3B parameters, 4K context (paper section 3.4)", "grid": ["1/1", "2/2", "4/2", "6/2"],
         "Transformer": [1.00, 0.85, 0.62, 0.55], "DIFF": [1.00, 0.92, 0.84, 0.85]}
OUTCOME_KINDS = ("distraction", "hallucination", "malformed")


@dataclass(frozen=True)
class NeedleSettings:
    samples_per_cell: int = setting(50, "prompts per N/R x depth cell")
    grid: tuple = setting(DEFAULT_GRID, "N/R cells, e.g. 1/1,2/2,4/2,6/2", parse_cells)
    depths: tuple = setting(DEFAULT_DEPTHS, "depths of the answer needle in [0, 1]")
    heatmap_lengths: tuple = setting((), "context lengths of the depth x length heatmap (empty: none)")
    heatmap_cell: tuple = setting(DEFAULT_CELL, "N/R cell of the heatmap", parse_cell)
    context_len: int = setting(256, "prompt tokens of the natural-language form (text models)")
    batch_size: int = setting(50, "prompts decoded together")

    def __post_init__(self) -> None:
        positive(self, "samples_per_cell", "context_len", "batch_size")
        if not self.grid:
            raise ValueError("NeedleSettings.grid: needs at least one N/R cell")
        for n, r in (*self.grid, self.heatmap_cell):
            if not 1 <= r <= n:
                raise ValueError(f"NeedleSettings: cell N/R = {n}/{r} needs 1 <= R <= N")
        if any(not 0.0 <= d <= 1.0 for d in self.depths) or not self.depths:
            raise ValueError(f"NeedleSettings.depths: need at least one depth in [0, 1], got {self.depths}")
        if any(not isinstance(x, int) or x <= 0 for x in self.heatmap_lengths):
            raise ValueError(f"NeedleSettings.heatmap_lengths: must be positive integers, got {self.heatmap_lengths}")


class NeedleTask(Task):
    name = "needle"
    title = "Multi-needle retrieval"
    help = "multi-needle retrieval: accuracy per N/R cell and depth, error classes, heatmap"
    Settings = NeedleSettings

    def applies(self, subject, settings) -> Optional[str]:
        return no_needle_task(subject)

    def run(self, subject, s: NeedleSettings, *, progress: bool = False) -> dict:
        grid = fitting_cells(subject, s.grid, at_least_one=True)
        text = subject.needle is None  # the synthetic form has its trained length
        check_context([*([s.context_len] if text else []), *s.heatmap_lengths], subject.model,
                      "needle --context-len / --heatmap-lengths", text=text)
        res = run_needles(subject, grid, s.depths, s.samples_per_cell, context_len=s.context_len,
                          batch_size=s.batch_size, progress=progress)
        out = {"grid": res.to_dict(), "dropped_cells": [f"{n}/{r}" for n, r in s.grid if (n, r) not in grid],
               "records": {"cell": [], "depth": [], "correct_fraction": []}}
        for c in res.cells:
            for k in c.correct_per_sample:
                out["records"]["cell"].append(f"{c.n_needles}/{c.n_query}")
                out["records"]["depth"].append(c.depth)
                out["records"]["correct_fraction"].append(k / c.n_query)
        if s.heatmap_lengths and fitting_cells(subject, [s.heatmap_cell]):
            n, r = s.heatmap_cell
            hm = run_needles(subject, [(n, r)], s.depths, s.samples_per_cell, lengths=s.heatmap_lengths,
                             context_len=s.context_len, batch_size=s.batch_size, progress=progress)
            depths, lengths, acc = hm.heatmap(n, r)
            out["heatmap"] = {"cell": f"{n}/{r}", "depths": depths, "lengths": lengths, "accuracy": acc}
        return out

    def metrics(self, s: NeedleSettings) -> list[Metric]:
        out = [Metric(f"needle_{n}_{r}", f"needle accuracy N={n}/R={r}", False,
                      lambda res, k=f"{n}/{r}": res["grid"]["accuracy"].get(k),
                      per_example=lambda res, k=f"{n}/{r}": _cell_records(res, k), floor=floor(n),
                      bounds=(0.0, 1.0))
               for n, r in s.grid]
        out.append(Metric("needle_mean", "needle accuracy, mean over the cells learned", False,
                          lambda res: sum(res["grid"]["accuracy"].values()) / len(res["grid"]["accuracy"]),
                          primary=True, per_example=lambda res: res["records"]["correct_fraction"], bounds=(0.0, 1.0),
                          groups=lambda res: [f"needle_{c.replace('/', '_')}" for c in res["records"]["cell"]]))
        out += [Metric(f"needle_{o}_rate", f"needle {o} rate (share of queried keys)", True,
                       lambda res, o=o: res["grid"]["outcome_rates"][o], bounds=(0.0, 1.0)) for o in OUTCOME_KINDS]
        return out

    def report(self, ctx: ReportContext) -> str:
        s = ctx.settings(self.name)
        grid = [f"{n}/{r}" for n, r in s["grid"]]
        keys = [f"needle_{g.replace('/', '_')}" for g in grid]
        depths = ", ".join(f"{round(d * 100)}%" for d in s["depths"])
        out = [f"## {self.title}\n", f"Per-key exact match, greedy decoding, {s['samples_per_cell']} prompts per N/R x "
               f"depth cell, depths {depths}. Mean over seeds [95% CI].\n"]
        rows = []
        for a in ctx.arms:
            rows.append([f"{ctx.name(a)}, this run"] + [ci(*_mean_ci(ctx.comparison(k), a), 2) for k in keys])
        cs = [ctx.comparison(k) for k in keys]
        b, a = (ctx.short(x) for x in ctx.arms)
        rows.append([f"{a} - {b} (paired)"] + [pair(c, 2) if c else "-" for c in cs])
        rows.append(["verdict"] + [call(c, ctx.short) if c else "-" for c in cs])
        for a, paper in ctx.paper_arms(PAPER):  # the paper's DIFF and Transformer, where they are compared
            rows.append([f"{ctx.name(a)}, paper ({PAPER['scale']})"]
                        + [fmt(paper[PAPER["grid"].index(g)], 2) if g in PAPER["grid"] else "-" for g in grid])
        out.append(table(rows, ["model"] + [f"N={g.split('/')[0]}, R={g.split('/')[1]}" for g in grid]))
        first = ctx.comparison(keys[0])
        if first is None or first["gated"]:
            out.append(f"**Neither model has learned retrieval at N/R = {grid[0]}** (no model's interval lies above "
                       f"the floor {floor(s['grid'][0][0]):.2f}): nothing in this section is compared.\n")
        out.append("A model that copies a random needle's value instead of the queried one scores about 1/N. Wrong "
                   "answers as a share of all queried keys (distraction: another needle's value; hallucination: a "
                   "value that appears nowhere in the context; malformed: anything else):\n")
        out.append(ctx.comparison_table([f"needle_{o}_rate" for o in OUTCOME_KINDS]))
        for a in ctx.arms:
            bd = ctx.result(self.name, a)["grid"]["by_depth"]
            out.append(f"{ctx.name(a)} (seed {ctx.first}) accuracy by depth: " + "; ".join(
                f"{cell}: " + ", ".join(f"{float(d):.2f}->{v:.2f}" for d, v in row.items()) for cell, row in bd.items())
                + "\n")
        return "\n".join(out)

    def plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        from ..eval import plots as P

        grid = [f"{n}/{r}" for n, r in ctx.settings(self.name)["grid"]]
        acc = {ctx.short(a): {g: ctx.comparison(f"needle_{g.replace('/', '_')}")["means"][a] for g in grid
                          if ctx.comparison(f"needle_{g.replace('/', '_')}")} for a in ctx.arms}
        made = {"needle accuracy": P.plot_needle_accuracy(
            acc, folder / "needle_accuracy.png", title=f"Multi-needle retrieval (mean over {len(ctx.seeds)} seed(s))")}
        for a in ctx.arms:
            hm = ctx.result(self.name, a).get("heatmap")
            if hm:
                made[f"needle heatmap {a}"] = P.plot_needle_heatmap(
                    hm["depths"], hm["lengths"], hm["accuracy"], folder / f"needle_heatmap_{a}.png",
                    title=f"{ctx.name(a)}: N/R={hm['cell']}, depth x length")
        return made

    def print(self, res: dict) -> None:
        g = res["grid"]
        form = g["config"].get("form", "synthetic")
        print(f"{form} needles, {g['config']['samples_per_cell']} prompts per cell and depth; per-key exact match:")
        print("  accuracy   " + "  ".join(f"N/R {k}: {v:.2f}" for k, v in g["accuracy"].items()))
        print("  wrong keys " + "  ".join(f"{k}: {v:.2f}" for k, v in g["outcome_rates"].items() if k != "correct")
              + "  (distraction: another needle's value; hallucination: a value not in the context; "
                "malformed: anything else)")
        first, acc = next(iter(g["accuracy"].items()))
        n = int(first.split("/")[0])
        if acc <= floor(n):
            print(f"  not learned: accuracy at N/R {first} is {acc:.2f}, not above the floor {floor(n):.2f} "
                  "(1/N for copying a random needle; 0.1 for one needle)")
        if res.get("dropped_cells"):
            print(f"  cells the model's task cannot pose (not run): {', '.join(res['dropped_cells'])}")


def floor(n_needles: int) -> float:
    """Accuracy of a model that has not learned key matching: copying a random needle's value
    scores 1/N; for a single needle, 0.1 stands for "no real retrieval"."""
    return 1.0 / n_needles if n_needles >= 2 else 0.1


def _cell_records(res: dict, cell: str) -> list[float]:
    r = res["records"]
    return [v for c, v in zip(r["cell"], r["correct_fraction"]) if c == cell]


def _mean_ci(c: Optional[dict], arm: str):
    return (None, [None]) if c is None else (c["means"][arm], c["cis"][arm])


def _write_block(block, space) -> dict:
    return {"needle_task": block.to_dict() if block is not None else None}


def _read_block(data: dict, before: dict):
    from ..eval.needle import NeedleBlock

    return NeedleBlock(**data["needle_task"]) if data.get("needle_task") else None


# the needle training task's block (ids from 0) in compare_task.json
register_block("needle", BlockKind(_write_block, _read_block, lambda block: block.vocab_size, "needle task"))
TASK = NeedleTask()
