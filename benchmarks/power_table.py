"""How many paired seeds the verdict rule needs for 80% power, in a family of 3 primary metrics
(the demo's): differences drawn from a stated model (4,000 draws), resampled by
:func:`difftx.eval.stats.seeds_for_power`. Prints a Markdown table.

    python benchmarks/power_table.py

Rows: an unbounded metric (an NLL) with normal seed differences of a given mean / SD; bounded
accuracies (the betting test of the mean joins the rule); a retrieval lottery; and the demo's three
primaries, modelled as normal with the mean and SD its 8-seed run measured (SD from the printed
interval: half-width x sqrt(8) / t(0.975, 7)), so a rough guide, not a measurement."""

from __future__ import annotations

import numpy as np

from difftx.eval.stats import POWER_MAX_SEEDS, seeds_for_power, seeds_for_verdict


def _row(label: str, d: np.ndarray, bounds=None) -> str:
    k = seeds_for_power(d, comparisons=3, bounds=bounds, reps=400)
    shown = str(k) if k else f"> {POWER_MAX_SEEDS}"
    return f"| {label} | {'yes' if bounds else 'no'} | {shown} |"


def main() -> None:
    rng = np.random.default_rng(0)
    draws = 4000
    print(f"Seeds for 80% power, family of 3 (a verdict is possible from {seeds_for_verdict(3)} seeds):\n")
    print("| differences | bounded (betting test of the mean) | seeds for 80% power |")
    print("|---|---|---|")
    for ratio in (0.25, 0.5, 1.0, 1.5, 2.0, 3.0):
        print(_row(f"normal, mean / SD = {ratio}", rng.normal(ratio, 1.0, draws)))
    for gain, sd in ((0.1, 0.05), (0.3, 0.05), (0.3, 0.2), (0.5, 0.1)):
        print(_row(f"accuracy gain {gain} (SD {sd})", np.clip(rng.normal(gain, sd, draws), -1, 1), (0.0, 1.0)))
    for p_diff, p_base in ((0.8, 0.5), (0.9, 0.1)):  # each seed of each arm learns (0.95) or not (0.1)
        acc = lambda p: np.where(rng.random(draws) < p, 0.95, 0.1)  # noqa: E731
        print(_row(f"lottery: DIFF learns with p {p_diff}, baseline {p_base}", acc(p_diff) - acc(p_base), (0.0, 1.0)))
    t7 = 2.3646
    for label, mean, half, bounds in (("demo: LM NLL +0.081 [+0.015, +0.151]", 0.081, 0.068, None),
                                      ("demo: needle N=1/R=1 -0.120 [-0.542, +0.297]", -0.120, 0.42, (0.0, 1.0)),
                                      ("demo: steps until learned -250 [-1,667, +1,034]", -250.0, 1350.0,
                                       (0.0, 4500.0))):
        sd = half * np.sqrt(8) / t7
        span = None if bounds is None else bounds[1] - bounds[0]
        d = rng.normal(mean, sd, draws) if span is None else np.clip(rng.normal(mean, sd, draws), -span, span)
        print(_row(f"{label} (SD {sd:.3g})", d, bounds))


if __name__ == "__main__":
    main()
