"""The training-side record of a compare model: loss per batch kind, gradient norm and lambda
over training, the needle probes (retrieval accuracy during training) and when retrieval was
learned, and the time it took."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import Metric, Task, setting
from .reporting import NAMES, SHORT, ReportContext, fmt, pair, call, table

LOSSES = (("needle_loss", "needle answer loss (nats)"), ("lm_loss", "LM loss (nats)"), ("icl_loss", "ICL loss (nats)"))


@dataclass(frozen=True)
class TrainingSettings:
    learned_at: float = setting(0.9, "probe accuracy at the first grid cell from which retrieval counts as learned")

    def __post_init__(self) -> None:
        if not 0.0 < self.learned_at <= 1.0:
            raise ValueError(f"TrainingSettings.learned_at: must be in (0, 1], got {self.learned_at!r}")


def first_learned_step(probes: list[dict], cell: str, threshold: float) -> Optional[int]:
    """The first probed step whose accuracy at ``cell`` reaches ``threshold`` (None: never)."""
    return next((p["step"] for p in probes if p["accuracy"].get(cell, 0.0) >= threshold), None)


class TrainingTask(Task):
    name = "training"
    title = "Training"
    help = "the training record of a compare model: losses, gradient norm, lambda, needle probes, time"
    Settings = TrainingSettings

    def applies(self, subject, settings) -> Optional[str]:
        return None if subject.history() is not None else "no training record (train.json) beside this checkpoint"

    def run(self, subject, s: TrainingSettings, *, progress: bool = False) -> dict:
        rec = subject.history()
        probes = rec.get("probes") or []
        first = next(iter(probes[0]["accuracy"])) if probes else None
        step = first_learned_step(probes, first, s.learned_at) if first else None
        return {"history": rec.get("history", []), "probes": probes, "probe_cell": first, "learned_step": step,
                "last_probe_step": probes[-1]["step"] if probes else None, "steps": rec.get("steps"),
                "train_wall_s": rec.get("wall_s"), "train_cpu_s": rec.get("cpu_s"), "threads": rec.get("threads"),
                "records": {"probe_step": [p["step"] for p in probes],
                            "probe_accuracy": [p["accuracy"].get(first) for p in probes]}}

    def metrics(self, s: TrainingSettings) -> list[Metric]:
        return [Metric("needle_learned_step", f"training steps until the first needle cell is learned (probe "
                       f"accuracy >= {s.learned_at}; compared when every model learned it)", True,
                       lambda r: None if r["learned_step"] is None else float(r["learned_step"]), "steps", digits=0)]

    def report(self, ctx: ReportContext) -> str:
        out = [f"## {self.title}\n"]
        if ctx.ran(self.name) and ctx.result(self.name)["probes"]:
            r0 = ctx.result(self.name)
            out.append(f"Needle accuracy on fixed probe prompts (depth 50%, not the evaluation's), every "
                       f"{r0['probes'][1]['step'] - r0['probes'][0]['step'] if len(r0['probes']) > 1 else '-'} steps. "
                       "Small models learn retrieval in a sudden transition whose step varies from seed to seed, so "
                       f"*when* each model learns it matters as much as the final accuracy. 'Learned at' is the first "
                       f"probe with accuracy >= {ctx.settings(self.name)['learned_at']} at N/R = {r0['probe_cell']}.\n")
            rows = []
            for sd in ctx.seeds:
                for a in ctx.arms:
                    r = ctx.result(self.name, a, sd)
                    at = r["learned_step"]
                    when = f"step {at}" if at is not None else f"not by step {r['last_probe_step']}"
                    rows.append([sd, NAMES[a], when] + [fmt(v, 2) for v in r["probes"][-1]["accuracy"].values()])
            out.append(table(rows, ["seed", "model", f"learned at ({r0['probe_cell']})"]
                             + [f"last probe {g}" for g in r0["probes"][-1]["accuracy"]]))
            c = ctx.comparison("needle_learned_step")
            out.append(f"Steps until learned, DIFF - baseline (paired): {pair(c, 0)}, {call(c)}.\n" if c else
                       "Steps until learned are compared only when every model learned the task.\n")
        rows = [[sd, SHORT[a], fmt(ctx.train(a, sd).get("wall_s"), 1), fmt(ctx.train(a, sd).get("cpu_s"), 1),
                 str(ctx.train(a, sd).get("threads", "-"))] for sd in ctx.seeds for a in ctx.arms]
        out.append("Training time:\n")
        out.append(table(rows, ["seed", "model", "wall s", "CPU s", "threads"]))
        return "\n".join(out)

    def plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        from ..eval import plots as P

        made = {}
        for key, label in LOSSES:
            curves = {f"{SHORT[a]} seed {sd}": ([h["step"] for h in hist], [h[key] for h in hist])
                      for sd in ctx.seeds for a in ctx.arms
                      for hist in [[h for h in ctx.train(a, sd).get("history", []) if key in h]] if hist}
            if curves:
                made[f"training {key}"] = P.plot_loss_curves(curves, folder / f"{key}.png", ylabel=label,
                                                             title=f"Training: {label}")
        if ctx.ran(self.name) and ctx.result(self.name)["probes"]:
            cell = ctx.result(self.name)["probe_cell"]
            curves = {f"{SHORT[a]} seed {sd}": (r["records"]["probe_step"], r["records"]["probe_accuracy"])
                      for sd in ctx.seeds for a in ctx.arms for r in [ctx.result(self.name, a, sd)]}
            made["needle accuracy during training"] = P.plot_loss_curves(
                curves, folder / "needle_probe.png", ylabel=f"needle accuracy N/R={cell}",
                title="Retrieval during training (probe prompts)")
        return made

    def print(self, r: dict) -> None:
        print(f"{r['steps']} steps in {fmt(r['train_wall_s'], 1)} s; last logged: "
              + (", ".join(f"{k} {v:.4f}" for k, v in r["history"][-1].items() if k.endswith("_loss"))
                 if r["history"] else "-"))
        if r["probes"]:
            at = r["learned_step"]
            print(f"needle probes at N/R {r['probe_cell']}: " + (f"learned at step {at}" if at is not None else
                                                                f"not learned by step {r['last_probe_step']}"))


TASK = TrainingTask()
