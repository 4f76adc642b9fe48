"""``difftx eval``: one of the paper's evaluations on a trained checkpoint."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("eval", help="run one evaluation (lm, needle, outliers, quant) on a checkpoint",
                       description="Evaluate a checkpoint (a checkpoint folder, or a run folder whose latest "
                                   "checkpoint is used). Models from `difftx compare` are scored on their synthetic "
                                   "needle task and held-out Shakespeare bytes; text models from `difftx train` on "
                                   "held-out text and the natural-language needle form.")
    p.add_argument("task", choices=["lm", "needle", "outliers", "quant"])
    p.add_argument("checkpoint", help="checkpoint or run folder")
    p.add_argument("--tokenizer", help="tokenizer of a text model (default: the one saved with it, else byte)")
    p.add_argument("--data", help="held-out text source for a text model (default: the bundled corpus)")
    p.add_argument("--seq-len", type=int, help="LM window length (default: the training length)")
    p.add_argument("--windows", type=int, default=32, help="LM windows (default 32)")
    p.add_argument("--samples", type=int, default=20, help="needle samples per N/R x depth cell (default 20)")
    p.add_argument("--context-len", type=int, default=256, help="text needle form: prompt tokens (default 256)")
    p.add_argument("--json", dest="json_out", help="also write the full result to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ..checkpoint import CheckpointError, atomic_write
    from ..compare.single import evaluate_checkpoint

    for name in ("windows", "samples", "context_len"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    try:
        res = evaluate_checkpoint(args.task, args.checkpoint, tokenizer=args.tokenizer, data=args.data,
                                  seq_len=args.seq_len, windows=args.windows, samples_per_cell=args.samples,
                                  context_len=args.context_len, progress=not args.no_progress)
    except CheckpointError as e:  # a missing / corrupt checkpoint: a clear message, exit code 2
        raise ValueError(str(e)) from None
    print(f"{res['checkpoint']} ({res['attention']}, {res['parameters']:,} parameters)")
    if args.task == "lm":
        h = res["heldout"]
        print(f"NLL {h['nll']:.4f} nats  bits/byte {h['bpb']:.4f}  AR-hit NLL {h['ar_hit_nll']}  other NLL "
              f"{h['other_nll']}")
        for f, r in res["extrapolation"].items():
            print(f"  x{f} training length: NLL {r['nll']:.4f}  beyond training length "
                  f"{r['extra'].get('nll_beyond_train_len', float('nan')):.4f}")
    elif args.task == "needle":
        n = res["needle"]
        print("accuracy " + "  ".join(f"{k}: {v:.2f}" for k, v in n["accuracy"].items()))
        print("outcomes " + "  ".join(f"{k}: {v:.2f}" for k, v in n["outcome_rates"].items()))
    elif args.task == "outliers":
        for q in ("attention_logits", "hidden_states"):
            s = res[q]
            print(f"{q:17s} top1 {s['top1']:.2f}  top10 {s['top10']:.2f}  median {s['median']:.3f}  "
                  f"top1/median {s['top1_over_median']:.1f}")
    else:
        for key in [k for k in ("nll", "needle_accuracy_4_2") if k in res]:
            c = res[key]
            print(f"{key}: full {c['full']:.4f}  " + "  ".join(
                f"{g} {b}b {v:.4f}" for g in ("row", "tensor") for b, v in c[g].items()))
    if args.json_out:
        atomic_write(Path(args.json_out), lambda p: Path(p).write_text(json.dumps(res, indent=1) + "\n"))
    return 0
