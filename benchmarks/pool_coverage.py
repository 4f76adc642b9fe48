"""Coverage of ``difftx runs --pool`` (``difftx.eval.pool``) by simulation: the pooled mean's HKSJ interval, the
prediction interval for a new comparison and tau's Q-profile interval, with 3-20 comparisons, tau from 0 to 2x the
within-comparison SE and unequal seeds per comparison.

    python benchmarks/pool_coverage.py [--runs 20000] [--k 3,5,10,20] [--ratios 0,0.5,1,2] [--seeds 3-14]
                                       [--spread] [--known-se]

Each run simulates ``k`` comparisons. Comparison ``i`` has a true paired difference ``theta_i ~ N(mu, tau^2)`` and
``n_i`` seeds drawn uniformly from ``--seeds``; its seeds' differences are ``N(theta_i, sigma_i^2)``, so its estimate
is their mean and its SE their sample SD over ``sqrt(n_i)`` (drawn exactly: the mean ``N(theta_i, sigma_i^2 / n_i)``,
the variance ``sigma_i^2 chi2_{n_i - 1} / (n_i - 1)``). ``sigma_i`` is 1, or log-uniform over [0.5, 2] with
``--spread`` (comparisons of unequal noise, e.g. other sizes). ``tau`` is ``ratio`` times the within-comparison SE
``sigma sqrt(mean over n of 1/n)`` (0.38 for 3-14 seeds). With ``--known-se`` each comparison's SE is its true
``sigma_i / sqrt(n_i)`` instead (what the formulas assume): the difference shows what estimating the SEs from few
seeds costs. The pooled estimate is then made exactly as ``runs --pool``
makes it (the same functions), by each method:

- ``PM+HKSJ>=1``: tau^2 by Paule-Mandel, the HKSJ interval with its factor ``q`` kept at least 1 (never narrower
  than the ordinary random-effects interval): the default of ``runs --pool``;
- ``PM+HKSJ``: the same with HKSJ's own ``q`` (``runs --pool --hksj plain``);
- ``DL+HKSJ``: tau^2 by DerSimonian-Laird, HKSJ's own ``q``.

Printed per cell (k, ratio) and method: the coverage of the true ``mu`` by the 95% interval; the expected coverage of
a new comparison's true difference (``N(mu, tau^2)``) by the 95% prediction interval (exact given each run's interval,
so only the runs vary): the one ``runs --pool`` prints, over tau^2's confidence distribution (CD; the default method
alone, over the first ``--pi-runs`` runs), and the plug-in one (t on ``k - 2`` df); the coverage of the true tau by its
Q-profile interval; and the median width of the mean's interval. Each coverage has its Monte Carlo SE. Cells under
0.93 are flagged, and the last lines say where each method falls short. The default (20,000 runs per cell, 2,000 of
them for the CD interval, 16 cells) takes about 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from difftx.eval.pool import (hksj, prediction_interval, prediction_interval_cd, tau2_estimate,  # noqa: E402
                              tau2_interval)
from difftx.eval.stats import _normal_cdf  # noqa: E402

TARGET = 0.93
WHAT = {"mean": "mean", "cd": "prediction (CD)", "pi": "prediction (plug-in)", "tau": "tau"}
METHODS = {"PM+HKSJ>=1": ("pm", True), "PM+HKSJ": ("pm", False), "DL+HKSJ": ("dl", False)}
DEFAULT = "PM+HKSJ>=1"


def _pi_cover(lo, hi, mu: float, tau: float) -> np.ndarray:
    """The probability that a new comparison's true difference, ``N(mu, tau^2)``, falls in ``[lo, hi]``."""
    if tau > 0:
        return _normal_cdf((hi - mu) / tau) - _normal_cdf((lo - mu) / tau)
    return ((lo <= mu) & (mu <= hi)).astype(float)


def simulate(k: int, ratio: float, runs: int, seeds: tuple[int, int], spread: bool, rng,
             known_se: bool = False, pi_runs: int = 2000) -> dict:
    """One cell: ``{method: {"mean", "pi", "cd", "tau", "width"}}`` (coverages as arrays of 0/1 or probabilities;
    ``cd``, the interval ``runs --pool`` prints, for the default method alone, over the first ``pi_runs`` runs)."""
    n = rng.integers(seeds[0], seeds[1] + 1, size=(runs, k))
    sigma = np.exp(rng.uniform(math.log(0.5), math.log(2.0), size=(runs, k))) if spread else np.ones((runs, k))
    within = math.sqrt(np.mean(1.0 / np.arange(seeds[0], seeds[1] + 1)))
    tau, mu = ratio * within, 0.0
    theta = mu + tau * rng.standard_normal((runs, k))
    y = theta + sigma / np.sqrt(n) * rng.standard_normal((runs, k))
    v = sigma ** 2 * rng.chisquare(n - 1) / (n - 1) / n
    if known_se:
        v = sigma ** 2 / n
    out = {}
    t_lo, t_hi = tau2_interval(y, v)
    tau_cover = (t_lo <= tau ** 2) & (tau ** 2 <= t_hi)
    for name, (method, floor) in METHODS.items():
        tau2 = tau2_estimate(y, v, method)
        m, se, lo, hi = hksj(y, v, tau2, floor=floor)
        p_lo, p_hi = prediction_interval(m, se, tau2, k)
        cd = None
        if name == DEFAULT:
            cd = _pi_cover(*prediction_interval_cd(y[:pi_runs], v[:pi_runs], floor=floor), mu, tau)
        out[name] = {"mean": (lo <= mu) & (mu <= hi), "pi": _pi_cover(p_lo, p_hi, mu, tau), "cd": cd,
                     "tau": tau_cover, "width": np.median(hi - lo)}
    return out


def _cov(x) -> tuple[float, float]:
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20000, help="simulated meta-analyses per cell")
    ap.add_argument("--k", default="3,5,10,20", help="numbers of comparisons")
    ap.add_argument("--ratios", default="0,0.5,1,2", help="tau as a multiple of the within-comparison SE")
    ap.add_argument("--seeds", default="3-14", help="the range of seeds per comparison, drawn uniformly")
    ap.add_argument("--spread", action="store_true",
                    help="each comparison's per-seed SD log-uniform over [0.5, 2] (default: all 1)")
    ap.add_argument("--pi-runs", type=int, default=2000,
                    help="the runs per cell whose prediction interval of runs --pool (CD) is measured (it simulates "
                         "4,000 draws per run)")
    ap.add_argument("--known-se", action="store_true",
                    help="give every comparison its true SE (default: the SE of its simulated seeds)")
    ap.add_argument("--rng", type=int, default=0, help="random seed")
    a = ap.parse_args(argv)
    if a.runs < 2:
        raise ValueError(f"--runs: at least 2, got {a.runs}")
    ks = [int(x) for x in a.k.split(",")]
    if any(k < 3 for k in ks):
        raise ValueError(f"--k: at least 3 comparisons each (the prediction interval needs 3), got {a.k}")
    ratios = [float(x) for x in a.ratios.split(",")]
    lo, _, hi = a.seeds.partition("-")
    seeds = (int(lo), int(hi or lo))
    if seeds[0] < 2 or seeds[1] < seeds[0]:
        raise ValueError(f"--seeds: a range LOW-HIGH with LOW >= 2, got {a.seeds}")
    rng = np.random.default_rng(a.rng)
    start = time.time()
    print(f"{a.runs} runs per cell; seeds per comparison uniform over {seeds[0]}-{seeds[1]}; per-seed SD "
          f"{'log-uniform over [0.5, 2]' if a.spread else '1'}; SEs {'known' if a.known_se else 'from the seeds'}; "
          f"tau = ratio x the within-comparison SE "
          f"({math.sqrt(np.mean(1.0 / np.arange(seeds[0], seeds[1] + 1))):.3f}); coverage (Monte Carlo SE); "
          f"* below {TARGET}")
    header = (f"{'k':>3} {'ratio':>5} {'method':<11} {'mean':>14} {'pred. (CD)':>14} {'pred. plug-in':>14} "
              f"{'tau (Q-prof.)':>14} {'width':>7}")
    print(header)
    print("-" * len(header))
    short: dict = {m: [] for m in METHODS}
    for k in ks:
        for r in ratios:
            cell = simulate(k, r, a.runs, seeds, a.spread, rng, a.known_se, a.pi_runs)
            for name, res in cell.items():
                parts = []
                for key in ("mean", "cd", "pi", "tau"):
                    if res[key] is None:
                        parts.append("- ")
                        continue
                    c, se = _cov(res[key])
                    flag = "*" if c < TARGET else " "
                    parts.append(f"{c:.3f} ({se:.3f}){flag}")
                    if c < TARGET:
                        short[name].append(f"{WHAT[key]} {c:.3f} at k={k}, ratio {r:g}")
                print(f"{k:>3} {r:>5g} {name:<11} " + " ".join(f"{x:>14}" for x in parts) + f" {res['width']:>7.3f}")
    print()
    for name, where in short.items():
        print(f"{name}: " + ("coverage >= {:.2f} in every cell".format(TARGET) if not where else
                             "below {:.2f}: {}".format(TARGET, "; ".join(where))))
    print(f"({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
