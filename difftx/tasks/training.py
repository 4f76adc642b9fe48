"""The training-side record of a compare model: loss per batch kind, gradient norm and lambda
over training, the needle probes (retrieval accuracy during training) and when retrieval was
learned; its cost (throughput, FLOPs, the loss at equal wall-clock and at equal FLOPs) and its
stability (gradient-norm spikes, the largest attention logit over training, lambda per layer)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .base import Metric, Task, positive, setting
from .common import first_learned_step, learning_bounds, learning_steps
from .reporting import ReportContext, fmt, pair, call, table
from .subject import TRAIN_RECORD

# the words for the built-in training tasks' losses; a registered task's loss ({name}_loss) is named after its task
LOSSES = {"needle_loss": "needle answer loss (nats)", "lm_loss": "LM loss (nats)", "icl_loss": "ICL loss (nats)",
          "recall_loss": "recall answer loss (nats)"}


def logged_losses(histories) -> list[str]:
    """The per-task losses (``{task}_loss``) the training histories hold, in order of first appearance: every task
    the mixture trained on, built-in or registered."""
    return list(dict.fromkeys(k for hist in histories for h in hist for k in h if k.endswith("_loss")))


@dataclass(frozen=True)
class TrainingSettings:
    learned_at: float = setting(0.9, "probe accuracy at the first grid cell from which retrieval counts as learned")
    spike_factor: float = setting(4.0, "a step's gradient norm is a spike above this multiple of the median of "
                                       "the previous spike_window steps")
    spike_window: int = setting(100, "steps of the running median that spikes are measured against")

    def __post_init__(self) -> None:
        if not 0.0 < self.learned_at <= 1.0:
            raise ValueError(f"TrainingSettings.learned_at: must be in (0, 1], got {self.learned_at!r}")
        if not self.spike_factor > 1.0:
            raise ValueError(f"TrainingSettings.spike_factor: must be > 1, got {self.spike_factor!r}")
        positive(self, "spike_window")


def grad_spikes(norms: list[float], factor: float, window: int) -> int:
    """Steps whose gradient norm exceeds ``factor`` times the median of the ``window`` steps
    before it (counted from the step that has a full window)."""
    import numpy as np

    x = np.asarray([v for v in norms if v is not None], dtype=np.float64)
    if x.size <= window:
        return 0
    past = np.lib.stride_tricks.sliding_window_view(x[:-1], window)  # past[i] = x[i : i + window]
    return int((x[window:] > factor * np.median(past, axis=1)).sum())


def flops_per_token(config: dict, parameters: int) -> float:
    """Training FLOPs per token (forward + backward) of a model: ``6 N + 12 L D T`` with ``N`` the
    parameters without the token embedding and ``T`` the training context (attention counted
    over every key; PaLM's convention)."""
    n = parameters - config["vocab_size"] * config["dim"]
    return 6.0 * n + 12.0 * config["n_layers"] * config["dim"] * config["max_seq_len"]


def value_at(xs: list, ys: list, x: float) -> Optional[float]:
    """``ys`` linearly interpolated at ``x`` (``None`` outside ``xs``, or where a value is missing)."""
    pts = [(a, b) for a, b in zip(xs, ys) if a is not None and b is not None]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1] if pts and pts[-1][0] == x else None


def at_equal(axis: str):
    """A peer metric: this model's training loss where both models of the seed have spent the
    smaller of their two budgets of ``axis`` (``time_s`` or ``flops``)."""
    def get(r: dict, peer: dict) -> Optional[float]:
        budget = min(r["cost"][axis], peer["cost"][axis])
        return value_at(r["curve"][axis], r["curve"]["loss"], budget)
    return get


def _logged(record: dict, key: str) -> list[dict]:
    """The history records of a training record that hold ``key`` (a loss of one batch kind)."""
    return [h for h in record.get("history", []) if key in h]


def _per_stack(ctx: ReportContext, task: str) -> str:
    """Throughput per stack: seeds trained as one stacked model share one clock, so each stack is one
    measurement (no seed interval); '' when no model was stacked."""
    stacks: dict = {}
    for a in ctx.arms:
        for sd in ctx.seeds:
            r = ctx.result(task, a, sd)
            if (r.get("stacked") or 1) > 1 and r["cost"]["tokens_per_s"] is not None:
                stacks.setdefault(a, {}).setdefault(r["cost"]["tokens_per_s"], []).append(sd)
    if not stacks:
        return ""
    parts = [f"{ctx.short(a)} {v:,.0f} tokens/s (seeds {', '.join(seeds)})" for a in ctx.arms
             for v, seeds in stacks.get(a, {}).items()]
    ratio = ""
    base, arm = ctx.arms
    if all(len(stacks.get(a, {})) == 1 for a in ctx.arms):
        (d,), (b,) = stacks[arm], stacks[base]
        ratio = f"; {ctx.short(arm)} / {ctx.short(base)} = {d / b:.3f}"
    return ("Seeds trained as one stacked model share its clock, so throughput and the loss at equal wall-clock are "
            f"one measurement per stack, not a sample of seeds (no interval): {'; '.join(parts)}{ratio}.\n")


class TrainingRecordTask(Task):
    name = "training"
    title = "Training"
    help = "the training record of a compare model: losses, gradient norm, lambda, needle probes, time"
    Settings = TrainingSettings

    def applies(self, subject, settings) -> Optional[str]:
        return None if subject.history() is not None else f"no training record ({TRAIN_RECORD}) beside this checkpoint"

    def run(self, subject, s: TrainingSettings, *, progress: bool = False) -> dict:
        rec = subject.history()
        probes = [p for p in rec.probes or [] if p.get("accuracy")]  # the needle probes (recall's: the recall task)
        first = next(iter(probes[0]["accuracy"])) if probes else None
        step = first_learned_step(probes, first, s.learned_at) if first else None
        hist = rec.history
        last = hist[-1] if hist else {}
        fpt = flops_per_token(rec.config, rec.parameters)
        tokens, time_s = last.get("tokens"), last.get("time_s")
        loss_key = "lm_loss" if any("lm_loss" in h for h in hist) else "needle_loss"
        logits = [max(p["max_attention_logit"]) for p in probes if p.get("max_attention_logit")]
        return {"history": hist, "probes": probes, "probe_cell": first, "learned_step": step,
                "last_probe_step": probes[-1]["step"] if probes else None, "steps": rec.steps,
                "invocation": rec.invocation, "stacked": rec.stacked, "train_wall_s": rec.wall_s,
                "train_cpu_s": rec.cpu_s, "threads": rec.threads,
                "cost": {"tokens": tokens, "time_s": time_s, "flops_per_token": fpt,
                         "flops": None if tokens is None else tokens * fpt,
                         "tokens_per_s": tokens / time_s if tokens and time_s else None},
                "stability": {"grad_spikes": grad_spikes([g for h in hist for g in h.get("grad_norms") or []],
                                                         s.spike_factor, s.spike_window),
                              "max_grad_norm": max((g for h in hist for g in h.get("grad_norms") or []), default=None),
                              "max_attention_logit": max(logits, default=None),
                              "final_lambda": last.get("lambda")},
                "curve": {"loss_key": loss_key, "step": [h["step"] for h in hist],
                          "time_s": [h.get("time_s") for h in hist],
                          "flops": [None if h.get("tokens") is None else h["tokens"] * fpt for h in hist],
                          "loss": [h.get(loss_key) for h in hist]},
                "records": {"probe_step": [p["step"] for p in probes],
                            "probe_accuracy": [p["accuracy"].get(first) for p in probes]}}

    def metrics(self, s: TrainingSettings) -> list[Metric]:
        return [Metric("needle_learned_step", f"training steps until the first needle cell is learned (probe "
                       f"accuracy >= {s.learned_at}; a model that did not learn it counts as its last probe step)",
                       True, learning_steps, "steps", primary=True, digits=0,
                       learned=lambda r: r["learned_step"] is not None, bounds_of=learning_bounds),
                Metric("train_tokens_per_s", "training throughput (tokens/s, measured while the model trained)", False,
                       lambda r: r["cost"]["tokens_per_s"], "tokens/s", digits=0, same_run=True),
                Metric("loss_at_equal_time", "training loss at equal wall-clock (the smaller of the two training "
                       "times)", True, at_equal("time_s"), "nats", peer=True, same_run=True),
                Metric("loss_at_equal_flops", "training loss at equal FLOPs (the smaller of the two FLOP budgets)",
                       True, at_equal("flops"), "nats", peer=True),
                Metric("grad_spikes", f"gradient-norm spikes (steps above {s.spike_factor:g}x the running median)",
                       True, lambda r: float(r["stability"]["grad_spikes"]), "steps", digits=1),
                Metric("max_attention_logit", "largest absolute attention logit over training (probe prompts)", True,
                       lambda r: r["stability"]["max_attention_logit"], "", digits=2)]

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
                    rows.append([sd, ctx.name(a), when] + [fmt(v, 2) for v in r["probes"][-1]["accuracy"].values()])
            out.append(table(rows, ["seed", "model", f"learned at ({r0['probe_cell']})"]
                             + [f"last probe {g}" for g in r0["probes"][-1]["accuracy"]]))
            out.append(self._learning_speed(ctx))
        rows = [[sd, ctx.short(a), fmt(ctx.train(a, sd).get("wall_s"), 1), fmt(ctx.train(a, sd).get("cpu_s"), 1),
                 str(ctx.train(a, sd).get("threads", "-"))] for sd in ctx.seeds for a in ctx.arms]
        out.append("Training time:\n")
        out.append(table(rows, ["seed", "model", "wall s", "CPU s", "threads"]))
        if ctx.ran(self.name):
            out.append(self._cost_and_stability(ctx))
        return "\n".join(out)

    def _learning_speed(self, ctx: ReportContext) -> str:
        """Who learned first, seed by seed, and the paired steps-until-learned (a primary metric)."""
        from ..eval.stats import p_text  # here: the command line's parser imports this module, not torch

        c = ctx.comparison("needle_learned_step")
        if c is None:
            return ""
        if c["gated"]:
            return "No model learned retrieval by its last probe: learning speed is not compared.\n"
        x, y = c["arms"]
        first = {x: 0, y: 0, "tie": 0}
        for d, b in zip(c["values"][x], c["values"][y]):
            first[x if d < b else y if b < d else "tie"] += 1
        return (f"Learning speed (primary): {ctx.short(x)} learned first in {first[x]} of {len(c['values'][x])} "
                f"seeds, the {ctx.short(y)} in {first[y]}, {first['tie']} tied (same probe, or neither learned). "
                f"Steps until learned, {ctx.short(x)} - {ctx.short(y)} (paired; a model that did not learn counts as "
                f"its last probe step, which "
                f"moves that seed's difference toward 0 but can move the mean either way): {pair(c, 0)}, sign-flip "
                f"p = {p_text(c['paired']['sign_flip_p'], 2)}; "
                f"{call(c, ctx.short)}.\n")

    def _cost_and_stability(self, ctx: ReportContext) -> str:
        st = ctx.settings(self.name)
        r0 = ctx.result(self.name)
        out = ["### Cost and stability\n",
               f"Throughput is training tokens per second of training-step time, measured while each model trained "
               f"(probes and checkpoints excluded; models trained side by side share the CPU, so it is compared "
               f"only between models trained by the same invocation). FLOPs per token = 6 N + 12 L D T (N: "
               f"parameters without the token embedding, T: the training context). The loss at equal wall-clock "
               f"(or FLOPs) is each model's training "
               f"{r0['curve']['loss_key'].replace('_', ' ')} (mean over a log interval, interpolated) where both "
               f"models of a seed have spent the smaller of their two budgets. A gradient-norm spike is a step above "
               f"{st['spike_factor']:g}x the median of the previous {st['spike_window']} steps; the largest absolute "
               f"attention logit (scaled, pre-softmax) is read on the probe prompts at every probe.\n"]
        rows = []
        for sd in ctx.seeds:
            for a in ctx.arms:
                r = ctx.result(self.name, a, sd)
                c, sb = r["cost"], r["stability"]
                lam = sb.get("final_lambda")
                rows.append([sd, ctx.short(a), fmt(c["tokens_per_s"], 0), fmt(c["time_s"], 1),
                             fmt(None if c["flops"] is None else c["flops"] / 1e12, 2), str(sb["grad_spikes"]),
                             fmt(sb["max_grad_norm"], 2), fmt(sb["max_attention_logit"], 2),
                             ", ".join(f"{v:.2f}" for v in lam) if lam else "-"])
        out.append(table(rows, ["seed", "model", "tokens/s", "train s", "TFLOPs", "grad spikes", "max grad norm",
                                "max abs attn logit", "final λ per layer"]))
        keys = ["train_tokens_per_s", "loss_at_equal_time", "loss_at_equal_flops", "grad_spikes",
                "max_attention_logit"]
        out.append(ctx.comparison_table(keys))
        out.append(_per_stack(ctx, self.name))
        return "\n".join(out)

    def plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        """PNGs of training: each curve with every seed faint and the mean over seeds bold, one colour per
        model, the legend outside the axes (:func:`difftx.eval.plots.plot_seed_curves`)."""
        from ..eval import plots as P

        made = {}
        keys = logged_losses(ctx.train(a, sd).get("history", []) for a in ctx.arms for sd in ctx.seeds)
        for key in keys:
            label = LOSSES.get(key, f"{key[:-len('_loss')]} loss (nats)")
            curves = {ctx.short(a): [([h["step"] for h in hist], [h[key] for h in hist])
                                 for sd in ctx.seeds for hist in [_logged(ctx.train(a, sd), key)] if hist]
                      for a in ctx.arms}
            curves = {name: seeds for name, seeds in curves.items() if seeds}
            if curves:
                made[f"training {key}"] = P.plot_seed_curves(curves, folder / f"{key}.png", ylabel=label,
                                                             title=f"Training: {label}")
        if ctx.ran(self.name):
            made.update(self._cost_plots(ctx, folder))
        if ctx.ran(self.name) and ctx.result(self.name)["probes"]:
            cell = ctx.result(self.name)["probe_cell"]
            curves = {ctx.short(a): [(r["records"]["probe_step"], r["records"]["probe_accuracy"])
                                 for sd in ctx.seeds for r in [ctx.result(self.name, a, sd)]] for a in ctx.arms}
            made["needle accuracy during training"] = P.plot_seed_curves(
                curves, folder / "needle_probe.png", ylabel=f"needle accuracy N/R={cell}",
                title="Retrieval during training (probe prompts)")
        return made

    def _cost_plots(self, ctx: ReportContext, folder: Path) -> dict[str, Path]:
        from ..eval import plots as P

        made = {}
        runs = {a: [ctx.result(self.name, a, sd) for sd in ctx.seeds] for a in ctx.arms}
        key = runs[ctx.arms[0]][0]["curve"]["loss_key"]
        curves = {ctx.short(a): [(r["curve"]["time_s"], r["curve"]["loss"]) for r in rs
                             if None not in r["curve"]["time_s"]] for a, rs in runs.items()}
        curves = {name: seeds for name, seeds in curves.items() if seeds}
        if curves:  # each seed has its own clock: no mean over seeds
            made["training loss against wall-clock"] = P.plot_seed_curves(
                curves, folder / "loss_vs_time.png", ylabel=f"training {key.replace('_', ' ')}", xlabel="training s",
                title="Equal wall-clock view", mean=False)
        lam = {f"{ctx.short(a)} L{i}": [(r["curve"]["step"], [h["lambda"][i] for h in r["history"]]) for r in rs]
               for a, rs in runs.items() if all(r["history"] and r["history"][0].get("lambda") for r in rs)
               for i in range(len(rs[0]["history"][0]["lambda"]))}
        if lam:
            made["lambda per layer during training"] = P.plot_seed_curves(
                lam, folder / "lambda_during_training.png", ylabel="λ",
                title="λ per layer (L0, L1, ...) during training", color_by_model=False)
        logit = {ctx.short(a): [([p["step"] for p in r["probes"]], [max(p["max_attention_logit"]) for p in r["probes"]])
                            for r in rs if r["probes"] and all(p.get("max_attention_logit") for p in r["probes"])]
                 for a, rs in runs.items()}
        logit = {name: seeds for name, seeds in logit.items() if seeds}
        if logit:
            made["largest attention logit during training"] = P.plot_seed_curves(
                logit, folder / "max_attention_logit.png", ylabel="max |attention logit|",
                title="Largest attention logit during training (probe prompts)")
        return made

    def print(self, r: dict) -> None:
        print(f"{r['steps']} steps in {fmt(r['train_wall_s'], 1)} s; last logged: "
              + (", ".join(f"{k} {v:.4f}" for k, v in r["history"][-1].items() if k.endswith("_loss"))
                 if r["history"] else "-"))
        if r["probes"]:
            at = r["learned_step"]
            print(f"needle probes at N/R {r['probe_cell']}: " + (f"learned at step {at}" if at is not None else
                                                                f"not learned by step {r['last_probe_step']}"))
        c, sb = r["cost"], r["stability"]
        print(f"throughput {fmt(c['tokens_per_s'], 0)} tokens/s over {fmt(c['time_s'], 1)} s of training steps; "
              f"gradient-norm spikes {sb['grad_spikes']}, max gradient norm {fmt(sb['max_grad_norm'], 2)}, "
              f"max |attention logit| {fmt(sb['max_attention_logit'], 2)}")


TASK = TrainingRecordTask()
