"""The two estimands of a paired comparison, simulated in the regimes they are used in (issue 48).

Table 1, false verdicts per comparison under identical arms (each seed's two models drawn from the same
distribution: the null of exchangeability), for the verdict (t and exact sign-flip, Holm over a family of
``--family`` independent comparisons) and for the mean's betting test (Holm alike), at 5-14 seeds:

- ``lottery``: each model learns with probability 0.5 (accuracy 0.95 + noise) or not (0.1 + noise);
- ``skew``: an accuracy in [0.55, 0.9], minus 0.5 in one seed in ten (a rare failure), plus noise;
- ``ties``: steps until learned within a budget of 4,500, censored there in 40% of models (ties at the budget).

Table 2, equal means with skewed differences (90% of seeds +0.056, 10% -0.5: the arms are not interchangeable,
their means are equal): the rate of a directional verdict, and of a claimed mean difference.

Table 2 also counts what a report prints (:func:`difftx.eval.stats.verdict`, family of 1): how often a verdict says
"better" or "worse" (only where the mean difference is established), and, where the true mean lies against most seeds
(90% +0.056, 10% -0.6: mean -0.01), how often such a word names the wrong side of the mean; before, every verdict
took its word from the sign of the sample mean.

Table 4, every printed interval against the estimand its label names, with Monte Carlo SEs: a bounded metric's
"interval of the mean difference" (it holds the betting interval) against the true mean, an unbounded one's "interval
of the median" (order statistics over seeds; with examples widened by their shared effect) against the true median
seed difference, and, for comparison, the t and sign-flip hull (printed for an unbounded metric before) against the
mean. Regimes of the seeds' differences: ``normal`` (N(0.05, 0.1)), ``skewed`` (90% +0.056, 10% -0.5: equal means),
``rare`` (95% +0.02, 5% -0.6: a rare failure); kinds: ``bounded`` (accuracies in [0, 1]), ``unbounded`` (seed values
only) and ``examples`` (an unbounded metric with 16 examples per seed whose shared effects have SD 0.05, as the LM
NLL's blocks).

Table 3, second looks: a comparison read at 7 seeds, then again with more seeds in the same folder (7 -> 14, and
7 -> 10 -> 14), under identical arms: the chance that *any* look gives a verdict, with every look at the nominal
level ("unadjusted") and with the rule in use (look k's p-values times ``look_factor(k)``: alpha spent over
looks, 1.053 at the first, 32.9 at the second; ``benchmarks/looks_error.py`` checks it to 6 looks).

    python benchmarks/verdict_rates.py [--runs 2000] [--family 3] [--coverage-runs 400] [--only TABLE]
"""

from __future__ import annotations

import argparse
import math
import re
import zlib

import numpy as np

from difftx.eval.stats import (_components, _p_value, betting_interval, holm, look_adjusted, paired_estimate,
                               sign_flip_p, verdict)

ALPHA = 0.05


class Est:
    """The two p-values of :func:`paired_estimate` for seed-level values, without its intervals (which cost the
    most at 14 seeds and are not needed here): ``p_value`` (the larger of the t and exact sign-flip p-values) and
    ``betting_p``. :func:`check` compares them with :func:`paired_estimate` first."""

    def __init__(self, a, b, bounds):
        d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
        p_t = _p_value(float(d.mean()), _components(d[:, None]))
        self.p_value = max(x for x in (p_t, sign_flip_p(d)) if x is not None)
        span = float(bounds[1] - bounds[0])
        self.betting_p = betting_interval(d, -span, span, point=0.0, grid=3)[2]


def check(rows: int = 30) -> None:
    """:class:`Est` gives :func:`paired_estimate`'s p-values, on random rows of every regime."""
    rng = _rng("check")
    for kind in ("lottery", "skew", "ties"):
        for n in (5, 9):
            for _ in range(rows):
                a, b, bounds = draw(kind, rng, n)
                mine, theirs = Est(a, b, bounds), paired_estimate(a, b, bounds=bounds)
                assert (mine.p_value, mine.betting_p) == (theirs.p_value, theirs.betting_p), (kind, n)


def draw(kind: str, rng, n: int) -> tuple[np.ndarray, np.ndarray, tuple[float, float]]:
    """One comparison's per-seed values of two identical arms, and the metric's bounds."""
    if kind == "lottery":
        learned = rng.random((2, n)) < 0.5
        v = np.where(learned, 0.95, 0.1) + rng.normal(0, 0.02, (2, n))
        return np.clip(v[0], 0, 1), np.clip(v[1], 0, 1), (0.0, 1.0)
    if kind == "skew":
        v = rng.uniform(0.55, 0.9, (2, n)) - 0.5 * (rng.random((2, n)) < 0.1) + rng.normal(0, 0.01, (2, n))
        return np.clip(v[0], 0, 1), np.clip(v[1], 0, 1), (0.0, 1.0)
    if kind == "ties":
        steps = np.round(rng.uniform(600, 3000, (2, n)) / 100) * 100
        v = np.where(rng.random((2, n)) < 0.4, 4500.0, steps)
        return v[0], v[1], (0.0, 4500.0)
    raise ValueError(kind)


def _family(kind: str, rng, n: int, family: int) -> tuple[list[float], list[float]]:
    """Holm-adjusted verdict and mean p-values of ``family`` independent comparisons."""
    est = [Est(a, b, bounds) for a, b, bounds in (draw(kind, rng, n) for _ in range(family))]
    return holm([e.p_value for e in est]), holm([e.betting_p for e in est])


def _rng(*key) -> np.random.Generator:
    """A generator fixed by ``key`` (the same numbers on every run and machine)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def identical_arms(runs: int, family: int) -> None:
    print(f"Table 1: false verdicts per comparison, identical arms, Holm over {family} ({runs} runs a cell)\n")
    print("| regime | seeds | verdict (not interchangeable) | mean established |")
    print("|---|---|---|---|")
    for kind in ("lottery", "skew", "ties"):
        for n in (5, 7, 10, 14):
            rng = _rng(kind, n)
            verdicts = claims = 0
            for _ in range(runs):
                pv, pm = _family(kind, rng, n, family)
                verdicts += sum(p < ALPHA for p in pv)
                claims += sum(p < ALPHA for p in pm)
            print(f"| {kind} | {n} | {verdicts / (runs * family):.4f} | {claims / (runs * family):.4f} |")
    print()


WORD = re.compile(r" is (better|worse) on average")


def _se(p: float, runs: int) -> str:
    return f"{p:.3f} ({math.sqrt(max(p * (1 - p), 1e-12) / runs):.3f})"


def equal_means(runs: int) -> None:
    print(f"Table 2: skewed differences, one comparison ({runs} runs a cell; Monte Carlo SE in brackets)\n")
    print("| differences | seeds | verdict (not interchangeable; before, each printed \"better\"/\"worse\") | mean "
          "difference claimed | \"better\"/\"worse\" printed | ... on the wrong side of the mean | before: a word on "
          "the wrong side |")
    print("|---|---|---|---|---|---|---|")
    for fall, name in ((0.5, "90% +0.056, 10% -0.5 (equal means)"), (0.6, "90% +0.056, 10% -0.6 (mean -0.01)")):
        truth = 0.9 * 0.05 / 0.9 - 0.1 * fall
        for n in (7, 10, 14):
            rng = np.random.default_rng(500 + n) if fall == 0.5 else _rng("against", n)
            base = rng.uniform(0.55, 0.9, (runs, n))
            fail = rng.random((runs, n)) < 0.1
            diff = np.clip(base + np.where(fail, -fall, 0.05 / 0.9) + rng.normal(0, 0.01, (runs, n)), 0, 1)
            est = [paired_estimate(d, b, bounds=(0.0, 1.0)) for d, b in zip(diff, base)]
            words = [WORD.search(verdict(e, "accuracy", lower_is_better=False, adjusted_p=e.p_value)) for e in est]
            wrong = [w is not None and (w.group(1) == "better") != (truth > 0) for w in words]
            # the rule before: a verdict's word from the sign of the sample mean
            before = [e.p_value < ALPHA and (e.mean > 0) != (truth > 0) for e in est]
            print(f"| {name} | {n} | {_se(np.mean([e.p_value < ALPHA for e in est]), runs)} | "
                  f"{_se(np.mean([e.betting_p < ALPHA for e in est]), runs)} | "
                  f"{_se(np.mean([w is not None for w in words]), runs)} | {_se(np.mean(wrong), runs)} | "
                  f"{_se(np.mean(before), runs) if truth else '-'} |")
    print()


# Table 4: the seeds' differences of each regime, as (share, centre, SD) of normal modes
REGIMES = {"normal": ((1.0, 0.05, 0.1),), "skewed": ((0.9, 0.05 / 0.9, 0.01), (0.1, -0.5, 0.01)),
           "rare": ((0.95, 0.02, 0.01), (0.05, -0.6, 0.02))}
EXAMPLES, EXAMPLE_SD, NOISE_SD = 16, 0.05, 0.05  # the kind "examples": per seed, 16 examples shared by every seed


def _modes(kind: str, rng, shape) -> np.ndarray:
    modes = REGIMES[kind]
    pick = rng.choice(len(modes), size=shape, p=[m[0] for m in modes])
    centre, sd = np.array([m[1] for m in modes]), np.array([m[2] for m in modes])
    return centre[pick] + sd[pick] * rng.standard_normal(shape)


def _median(kind: str, extra_sd: float = 0.0) -> float:
    """The median of the regime's seed differences (each mode's SD widened by ``extra_sd``), by bisection."""
    def cdf(x):
        return sum(w * 0.5 * math.erfc(-(x - c) / math.sqrt(2 * (s * s + extra_sd ** 2))) for w, c, s in REGIMES[kind])
    lo, hi = -2.0, 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if cdf(mid) < 0.5 else (lo, mid)
    return 0.5 * (lo + hi)


def _draw4(what: str, kind: str, rng, n: int):
    """One comparison of Table 4: the arguments of :func:`paired_estimate`."""
    d = _modes(kind, rng, n)
    if what == "bounded":
        base = rng.uniform(0.55, 0.75, n)
        return dict(diff=np.clip(base + d, 0, 1), baseline=base, bounds=(0.0, 1.0))
    if what == "unbounded":
        return dict(diff=2.0 + d, baseline=np.full(n, 2.0))
    D = d[:, None] + rng.normal(0, EXAMPLE_SD, EXAMPLES)[None, :] + rng.normal(0, NOISE_SD, (n, EXAMPLES))
    return dict(diff=D.mean(1), baseline=np.zeros(n), diff_examples=D, baseline_examples=np.zeros_like(D))


def coverage(runs: int) -> None:
    print(f"Table 4: coverage of each printed 95% interval of the estimand its label names ({runs} runs a cell; "
          "Monte Carlo SE in brackets)\n")
    print("| kind | regime | seeds | printed interval, of | covers it | the t and sign-flip hull covers the mean |")
    print("|---|---|---|---|---|---|")
    for what in ("bounded", "unbounded", "examples"):
        for kind in REGIMES:
            if what == "bounded":  # the mean of the clipped differences, from many draws
                big = _rng("truth", kind).uniform(0.55, 0.75, 400_000)
                truth = float((np.clip(big + _modes(kind, _rng("truth2", kind), big.size), 0, 1) - big).mean())
            mean = sum(w * c for w, c, _ in REGIMES[kind]) if what != "bounded" else truth
            median = _median(kind, NOISE_SD / math.sqrt(EXAMPLES) if what == "examples" else 0.0)
            for n in (7, 10, 14):
                rng = _rng("coverage", what, kind, n)
                hit = hull = 0
                for _ in range(runs):
                    e = paired_estimate(**_draw4(what, kind, rng, n))
                    lo, hi = e.printed_interval()
                    target = mean if e.interval_of == "mean" else median
                    hit += lo <= target <= hi
                    hull += e.low <= mean <= e.high
                of = "the mean difference" if what == "bounded" else "the median seed difference"
                print(f"| {what} | {kind} | {n} | {of} | {_se(hit / runs, runs)} | {_se(hull / runs, runs)} |")
    print()


def looks(runs: int, family: int) -> None:
    print(f"Table 3: any false verdict over the looks of one folder, identical arms, Holm over {family} "
          f"({runs} runs a cell)\n")
    print("| regime | looks (seeds) | unadjusted: verdict / mean | rule in use: verdict / mean |")
    print("|---|---|---|---|")
    for kind in ("lottery", "skew", "ties"):
        for plan in ((7, 14), (7, 10, 14)):
            rng = _rng(kind, plan)
            hits = np.zeros((2, 2))
            for _ in range(runs):
                data = [draw(kind, rng, plan[-1]) for _ in range(family)]
                any_v = np.zeros((2, family), bool)  # [unadjusted, adjusted] x comparison
                any_m = np.zeros((2, family), bool)
                for k, n in enumerate(plan, start=1):
                    est = [Est(a[:n], b[:n], bounds) for a, b, bounds in data]
                    pv, pm = holm([e.p_value for e in est]), holm([e.betting_p for e in est])
                    any_v[0] |= np.array(pv) < ALPHA
                    any_m[0] |= np.array(pm) < ALPHA
                    any_v[1] |= np.array([look_adjusted(p, k) for p in pv]) < ALPHA
                    any_m[1] |= np.array([look_adjusted(p, k) for p in pm]) < ALPHA
                hits += np.array([[any_v[0].mean(), any_m[0].mean()], [any_v[1].mean(), any_m[1].mean()]])
            r = hits / runs
            print(f"| {kind} | {' -> '.join(map(str, plan))} | {r[0, 0]:.4f} / {r[0, 1]:.4f} | "
                  f"{r[1, 0]:.4f} / {r[1, 1]:.4f} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000, help="simulated families per cell (default 2000)")
    ap.add_argument("--family", type=int, default=3, help="comparisons in a Holm family (default 3: the primaries)")
    ap.add_argument("--coverage-runs", type=int, default=400, help="simulated comparisons per cell of table 4 "
                                                                     "(default 400)")
    ap.add_argument("--only", choices=("identical", "equal", "looks", "coverage"), default=None, help="one table")
    args = ap.parse_args()
    check()
    if args.only in (None, "identical"):
        identical_arms(args.runs, args.family)
    if args.only in (None, "equal"):
        equal_means(args.runs)
    if args.only in (None, "looks"):
        looks(args.runs, args.family)
    if args.only in (None, "coverage"):
        coverage(args.coverage_runs)


if __name__ == "__main__":
    main()
