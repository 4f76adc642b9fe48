"""``difftx runs RUN [RUN ...]``: training runs side by side (``difftx.training.summary``)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from ..tasks.lm import LMSettings, interval_about, nll_interval, scored_tokens
from ..tasks.subject import TRAIN_RECORD
from .args import check_not_input, check_not_owned, check_output_file
from .train import strict_unknown_flags


def register(sub) -> None:
    p = sub.add_parser("runs", help="training runs side by side: params, tokens, tokens/s, losses; --plot curves",
                       description="Summarise training run folders (what `difftx train --out` wrote) side by side: "
                                   "attention kind, parameters, steps, tokens seen, tokens/s over the whole run, "
                                   "last training loss, best and final validation loss with their steps, "
                                   "validation size. Read from the folders; nothing is recomputed.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (e.g. a DIFF run and its baseline)")
    p.add_argument("--plot", metavar="FILE.png", help="also write the training and validation curves (matplotlib)")
    p.add_argument("--nll", action="store_true",
                   help="also score each run's latest checkpoint on held-out text (`difftx eval lm`): mean NLL with "
                        "its 95%% interval, and each run minus the first, window by window on the same text, with "
                        "its 95%% interval; the intervals are about text like the scored one, with blocks of "
                        "windows spanning at least 8,192 tokens of text as their units")
    p.add_argument("--data", metavar="FILE",
                   help="with --nll: score every token of this file (default: each run's own validation split; give "
                        "one file to compare runs on the same text)")
    p.add_argument("--windows", type=int, default=None,
                   help="with --nll: disjoint windows spread over the held-out split (default 512, or as many as "
                        "fit; with --data every token)")
    p.set_defaults(func=run)
    strict_unknown_flags(p)


def run(args: argparse.Namespace) -> int:
    from ..training.summary import (  # lazy: torch; --help stays fast
        DEFAULT_COLUMNS, LEGEND, comparability_notes, format_table, plot_runs, summarize_run,
    )

    if args.plot and not Path(args.plot).suffix:
        args.plot += ".png"  # what matplotlib writes for a name without a suffix: say so, and check that file
    check_output_file(args.plot, "--plot")
    check_not_owned(args.plot, "--plot")
    check_not_input(args.plot, "--plot", {"the run": list(args.runs), "--data": args.data})
    # ValueError naming a folder that is not a run; a compare model's model/ stands for its train/ run
    summaries = [summarize_run(_compare_run(Path(r)) or r) for r in args.runs]
    columns, notes = extra_columns(args, summaries)
    if any(s.final_lambda for s in summaries):  # DIFF runs: the λ each layer learned, at the last log record
        from ..training.summary import Column, lambda_text  # lazy: torch; --help stays fast

        columns = [Column("final λ per layer", lambda s: lambda_text(s.final_lambda), "<"), *columns]
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
    ``difftx.tasks``, as ``difftx eval lm`` computes it) with its 95% interval, and every run's
    paired difference from the first, window by window on the same text. The intervals are over
    blocks of windows (``difftx.tasks.lm.nll_interval``, ``difftx.eval.blocks``).
    Returns the columns and the lines that explain them."""
    if not args.nll:
        if args.data or args.windows is not None:
            raise ValueError("--data and --windows apply with --nll")
        return [], []
    from ..tasks.runner import evaluate_checkpoint  # lazy: --help stays fast
    from ..training.summary import Column  # lazy: torch; --help stays fast

    if args.windows is not None and args.windows < 0:
        raise ValueError(f"--windows: must be >= 0, got {args.windows}")
    settings = LMSettings(windows=args.windows, extrapolation_factors=(1,))
    # a compare model's run folder keeps no checkpoint once trained: its model/ is scored
    results = {s.path: evaluate_checkpoint("lm", s.path if s.checkpoint else _compare_model(s.path) or s.path,
                                           settings=settings, data=args.data, progress=False) for s in summaries}
    notes = [f"held-out NLL of {s.path}: {scored_tokens(results[s.path])} of {results[s.path]['source']}"
             for s in summaries]
    abouts = {interval_about(r, nll_interval(r)) for r in results.values()}
    notes += [textwrap.fill(f"- the NLL interval: {a}", 100, subsequent_indent="  ") for a in sorted(abouts)]
    first = summaries[0].path
    paired = {s.path: paired_nll(results[s.path], results[first]) for s in summaries[1:]}
    if paired:
        notes.append(f"- first run: each run's NLL minus {first}'s, window by window on the same text, with the same\n"
                     "  units (text noise only: one trained model per run, so seed noise is not in it)")
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


def _compare_run(path) -> "Path | None":
    """The ``train/`` run folder of the compare model whose ``model/`` folder is ``path`` (else None)."""
    folder = path.parent
    return folder / "train" if path.name == "model" and (folder / TRAIN_RECORD).is_file() and \
        (folder / "train").is_dir() else None


def _compare_model(run) -> "Path | None":
    """The ``model/`` folder of the compare model whose ``train/`` run folder is ``run`` (else None)."""
    folder = run.parent
    return folder / "model" if (folder / TRAIN_RECORD).is_file() and (folder / "model").is_dir() else None


def _window_interval(res: dict) -> tuple:
    """The interval of a run's NLL (``difftx.tasks.lm.nll_interval``), as offsets from its mean."""
    ci = nll_interval(res)
    return (None, None) if ci.low is None else (ci.low - ci.mean, ci.high - ci.mean)


def _with_interval(value: float, lo, hi, fmt: str) -> str:
    if lo is None:
        return fmt.format(value)
    return f"{fmt.format(value)} [{fmt.format(value + lo)}, {fmt.format(value + hi)}]"


def paired_nll(res: dict, ref: dict):
    """``(mean, low offset, high offset)`` of ``res`` minus ``ref`` over the same windows
    (token-weighted mean; interval over blocks of windows: ``difftx.tasks.lm.nll_interval``), or
    why they cannot be paired."""
    tokens = res["records"]["window_tokens"]
    if res.get("text_id") != ref.get("text_id") or tokens != ref["records"]["window_tokens"]:
        return "not paired: other text"
    ci = nll_interval(res, ref)
    return (ci.mean, None, None) if ci.low is None else (ci.mean, ci.low - ci.mean, ci.high - ci.mean)
