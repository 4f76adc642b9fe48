"""The regime the demo lives in, simulated at scale: each seed of each arm learns retrieval or not
(a lottery), through the comparison pipeline (learning gate, intervals, Holm over three primary
metrics). Prints, per number of seeds, the share of runs with a false verdict under the null (both
arms learn with the same probability) for the rule in use (p = max(t, sign-flip)) beside the t test
alone, and the coverage of the printed 95% intervals under a true difference (DIFF 0.8, baseline 0.5).

    python benchmarks/stats_lottery.py [--runs 1000]

The simulated models are those of ``tests/test_stats_lottery.py`` (imported from there)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_stats_lottery as sim  # noqa: E402

from difftx.compare import summary  # noqa: E402
from difftx.eval.stats import holm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000, help="simulated comparisons per cell (default 1000)")
    ap.add_argument("--seeds", default="2,3,5,6,8,10", help="numbers of paired seeds")
    args = ap.parse_args()
    summary.TASKS = {"lottery": sim._Lottery()}
    truth = sim._truth(0.8, 0.5, -0.05)
    print("| seeds | prompts | p (both arms) | false verdicts, rule in use | false verdicts, t alone | "
          "coverage where printed (acc / steps / NLL), DIFF 0.8 vs 0.5 | runs with an interval |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.seeds.split(",")):
        for prompts in (50, 250):
            rng = np.random.default_rng(1000 * n + prompts)
            alt = sim._run(rng, args.runs, n=n, p_diff=0.8, p_base=0.5, prompts=prompts, nll_shift=-0.05)
            cov, shown = [], 0
            for k in truth:
                printed = [c[k]["paired"] for c in alt if c[k]["gated"] is None and c[k]["paired"]["low"] is not None]
                shown = max(shown, len(printed))
                hits = [p["low"] <= truth[k] <= p["high"] for p in printed]
                cov.append(f"{np.mean(hits):.3f}" if printed else "-")
            for p in (0.5, 0.8):
                null = sim._run(rng, args.runs, n=n, p_diff=p, p_base=p, prompts=prompts)
                rule = np.mean([any(c["better"] is not None for c in comps.values()) for comps in null])
                t_alone = np.mean([_t_verdict(comps) for comps in null])
                print(f"| {n} | {prompts} | {p} | {rule:.3f} | {t_alone:.3f} | {' / '.join(cov)} | {shown} of "
                      f"{args.runs} |")


def _t_verdict(comps: dict) -> bool:
    """Whether the t test alone, Holm-adjusted over the compared primaries, declares any of them."""
    chosen = [c["paired"]["p_t"] for c in comps.values() if c["gated"] is None and c["paired"]["p_t"] is not None]
    return any(p < 0.05 for p in holm(chosen)) if chosen else False


if __name__ == "__main__":
    main()
