"""Skewed paired differences on a bounded metric: in 90% of seeds DIFF gains a little, in 10% it
fails by 0.5 (``tests/test_stats.py::_skewed_pairs``), with a true mean difference of 0 or +0.1.
Prints, per number of seeds, how often the symmetric tests alone (t and sign-flip) and the rule in
use (with the betting test of the mean) say "better", and how often each interval covers the truth.

    python benchmarks/stats_skewed.py [--runs 2000]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_stats import _skewed_pairs  # noqa: E402

from difftx.eval.stats import paired_estimate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000, help="simulated comparisons per row (default 2000)")
    args = ap.parse_args()
    print("| seeds | true mean difference | 'better' from t + sign-flip | verdicts, rule in use | "
          "interval covers: t + sign-flip | rule in use |")
    print("|---|---|---|---|---|---|")
    for shift in (0.0, 0.1):
        for n in (6, 8, 10):
            rng = np.random.default_rng(100 + n)
            diff, base = _skewed_pairs(rng, n, args.runs, shift)
            truth = float((diff - base).mean())
            new = [paired_estimate(d, b, bounds=(0.0, 1.0)) for d, b in zip(diff, base)]
            old = [paired_estimate(d, b) for d, b in zip(diff, base)]
            said = np.mean([max(e.p_t or 0.0, e.sign_flip_p) < 0.05 for e in new])
            verdicts = np.mean([e.p_value < 0.05 for e in new])

            def cover(est):
                return np.mean([e.low is not None and e.low <= truth <= e.high for e in est])

            print(f"| {n} | {shift:+.1f} | {said:.3f} | {verdicts:.3f} | {cover(old):.3f} | {cover(new):.3f} |")


if __name__ == "__main__":
    main()
