"""Attention to the answer and attention noise (paper Table 3, Figure 1): at the position that
emits the first answer token of needle prompts, the L1-normalised attention row's mass on the
answer needle's value tokens and on filler tokens, per layer (head mean and best head)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import Metric, Task, parse_cell, positive, setting
from .needle import probe_prompts
from .reporting import NAMES, ReportContext, fmt, table

PAPER = {"scale": "3B parameters (paper Table 3; ranges over needle depths)",
         "baseline": {"answer": "0.03-0.09", "noise": "0.49-0.54"},
         "diff": {"answer": "0.27-0.40", "noise": "0.01-0.02"}}
VARIANTS_REPORTED = ("absolute", "signed")


@dataclass(frozen=True)
class AttentionSettings:
    samples: int = setting(50, "needle prompts probed (depth 0.5)")
    cell: Optional[tuple] = setting(None, "needle cell N/R of the prompts (default 4/2, or the most the model's "
                                          "needle task has)", parse_cell)
    context_len: int = setting(256, "prompt tokens of the natural-language form (text models)")

    def __post_init__(self) -> None:
        positive(self, "samples", "context_len")


class AttentionTask(Task):
    name = "attention"
    title = "Attention to the answer and attention noise"
    help = "attention mass on the answer needle and on filler at the first answer position, per layer"
    Settings = AttentionSettings

    def run(self, subject, s: AttentionSettings, *, progress: bool = False) -> dict:
        from ..eval.attention_noise import attention_report

        probes, info = probe_prompts(subject, s.cell, s.samples, s.context_len)
        res = attention_report(subject.model, probes)
        res["records"] = res.pop("per_sample")
        return {**info, **res}

    def metrics(self, settings) -> list[Metric]:
        out = []
        for v in VARIANTS_REPORTED:
            out.append(Metric(f"attn_answer_{v}", f"attention to answer ({v}, mean over heads and layers)", False,
                              lambda r, v=v: r["summary"][v]["answer"],
                              per_example=lambda r, v=v: r["records"]["answer"][v]))
            out.append(Metric(f"attn_noise_{v}", f"attention noise ({v}, mean over heads and layers)", True,
                              lambda r, v=v: r["summary"][v]["noise"],
                              per_example=lambda r, v=v: r["records"]["noise"][v]))
        return out

    def report(self, ctx: ReportContext) -> str:
        r0 = ctx.result(self.name)
        out = [f"## {self.title} (N/R = {r0['cell']}, depth 50%, {r0['n_samples']} {r0['form']} prompts)\n",
               "Each head's row at the first answer position divided by its L1 norm; answer = the answer needle's "
               "value tokens, noise = filler tokens. DIFF rows are `A1 - lambda*A2` and may be negative, hence the "
               "absolute and signed variants. Mean over seeds [95% CI]:\n",
               ctx.comparison_table(ctx.metric_keys(self.name))]
        out.append(table([[f"{part}, paper ({PAPER['scale']})", PAPER["baseline"][part], PAPER["diff"][part]]
                          for part in ("answer", "noise")], ["", "baseline", "DIFF"]))
        rows = [[NAMES[a], str(lay["layer"]), fmt(lay["answer_mean"]["absolute"]), fmt(lay["answer_best"]["absolute"]),
                 fmt(lay["noise_mean"]["absolute"]), fmt(lay["noise_best"]["absolute"])]
                for a in ctx.arms for lay in ctx.result(self.name, a)["layers"]]
        out.append(f"Per layer (seed {ctx.first}, absolute variant):\n")
        out.append(table(rows, ["model", "layer", "answer, head mean", "answer, best head", "noise, head mean",
                                "noise, best head"]))
        return "\n".join(out)

    def plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        from ..eval import plots as P

        rows = {NAMES[a]: ctx.result(self.name, a)["rows"][0]["layers"][-1] for a in ctx.arms}
        roles = ctx.result(self.name)["rows"][0]["roles"]
        return {"attention to answer": P.plot_attention_to_answer(
            rows, roles, folder / "attention_to_answer.png",
            title=f"First answer token, last layer, head mean (seed {ctx.first})")}

    def print(self, a: dict) -> None:
        print(f"attention at the first answer position: {a['n_samples']} {a['form']} needle prompts, cell {a['cell']}, "
              f"answer needle at depth {a['depth']}; mass of the L1-normalised row (best head in brackets)")
        print(f"{'layer':>5}  {'variant':8}  {'answer mean':>11}  {'best head':>13}  {'noise mean':>10}  "
              f"{'best head':>13}")
        for lay in a["layers"]:
            for v in VARIANTS_REPORTED:
                ans, noi = lay["answer_heads"][v], lay["noise_heads"][v]
                print(f"{lay['layer']:>5}  {v:8}  {lay['answer_mean'][v]:11.4f}  "
                      f"{lay['answer_best'][v]:7.4f} (h{ans.index(max(ans))})  {lay['noise_mean'][v]:10.4f}  "
                      f"{lay['noise_best'][v]:7.4f} (h{noi.index(min(noi))})")
        for v in VARIANTS_REPORTED:
            sm = a["summary"][v]
            print(f"mean over layers ({v}): answer {sm['answer']:.4f}  noise {sm['noise']:.4f}")


TASK = AttentionTask()
