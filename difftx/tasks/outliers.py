"""Activation outliers (paper Table 5): the largest magnitudes of the pre-softmax attention logits
(both maps for DIFF) and of the hidden states over a fixed token budget, against their median."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import Metric, Task, positive, setting
from .common import probe_prompts, recall_prompts
from .reporting import ReportContext, fmt, table

PAPER = {"scale": "3B parameters (paper Table 5)",
         "Transformer": {"attention_logits": 318.0, "hidden_states": 3608.6},
         "DIFF": {"attention_logits": 38.8, "hidden_states": 1688.2}}
QUANTITIES = ("attention_logits", "hidden_states")
STATS = ("top1", "top2", "top3", "top10", "top100", "median", "top1_over_median")


@dataclass(frozen=True)
class OutlierSettings:
    tokens: int = setting(4096, "token budget: held-out text windows (or needle prompts, or recall examples, without "
                                "text)")

    def __post_init__(self) -> None:
        positive(self, "tokens")


class OutlierTask(Task):
    name = "outliers"
    title = "Activation outliers"
    help = "largest attention-logit and hidden-state magnitudes over a token budget"
    Settings = OutlierSettings

    def applies(self, subject, settings) -> Optional[str]:
        if not subject.has_text and subject.needle is None and subject.recall is None:
            return "the model has no held-out text, needle task or recall task to take its inputs from"
        return None

    def run(self, subject, s: OutlierSettings, *, progress: bool = False) -> dict:
        import torch

        from ..eval.lm import spread_windows
        from ..eval.outliers import activation_outliers

        if subject.has_text:
            held = subject.heldout()
            w, _ = spread_windows(held.tokens, held.train_len, max(1, s.tokens // held.train_len))
            tokens, source = w[:, :-1], held.source
        elif subject.needle is None and subject.recall is not None:
            tokens, source = recall_prompts(subject, max(1, s.tokens // subject.recall.seq_len))
        else:
            n = max(1, s.tokens // subject.needle.context_len)
            tokens = torch.tensor([p.prompt for p in probe_prompts(subject, None, n)[0]])
            source = "needle prompts"
        res = activation_outliers(subject.model, tokens, token_budget=s.tokens, progress=progress)
        res["source"] = source
        return res

    def metrics(self, settings) -> list[Metric]:
        out = []
        for q, name in (("attention_logits", "logit"), ("hidden_states", "hidden")):
            what = q.replace("_", " ").replace("states", "state")
            out.append(Metric(f"outlier_{name}_top1", f"{what} magnitude top-1", True, lambda r, q=q: r[q]["top1"],
                              digits=2))
            out.append(Metric(f"outlier_{name}_top1_over_median", f"{what} magnitude top-1 / median", True,
                              lambda r, q=q: r[q]["top1_over_median"], digits=2))
        return out

    def report(self, ctx: ReportContext) -> str:
        o0 = ctx.result(self.name)
        rows = [[ctx.name(a), q.replace("_", " ")] + [fmt(ctx.result(self.name, a)[q][x], 2) for x in STATS]
                for a in ctx.arms for q in QUANTITIES]
        rows += [[f"{ctx.name(a)}, paper ({PAPER['scale']})", q.replace("_", " "), fmt(paper[q], 1)] + ["-"] * 6
                 for a, paper in ctx.paper_arms(PAPER) for q in QUANTITIES]  # the paper's DIFF and Transformer, where compared
        return "\n".join([f"## {self.title}\n",
                          f"Over {o0['tokens']} tokens of {str(o0['source']).removeprefix('all of ')}"
                          + (f"; {ctx.two_maps()} logits include both softmax maps. " if ctx.two_maps() else ". ")
                          + f"Seed {ctx.first}:\n",
                          table(rows, ["model", "quantity", "top-1", "top-2", "top-3", "top-10", "top-100", "median",
                                       "top-1/median"]),
                          "Over seeds:\n", ctx.comparison_table(ctx.metric_keys(self.name), 2)])

    def plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        from ..eval import plots as P

        return {"outliers": P.plot_outliers({ctx.short(a): ctx.result(self.name, a) for a in ctx.arms},
                                            folder / "outliers.png")}

    def print(self, res: dict) -> None:
        print(f"over {res['tokens']} tokens of {res['source']}")
        for q in QUANTITIES:
            s = res[q]
            print(f"{q:17s} top1 {s['top1']:.2f}  top10 {s['top10']:.2f}  median {s['median']:.3f}  "
                  f"top1/median {s['top1_over_median']:.1f}")


TASK = OutlierTask()
