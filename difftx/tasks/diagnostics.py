"""Diagnostics: the learned lambda per layer (DIFF) and head redundancy (mean pairwise cosine of
the heads' effective attention maps), on needle prompts (compare models) or held-out windows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import Task, parse_cell, positive, setting
from .common import probe_prompts, recall_prompts
from .reporting import ReportContext, fmt, table


@dataclass(frozen=True)
class DiagnosticsSettings:
    samples: int = setting(8, "needle prompts (compare models; recall examples without needles) or held-out "
                              "windows (text models)")
    cell: Optional[tuple] = setting(None, "needle cell N/R of the prompts (default 4/2), clipped to the most the "
                                          "model's needle task has", parse_cell)
    batch_size: int = setting(4, "sequences per forward (bounds the memory of the captured maps)")

    def __post_init__(self) -> None:
        positive(self, "samples", "batch_size")


class DiagnosticsTask(Task):
    name = "diagnostics"
    title = "Diagnostics"
    help = "learned lambda and head redundancy per layer"
    Settings = DiagnosticsSettings

    def run(self, subject, s: DiagnosticsSettings, *, progress: bool = False) -> dict:
        import torch

        from ..eval.diagnostics import lambda_summary, model_head_redundancy
        from ..eval.lm import spread_windows

        if subject.needle is not None:
            probes, info = probe_prompts(subject, s.cell, s.samples)
            tokens = torch.tensor([p.prompt for p in probes])  # (samples, context_len)
            on = {"source": "needle prompts", **info}
        elif subject.recall is not None and not subject.has_text:
            tokens, source = recall_prompts(subject, s.samples)
            on = {"source": source, "n_samples": len(tokens), "seq_len": int(tokens.shape[1])}
        elif subject.has_text:
            held = subject.heldout()
            tokens = spread_windows(held.tokens, held.train_len, s.samples)[0][:, :-1]  # (samples, seq_len)
            on = {"source": held.source, "n_samples": len(tokens), "seq_len": held.train_len}
        else:  # trained on a task of your own alone: lambda, and no inputs to compare the heads' maps on
            return {**lambda_summary(subject.model), "head_redundancy_on": None,
                    "head_redundancy": [None] * len(subject.model.layers),
                    "null_reasons": {"head_redundancy": "the model has no held-out text, needle task or recall task "
                                                        "to take inputs from"}}
        redundancy = model_head_redundancy(subject.model, tokens, batch_size=s.batch_size)
        out = {**lambda_summary(subject.model), "head_redundancy_on": on,
               "head_redundancy": [None if math.isnan(v) else v for v in redundancy]}
        if any(v is None for v in out["head_redundancy"]):
            out["null_reasons"] = {"head_redundancy": "a layer with a single head has no pair of heads to compare"}
        return out

    def report(self, ctx: ReportContext) -> str:
        j = lambda xs: ", ".join(fmt(x) for x in xs)  # noqa: E731
        base, arm = ctx.arms  # the primary pair: its lambda is the first arm's (the one measured against the second)
        rows, why = [], []
        for sd in ctx.seeds:
            d, b = ctx.result(self.name, arm, sd), ctx.result(self.name, base, sd)
            rows.append([sd, j(d["lambda"]), j(d["lambda_init"]), j(d["head_redundancy"]), j(b["head_redundancy"])])
            for r in (d, b):
                reason = r.get("null_reasons", {}).get("head_redundancy")
                if reason is not None and reason not in why:
                    why.append(reason)
        dn, bn = ctx.short(arm), ctx.short(base)
        dash = f"; '-': {'; '.join(why)}" if why else ""  # the reasons the results record, not a guess
        return (f"## {self.title}\n\n" + table(rows, ["seed", f"{dn} lambda per layer (final)", "lambda_init",
                                                       f"{dn} head redundancy per layer",
                                                       f"{bn} head redundancy per layer"])
                + "\nHead redundancy: mean pairwise cosine similarity of the heads' effective maps (1 = identical "
                  f"heads{dash}).\n")

    def plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        from ..eval import plots as P

        arm = ctx.arms[-1]
        lam = {f"seed {sd} final": ctx.result(self.name, arm, sd)["lambda"] for sd in ctx.seeds}
        if all(v is None for vals in lam.values() for v in vals):  # an arm without a lambda (one map, gated, ...)
            return {}
        hist = [r for r in ctx.train(arm).get("history", []) if r.get("lambda")]
        for r in hist[:1] + hist[len(hist) // 2:len(hist) // 2 + 1]:
            lam[f"seed {ctx.first} step {r['step']}"] = r["lambda"]
        return {"lambda per layer": P.plot_lambda_per_layer(
            lam, folder / "lambda_per_layer.png", lambda_init=ctx.result(self.name, arm)["lambda_init"])}

    def print(self, res: dict) -> None:
        on = res["head_redundancy_on"]
        what = (f"{on['n_samples']} needle prompts (cell {on['cell']})" if "cell" in on else
                f"{on['n_samples']} windows of {on['seq_len']} tokens of {on['source']}")
        print(f"head redundancy (mean pairwise cosine of the heads' maps) over {what}")
        f = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
        print(f"{'layer':>5}  {'lambda':>8}  {'lambda_init':>11}  {'head redundancy':>15}")
        for i, (lam, init, red) in enumerate(zip(res["lambda"], res["lambda_init"], res["head_redundancy"])):
            print(f"{i:>5}  {f(lam):>8}  {f(init):>11}  {f(red):>15}")


TASK = DiagnosticsTask()
