"""Per-seed scalar metrics of a comparison and their paired DIFF - baseline differences."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..eval.icl import ORDER_KINDS as ICL_ORDER_KINDS
from ..eval.stats import mean_and_ci, paired_bootstrap, verdict

PROBE_LEARNED = 0.9  # probe accuracy at the first grid cell from which a model counts as having learned retrieval


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    lower_is_better: bool
    unit: str
    get: Callable[[dict], float | None]  # evals (or train record) of one model -> value (None: not measured)
    source: str = "evals"  # "evals" or "train": which part of a model's run `get` reads


def _lm(field: str) -> Callable[[dict], float | None]:
    return lambda ev: None if "heldout" not in ev["lm"] else ev["lm"]["heldout"][field]


def _beyond(ev: dict) -> float | None:
    ext = ev["lm"].get("extrapolation")
    if not ext:
        return None
    f = max(ext, key=int)
    return ext[f]["extra"].get("nll_beyond_train_len")


def _quant(kind: str, gran: str, bits: str) -> Callable[[dict], float | None]:
    def get(ev: dict) -> float | None:
        q = ev["quant"].get(kind)
        if q is None or bits not in q.get(gran, {}):
            return None
        return q[gran][bits] - q["full"]  # change against full precision
    return get


def first_learned_step(probes: list[dict], cell: str, threshold: float = PROBE_LEARNED) -> int | None:
    """The first probed step whose accuracy at ``cell`` reaches ``threshold`` (None: never)."""
    return next((p["step"] for p in probes if p["accuracy"].get(cell, 0.0) >= threshold), None)


def _learned_step(train: dict, cell: str) -> float | None:
    step = first_learned_step(train.get("probes") or [], cell)
    return None if step is None else float(step)


def _icl(kind: str, field: str, learned_only: bool = False) -> Callable[[dict], float | None]:
    """An ICL result field; with ``learned_only`` None unless the model is above chance (best - worst
    of a model at chance is sampling noise, so the metric is left out of the comparison)."""
    def get(ev: dict) -> float | None:
        r = ev.get("icl", {}).get(kind)
        if r is None or (learned_only and not r["above_chance"]):
            return None
        return r[field]
    return get


def metrics_for(results: dict) -> list[Metric]:
    """The metrics compared in the report, in report order."""
    p = results["preset"]
    out = [
        Metric("lm_nll", "LM NLL (held-out)", True, "nats", _lm("nll")),
        Metric("lm_bpb", "LM bits per byte", True, "bits", _lm("bpb")),
        Metric("lm_ar_hit_nll", "LM NLL, AR-hit tokens", True, "nats", _lm("ar_hit_nll")),
        Metric("lm_other_nll", "LM NLL, other tokens", True, "nats", _lm("other_nll")),
        Metric("lm_nll_beyond_train_len", f"LM NLL beyond the training length (x{max(p['extrapolation_factors'])})",
               True, "nats", _beyond),
    ]
    for n, r in p["grid"]:
        out.append(Metric(f"needle_{n}_{r}", f"needle accuracy N={n}/R={r}", False, "",
                          lambda ev, k=f"{n}/{r}": ev["needle"]["grid"]["accuracy"][k]))
    out.append(Metric("needle_mean", "needle accuracy, mean over the grid", False, "",
                      lambda ev: sum(ev["needle"]["grid"]["accuracy"].values())
                      / len(ev["needle"]["grid"]["accuracy"])))
    for o in ("distraction", "hallucination", "malformed"):
        out.append(Metric(f"needle_{o}_rate", f"needle {o} rate (share of queried keys)", True, "",
                          lambda ev, o=o: ev["needle"]["grid"]["outcome_rates"][o]))
    for v in ("absolute", "signed"):
        out.append(Metric(f"attn_answer_{v}", f"attention to answer ({v}, mean over heads and layers)", False, "",
                          lambda ev, v=v: ev["attention"]["summary"][v]["answer"]))
        out.append(Metric(f"attn_noise_{v}", f"attention noise ({v}, mean over heads and layers)", True, "",
                          lambda ev, v=v: ev["attention"]["summary"][v]["noise"]))
    out += [
        Metric("outlier_logit_top1", "attention-logit magnitude top-1", True, "",
               lambda ev: ev["outliers"]["attention_logits"]["top1"]),
        Metric("outlier_logit_top1_over_median", "attention-logit magnitude top-1 / median", True, "",
               lambda ev: ev["outliers"]["attention_logits"]["top1_over_median"]),
        Metric("outlier_hidden_top1", "hidden-state magnitude top-1", True, "",
               lambda ev: ev["outliers"]["hidden_states"]["top1"]),
        Metric("outlier_hidden_top1_over_median", "hidden-state magnitude top-1 / median", True, "",
               lambda ev: ev["outliers"]["hidden_states"]["top1_over_median"]),
    ]
    first = "{}/{}".format(*p["grid"][0])
    out.append(Metric("needle_learned_step", f"training steps until needle N/R={first} is learned (probe accuracy "
                      f">= {PROBE_LEARNED}; compared when every model learned it)", True, "steps",
                      lambda tr: _learned_step(tr, first), source="train"))
    for kind in ICL_ORDER_KINDS:
        out.append(Metric(f"icl_{kind}_accuracy", f"ICL accuracy, {kind} orders (mean over orders)", False, "",
                          _icl(kind, "mean")))
        out.append(Metric(f"icl_{kind}_best_minus_worst", f"ICL best - worst accuracy over {kind} orders", True, "",
                          _icl(kind, "best_minus_worst", learned_only=True)))
    for b in (str(x) for x in p["quant_bits"] if x <= 6):
        for g in ("row", "tensor"):
            out.append(Metric(f"quant_nll_{g}_{b}", f"NLL change at {b}-bit logits ({g})", True, "nats",
                              _quant("nll", g, b)))
            out.append(Metric(f"quant_needle_{g}_{b}", f"needle accuracy change at {b}-bit logits ({g})", False, "",
                              _quant("needle_accuracy", g, b)))
    return out


def _ok(v: float | None) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def paired_comparisons(results: dict) -> dict:
    """``{metric key: {label, lower_is_better, unit, diff: [per seed], baseline: [...],
    diff_mean/ci, baseline_mean/ci, paired: PairedDifference dict, verdict}}``; metrics not
    measured (for example LM without LM training) are left out."""
    seeds = [str(s) for s in results["seeds"]]
    out = {}
    for m in metrics_for(results):
        d = [m.get(results["runs"][s]["diff"][m.source]) for s in seeds]
        b = [m.get(results["runs"][s]["baseline"][m.source]) for s in seeds]
        if not all(_ok(x) for x in d + b):
            continue
        pair = paired_bootstrap(d, b)
        dm, dl, dh = mean_and_ci(d)
        bm, bl, bh = mean_and_ci(b)
        out[m.key] = {"label": m.label, "lower_is_better": m.lower_is_better, "unit": m.unit, "diff": d,
                      "baseline": b, "diff_mean": dm, "diff_ci": [dl, dh], "baseline_mean": bm, "baseline_ci": [bl, bh],
                      "paired": pair.to_dict(),
                      "verdict": verdict(pair, m.label, lower_is_better=m.lower_is_better, unit=m.unit)}
    return out
