"""Looks at one comparison folder, simulated (issue 59 item 3): alpha spent over looks, as ``look_adjusted`` does.

A folder read at 7 seeds, then again as seeds are added (2 to 6 looks, to 28 seeds), each look's verdicts drawn by
the project's rule (the larger of the t and exact sign-flip p-values, Holm over a family of ``--family``
comparisons, times the look's factor). Three rules for the factor at look k:

- ``x k``: the rule before, a Bonferroni step per look; its shares 1 / k sum to more than 1;
- ``pi^2 k^2 / 6``: the shares 6 / (pi^2 k^2), summing to 1, the same at every look;
- ``half first``: 0.5 of alpha at the first look, 0.5 * 6 / (pi^2 (k-1)^2) at look k after it (summing to 1);
- ``in use``: :func:`difftx.eval.stats.look_factor`, 0.95 of alpha at the first look and 0.05 * 6 / (pi^2 (k-1)^2)
  at look k after it (summing to 1).

Table 1, identical arms (the null: every verdict is false), per regime and plan of looks: the chance that a
comparison gets a verdict at any look (nominal: 0.05 / family) and that any comparison of the family does
(family-wise, nominal 0.05), with Monte Carlo standard errors. Regimes: ``normal`` values, and the ``lottery``,
``skew`` and ``ties`` regimes of benchmarks/verdict_rates.py.

Table 2, why the rule in use spends most of alpha at the first look: one comparison of the family has a true effect
(normal differences of ``effect`` SD, or a lottery: 80% of seeds +1, 20% -0.8, noise 0.3), the others none; the
chance of its verdict by each look, reading the folder at 7, 14, 21 and 28 seeds and stopping at a verdict.

    python benchmarks/looks_error.py [--runs 4000] [--power-runs 1500] [--family 3]

The p-values are those of :func:`difftx.eval.stats.paired_estimate` (checked on random rows first), computed for
many families at once.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verdict_rates import draw  # noqa: E402  (the regimes of the verdict's audit)

from difftx.eval.stats import _signs, holm, look_adjusted, look_factor, paired_estimate, t_two_sided_p  # noqa: E402

ALPHA = 0.05
PLANS = ((7, 14), (7, 14, 21), (7, 14, 21, 28), (7, 10, 14, 21, 28), (7, 10, 14, 18, 21, 28))
RULES = {
    "x k": lambda k: float(k),
    "pi^2 k^2 / 6": lambda k: math.pi ** 2 * k * k / 6,
    "half first": lambda k: 2.0 if k == 1 else math.pi ** 2 * (k - 1) ** 2 / 3,
    "in use": look_factor,
}


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def verdict_p(d: np.ndarray, chunk: int = 512) -> np.ndarray:
    """The verdict's p-value (the larger of the t and sign-flip p-values) of each row of paired differences ``d``
    ``(rows, n)``, as :func:`paired_estimate` computes it for seed-level values (the same sign patterns)."""
    rows, n = d.shape
    signs = _signs(n)
    exact = signs.shape[0] == 2 ** n
    p_sf = np.empty(rows)
    for i in range(0, rows, chunk):
        x = d[i:i + chunk]
        obs = np.abs(x.sum(1))
        tol = 1e-12 * (1.0 + np.abs(x).sum(1))
        hits = (np.abs(x @ signs.T) >= (obs - tol)[:, None]).sum(1)
        p_sf[i:i + chunk] = hits / signs.shape[0] if exact else (hits + 1) / (signs.shape[0] + 1)
    mean, var = d.mean(1), d.var(1, ddof=1) / n
    p_t = np.array([t_two_sided_p(abs(m) / math.sqrt(v), n - 1) if v > 0 else 0.0 for m, v in zip(mean, var)])
    return np.maximum(p_sf, p_t)  # no spread: no t test, the sign-flip p alone


def check(rng, rows: int = 12) -> None:
    """:func:`verdict_p` gives :func:`paired_estimate`'s p-values (before it rounds them to 4 digits)."""
    for kind in ("normal", "lottery", "ties"):
        for n in (7, 14, 21):
            pairs = [values(kind, rng, n) for _ in range(rows)]
            mine = verdict_p(np.array([a - b for a, b in pairs]))
            theirs = [paired_estimate(a, b).p_value for a, b in pairs]
            assert np.allclose(mine, theirs, rtol=1e-9, atol=0), (kind, n, mine, theirs)


def values(kind: str, rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """One comparison's per-seed values of two identical arms."""
    if kind == "normal":
        v = rng.normal(0.0, 1.0, (2, n))
        return v[0], v[1]
    return draw(kind, rng, n)[:2]


def any_verdict(p: dict[int, np.ndarray], plan: tuple, factor, family: int) -> np.ndarray:
    """``(runs, family)``: whether each comparison got a verdict at some look of ``plan`` (``p[n]``: the Holm-adjusted
    p-values at ``n`` seeds, ``(runs, family)``), each look's times ``factor(k)``."""
    runs = next(iter(p.values())).shape[0]
    hit = np.zeros((runs, family), bool)
    for k, n in enumerate(plan, start=1):
        hit |= np.minimum(1.0, p[n] * factor(k)) < ALPHA
    return hit


def pvalues(make, runs: int, family: int, seeds: list[int]) -> dict[int, np.ndarray]:
    """``{n: (runs, family) Holm-adjusted p-values}`` of ``runs`` families whose comparisons' differences
    ``make(run, j)`` draws (the last look's seeds; the look at ``n`` seeds reads the first ``n``)."""
    d = np.array([[make(r, j) for j in range(family)] for r in range(runs)])  # (runs, family, seeds)
    raw = {n: verdict_p(d[:, :, :n].reshape(-1, n)).reshape(runs, family) for n in seeds}
    return {n: np.array([holm(row) for row in p]) for n, p in raw.items()}


def null_table(runs: int, family: int) -> None:
    nominal = ALPHA / family
    print(f"Table 1: identical arms, a verdict at any look ({runs} families of {family} a regime; Monte Carlo SE in "
          f"brackets; nominal {nominal:.4f} a comparison, {ALPHA} family-wise)\n")
    print("| regime | looks (seeds) | " + " | ".join(f"{r}: comparison / family" for r in RULES) + " |")
    print("|---|---|" + "---|" * len(RULES))
    seeds = sorted({n for plan in PLANS for n in plan})
    worst = {r: [0.0, 0.0] for r in RULES}
    for kind in ("normal", "lottery", "skew", "ties"):
        rng = _rng("null", kind)
        p = pvalues(lambda r, j: np.subtract(*values(kind, rng, seeds[-1])), runs, family, seeds)
        for plan in PLANS:
            cells = []
            for name, rule in RULES.items():
                hit = any_verdict(p, plan, rule, family)
                per, fw = hit.mean(), hit.any(1).mean()
                worst[name] = [max(worst[name][0], per), max(worst[name][1], fw)]
                se_per, se_fw = math.sqrt(per * (1 - per) / hit.size), math.sqrt(fw * (1 - fw) / runs)
                cells.append(f"{per:.4f} ({se_per:.4f}) / {fw:.4f} ({se_fw:.4f})")
            print(f"| {kind} | {' -> '.join(map(str, plan))} | " + " | ".join(cells) + " |")
    print("\nWorst cell: " + "; ".join(f"{r} {w[0]:.4f} a comparison, {w[1]:.4f} family-wise"
                                       for r, w in worst.items()) + "\n")


def lottery(rng, n: int) -> np.ndarray:
    return np.where(rng.random(n) < 0.8, 1.0, -0.8) + rng.normal(0.0, 0.3, n)


def power_table(runs: int, family: int) -> None:
    plan = (7, 14, 21, 28)
    print(f"Table 2: one comparison of {family} with a true effect, the others none: the chance of its verdict by "
          f"each look, reading at {', '.join(map(str, plan))} seeds ({runs} families a row; SE at most "
          f"{0.5 / math.sqrt(runs):.3f})\n")
    print("| effect | rule | " + " | ".join(f"by look {k} ({n} seeds)" for k, n in enumerate(plan, start=1)) + " |")
    print("|---|---|" + "---|" * len(plan))
    effects = {"normal, 0.7 SD": lambda rng, n: rng.normal(0.7, 1.0, n),
               "normal, 1.2 SD": lambda rng, n: rng.normal(1.2, 1.0, n),
               "lottery 80/20": lottery}
    for label, effect in effects.items():
        rng = _rng("power", label)
        p = pvalues(lambda r, j: effect(rng, plan[-1]) if j == 0 else rng.normal(0.0, 1.0, plan[-1]), runs, family,
                    list(plan))
        for name, rule in RULES.items():
            by = [any_verdict(p, plan[:k], rule, family)[:, 0].mean() for k in range(1, len(plan) + 1)]
            print(f"| {label} | {name} | " + " | ".join(f"{x:.3f}" for x in by) + " |")
    print()


def factors() -> None:
    print("What look k multiplies its p-values by (and the share of alpha it spends):\n")
    print("| look | " + " | ".join(RULES) + " |")
    print("|---|" + "---|" * len(RULES))
    for k in range(1, 7):
        print(f"| {k} | " + " | ".join(f"x{rule(k):.3g} ({1 / rule(k):.3f})" for rule in RULES.values()) + " |")
    print("| sum of shares, looks 1-6 / all | " + " | ".join(
        f"{sum(1 / rule(k) for k in range(1, 7)):.3f} / " + ("diverges" if name == "x k" else "1")
        for name, rule in RULES.items()) + " |\n")
    assert all(look_adjusted(0.001, k) == min(1.0, 0.001 * look_factor(k)) for k in range(1, 7))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4000, help="simulated families per regime, table 1 (default 4000)")
    ap.add_argument("--power-runs", type=int, default=1500, help="simulated families per row, table 2 (default 1500)")
    ap.add_argument("--family", type=int, default=3, help="comparisons in a Holm family (default 3: the primaries)")
    args = ap.parse_args()
    if args.runs < 1 or args.power_runs < 1 or args.family < 1:
        raise ValueError("--runs, --power-runs and --family must be at least 1")
    start = time.time()
    check(_rng("check"))
    factors()
    null_table(args.runs, args.family)
    power_table(args.power_runs, args.family)
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
