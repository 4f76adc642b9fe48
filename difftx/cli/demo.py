"""``difftx demo``: a short DIFF-vs-baseline run on built-in synthetic data."""

from __future__ import annotations

import argparse

from .args import positive_int, seed_int


def register(sub) -> None:
    p = sub.add_parser("demo", help="short DIFF-vs-baseline demo on built-in data",
                       description="Train a tiny DIFF model and its parameter-matched baseline on synthetic "
                                   "associative recall (same seed, same batches) and print accuracy, loss and "
                                   "learned lambda. About a minute on 2 CPU cores.")
    p.add_argument("--steps", type=positive_int, default=600, help="training steps per model (default 600)")
    p.add_argument("--pairs", type=positive_int, default=6, help="key-value pairs per sequence (default 6)")
    p.add_argument("--seq-len", type=positive_int, default=64, help="sequence length (default 64)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..demo import format_results, run_demo  # lazy: torch; --help stays fast

    if args.steps <= 0:
        raise ValueError("--steps must be positive")
    eval_samples = 1000
    results = run_demo(steps=args.steps, seq_len=args.seq_len, n_pairs=args.pairs, seed=args.seed,
                       eval_samples=eval_samples, show_progress=not args.no_progress)
    print()
    print(format_results(results, args.pairs, eval_samples))
    return 0
