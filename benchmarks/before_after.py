"""Speed before and after a change: the stack, the one-model train step and decoding, two commits side by side.

Usage:
    python benchmarks/before_after.py --before 832e6b3 [--after HEAD] [--pairs 8]

Each commit is checked out once in a git worktree (``--trees``, default ``/tmp/difftx-trees``; the after side may
be ``.``, this working tree). A *pair* runs, for both commits back to back in alternating order (ABBA across
pairs), ``benchmarks/stack_throughput.py --ks 1,5 --rounds 4 --warmup 1 --arms diff,baseline`` and
``difftx bench --decode --seq-lens 256 --dim 256 --layers 4 --repeats 20 --backends chunked``, each from its
own tree (``PYTHONPATH``) with this interpreter, one thread. The ratio after / before is taken pair by pair;
the table gives both medians and the median ratio with its distribution-free 95% interval
(:func:`difftx.eval.stats.median_interval`), which drift of the machine's speed between pairs does not bias.
Higher is faster in every row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STACK = ["benchmarks/stack_throughput.py", "--ks", "1,5", "--rounds", "4", "--warmup", "1", "--arms", "diff,baseline"]
DECODE = ["-m", "difftx", "bench", "--decode", "--seq-lens", "256", "--dim", "256", "--layers", "4", "--repeats", "20",
          "--backends", "chunked"]


def tree(commit: str, trees: Path) -> Path:
    """A checkout of ``commit`` (``.``: this working tree)."""
    if commit == ".":
        return ROOT
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit], check=True, capture_output=True,
                         text=True).stdout.strip()
    path = trees / sha
    if not path.exists():
        trees.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha], check=True,
                       capture_output=True)
    return path


def measure(where: Path) -> dict[str, float]:
    """One run of both benchmarks from the tree ``where``: ``{measure: value}``, higher is faster."""
    env = {**os.environ, "PYTHONPATH": str(where), "OMP_NUM_THREADS": "1"}
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stack_json, decode_json = Path(tmp) / "stack.json", Path(tmp) / "decode.json"
        subprocess.run([sys.executable, *STACK, "--json", str(stack_json)], cwd=where, env=env, check=True,
                       capture_output=True)
        for r in json.loads(stack_json.read_text()):
            out[f"{r['arm']}, stack of {r['k']}, model-steps per CPU-s"] = r["stacked"]["model_steps_per_cpu_s"]
            if r["k"] == 1:
                out[f"{r['arm']}, one model (the trainer's step)"] = r["separate"]["model_steps_per_cpu_s"]
        subprocess.run([sys.executable, *DECODE, "--json", str(decode_json)], cwd=where, env=env, check=True,
                       capture_output=True)
        for r in json.loads(decode_json.read_text())["rows"]:
            arm, backend = r["name"].split("/")
            out[f"decode, {arm} ({backend}), steps per ms"] = 1.0 / r["ms"]
    return out


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    from difftx.eval.stats import median_interval

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the commit before the change")
    p.add_argument("--after", default=".", help="the commit after it (default: this working tree)")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--trees", type=Path, default=Path(tempfile.gettempdir()) / "difftx-trees")
    p.add_argument("--json", help="also write every pair's figures here")
    args = p.parse_args(argv)
    sides = {"before": tree(args.before, args.trees), "after": tree(args.after, args.trees)}
    pairs = []
    for i in range(args.pairs):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        got = {side: measure(sides[side]) for side in order}
        pairs.append(got)
        print(f"pair {i + 1}/{args.pairs} done", file=sys.stderr, flush=True)
    print(f"# before {args.before}, after {args.after}, {args.pairs} pairs, one thread, {sys.executable}")
    print("| measure (higher is faster) | before (median) | after (median) | after / before [95%] |")
    print("|---|---:|---:|---|")
    for key in pairs[0]["before"]:
        if not all(key in p["after"] for p in pairs):
            continue
        b = [p["before"][key] for p in pairs]
        a = [p["after"][key] for p in pairs]
        med, lo, hi = median_interval([x / y for x, y in zip(a, b)])
        ci = "[-]" if lo is None else f"[{lo:.2f}, {hi:.2f}]"
        print(f"| {key} | {statistics.median(b):.3g} | {statistics.median(a):.3g} | {med:.2f} {ci} |")
    if args.json:
        Path(args.json).write_text(json.dumps(pairs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
