"""Attention to the answer and attention noise (paper Table 3, Figure 1): at the position that
emits the first answer token of needle prompts, the L1-normalised attention row's mass on the
answer needle's value tokens and on filler tokens, per layer (head mean and best head).

Measured on every needle cell at every depth (the paper's Table 3 reads it at five depths), on
all prompts and on the prompts the model answered correctly. In a comparison each cell is
compared only where both models learned it (its needle accuracy clears the copy floor), and the
report leads with the hardest such cell: attention to the answer of a model that does not
retrieve says nothing about noise cancellation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import Metric, Task, parse_cells, positive, setting
from .common import EVAL_SEED, check_context, fitting_cells, no_needle_task
from .reporting import ReportContext, fmt, table

PAPER = {"scale": "3B parameters (paper Table 3; ranges over needle depths)",
         "Transformer": {"answer": "0.03-0.09", "noise": "0.49-0.54"},
         "DIFF": {"answer": "0.27-0.40", "noise": "0.01-0.02"}}
VARIANTS_REPORTED = ("absolute", "signed")


@dataclass(frozen=True)
class AttentionSettings:
    samples: int = setting(10, "needle prompts per cell and depth")
    cells: tuple = setting(((1, 1), (2, 2), (4, 2), (6, 2)), "needle cells N/R (those the model's task cannot pose "
                                                            "are left out)", parse_cells)
    depths: tuple = setting((0.0, 0.25, 0.5, 0.75, 1.0), "depths of the answer needle in [0, 1]")
    context_len: int = setting(256, "prompt tokens of the natural-language form (text models)")

    def __post_init__(self) -> None:
        positive(self, "samples", "context_len")
        if not self.cells:
            raise ValueError("AttentionSettings.cells: needs at least one N/R cell")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"AttentionSettings.depths: need depths in [0, 1], got {self.depths}")


def _key(cell: str) -> str:
    return cell.replace("/", "_")


def _cell_prompts(subject, n: int, r: int, depths, samples: int, context_len: int):
    """Prompts of one cell at every depth, and whether the model answers each correctly (``None``
    for the natural-language form, whose answers are not scored here)."""
    from ..eval.needle import needle_samples, score_sample
    from ..eval.needle_text import text_needle_probes
    from ..generation import generate

    if subject.needle is None:
        tok = subject.tokenizer
        probes = [p for d in depths
                  for p in text_needle_probes(tok.encode, tok.decode, n, r, d, samples, context_len, seed=EVAL_SEED)]
        return probes, None
    task = subject.needle
    probes = [p for d in depths for p in needle_samples(task, n, r, d, samples, seed=EVAL_SEED)]
    gens = generate(subject.model, [p.prompt for p in probes], task.answer_len(r), temperature=0.0,
                    stop_tokens=[task.EOS], pad_id=task.PAD)
    return probes, [int(all(o == "correct" for o in score_sample(task, p, g))) for p, g in zip(probes, gens)]


class AttentionTask(Task):
    name = "attention"
    title = "Attention to the answer and attention noise"
    help = "attention mass on the answer needle and on filler at the first answer position, per cell and layer"
    Settings = AttentionSettings

    def applies(self, subject, settings) -> Optional[str]:
        return no_needle_task(subject)

    def run(self, subject, s: AttentionSettings, *, progress: bool = False) -> dict:
        from ..eval.attention_noise import attention_report

        cells = fitting_cells(subject, s.cells, at_least_one=True)
        check_context([s.context_len] if subject.needle is None else [], subject.model, "attention --context-len",
                      text=True)
        out: dict = {"form": "synthetic" if subject.needle is not None else "text", "depths": list(s.depths),
                     "samples_per_depth": s.samples, "cells": {},
                     "dropped_cells": [f"{n}/{r}" for n, r in s.cells if (n, r) not in cells]}
        for n, r in cells:
            probes, correct = _cell_prompts(subject, n, r, s.depths, s.samples, s.context_len)
            res = attention_report(subject.model, probes)
            rec = res.pop("per_sample")
            res["records"] = {**rec, "correct": correct}
            res["correct_only"] = None if not correct or not any(correct) else {
                v: {part: sum(x for x, c in zip(rec[part][v], correct) if c) / sum(correct)
                    for part in ("answer", "noise")} for v in VARIANTS_REPORTED}
            res["accuracy"] = None if correct is None else sum(correct) / len(correct)
            out["cells"][f"{n}/{r}"] = res
        return out

    def metrics(self, s: AttentionSettings) -> list[Metric]:
        out = []
        for n, r in s.cells:
            c, gate = f"{n}/{r}", f"needle_{n}_{r}"
            for part, lower in (("answer", False), ("noise", True)):
                what = "attention to answer" if part == "answer" else "attention noise"
                out.append(Metric(f"attn_{part}_{_key(c)}", f"{what} at N/R={c} (absolute, mean over heads, layers "
                                  "and depths)", lower,
                                  lambda res, c=c, p=part: res["cells"][c]["summary"]["absolute"][p],
                                  per_example=lambda res, c=c, p=part: res["cells"][c]["records"][p]["absolute"],
                                  groups=lambda res, c=c, g=gate: [g] * len(res["cells"][c]["records"]["answer"]
                                                                            ["absolute"]),
                                  gate="all", bounds=(0.0, 1.0)))
                out.append(Metric(f"attn_{part}_correct_{_key(c)}", f"{what} at N/R={c}, correctly answered prompts "
                                  "only (absolute)", lower, lambda res, c=c, p=part: _correct_only(res, c, p),
                                  gated_by=gate, gate="all", bounds=(0.0, 1.0)))
        return out

    def headline_cell(self, ctx: ReportContext) -> tuple[str, bool]:
        """The hardest cell both models learned (``True``), else the easiest measured (``False``)."""
        cells = list(ctx.result(self.name)["cells"])
        learned = [c for c in cells if (ctx.comparison(f"attn_answer_{_key(c)}") or {}).get("gated") is None
                   and ctx.comparison(f"attn_answer_{_key(c)}") is not None]
        return (learned[-1], True) if learned else (cells[0], False)

    def report(self, ctx: ReportContext) -> str:
        cell, learned = self.headline_cell(ctx)
        r0 = ctx.result(self.name)
        out = [f"## {self.title}\n",
               f"At the position emitting the first answer token of {r0['samples_per_depth']} {r0['form']} prompts per "
               f"depth ({', '.join(f'{round(d * 100)}%' for d in r0['depths'])}) in every needle cell; each head's row "
               "divided by its L1 norm; answer = the answer needle's value tokens, noise = filler tokens. "
               + (f"{ctx.two_maps()} rows are `A1 - lambda*A2` and may be negative (absolute and signed variants). "
                  if ctx.two_maps() else "") + "A cell is compared only where both models learned it.\n"]
        out.append(f"**Headline cell: N/R = {cell}**" + (" (the hardest cell both models learned)." if learned else
                                                      " (no cell was learned by both models: shown for reference, "
                                                      "not compared)."))
        rows = []
        for a in ctx.arms:
            c = ctx.result(self.name, a)["cells"][cell]
            co = c.get("correct_only") or {}
            rows.append([ctx.name(a), fmt(c.get("accuracy"), 2)]
                        + [fmt(c["summary"][v][p]) for v in VARIANTS_REPORTED for p in ("answer", "noise")]
                        + [fmt(co.get("absolute", {}).get(p)) for p in ("answer", "noise")])
        rows += [[f"{ctx.name(a)}, paper ({PAPER['scale']})", "-", paper["answer"], paper["noise"], "-", "-",
                  "-", "-"] for a, paper in ctx.paper_arms(PAPER)]  # the paper's DIFF and Transformer, where compared
        out.append(f"\nSeed {ctx.first}:\n")
        out.append(table(rows, ["model", "accuracy", "answer (abs)", "noise (abs)", "answer (signed)",
                                "noise (signed)", "answer, correct only", "noise, correct only"]))
        out.append("Over seeds, every cell compared:\n")
        compared = [k for k in ctx.metric_keys(self.name) if ctx.comparison(k) and not ctx.comparison(k)["gated"]]
        out.append(ctx.comparison_table(compared) or "No cell was learned by both models.\n")
        rows = [[ctx.name(a), str(lay["layer"]), fmt(lay["answer_mean"]["absolute"]),
                 fmt(lay["answer_best"]["absolute"]),
                 fmt(lay["noise_mean"]["absolute"]), fmt(lay["noise_best"]["absolute"])]
                for a in ctx.arms for lay in ctx.result(self.name, a)["cells"][cell]["layers"]]
        out.append(f"Per layer at N/R = {cell} (seed {ctx.first}, absolute variant):\n")
        out.append(table(rows, ["model", "layer", "answer, head mean", "answer, best head", "noise, head mean",
                                "noise, best head"]))
        return "\n".join(out)

    def plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        from ..eval import plots as P

        cell, _ = self.headline_cell(ctx)
        rows = {ctx.name(a): ctx.result(self.name, a)["cells"][cell]["rows"][0]["layers"][-1] for a in ctx.arms}
        roles = ctx.result(self.name)["cells"][cell]["rows"][0]["roles"]
        return {"attention to answer": P.plot_attention_to_answer(
            rows, roles, folder / "attention_to_answer.png",
            title=f"First answer token, N/R={cell}, last layer, head mean (seed {ctx.first})")}

    def print(self, a: dict) -> None:
        print(f"attention at the first answer position: {a['form']} needle prompts, {a['samples_per_depth']} per depth "
              f"at depths {', '.join(str(d) for d in a['depths'])}; mass of the L1-normalised row, mean over heads, "
              "layers and prompts (absolute variant)")
        print(f"{'cell':>5}  {'accuracy':>8}  {'answer':>7}  {'noise':>7}  {'answer, correct':>15}  "
              f"{'noise, correct':>14}")
        for cell, c in a["cells"].items():
            co = (c.get("correct_only") or {}).get("absolute", {})
            print(f"{cell:>5}  {fmt(c.get('accuracy'), 2):>8}  {c['summary']['absolute']['answer']:7.4f}  "
                  f"{c['summary']['absolute']['noise']:7.4f}  {fmt(co.get('answer'), 4):>15}  "
                  f"{fmt(co.get('noise'), 4):>14}")
        cell = list(a["cells"])[-1]
        print(f"per layer at N/R {cell} (best head in brackets):")
        print(f"{'layer':>5}  {'variant':8}  {'answer mean':>11}  {'best head':>13}  {'noise mean':>10}  "
              f"{'best head':>13}")
        for lay in a["cells"][cell]["layers"]:
            for v in VARIANTS_REPORTED:
                ans, noi = lay["answer_heads"][v], lay["noise_heads"][v]
                print(f"{lay['layer']:>5}  {v:8}  {lay['answer_mean'][v]:11.4f}  "
                      f"{lay['answer_best'][v]:7.4f} (h{ans.index(max(ans))})  {lay['noise_mean'][v]:10.4f}  "
                      f"{lay['noise_best'][v]:7.4f} (h{noi.index(min(noi))})")
        if a.get("dropped_cells"):
            print(f"cells the model's task cannot pose (not run): {', '.join(a['dropped_cells'])}")


def _correct_only(res: dict, cell: str, part: str):
    co = res["cells"][cell]["correct_only"]
    return None if co is None else co["absolute"][part]


TASK = AttentionTask()
