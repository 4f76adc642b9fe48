"""``difftx eval``: one of the paper's evaluations on a trained checkpoint."""

from __future__ import annotations

import argparse

from .args import output_file, positive_int

# the same names as difftx.compare.single.TASKS (not imported here: `difftx --help` stays light)
TASKS = ("lm", "needle", "attention", "outliers", "quant", "diagnostics", "icl")


def register(sub) -> None:
    p = sub.add_parser("eval", help=f"run one evaluation ({', '.join(TASKS)}) on a checkpoint",
                       description="Evaluate a checkpoint (a checkpoint folder, or a run folder whose latest "
                                   "checkpoint is used). Models from `difftx compare` are scored on their synthetic "
                                   "needle task and held-out Shakespeare bytes; text models from `difftx train` on "
                                   "held-out text and the natural-language needle form. attention: answer / noise "
                                   "attention mass per layer at the first answer position of needle prompts (cell "
                                   "--cell, depth 0.5). diagnostics: learned lambda and head redundancy per layer. "
                                   "icl: in-context learning order robustness, for a compare model trained on the "
                                   "synthetic ICL task (`difftx compare --set icl_every=4`).")
    p.add_argument("task", choices=TASKS)
    p.add_argument("checkpoint", help="checkpoint or run folder")
    p.add_argument("--tokenizer", help="tokenizer of a text model (default: the one saved with it, else byte)")
    p.add_argument("--data", help="held-out text source for a text model (default: the bundled corpus)")
    p.add_argument("--seq-len", type=positive_int, help="LM window length (default: the training length)")
    p.add_argument("--windows", type=int, default=32, help="LM windows (default 32)")
    p.add_argument("--samples", type=int, default=20,
                   help="needle samples per N/R x depth cell; attention / diagnostics: probe prompts (default 20)")
    p.add_argument("--context-len", type=positive_int, default=256,
                   help="text needle form: prompt tokens (default 256)")
    p.add_argument("--cell", help="attention / diagnostics: probe cell N/R, N needles and R queried keys "
                                  "(default 4/2, or the most the model's needle task has)")
    p.add_argument("--episodes", type=int, default=100, help="icl: episodes (default 100)")
    p.add_argument("--orders", type=int, default=5, help="icl: demonstration orders per order kind (default 5)")
    p.add_argument("--json", dest="json_out", type=output_file, help="also write the full result to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def parse_cell(text: str | None) -> tuple[int, int] | None:
    """``"4/2"`` -> ``(4, 2)``; ``None`` stays ``None``."""
    if text is None:
        return None
    try:
        n, r = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--cell: expected N/R such as 4/2, got {text!r}") from None
    if n < 1 or r < 1:
        raise ValueError(f"--cell: N and R must be positive, got {text!r}")
    return n, r


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ..checkpoint import CheckpointError, atomic_write
    from ..compare.single import evaluate_checkpoint

    for name in ("windows", "samples", "context_len", "episodes", "orders"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    try:
        res = evaluate_checkpoint(args.task, args.checkpoint, tokenizer=args.tokenizer, data=args.data,
                                  seq_len=args.seq_len, windows=args.windows, samples_per_cell=args.samples,
                                  context_len=args.context_len, cell=parse_cell(args.cell), episodes=args.episodes,
                                  orders=args.orders, progress=not args.no_progress)
    except CheckpointError as e:  # a missing / corrupt checkpoint: a clear message, exit code 2
        raise ValueError(str(e)) from None
    print(f"{res['checkpoint']} ({res['attention']}, {res['parameters']:,} parameters)")
    PRINTERS[args.task](res)
    if args.json_out:
        atomic_write(Path(args.json_out), lambda p: Path(p).write_text(json.dumps(res, indent=1) + "\n"))
    return 0


def _print_lm(res: dict) -> None:
    h = res["heldout"]
    print(f"NLL {h['nll']:.4f} nats  bits/byte {h['bpb']:.4f}  AR-hit NLL {h['ar_hit_nll']}  other NLL "
          f"{h['other_nll']}")
    for f, r in res["extrapolation"].items():
        print(f"  x{f} training length: NLL {r['nll']:.4f}  beyond training length "
              f"{r['extra'].get('nll_beyond_train_len', float('nan')):.4f}")


def _print_needle(res: dict) -> None:
    n = res["needle"]
    print("accuracy " + "  ".join(f"{k}: {v:.2f}" for k, v in n["accuracy"].items()))
    print("outcomes " + "  ".join(f"{k}: {v:.2f}" for k, v in n["outcome_rates"].items()))


def _print_outliers(res: dict) -> None:
    for q in ("attention_logits", "hidden_states"):
        s = res[q]
        print(f"{q:17s} top1 {s['top1']:.2f}  top10 {s['top10']:.2f}  median {s['median']:.3f}  "
              f"top1/median {s['top1_over_median']:.1f}")


def _print_quant(res: dict) -> None:
    for key in [k for k in ("nll", "needle_accuracy_4_2") if k in res]:
        c = res[key]
        print(f"{key}: full {c['full']:.4f}  " + "  ".join(
            f"{g} {b}b {v:.4f}" for g in ("row", "tensor") for b, v in c[g].items()))


def _print_attention(res: dict) -> None:
    a = res["attention_to_answer"]
    print(f"attention at the first answer position: {a['n_samples']} {a['form']} needle prompts, cell {a['cell']}, "
          f"answer needle at depth {a['depth']}; mass of the L1-normalised row (best head in brackets)")
    print(f"{'layer':>5}  {'variant':8}  {'answer mean':>11}  {'best head':>13}  {'noise mean':>10}  {'best head':>13}")
    for lay in a["layers"]:
        for v in ("absolute", "signed"):
            ans, noi = lay["answer_heads"][v], lay["noise_heads"][v]
            print(f"{lay['layer']:>5}  {v:8}  {lay['answer_mean'][v]:11.4f}  "
                  f"{lay['answer_best'][v]:7.4f} (h{ans.index(max(ans))})  {lay['noise_mean'][v]:10.4f}  "
                  f"{lay['noise_best'][v]:7.4f} (h{noi.index(min(noi))})")
    for v in ("absolute", "signed"):
        sm = a["summary"][v]
        print(f"mean over layers ({v}): answer {sm['answer']:.4f}  noise {sm['noise']:.4f}")


def _print_diagnostics(res: dict) -> None:
    on = res["head_redundancy_on"]
    what = f"cell {on['cell']}" if "cell" in on else f"{on['seq_len']} tokens"
    print(f"head redundancy (mean pairwise cosine of the heads' maps) over {on['n_samples']} {on['source']} ({what})")
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    print(f"{'layer':>5}  {'lambda':>8}  {'lambda_init':>11}  {'head redundancy':>15}")
    for i, (lam, init, red) in enumerate(zip(res["lambda"], res["lambda_init"], res["head_redundancy"])):
        print(f"{i:>5}  {fmt(lam):>8}  {fmt(init):>11}  {fmt(red):>15}")


def _print_icl(res: dict) -> None:
    from ..eval.icl import ORDER_KINDS

    r = res["icl"]
    c = r["config"]
    print(f"ICL order robustness: {c['n_episodes']} episodes, {c['n_orders']} orders per kind, chance "
          f"{r['chance']:.2f}")
    for kind in (k for k in ORDER_KINDS if k in r):
        k = r[kind]
        line = (f"{kind:11}  mean accuracy {k['mean']:.3f}  best-worst {k['best_minus_worst']:.3f}  above chance: "
                f"{'yes' if k['above_chance'] else 'no'}")
        if not k["above_chance"]:
            line += "  (the task was not learned, so best-worst is sampling noise, not robustness)"
        print(line)


PRINTERS = {"lm": _print_lm, "needle": _print_needle, "attention": _print_attention, "outliers": _print_outliers,
            "quant": _print_quant, "diagnostics": _print_diagnostics, "icl": _print_icl}
