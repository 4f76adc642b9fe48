"""Which reading of the recall grid has more power: the frontier as the mean accuracy over the plain-MQAR
cells (``recall_frontier``) or as the pair count where accuracy falls through 50% (``recall_pairs_at_half``).

Reads a ``difftx compare`` folder whose models ran the recall grid (``results.json``), takes every seed's
cells as they were measured, and for each pair of arms and each reading: the paired differences' mean,
their standard deviation and the standardised effect (mean / SD, the quantity power grows with), then the
share of ``--draws`` experiments of N seeds, resampled with replacement from the measured seeds, in which
the compare rule (``difftx.eval.stats.paired_estimate`` with each reading's range: [0, 1] for the frontier,
the grid's fewest to most pairs for the pair count, where it is censored) rejects at 0.05 / ``--family`` (Holm's first step over the comparison's primary family). Resampling the measured seeds keeps what a model does on
the grid (its lottery of learning the circuit included), so both readings are judged on the same seeds.

    python benchmarks/recall_frontier_power.py RUN_FOLDER [--seeds 5,8,12] [--draws 400] [--family 3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main() -> None:
    from difftx.compare.summary import pairs
    from difftx.eval.stats import paired_estimate
    from difftx.tasks.recall import frontier, pairs_at_half, pairs_range

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a difftx compare folder whose models ran the recall grid")
    ap.add_argument("--seeds", default="5,8,12", help="experiment sizes (seeds) to simulate")
    ap.add_argument("--draws", type=int, default=400, help="simulated experiments per size")
    ap.add_argument("--family", type=int, default=3, help="Holm family: the test at 0.05 / family (its first step)")
    a = ap.parse_args()
    res = json.loads((a.run / "results.json").read_text())
    arms, seeds = list(res["arms"]), [str(s) for s in res["seeds"]]
    cells = {arm: [res["runs"][s][arm]["tasks"]["recall"]["cells"] for s in seeds] for arm in arms}
    first = res["runs"][seeds[0]][arms[0]]["tasks"]["recall"]
    readings = {"recall_frontier": (frontier, (0.0, 1.0)), "recall_pairs_at_half": (pairs_at_half, pairs_range(first))}
    values = {name: {arm: np.array([f(c) for c in cells[arm]]) for arm in arms} for name, (f, _) in readings.items()}
    sizes = [int(x) for x in a.seeds.split(",")]
    rng = np.random.default_rng(0)
    print(f"# {a.run}: {len(seeds)} measured seeds; {a.draws} resampled experiments per size; a verdict at p < "
          f"0.05 / {a.family}\n")
    print("| pair | reading | mean difference | SD | mean / SD | " + " | ".join(f"power at {n}" for n in sizes) + " |")
    print("|" + "---|" * (5 + len(sizes)))
    for x, y in pairs(arms):
        for name, (_, bounds) in readings.items():
            d = values[name][x] - values[name][y]
            sd = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
            power = []
            for n in sizes:
                hits = 0
                for _ in range(a.draws):
                    pick = rng.integers(0, len(d), size=n)
                    e = paired_estimate(values[name][x][pick], values[name][y][pick], bounds=bounds)
                    hits += e.p_value is not None and e.p_value < 0.05 / a.family
                power.append(hits / a.draws)
            print(f"| {x} - {y} | {name} | {d.mean():+.3f} | {sd:.3f} | "
                  f"{(d.mean() / sd if sd > 0 else float('nan')):+.2f} | " + " | ".join(f"{p:.2f}" for p in power)
                  + " |")


if __name__ == "__main__":
    main()
