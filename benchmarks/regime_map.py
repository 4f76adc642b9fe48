"""The regime map's table: several recall compares (each a cell of the map: an initialisation, a depth, a set of
arms) read side by side, each arm against that compare's baseline.

    python benchmarks/regime_map.py normal=runs/map/normal torch=runs/map/torch depth8=runs/map/depth8 [--json F]
    python benchmarks/regime_map.py --at-init [--layers 2,8] [--arms A,B,...] [--seeds 7]

For every cell and arm: its regime (initialisation, layers, width, lambda_init and output scale per layer, the
per-head norm), the frontier (mean over seeds [95%]), how many seeds learned recall and the step range, the last
layer's attention on the binding, the output/residual ratio of each layer at initialisation (step 0's probe, where
recorded), and the arm minus the baseline in frontier with the compare's own interval, Holm p and verdict
(:mod:`difftx.studies.scale_recall` reads them out of each ``results.json``; nothing is re-estimated here).

``--at-init`` trains nothing: for fresh models of the ``recall-cpu`` preset's shape (its vocabulary, width and heads,
at each depth given), under each initialisation, each layer's attention output against the residual stream
(:func:`difftx.eval.residual.attention_residual_ratio`) at the queries of 64 recall examples, mean and range over
seeds, per arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from difftx.compare.regime import regime
from difftx.studies.scale_recall import recall_by_size
from difftx.compare.schema import CompareResult, read_results
from difftx.compare.summary import adjusted_p_text, difference_text, short_verdict
from difftx.config import ModelConfig


def _fmt(r, d=3) -> str:
    if r is None or r.get("mean") is None:
        return "-"
    ci = "" if r.get("low") is None else f" [{r['low']:.{d}f}, {r['high']:.{d}f}]"
    return f"{r['mean']:.{d}f}{ci}"


def _regime_text(cfg: ModelConfig) -> str:
    r = regime(cfg, None, 1) if cfg.attention == "diff" else None
    more = ".." if cfg.n_layers > 3 else ""
    scale = "" if r is None else (" λ_init " + "/".join(f"{x:.2f}" for x in r["lambda_init"][:3]) + more
                                  + ", scale " + "/".join(f"{x:.2f}" for x in r["out_scale"][:3]) + more)
    if r is None and cfg.out_scale is not None:
        scale = f" scale {cfg.out_scale}"
    return f"{cfg.init}, {cfg.n_layers}L x {cfg.dim}{scale}{', norm' if cfg.uses_head_norm else ''}"


def _learned(res: CompareResult, arm: str) -> str:
    steps = []
    for s in res.seeds:
        g = (res.run(s, arm).tasks.get("recall") or {}).get("learning") or {}
        steps.append(g.get("learned_step"))
    got = [x for x in steps if x is not None]
    span = f" ({min(got):,}-{max(got):,})" if got else ""
    return f"{len(got)}/{len(steps)}{span}"


def _probe_at(res: CompareResult, arm: str, step: int, key: str):
    """The mean over seeds of a probe field at ``step`` (a list per layer), or None where not recorded."""
    rows = []
    for s in res.seeds:
        probes = res.run(s, arm).train.get("probes") or []
        got = next((p.get(key) for p in probes if p.get("step") == step), None)
        if got is None:
            return None
        rows.append(got)
    return [statistics.fmean(col) for col in zip(*rows)]


def table(cells: dict[str, CompareResult]) -> list[str]:
    by_cell = recall_by_size(list(cells), cells)
    lines = ["| cell | arm | regime | frontier [95%] | learned | attention on binding (last layer) | "
             "output/residual at init | frontier - baseline [95%] | Holm p | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in cells.items():
        got = by_cell[name]
        for arm in res.arms:
            cfg = ModelConfig.from_dict(res.arms[arm].config)
            ratio = _probe_at(res, arm, 0, "attention_output_ratio")
            ratio_text = "-" if ratio is None else "/".join(f"{x:.2f}" for x in ratio)
            d = None if arm == "baseline" else got["vs_baseline"][arm]["frontier"]
            diff = ["", "", ""] if arm == "baseline" else ["-", "-", "not measured"] if d is None else \
                [difference_text(d), adjusted_p_text(d), short_verdict(d)]
            lines.append(f"| {name} | {arm} | {_regime_text(cfg)} | {_fmt(got['arms'][arm]['frontier'])} | "
                         f"{_learned(res, arm)} | {_fmt(got['arms'][arm]['attention_on_binding'])} | {ratio_text} | "
                         + " | ".join(diff) + " |")
    return lines


def at_init(arms: list[str], layers: list[int], seeds: int) -> list[str]:
    """The output/residual ratio per layer of fresh models, per initialisation, depth and arm."""
    import torch

    from difftx import Transformer
    from difftx.compare.presets import get_preset
    from difftx.eval.recall import IGNORE, generate
    from difftx.eval.residual import attention_residual_ratio

    lines = ["| init | layers | arm | output/residual per layer at the queries (mean over seeds; min-max) |",
             "|---|---|---|---|"]
    for init in ("normal", "torch"):
        for n in layers:
            plan = get_preset("recall-cpu", n_layers=n, init=init, arms=tuple(arms)).resolve()
            block = plan.space.block("recall")
            examples = block.shifted(generate(block.spec(max(block.pairs)), 64, seed=0))
            for arm in arms:
                rows = []
                for seed in range(seeds):
                    torch.manual_seed(seed)
                    model = Transformer(plan.arms[arm])
                    rows.append(attention_residual_ratio(model, examples.inputs, examples.labels != IGNORE)["ratio"])
                per = ", ".join(f"{statistics.fmean(c):.2f} ({min(c):.2f}-{max(c):.2f})" for c in zip(*rows))
                lines.append(f"| {init} | {n} | {arm} | {per} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cells", nargs="*", metavar="NAME=FOLDER", help="a compare folder with its cell's name")
    p.add_argument("--json", default=None, help="also write the per-cell readings here")
    p.add_argument("--at-init", action="store_true", help="fresh models' output/residual ratio instead (no training)")
    p.add_argument("--arms", default="baseline,diff,diff_lambda_0.8,diff_out_0.2,baseline_head_norm_out_0.2",
                   help="with --at-init: the arms")
    p.add_argument("--layers", default="2,8", help="with --at-init: the depths")
    p.add_argument("--seeds", type=int, default=7, help="with --at-init: fresh models per arm")
    args = p.parse_args(argv)
    if args.at_init:
        print("\n".join(at_init(args.arms.split(","), [int(x) for x in args.layers.split(",")], args.seeds)))
        return 0
    if not args.cells:
        p.error("give NAME=FOLDER cells, or --at-init")
    cells = {}
    for item in args.cells:
        name, sep, folder = item.partition("=")
        path = Path(folder) / "results.json"
        if not sep or not path.is_file():
            p.error(f"{item!r}: expected NAME=FOLDER with FOLDER/results.json (a finished difftx compare)")
        cells[name] = read_results(path)
    print("\n".join(table(cells)))
    if args.json:
        Path(args.json).write_text(json.dumps(recall_by_size(list(cells), cells), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
