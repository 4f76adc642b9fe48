"""``report.md``, ``results.json`` and ``plots/`` of a comparison (from the collected results)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..checkpoint import atomic_write
from ..eval.icl import ORDER_KINDS as ICL_ORDER_KINDS
from ..eval.stats import FEW_SEEDS
from .summary import PROBE_LEARNED, first_learned_step

# The paper's own numbers (SPEC section 5), at 3B parameters: a very different scale.
PAPER = {
    "needle": {"scale": "3B parameters, 4K context (paper section 3.4)",
               "grid": ["1/1", "2/2", "4/2", "6/2"],
               "baseline": [1.00, 0.85, 0.62, 0.55], "diff": [1.00, 0.92, 0.84, 0.85]},
    "attention": {"scale": "3B parameters (paper Table 3; ranges over needle depths)",
                  "baseline": {"answer": "0.03-0.09", "noise": "0.49-0.54"},
                  "diff": {"answer": "0.27-0.40", "noise": "0.01-0.02"}},
    "outliers": {"scale": "3B parameters (paper Table 5)",
                 "baseline": {"attention_logits_top1": 318.0, "hidden_states_top1": 3608.6},
                 "diff": {"attention_logits_top1": 38.8, "hidden_states_top1": 1688.2}},
    "lm": {"note": "At 1-30M parameters published reproductions find the LM-loss gap within seed noise "
                   "(about -0.016 +- 0.023 nats at 30M, SPEC section 5); the paper's LM gains are at 3B-13B."},
}

NAMES = {"diff": "DIFF", "baseline": "Transformer (baseline)"}
LEARNED = 0.5  # needle accuracy at the easiest cell below which the report says the task was not learned


def _f(v: float | None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def _ci(mean: float, ci: list, digits: int = 3) -> str:
    if ci[0] is None:
        return _f(mean, digits)
    return f"{_f(mean, digits)} [{_f(ci[0], digits)}, {_f(ci[1], digits)}]"


def _pair(c: dict, digits: int = 3) -> str:
    p = c["paired"]
    if p["n"] == 1:
        return f"{p['mean']:+.{digits}f} (1 seed)"
    return f"{p['mean']:+.{digits}f} [{p['low']:+.{digits}f}, {p['high']:+.{digits}f}]"


def _call(c: dict) -> str:
    p = c["paired"]
    if p["n"] == 1:
        return "no CI (1 seed)"
    if not p["excludes_zero"]:
        return "within noise"
    better = (p["mean"] < 0) == c["lower_is_better"]
    word = "DIFF better" if better else "DIFF worse"
    return f"suggests {word} ({p['n']} seeds: not conclusive)" if p["n"] < FEW_SEEDS else word


def _table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _mean(vals: list) -> float:
    return sum(vals) / len(vals)


def render_report(results: dict, plots: dict[str, str]) -> str:
    """The Markdown report (tables beside the paper's numbers, paired differences with verdicts)."""
    p, C, seeds = results["preset"], results["comparison"], results["seeds"]
    runs = results["runs"]
    s0 = str(seeds[0])
    P = results["models"]
    out = [f"# DIFF vs parameter-matched Transformer: `{p['name']}` preset\n"]
    out.append(f"{p['description']}. Seeds: {', '.join(map(str, seeds))} (paired: same seed, same batches in the "
               f"same order for both models). DIFF: {P['diff']['parameters']:,} parameters; baseline: "
               f"{P['baseline']['parameters']:,}. {p['steps']} steps of batch {p['batch_size']}; "
               f"{_mix(results)}. "
               f"Wall time of this invocation: {results['wall_s']:.0f} s (parts already stored are not redone).\n")
    out.append("**Scale.** The paper's numbers below come from 3B-parameter models; these "
               "models are orders of magnitude smaller and trained for minutes on synthetic tasks plus a little "
               "byte-level Shakespeare. Compare the *direction* of differences, not the values.\n")
    out.append("Every difference is DIFF - baseline, its mean over paired seeds with a 95% percentile bootstrap CI; "
               "'within noise' means the CI contains 0. "
               + ("With one seed there is no CI and no conclusion. " if len(seeds) == 1 else "")
               + (f"With fewer than {FEW_SEEDS} seeds the bootstrap CI understates the uncertainty, so a CI that "
                  "excludes 0 is reported as *suggestive*, not as a conclusion. " if 1 < len(seeds) < FEW_SEEDS
                  else "") + "\n")
    # -- headline ------------------------------------------------------------------------------
    out.append("## Verdicts\n")
    for key in [k for k in ("needle_mean", *[f"needle_{n}_{r}" for n, r in p["grid"]], "needle_learned_step", "lm_nll",
                            "needle_hallucination_rate", "attn_noise_absolute") if k in C]:
        out.append(f"- {C[key]['verdict']}")
    out.append("")
    # -- needle --------------------------------------------------------------------------------
    out.append("## Multi-needle retrieval (synthetic token-level form)\n")
    out.append(f"Per-key exact match, greedy decoding, {p['samples_per_cell']} samples per N/R x depth cell, depths "
               f"{', '.join(str(int(d * 100)) + '%' for d in p['depths'])}; context {p['context_len']} tokens. "
               "Mean over seeds [95% bootstrap CI].\n")
    grid = [f"{n}/{r}" for n, r in p["grid"]]
    header = ["model"] + [f"N={g.split('/')[0]}, R={g.split('/')[1]}" for g in grid]
    rows = []
    for k in ("baseline", "diff"):
        rows.append([f"{NAMES[k]}, this run"] + [_ci(C[f"needle_{g.replace('/', '_')}"][f"{k}_mean"],
                                                      C[f"needle_{g.replace('/', '_')}"][f"{k}_ci"], 2) for g in grid])
    rows.append(["DIFF - baseline (paired)"] + [_pair(C[f"needle_{g.replace('/', '_')}"], 2) for g in grid])
    rows.append(["verdict"] + [_call(C[f"needle_{g.replace('/', '_')}"]) for g in grid])
    pn = PAPER["needle"]
    for k in ("baseline", "diff"):
        rows.append([f"{NAMES[k]}, paper ({pn['scale']})"]
                    + [_f(pn[k][pn["grid"].index(g)], 2) if g in pn["grid"] else "-" for g in grid])
    out.append(_table(rows, header))
    first = f"needle_{p['grid'][0][0]}_{p['grid'][0][1]}"
    best = max(C[first]["diff_mean"], C[first]["baseline_mean"])
    if best < LEARNED:
        out.append(f"**Neither model has learned the retrieval task** (accuracy at N/R = {p['grid'][0][0]}/"
                   f"{p['grid'][0][1]} is at most {best:.2f}, below {LEARNED}): differences in this section measure "
                   "partial learning, not retrieval quality; train longer (`--set steps=...`) for a retrieval "
                   "comparison.\n")
    out.append("For scale: a model that copies the value of a random needle instead of the queried one scores about "
               "1/N (a distraction error otherwise); a random well-formed value almost never scores.\n")
    out.append("**Wrong answers**, as a share of all queried keys (distraction: another needle's value; "
               "hallucination: a value that appears nowhere in the context, an offline proxy for the paper's "
               "GPT-4o-judged section 3.6; malformed: anything else):\n")
    rows = []
    for o in ("distraction", "hallucination", "malformed"):
        c = C[f"needle_{o}_rate"]
        rows.append([o, _ci(c["baseline_mean"], c["baseline_ci"]), _ci(c["diff_mean"], c["diff_ci"]), _pair(c),
                     _call(c)])
    out.append(_table(rows, ["outcome", "baseline", "DIFF", "DIFF - baseline", "verdict"]))
    for k in ("baseline", "diff"):
        bd = runs[s0][k]["evals"]["needle"]["grid"]["by_depth"]
        out.append(f"{NAMES[k]} (seed {s0}) accuracy by depth: "
                   + "; ".join(f"{cell}: " + ", ".join(f"{float(d):.2f}->{a:.2f}" for d, a in v.items())
                               for cell, v in bd.items()) + "\n")
    out.append(_probe_section(results))
    # -- LM ------------------------------------------------------------------------------------
    out.append("## Language modelling (held-out bundled Shakespeare, bytes)\n")
    if "lm_nll" in C:
        rows = []
        for key in ("lm_nll", "lm_bpb", "lm_ar_hit_nll", "lm_other_nll", "lm_nll_beyond_train_len"):
            if key in C:
                c = C[key]
                rows.append([c["label"], _ci(c["baseline_mean"], c["baseline_ci"]), _ci(c["diff_mean"], c["diff_ci"]),
                             _pair(c), _call(c)])
        out.append(_table(rows, ["metric", "baseline", "DIFF", "DIFF - baseline", "verdict"]))
        out.append(f"Training length {p['lm_seq_len']} bytes; the extrapolation rows score windows of "
                   f"{max(p['extrapolation_factors'])}x that length (RoPE, nothing rescaled). {PAPER['lm']['note']}\n")
    else:
        out.append("Not measured: this preset trains no LM batches.\n")
    # -- attention -----------------------------------------------------------------------------
    att0 = runs[s0]["diff"]["evals"]["attention"]
    out.append(f"## Attention to the answer and attention noise (N/R = {att0['cell']}, depth 50%)\n")
    out.append("At the position emitting the first answer token; each head's row divided by its L1 norm; answer = "
               "the answer needle's value tokens, noise = filler tokens. DIFF rows are `A1 - lambda*A2` and may be "
               "negative, hence three variants. Mean over heads and layers, mean over seeds:\n")
    rows = []
    for v in ("absolute", "signed"):
        for part in ("answer", "noise"):
            c = C[f"attn_{part}_{v}"]
            rows.append([f"{part} ({v})", _ci(c["baseline_mean"], c["baseline_ci"]), _ci(c["diff_mean"], c["diff_ci"]),
                         _pair(c), _call(c)])
    pa = PAPER["attention"]
    rows.append([f"answer, paper ({pa['scale']})", pa["baseline"]["answer"], pa["diff"]["answer"], "", ""])
    rows.append([f"noise, paper ({pa['scale']})", pa["baseline"]["noise"], pa["diff"]["noise"], "", ""])
    out.append(_table(rows, ["", "baseline", "DIFF", "DIFF - baseline", "verdict"]))
    rows = []
    for k in ("baseline", "diff"):
        for lay in runs[s0][k]["evals"]["attention"]["layers"]:
            rows.append([NAMES[k], str(lay["layer"]), _f(lay["answer_mean"]["absolute"]),
                         _f(lay["answer_best"]["absolute"]), _f(lay["noise_mean"]["absolute"]),
                         _f(lay["noise_best"]["absolute"])])
    out.append(f"Per layer (seed {s0}, absolute variant):\n")
    out.append(_table(rows, ["model", "layer", "answer, head mean", "answer, best head", "noise, head mean",
                             "noise, best head"]))
    # -- outliers ------------------------------------------------------------------------------
    out.append("## Activation outliers\n")
    o0 = runs[s0]["diff"]["evals"]["outliers"]
    out.append(f"Over {o0['tokens']} tokens of {o0['source']}; DIFF logits include both softmax maps. "
               f"Seed {s0}:\n")
    rows = []
    for k in ("baseline", "diff"):
        ev = runs[s0][k]["evals"]["outliers"]
        for q in ("attention_logits", "hidden_states"):
            s = ev[q]
            rows.append([NAMES[k], q.replace("_", " ")] + [_f(s[x], 2) for x in ("top1", "top2", "top3", "top10",
                                                                               "top100", "median",
                                                                               "top1_over_median")])
    po = PAPER["outliers"]
    for k in ("baseline", "diff"):
        rows.append([f"{NAMES[k]}, paper ({po['scale']})", "attention logits", _f(po[k]["attention_logits_top1"], 1)]
                    + ["-"] * 6)
        rows.append([f"{NAMES[k]}, paper", "hidden states", _f(po[k]["hidden_states_top1"], 1)] + ["-"] * 6)
    out.append(_table(rows, ["model", "quantity", "top-1", "top-2", "top-3", "top-10", "top-100", "median",
                             "top-1/median"]))
    rows = []
    for key in ("outlier_logit_top1", "outlier_logit_top1_over_median", "outlier_hidden_top1",
                "outlier_hidden_top1_over_median"):
        c = C[key]
        rows.append([c["label"], _ci(c["baseline_mean"], c["baseline_ci"], 2), _ci(c["diff_mean"], c["diff_ci"], 2),
                     _pair(c, 2), _call(c)])
    out.append("Over seeds:\n")
    out.append(_table(rows, ["metric", "baseline", "DIFF", "DIFF - baseline", "verdict"]))
    # -- quantisation --------------------------------------------------------------------------
    out.append("## Low-bit attention logits (dynamic absmax, per row / per tensor)\n")
    q0 = runs[s0]["diff"]["evals"]["quant"]
    header = ["model", "metric", "full"] + [f"{g} {b}b" for g in ("row", "tensor") for b in q0["bits"]]
    rows = []
    for k in ("baseline", "diff"):
        q = runs[s0][k]["evals"]["quant"]
        for name, label in (("nll", "LM NLL"), ("needle_accuracy", f"needle acc. {q['needle_cell']}")):
            if name in q:
                rows.append([NAMES[k], label, _f(q[name]["full"])]
                            + [_f(q[name][g][str(b)]) for g in ("row", "tensor") for b in q["bits"]])
    out.append(f"Seed {s0}:\n")
    out.append(_table(rows, header))
    qkeys = [k for k in C if k.startswith("quant_")]
    if qkeys:
        rows = [[C[k]["label"], _ci(C[k]["baseline_mean"], C[k]["baseline_ci"]), _ci(C[k]["diff_mean"], C[k]["diff_ci"]),
                 _pair(C[k]), _call(C[k])] for k in qkeys]
        out.append("Change against full precision, over seeds:\n")
        out.append(_table(rows, ["metric", "baseline", "DIFF", "DIFF - baseline", "verdict"]))
    out.append("The paper (section 3.7) reports DIFF keeping its accuracy at 6 and 4 bits where the Transformer "
               "degrades, at 3B scale.\n")
    out.append(_icl_section(results))
    # -- diagnostics ---------------------------------------------------------------------------
    out.append("## Diagnostics\n")
    rows = []
    for s in seeds:
        d = runs[str(s)]["diff"]["evals"]["diagnostics"]
        b = runs[str(s)]["baseline"]["evals"]["diagnostics"]
        rows.append([str(s), ", ".join(_f(x) for x in d["lambda"]), ", ".join(_f(x) for x in d["lambda_init"]),
                     ", ".join(_f(x) for x in d["head_redundancy"]), ", ".join(_f(x) for x in b["head_redundancy"])])
    out.append(_table(rows, ["seed", "DIFF lambda per layer (final)", "lambda_init", "DIFF head redundancy per layer",
                             "baseline head redundancy per layer"]))
    out.append("Head redundancy: mean pairwise cosine similarity of the heads' effective maps on needle prompts "
               "(1 = identical heads).\n")
    out.append("## Not run\n")
    out.append("- Natural-language (LWM-style) needles: these models have a task vocabulary, not a text tokenizer "
               "(`difftx.eval.evaluate_needles_text` serves models that have one).\n")
    # -- time and plots ------------------------------------------------------------------------
    out.append("## Training time\n")
    rows = [[str(s), k, _f(runs[str(s)][k]["train"]["wall_s"], 1), _f(runs[str(s)][k]["train"]["cpu_s"], 1),
             str(runs[str(s)][k]["train"]["threads"])] for s in seeds for k in ("diff", "baseline")]
    out.append(_table(rows, ["seed", "model", "wall s", "CPU s", "threads"]))
    if plots:
        out.append("## Plots\n")
        for name, path in plots.items():
            out.append(f"![{name}]({path})\n")
    v = results["versions"]
    out.append(f"\n---\ndifftx {v['difftx']}, torch {v['torch']}, Python {v['python']}, {v['platform']}. "
               "Every number is in `results.json`.\n")
    return "\n".join(out)


def _mix(results: dict) -> str:
    """The training mix in words, e.g. 'batches: 75% needle, 12.5% LM (Shakespeare bytes), 12.5% ICL'."""
    from .presets import ComparePreset
    from .train import batch_shares

    shares = batch_shares(ComparePreset.from_dict(results["preset"]))
    names = {"needle": "needle", "lm": "LM (Shakespeare bytes)", "icl": "ICL"}
    return "batches: " + ", ".join(f"{100 * v:.3g}% {names[k]}" for k, v in shares.items() if v)


def _probe_section(results: dict) -> str:
    """When each model learned retrieval: needle accuracy probed during training."""
    runs, seeds, p = results["runs"], [str(s) for s in results["seeds"]], results["preset"]
    if not all(runs[s][k]["train"].get("probes") for s in seeds for k in ("diff", "baseline")):
        return ""
    grid = [f"{n}/{r}" for n, r in p["grid"]]
    first = grid[0]
    out = ["### Retrieval during training\n",
           f"Needle accuracy on {p['probe_samples']} fixed prompts per N/R cell (depth 50%, not the evaluation's "
           f"prompts), every {p['probe_every']} steps. Small models learn this task in a sudden transition whose "
           "step varies from seed to seed, so *when* each model learns it says as much as the final accuracy. "
           f"'Learned at' is the first probe with accuracy >= {PROBE_LEARNED} at N/R = {first}.\n"]
    rows = []
    for s in seeds:
        for k in ("baseline", "diff"):
            pr = runs[s][k]["train"]["probes"]
            at = first_learned_step(pr, first)
            rows.append([s, NAMES[k], f"step {at}" if at is not None else f"not by step {pr[-1]['step']}"]
                        + [_f(pr[-1]["accuracy"].get(g), 2) for g in grid])
    out.append(_table(rows, ["seed", "model", f"learned at ({first})"] + [f"last probe {g}" for g in grid]))
    c = results["comparison"].get("needle_learned_step")
    if c:
        out.append(f"Steps until learned, DIFF - baseline (paired): {_pair(c, 0)}, {_call(c)}.\n")
    else:
        out.append("Steps until learned are compared only when every model learned the task.\n")
    return "\n".join(out)


def _icl_section(results: dict) -> str:
    """In-context learning order robustness: accuracy and best - worst over orders, with the
    'not learned' rule (best - worst of a model at chance is sampling noise, not robustness)."""
    p, C, runs, seeds = results["preset"], results["comparison"], results["runs"], results["seeds"]
    out = ["## In-context learning order robustness\n"]
    if not p.get("icl_every"):
        return out[0] + ("Not run: this preset trains no in-context classification batches (`--set icl_every=4` "
                         "adds them).\n")
    ev0 = runs[str(seeds[0])]["diff"]["evals"]["icl"]
    task = ev0["config"]["task"]
    out.append(f"A synthetic classification task whose label map is drawn per sequence ({task['n_classes']} classes, "
               f"{task['n_demos']} demonstrations, chance {ev0['chance']:.2f}), trained alongside the others "
               f"({_mix(results)}). "
               f"The same {p['icl_episodes']} episodes are shown in {p['icl_orders']} orders of each kind "
               "(random; alternating by class); best - worst is the spread of accuracy over those orders (paper "
               "section 3.5: lower is more robust). Mean over seeds [95% bootstrap CI]:\n")
    rows = []
    for key in [k for k in C if k.startswith("icl_")]:
        c = C[key]
        rows.append([c["label"], _ci(c["baseline_mean"], c["baseline_ci"]), _ci(c["diff_mean"], c["diff_ci"]),
                     _pair(c), _call(c)])
    out.append(_table(rows, ["metric", "baseline", "DIFF", "DIFF - baseline", "verdict"]))
    runs_all = [(s, k, kind) for s in seeds for k in ("baseline", "diff") for kind in ICL_ORDER_KINDS]
    at_chance = [f"{NAMES[k]} seed {s} ({kind})" for s, k, kind in runs_all
                 if not runs[str(s)][k]["evals"]["icl"][kind]["above_chance"]]
    rule = ("(mean accuracy within two binomial standard errors of chance): its best - worst is sampling noise, not a "
            "robustness measurement, so best - worst is compared only where every seed of both models is above chance")
    if len(at_chance) == len(runs_all):
        out.append(f"**No model learned the ICL task** in any seed or order kind {rule}. Per seed (random orders), "
                   "accuracy / best - worst: " + "; ".join(
                       f"{NAMES[k]} seed {s} {runs[str(s)][k]['evals']['icl']['random']['mean']:.2f} / "
                       f"{runs[str(s)][k]['evals']['icl']['random']['best_minus_worst']:.2f}"
                       for s in seeds for k in ("baseline", "diff")) + ".\n")
    elif at_chance:
        out.append(f"**Not above chance** {rule}: " + ", ".join(at_chance) + ".\n")
    return "\n".join(out)


def make_plots(out: Path, results: dict) -> dict[str, str]:
    """The PNGs under ``out/plots`` (empty when matplotlib is missing); name -> relative path."""
    try:
        import matplotlib  # noqa: F401

        from ..eval import plots as P
    except ImportError:
        return {}
    runs, seeds = results["runs"], [str(s) for s in results["seeds"]]
    s0 = seeds[0]
    d = out / "plots"
    made: dict[str, str] = {}

    def rel(name: str, path) -> None:
        made[name] = str(Path(path).relative_to(out))

    for loss, label in (("needle_loss", "needle answer loss (nats)"), ("lm_loss", "LM loss (nats)")):
        curves = {}
        for s in seeds:
            for k in ("diff", "baseline"):
                h = [r for r in runs[s][k]["train"]["history"] if loss in r]
                if h:
                    curves[f"{'DIFF' if k == 'diff' else 'baseline'} seed {s}"] = ([r["step"] for r in h],
                                                                                  [r[loss] for r in h])
        if curves:
            rel(f"training {loss}", P.plot_loss_curves(curves, d / f"{loss}.png", ylabel=label,
                                                       title=f"Training: {label}"))
    first = "{}/{}".format(*results["preset"]["grid"][0])
    curves = {}
    for s in seeds:
        for k in ("diff", "baseline"):
            pr = runs[s][k]["train"].get("probes")
            if pr:
                curves[f"{'DIFF' if k == 'diff' else 'baseline'} seed {s}"] = ([r["step"] for r in pr],
                                                                              [r["accuracy"][first] for r in pr])
    if curves:
        rel("needle accuracy during training", P.plot_loss_curves(
            curves, d / "needle_probe.png", ylabel=f"needle accuracy N/R={first}",
            title="Retrieval during training (probe prompts)"))
    C = results["comparison"]
    grid = [f"{n}/{r}" for n, r in results["preset"]["grid"]]
    acc = {m: {g: C[f"needle_{g.replace('/', '_')}"][f"{k}_mean"] for g in grid}
           for m, k in (("baseline", "baseline"), ("DIFF", "diff"))}
    rel("needle accuracy", P.plot_needle_accuracy(acc, d / "needle_accuracy.png",
                                                  title=f"Multi-needle retrieval (mean over {len(seeds)} seed(s))"))
    for k in ("baseline", "diff"):
        hm = runs[s0][k]["evals"]["needle"].get("heatmap")
        if hm:
            rel(f"needle heatmap {k}", P.plot_needle_heatmap(hm["depths"], hm["lengths"], hm["accuracy"],
                                                             d / f"needle_heatmap_{k}.png",
                                                             title=f"{NAMES[k]}: N/R={hm['cell']}, depth x length"))
    att = {NAMES[k]: runs[s0][k]["evals"]["attention"]["rows"][0]["layers"][-1] for k in ("baseline", "diff")}
    roles = runs[s0]["diff"]["evals"]["attention"]["rows"][0]["roles"]
    rel("attention to answer", P.plot_attention_to_answer(att, roles, d / "attention_to_answer.png",
                                                          title="First answer token, last layer, head mean "
                                                                f"(seed {s0})"))
    rel("outliers", P.plot_outliers({m: runs[s0][k]["evals"]["outliers"] for m, k in (("baseline", "baseline"),
                                                                                     ("DIFF", "diff"))},
                                    d / "outliers.png"))
    for name, metric in (("nll", "NLL"), ("needle_accuracy", "needle accuracy")):
        curves = {m: runs[s0][k]["evals"]["quant"][name] for m, k in (("baseline", "baseline"), ("DIFF", "diff"))
                  if name in runs[s0][k]["evals"]["quant"]}
        if curves:
            rel(f"quantization {metric}", P.plot_quantization(curves, d / f"quant_{name}.png", metric=metric))
    if "extrapolation" in runs[s0]["diff"]["evals"]["lm"]:
        f = max(runs[s0]["diff"]["evals"]["lm"]["extrapolation"], key=int)
        curves = {m: runs[s0][k]["evals"]["lm"]["extrapolation"][f]["nll_by_position"]
                  for m, k in (("baseline", "baseline"), ("DIFF", "diff"))}
        rel("NLL by position", P.plot_nll_by_position(curves, d / "nll_by_position.png",
                                                      train_len=results["preset"]["lm_seq_len"]))
    lam = {f"seed {s} final": runs[s]["diff"]["evals"]["diagnostics"]["lambda"] for s in seeds}
    hist = [r for r in runs[s0]["diff"]["train"]["history"] if r.get("lambda")]
    if hist:
        for r in (hist[0], hist[len(hist) // 2]):
            lam[f"seed {s0} step {r['step']}"] = r["lambda"]
    rel("lambda per layer", P.plot_lambda_per_layer(lam, d / "lambda_per_layer.png",
                                                    lambda_init=runs[s0]["diff"]["evals"]["diagnostics"]["lambda_init"]))
    return made


def _json_default(o):
    return str(o)


def write_outputs(out: Path, results: dict, *, progress: bool = True) -> None:
    """Write ``plots/``, ``report.md`` and ``results.json`` (atomically)."""
    plots = make_plots(out, results)
    results["plots"] = plots
    text = render_report(results, plots)
    atomic_write(out / "report.md", lambda p: Path(p).write_text(text))
    atomic_write(out / "results.json",
                 lambda p: Path(p).write_text(json.dumps(results, indent=1, default=_json_default) + "\n"))
