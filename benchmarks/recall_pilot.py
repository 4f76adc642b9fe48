"""A pilot of the recall benchmark: arms trained on a mixture of multi-query associative recall (MQAR)
difficulties, scored on a grid of pairs, variants and lengths, with paired intervals over seeds.

One arm alone (``--arms baseline``) is trained and scored without differences, so that arms can run side by
side in separate processes. Each arm's seeds train together as one stack (``difftx.training.train_stacked``) on
``difftx.eval.recall.RecallSource`` (a mixture of pair counts at the training length, in turn); every
model is then scored (``difftx.eval.recall.score``) on the same generated examples of each cell. The
frontier of a model is its mean accuracy over the pair grid (plain MQAR, training length): the area
under its accuracy-against-pairs curve. Printed: per cell each arm's mean accuracy, and per arm
other than the baseline its paired difference from the baseline with the verdict rule's interval
(``difftx.eval.stats.paired_estimate``, bounded metric) and, for the frontier, the seeds that 80%
power needs (``difftx.eval.stats.power_plan``); then the attention noise at the first cell (plain MQAR,
training length, fewest pairs): each layer's L1-normalised attention mass on the binding a query asks for
(``difftx.eval.recall.attention_mass``, absolute variant, mean over heads), per arm and its paired difference.

    python benchmarks/recall_pilot.py [--arms diff,baseline,diff_lambda_0.8] [--seeds 4] [--steps 1500]
                                      [--dim 64] [--layers 2] [--heads 2] [--vocab 256] [--train-len 64]
                                      [--train-pairs 4,8,16] [--eval-pairs 4,8,16,24]
                                      [--variants mqar,reassigned] [--lengths 64,128] [--samples 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    from difftx.checkpoint import load_model
    from difftx.config import ModelConfig, arm_config
    from difftx.eval.recall import RecallSource, RecallSpec, attention_mass, generate, score
    from difftx.eval.stats import mean_interval, paired_estimate, power_plan
    from difftx.training import TrainConfig, train_stacked

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="diff,baseline,diff_lambda_0.8")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--train-len", type=int, default=64)
    ap.add_argument("--train-pairs", default="4,8,16")
    ap.add_argument("--eval-pairs", default="4,8,16,24")
    ap.add_argument("--variants", default="mqar,reassigned")
    ap.add_argument("--lengths", default="64,128")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--out", default=None, help="keep the trained models here (default: a temporary folder)")
    a = ap.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    if "baseline" not in arms and len(arms) > 1:
        raise SystemExit("--arms: include baseline (the differences are against it), or give one arm alone")
    others = [arm for arm in arms if arm != "baseline" and "baseline" in arms]  # arms compared with the baseline
    lengths, pairs, variants = _ints(a.lengths), _ints(a.eval_pairs), [v for v in a.variants.split(",") if v]
    specs = [RecallSpec(vocab_size=a.vocab, seq_len=a.train_len, n_pairs=p) for p in _ints(a.train_pairs)]
    base = ModelConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, attention="diff",
                       max_seq_len=max(lengths + [a.train_len]))
    cells = [(v, L, p) for v in variants for L in lengths for p in pairs
             if (L - 2 * (p + (-(-p // 2) if v == "reassigned" else 0))) >= 2 * p]
    examples = {c: generate(RecallSpec(vocab_size=a.vocab, seq_len=c[1], n_pairs=c[2], variant=c[0]), a.samples,
                            seed=1234) for c in cells}
    acc: dict = {}  # arm -> cell -> [per seed]
    mass: dict = {}  # arm -> [per seed: per layer answer mass]
    probe = cells[0]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        for arm in arms:
            cfg = arm_config(base, arm)
            configs = [TrainConfig(model=cfg.to_dict(), seq_len=a.train_len, batch_size=a.batch, steps=a.steps,
                                   lr=a.lr, warmup_steps=max(1, a.steps // 20), eval_interval=0,
                                   log_interval=max(1, a.steps // 10), ckpt_interval=a.steps, seed=s,
                                   out_dir=str(root / arm / f"seed{s}"), progress=False) for s in range(a.seeds)]
            t = time.time()
            results = train_stacked(configs, data=[RecallSource(specs, seed=s) for s in range(a.seeds)],
                                    model_config=cfg)
            for r in results:
                model = load_model(r.last_checkpoint)
                for c in cells:
                    acc.setdefault(arm, {}).setdefault(c, []).append(score(model, examples[c])["accuracy"])
                layers = attention_mass(model, examples[probe].head(64))["layers"]
                mass.setdefault(arm, []).append([m["answer_mean"]["absolute"] for m in layers])
            print(f"# {arm}: {a.seeds} seeds trained and scored in {time.time() - t:.0f} s", flush=True)
    front = [c for c in cells if c[0] == "mqar" and c[1] == a.train_len]
    frontier = {arm: [float(np.mean([acc[arm][c][s] for c in front])) for s in range(a.seeds)] for arm in arms}
    print(f"\n# {a.seeds} seeds; width {a.dim}, {a.layers} layers, {a.heads} heads; V={a.vocab}; trained {a.steps} "
          f"steps on pairs {a.train_pairs} at length {a.train_len}; {a.samples} examples a cell; "
          f"{time.time() - t0:.0f} s\n")
    head = "| variant | length | pairs | " + " | ".join(arms) + " | " + " | ".join(
        f"{arm} - baseline [95% CI]" for arm in others) + " |"
    print(head)
    print("|" + "---|" * (3 + len(arms) + len(others)))
    rows = [(c, acc) for c in cells] + [(("frontier", a.train_len, "mean"), None)]
    for c, _ in rows:
        vals = {arm: (frontier[arm] if c[0] == "frontier" else acc[arm][c]) for arm in arms}
        means = [f"{np.mean(vals[arm]):.3f}" for arm in arms]
        diffs = []
        for arm in others:
            e = paired_estimate(vals[arm], vals["baseline"], bounds=(0.0, 1.0))
            ci = "" if e.low is None else f" [{e.low:+.3f}, {e.high:+.3f}]"
            diffs.append(f"{e.mean:+.3f}{ci}")
        print(f"| {c[0]} | {c[1]} | {c[2]} | " + " | ".join(means) + " | " + " | ".join(diffs) + " |")
    print()
    for arm in arms:
        lo = mean_interval(frontier[arm], bounds=(0.0, 1.0))
        print(f"frontier of {arm}: per seed {', '.join(f'{x:.3f}' for x in frontier[arm])}; mean {lo[0]:.3f}"
              + ("" if lo[1] is None else f" [{lo[1]:.3f}, {lo[2]:.3f}]"))
        if arm in others:
            d = np.array(frontier[arm]) - np.array(frontier["baseline"])
            print(f"  {arm} - baseline: {power_plan(d, bounds=(-1.0, 1.0)).describe()}")
    print(f"\nattention mass on the binding asked for, at {probe[0]}, length {probe[1]}, {probe[2]} pairs (absolute, "
          "mean over heads; per layer, mean over seeds):")
    for arm in arms:
        per_layer = np.array(mass[arm])  # (seeds, layers)
        line = ", ".join(f"layer {i}: {v:.3f}" for i, v in enumerate(per_layer.mean(0)))
        if arm in others:
            e = paired_estimate(per_layer[:, -1], np.array(mass["baseline"])[:, -1], bounds=(0.0, 1.0))
            ci = "" if e.low is None else f" [{e.low:+.3f}, {e.high:+.3f}]"
            line += f"; last layer - baseline {e.mean:+.3f}{ci}"
        print(f"  {arm}: {line}")


if __name__ == "__main__":
    main()
