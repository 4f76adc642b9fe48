"""How far a comparison assembled from shards is from the same comparison run in one invocation.

A shard stacks only the models it holds, so a model can train in a stack of another size than in one
invocation; the stacked forward sums in another order, and float32 rounding differences grow along
training. This script runs the same `difftx compare` (optionally `--tune`) twice, in fresh folders:
once without `--shard`, once as N shards then an assembling run, each with the same thread count, and
prints per metric the largest relative difference between the two, over arms and seeds (and, with
--tune, the tuned gap both ways).

    python benchmarks/shard_equality.py --preset smoke --seeds 4 --shards 2 --tune lr=0.001,0.01
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from difftx.compare.schema import from_json

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], env: dict) -> None:
    done = subprocess.run([sys.executable, "-m", "difftx", *args], env=env, cwd=str(ROOT), capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"failed: difftx {' '.join(args)}\n{done.stderr[-3000:]}")


def _values(results: dict) -> dict:
    """``{metric: {arm: [per-seed values]}}`` of a results.json (numbers only)."""
    out = {}
    for key, c in from_json(results).primary.metrics.items():
        for arm, vals in (c.get("values") or {}).items():
            if isinstance(vals, list) and all(isinstance(v, (int, float)) for v in vals):
                out.setdefault(key, {})[arm] = vals
    return out


def _largest(a: dict, b: dict) -> dict:
    """``{metric: (largest |a-b| / max(|b|, 1e-12), largest |a-b|)}`` over arms and seeds."""
    got = {}
    for key in sorted(set(a) & set(b)):
        rel = ab = 0.0
        for arm in set(a[key]) & set(b[key]):
            for x, y in zip(a[key][arm], b[key][arm]):
                ab = max(ab, abs(x - y))
                rel = max(rel, abs(x - y) / max(abs(y), 1e-12))
        got[key] = (rel, ab)
    return got


def _gap(folder: Path):
    path = folder / "tune.json"
    if not path.is_file():
        return None
    t = json.loads(path.read_text())
    return {pair: c["lm_nll"]["paired"]["mean"] for pair, c in t["tuned"].items() if "lm_nll" in c}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--tune", default=None, help="FIELD=V1,V2 (as compare's --tune); none: a plain comparison")
    ap.add_argument("--set", action="append", default=[], help="compare --set FIELD=VALUE (repeatable)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every invocation")
    a = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    common = ["--preset", a.preset, "--seeds", str(a.seeds), "--workers", "1", "--no-progress"]
    common += [x for s in a.set for x in ("--set", s)] + (["--tune", a.tune] if a.tune else [])
    with tempfile.TemporaryDirectory() as tmp:
        one, sharded = Path(tmp) / "one", Path(tmp) / "sharded"
        t0 = time.time()
        _run(["compare", *common, "--out", str(one)], env)
        t1 = time.time()
        for k in range(1, a.shards + 1):
            _run(["compare", *common, "--out", str(sharded), "--shard", f"{k}/{a.shards}"], env)
        _run(["compare", *common, "--out", str(sharded)], env)
        t2 = time.time()
        got = _largest(_values(json.loads((sharded / "results.json").read_text())),
                       _values(json.loads((one / "results.json").read_text())))
        print(f"# difftx compare {' '.join(common)}: one invocation {t1 - t0:.0f} s; {a.shards} shards + assembly "
              f"{t2 - t1:.0f} s")
        print(f"{'metric':44s} {'largest rel. diff':>18s} {'largest abs. diff':>18s}")
        for key, (rel, ab) in got.items():
            print(f"{key:44s} {rel:18.2e} {ab:18.2e}")
        gaps = (_gap(one), _gap(sharded))
        if gaps[0]:
            for pair in gaps[0]:
                print(f"tuned LM NLL gap, {pair}: one invocation {gaps[0][pair]:+.6f}, sharded {gaps[1][pair]:+.6f}")


if __name__ == "__main__":
    main()
