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
    """Columns measured beyond what the run folders record, appended to the table: the place
    where the held-out NLL with its interval over windows (from the evaluation layer) joins.
    Each is a ``difftx.training.summary.Column``; none yet."""
    return []
