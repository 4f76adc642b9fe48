"""``difftx runs RUN [RUN ...]``: training runs side by side (``difftx.training.summary``)."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    from .train import strict_unknown_flags

    p = sub.add_parser("runs", help="training runs side by side: params, tokens, tokens/s, losses; --plot curves",
                       description="Summarise training run folders (what `difftx train --out` wrote) side by side: "
                                   "attention kind, parameters, steps, tokens seen, tokens/s over the whole run, "
                                   "last training loss, best and final validation loss with their steps, "
                                   "validation size. Read from the folders; nothing is recomputed.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (e.g. a DIFF run and its baseline)")
    p.add_argument("--plot", metavar="FILE.png", help="also write the training and validation curves (matplotlib)")
    p.add_argument("--nll", action="store_true",
                   help="also score each run's latest checkpoint on held-out text (`difftx eval lm`): mean NLL with "
                        "its 95%% interval over windows")
    p.add_argument("--data", metavar="FILE",
                   help="with --nll: score every token of this file (default: each run's own validation split; give "
                        "one file to compare runs on the same text)")
    p.add_argument("--windows", type=int, default=None,
                   help="with --nll: windows spread over the held-out split (default 512; with --data every token)")
    p.set_defaults(func=run)
    strict_unknown_flags(p)


def run(args: argparse.Namespace) -> int:
    from ..training.summary import LEGEND, comparability_notes, format_table, plot_runs, summarize_run

    summaries = [summarize_run(r) for r in args.runs]  # ValueError naming a folder that is not a run
    print(format_table(summaries, extra=extra_columns(args, summaries)))
    print(f"({LEGEND})")
    for note in comparability_notes(summaries):
        print(f"note: {note}")
    if args.plot:
        try:
            path = plot_runs(summaries, args.plot)
        except ImportError as e:
            print(f"difftx runs: error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
    return 0


def extra_columns(args: argparse.Namespace, summaries: list) -> list:
    """Columns measured beyond what the run folders record, appended to the table: with
    ``--nll``, the held-out NLL of each run's latest checkpoint (the ``lm`` task of
    ``difftx.tasks``, as ``difftx eval lm`` computes it) with its 95% t-interval over windows."""
    if not args.nll:
        if args.data or args.windows is not None:
            raise ValueError("--data and --windows apply with --nll")
        return []
    from ..eval.stats import mean_interval
    from ..tasks.lm import LMSettings
    from ..tasks.runner import evaluate_checkpoint
    from ..training.summary import Column

    if args.windows is not None and args.windows < 0:
        raise ValueError(f"--windows: must be >= 0, got {args.windows}")
    settings = LMSettings(windows=args.windows, extrapolation_factors=(1,))
    scored = {}
    for s in summaries:
        res = evaluate_checkpoint("lm", s.path, settings=settings, data=args.data, progress=False)
        m, lo, hi = mean_interval(res["records"]["window_nll"])  # a t-interval over the windows
        nll = res["heldout"]["nll"]  # token-weighted (a shorter last window counts by its tokens)
        scored[s.path] = (nll, None if lo is None else nll - (m - lo), None if hi is None else nll + (hi - m),
                          res["tokens"], res["source"])
    for s in summaries:
        m, lo, hi, n, src = scored[s.path]
        print(f"held-out NLL of {s.path}: {n:,} tokens of {src}")

    def cell(s) -> str:
        m, lo, hi, _, _ = scored[s.path]
        return f"{m:.4f}" if lo is None else f"{m:.4f} [{lo:.4f}, {hi:.4f}]"

    return [Column("held-out NLL [95% CI]", cell)]
