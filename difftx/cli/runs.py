"""``difftx runs RUN [RUN ...]``: training runs side by side (``difftx.training.summary``)."""

from __future__ import annotations

import argparse


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
                        "its 95%% interval over disjoint windows, and each run minus the first, window by window on "
                        "the same text, with its 95%% interval")
    p.add_argument("--data", metavar="FILE",
                   help="with --nll: score every token of this file (default: each run's own validation split; give "
                        "one file to compare runs on the same text)")
    p.add_argument("--windows", type=int, default=None,
                   help="with --nll: disjoint windows spread over the held-out split (default 512, or as many as "
                        "fit; with --data every token)")
    p.set_defaults(func=run)
    strict_unknown_flags(p)


def run(args: argparse.Namespace) -> int:
    from ..training.summary import DEFAULT_COLUMNS, LEGEND, comparability_notes, format_table, plot_runs, summarize_run

    from pathlib import Path

    from .args import check_not_owned, check_output_file

    if args.plot and not Path(args.plot).suffix:
        args.plot += ".png"  # what matplotlib writes for a name without a suffix: say so, and check that file
    check_output_file(args.plot, "--plot")
    check_not_owned(args.plot, "--plot")
    summaries = [summarize_run(r) for r in args.runs]  # ValueError naming a folder that is not a run
    columns, notes = extra_columns(args, summaries)
    print(format_table(summaries))
    print(f"({LEGEND})")
    if columns:  # a table of their own, so that no row is much wider than 100 characters
        print()
        print(format_table(summaries, columns=DEFAULT_COLUMNS[:1], extra=columns))
    for note in notes:
        print(note)
    for note in comparability_notes(summaries):
        print(f"note: {note}")
    if args.plot:  # without matplotlib: a ModuleNotFoundError, which the boundary (difftx.cli.main) reports
        print(f"wrote {plot_runs(summaries, args.plot)}")
    return 0


def extra_columns(args: argparse.Namespace, summaries: list) -> tuple[list, list[str]]:
    """Columns measured beyond what the run folders record, appended to the table: with
    ``--nll``, the held-out NLL of each run's latest checkpoint (the ``lm`` task of
    ``difftx.tasks``, as ``difftx eval lm`` computes it) with its 95% t-interval over disjoint
    windows, and every run's paired difference from the first, window by window on the same text.
    Returns the columns and the lines that explain them."""
    if not args.nll:
        if args.data or args.windows is not None:
            raise ValueError("--data and --windows apply with --nll")
        return [], []
    from ..tasks.lm import LMSettings, scored_tokens
    from ..tasks.runner import evaluate_checkpoint
    from ..training.summary import Column

    if args.windows is not None and args.windows < 0:
        raise ValueError(f"--windows: must be >= 0, got {args.windows}")
    settings = LMSettings(windows=args.windows, extrapolation_factors=(1,))
    results = {s.path: evaluate_checkpoint("lm", s.path, settings=settings, data=args.data, progress=False)
               for s in summaries}
    notes = [f"held-out NLL of {s.path}: {scored_tokens(results[s.path])} of {results[s.path]['source']}"
             for s in summaries]
    first = summaries[0].path
    paired = {s.path: paired_nll(results[s.path], results[first]) for s in summaries[1:]}
    if paired:
        notes.append(f"- first run: each run's NLL minus {first}'s, window by window on the same text; a t interval\n"
                     "  over disjoint windows (text noise only: one trained model per run, so seed noise is not in it)")
    if any(isinstance(p, str) for p in paired.values()):
        notes.append("not paired: the runs were scored on different held-out texts (their own validation splits);\n"
                     "  pass --data FILE to score every run on one text")

    def cell(s) -> str:
        return _with_interval(results[s.path]["heldout"]["nll"], *_window_interval(results[s.path]), "{:.4f}")

    def vs_first(s) -> str:
        if s.path == first:
            return "(reference)"
        p = paired[s.path]
        return p if isinstance(p, str) else _with_interval(*p, "{:+.4f}")

    return [Column("held-out NLL [95% CI]", cell), Column("- first run [95% CI]", vs_first)], notes


def _window_interval(res: dict) -> tuple:
    """The t interval of a run's per-window NLL, shifted to its token-weighted mean."""
    from ..eval.stats import t_interval

    m, lo, hi = t_interval(res["records"]["window_nll"])
    return (None, None) if lo is None else (lo - m, hi - m)


def _with_interval(value: float, lo, hi, fmt: str) -> str:
    if lo is None:
        return fmt.format(value)
    return f"{fmt.format(value)} [{fmt.format(value + lo)}, {fmt.format(value + hi)}]"


def paired_nll(res: dict, ref: dict):
    """``(mean, low offset, high offset)`` of ``res`` minus ``ref`` over the same windows
    (token-weighted mean; t interval over the windows), or why they cannot be paired."""
    import numpy as np

    from ..eval.stats import t_interval

    tokens = res["records"]["window_tokens"]
    if res.get("text_id") != ref.get("text_id") or tokens != ref["records"]["window_tokens"]:
        return "not paired: other text"
    d = np.asarray(res["records"]["window_nll"]) - np.asarray(ref["records"]["window_nll"])
    w = np.asarray(tokens, dtype=np.float64)
    mean = float((d * w).sum() / w.sum())
    m, lo, hi = t_interval(d)
    return (mean, None, None) if lo is None else (mean, lo - m, hi - m)
