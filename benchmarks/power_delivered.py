"""Does :func:`difftx.eval.stats.power_plan` deliver the power it names? From pilots of 5 and 8
seeds drawn from a known truth, each answer ``n`` is checked against the TRUE power of the verdict
rule at ``n``: fresh experiments of ``n`` seeds drawn from the truth itself, each decided by the verdict
rule (reject where ``max(t p-value, sign-flip p-value) x comparisons < 0.05``: the rule
:func:`difftx.eval.stats.rule_power` models, Holm's first step; the sign-flip p-value exact up to
16 seeds, else from 20,000 random flips, as :func:`difftx.eval.stats.sign_flip_p`; checked against
:func:`difftx.eval.stats.paired_estimate` on random rows first). Prints a Markdown table of two
plans on the same pilots: before (modes only for a bounded metric: ``modes=bounded``, the plan of
2026-11-28), then (modes for a bounded metric and wherever the seeds split, :func:`difftx.eval.stats.seeds_split`:
the plan of the morning of 2026-12-06) and now (the default: also for every pilot of fewer than
:data:`difftx.eval.stats.MODES_BELOW` seeds).

    python benchmarks/power_delivered.py [--pilots 200] [--experiments 1000] [--comparisons 1]
                                         [--pilot-seeds 5,8] [--truths 0,4] [--plans 0,1]

Truths: normal differences of 0.5, 0.8, 1.2 and 2 SD (an unbounded metric), and lotteries (a seed
learns a task with one arm or the other): 70% of seeds +1, 30% -0.8, without noise and with normal
noise of SD 0.1, 0.2 and 0.3, and 80% / 20% with the same noises (unbounded: an NLL), and the 70/30 and
80/20 lotteries with noise 0.2 clipped to [-1, 1] and planned with bounds (0, 1) (an accuracy). Per
truth and pilot size: the seeds the truth needs (the fewest with true power >= 0.8); per plan the
median answer (``None`` counted as "> 64"), the mean true power at the numeric answers (target >= 0.8)
and the share of them below 0.7 (target <= 0.05), and the share of pilots answered ``None`` (not
within 64 seeds, or unknown: a pilot without spread); then per plan and pilot size the lotteries'
numeric answers pooled (mean true power and share below 0.7, Monte Carlo SEs). The default run takes
about 3 minutes on 2 busy cores (``--pilots 60`` about 1)."""

from __future__ import annotations

import argparse
import time
from typing import Callable, Optional

import numpy as np

from difftx.eval.stats import POWER_MAX_SEEDS, paired_estimate, power_plan, seeds_for_verdict, seeds_split, t_quantile

ALPHA = 0.05
TARGET = 0.8


def _normal(effect: float) -> Callable:
    return lambda rng, shape: rng.normal(effect, 1.0, shape)


def _lottery(share: float, noise: float) -> Callable:
    """A share of seeds at +1 (the task learned with this arm), the rest at -0.8, plus normal noise."""
    def draw(rng, shape):
        x = np.where(rng.random(shape) < share, 1.0, -0.8)
        return x + rng.normal(0.0, noise, shape) if noise else x
    return draw


def _bounded(draw: Callable) -> Callable:
    """The lottery of an accuracy: differences clipped to [-1, 1] (bounds (0, 1)), so noisy winners sit at 1."""
    return lambda rng, shape: np.clip(draw(rng, shape), -1.0, 1.0)


TRUTHS: dict[str, Callable] = {"normal, 0.5 SD": _normal(0.5), "normal, 0.8 SD": _normal(0.8),
                               "normal, 1.2 SD": _normal(1.2), "normal, 2 SD": _normal(2.0),
                               **{f"lottery {round(100 * p)}/{round(100 * (1 - p))}, noise {sd:g}": _lottery(p, sd)
                                  for p in (0.7, 0.8) for sd in (0.0, 0.1, 0.2, 0.3) if (p, sd) != (0.8, 0.0)},
                               **{f"bounded lottery {round(100 * p)}/{round(100 * (1 - p))}, noise 0.2":
                                  _bounded(_lottery(p, 0.2)) for p in (0.7, 0.8)}}
BOUNDS = (0.0, 1.0)  # the bounds a "bounded" truth is planned with (its differences lie in [-1, 1])
# each plan: power_plan's keyword arguments, given whether the metric is bounded
PLANS: dict[str, Callable[[bool, np.ndarray], dict]] = {
    "before: modes where bounded": lambda bounded, pilot: dict(modes=bounded, bounds=BOUNDS if bounded else None),
    "then: where seeds split": lambda bounded, pilot: dict(modes=bounded or seeds_split(pilot),
                                                           bounds=BOUNDS if bounded else None),
    "now: and below 6 seeds": lambda bounded, pilot: dict(bounds=BOUNDS if bounded else None)}


def verdicts(x: np.ndarray, comparisons: int, alpha: float = ALPHA, chunk: int = 100) -> np.ndarray:
    """Whether the verdict rule rejects for each row of ``x`` ``(experiments, n)``: the t test (none
    where a row has no spread, as in :func:`difftx.eval.stats.paired_estimate`) and the sign-flip test
    (exact up to 16 seeds, else 20,000 random flips from seed 0), each below ``alpha / comparisons``."""
    reps, n = x.shape
    level = alpha / comparisons
    m, sd = x.mean(1), x.std(1, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.abs(m) / (sd / np.sqrt(n))
    t_ok = np.where(sd > 0, t > t_quantile(1 - level / 2, n - 1), True)
    exact = n <= 16
    signs = (np.array(np.meshgrid(*[[1.0, -1.0]] * n, indexing="ij")).reshape(n, -1).T if exact else
             np.random.default_rng(0).choice((1.0, -1.0), size=(20_000, n)))
    ok = np.zeros(reps, dtype=bool)
    rows = np.flatnonzero(t_ok)  # the sign-flip test decides only where the t test rejects
    for i in range(0, rows.size, chunk):
        r = rows[i:i + chunk]
        c = x[r]
        obs = np.abs(c.sum(1))
        tol = 1e-12 * (1.0 + np.abs(c).sum(1))
        p = (np.abs(c @ signs.T) >= (obs - tol)[:, None]).mean(1)
        if not exact:
            p = (p * signs.shape[0] + 1) / (signs.shape[0] + 1)
        ok[r] = p < level
    return ok


class TruePower:
    """The true power of the rule at ``n`` seeds for each truth, from ``experiments`` fresh
    experiments (memoised; each (truth, n) has its own fixed random stream)."""

    def __init__(self, experiments: int, comparisons: int):
        self.experiments, self.comparisons, self.memo = experiments, comparisons, {}

    def __call__(self, truth: str, n: int) -> float:
        key = (truth, n)
        if key not in self.memo:
            rng = np.random.default_rng([list(TRUTHS).index(truth), n, 7])
            x = TRUTHS[truth](rng, (self.experiments, n))
            self.memo[key] = float(verdicts(x, self.comparisons).mean())
        return self.memo[key]

    def needed(self, truth: str) -> Optional[int]:
        """The fewest seeds with true power >= TARGET (bisection; ``None`` beyond 64)."""
        lo, hi = seeds_for_verdict(self.comparisons, ALPHA), POWER_MAX_SEEDS
        if self(truth, hi) < TARGET:
            return None
        if self(truth, lo) >= TARGET:
            return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self(truth, mid) >= TARGET else (mid, hi)
        return hi


def check_rule(comparisons: int, rows: int = 40) -> None:
    """The vectorised rule agrees with the library's own p-value (paired_estimate) on random rows."""
    rng = np.random.default_rng(5)
    for n in (6, 9, 20):
        x = np.where(rng.random((rows, n)) < 0.75, 1.0, -0.8) + rng.normal(0, 0.3, (rows, n))
        mine = verdicts(x, comparisons)
        theirs = np.array([paired_estimate(r, np.zeros(n)).p_value * comparisons < ALPHA for r in x])
        assert (mine == theirs).all(), (n, mine, theirs)


def summarise(answers: list, truth: str, true_power: TruePower) -> dict:
    """Per plan: the median answer (``None`` as 65: "more than 64"), the true power at the numeric answers
    (mean, share below 0.7), and the share of ``None``."""
    given = [a for a in answers if a is not None]
    powers = np.array([true_power(truth, a) for a in given])
    return {"median": float(np.median([a if a is not None else POWER_MAX_SEEDS + 1 for a in answers])),
            "power": float(powers.mean()) if given else None, "low": float((powers < 0.7).mean()) if given else None,
            "none": 1 - len(given) / len(answers)}


def _f(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def _cells(s: dict) -> str:
    median = "> 64" if s["median"] > POWER_MAX_SEEDS else f"{s['median']:g}"
    return f"{median} | {_f(s['power'])} | {_f(s['low'])} | {s['none']:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pilots", type=int, default=200, help="pilots per truth and pilot size (default 200)")
    ap.add_argument("--experiments", type=int, default=1000,
                    help="fresh experiments per (truth, seeds) for the true power (default 1000)")
    ap.add_argument("--comparisons", type=int, default=1, help="Holm family size (default 1: the audit's)")
    ap.add_argument("--pilot-seeds", default="5,8", help="pilot sizes (default 5,8)")
    ap.add_argument("--truths", default=None, help="comma-separated indices of the truths to run (default: all)")
    ap.add_argument("--plans", default=None, help="comma-separated indices of the plans to run (default: all)")
    args = ap.parse_args()
    check_rule(args.comparisons)
    true_power = TruePower(args.experiments, args.comparisons)
    plans = {name: kw for i, (name, kw) in enumerate(PLANS.items())
             if args.plans is None or i in {int(v) for v in args.plans.split(",")}}
    took: dict[str, list] = {name: [] for name in plans}
    pooled: dict[tuple, list] = {}  # (plan, pilot seeds) -> the true powers at the lotteries' numeric answers
    print(f"True power at the answer of power_plan (80% asked), {args.pilots} pilots per row, {args.experiments} "
          f"fresh experiments per (truth, seeds), family of {args.comparisons}. Per plan: median answer | mean true "
          f"power at the numeric answers | their share below 0.7 | share None.\n")
    print("| differences | pilot seeds | seeds needed | " + " | ".join(
        f"{name}: median | power | < 0.7 | None" for name in plans) + " |")
    print("|---|---|---|" + "---|---|---|---|" * len(plans))
    chosen = None if args.truths is None else {int(v) for v in args.truths.split(",")}
    for t_index, truth in enumerate(TRUTHS):
        if chosen is not None and t_index not in chosen:
            continue
        need = true_power.needed(truth)
        for n0 in (int(v) for v in args.pilot_seeds.split(",")):
            rng = np.random.default_rng([t_index, n0, 11])
            pilots = TRUTHS[truth](rng, (args.pilots, n0))
            cells = []
            for name, kwargs in plans.items():
                answers = []
                for p in pilots:
                    start = time.perf_counter()
                    answers.append(power_plan(p, args.comparisons, **kwargs(truth.startswith("bounded"), p)).seeds)
                    took[name].append(time.perf_counter() - start)
                cells.append(_cells(summarise(answers, truth, true_power)))
                if "lottery" in truth:
                    pooled.setdefault((name, n0), []).extend(true_power(truth, a) for a in answers if a is not None)
            print(f"| {truth} | {n0} | {need if need else '> 64'} | " + " | ".join(cells) + " |", flush=True)
    print()
    for (name, n0), powers in sorted(pooled.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        w = np.array(powers)
        if w.size:
            low = float((w < 0.7).mean())
            print(f"Lotteries pooled, {n0}-seed pilots, {name}: {w.size} numeric answers, mean true power {w.mean():.3f} "
                  f"(SE {w.std() / np.sqrt(w.size):.3f}), below 0.7 {low:.3f} (SE {np.sqrt(low * (1 - low) / w.size):.3f}).")
        else:
            print(f"Lotteries pooled, {n0}-seed pilots, {name}: no numeric answers.")
    print()
    for name, times in took.items():
        t = np.array(times)
        print(f"power_plan, {name}: {1000 * t.mean():.0f} ms per call on average, {1000 * t.max():.0f} ms at most "
              f"({t.size} calls).")


if __name__ == "__main__":
    main()
