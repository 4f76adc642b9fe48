"""``difftx scale``: the comparison at several model sizes and DIFF's parameter efficiency."""

from __future__ import annotations

import argparse

from ..overrides import parse_overrides
from .args import check_not_input, output_dir, positive_int
from .compare import take_arms, take_workers


def register(sub) -> None:
    p = sub.add_parser("scale", help="the comparison at several model sizes; DIFF's parameter efficiency (Fig. 3a)",
                       description="Run `difftx compare` at each model size (into --out/size=NAME/, reused when "
                                   "present, resumable), fit L = E + A N^-b to the held-out LM loss against the "
                                   "non-embedding parameters (the floor E shared by DIFF and its baseline; with 2 "
                                   "sizes, the straight line log L = a + b log N), and write --out/scale.md, "
                                   "scale.json and scale.png: for each DIFF size, the baseline size with the same "
                                   "loss and the ratio, with a 95% interval over seeds, beside the gap in nats "
                                   "(DIFF - baseline held-out NLL, paired over seeds) and how far 0.01 nats moves "
                                   "the ratio at the fit's slope; the straight line's ratios and lack of fit; where "
                                   "the curves cross; each size's regime against the paper's recipe (lambda_init, "
                                   "heads, context, tokens per parameter); the gap along training per size. Every size "
                                   "trains DIFF, the baseline and DIFF with lambda_init 0.8. With --tune, every size "
                                   "is a tuned comparison and the report opens with the tuned gaps. Run again on the "
                                   "same --out, it trains nothing and re-fits. A comparison that trains recall "
                                   "without LM batches (--preset recall-scale-cpu, or recall-cpu with --sizes) has no "
                                   "loss to fit: its sizes are a map of depth and width, in any order (no rule that "
                                   "parameters grow, no floor fit), and scale.md, scale.json and scale.png give per "
                                   "size and arm the recall frontier, the step recall was learned and the last "
                                   "layer's attention on the binding, each against the baseline as the size's "
                                   "compare compared it. See docs/efficiency.md.")
    p.add_argument("--preset", default="scale-cpu",
                   help="a scale preset (scale-cpu, scale-gpu, recall-scale-cpu: sizes, seeds and settings) or a "
                        "compare preset (smoke, cpu, recall-cpu, gpu-small) with --sizes (default scale-cpu)")
    p.add_argument("--sizes", default=None, metavar="S1,S2,...",
                   help="model sizes from small to large (in any order for recall without LM): names (xs, s, m, l, "
                        "xl, xxl, 10m, 40m, 85m, 290m, 680m) or DIMxLAYERSxHEADS, e.g. a depth sweep at fixed width: "
                        "48x2x2,48x4x2,48x8x2 (default: the scale preset's)")
    p.add_argument("--seeds", type=positive_int, default=None, help="paired seeds per size (default: the scale "
                                                                       "preset's, else 3)")
    p.add_argument("--out", default=None, type=output_dir, help="output folder (default runs/scale-PRESET)")
    p.add_argument("--tokens-per-param", type=float, default=None, metavar="X",
                   help="train each size on X tokens per non-embedding parameter of its baseline (default: the "
                        "preset's steps at every size, the paper's setting)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a compare preset field at every size (as `difftx compare --set`)")
    p.add_argument("--arms", default=None, metavar="ARMS", help="more arms at every size (as `difftx compare --arms`)")
    p.add_argument("--tune", default=None, metavar="FIELD=V1,V2,...",
                   help="tune one training field per arm at every size, e.g. --tune lr=0.0015,0.003,0.006 (as "
                        "`difftx compare --tune`: every arm at every value, each seed's value chosen from the other "
                        "seeds' validation loss, the grid extended at an edge); scale.md and scale.json open with the "
                        "tuned gaps and ratios beside those at the preset's value")
    p.add_argument("--no-lambda-arm", action="store_true",
                   help="leave out the arm diff_lambda_0.8 (DIFF with lambda_init 0.8 at every layer), which scale "
                        "trains beside DIFF by default to separate differential attention from the depth schedule "
                        "of lambda_init at shallow depth")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="your own text at every size, LM only (as `difftx compare --data`: a text file, a folder or "
                        "a JSONL file)")
    p.add_argument("--tokenizer", default=None, metavar="DIR|byte", help="with --data: its tokenizer (default byte)")
    p.add_argument("--heldout", default=None, metavar="FILE",
                   help="with --data: score every token of this file (default: the corpus's validation split)")
    p.add_argument("--workers", type=int, default=None, help="models trained side by side (default: the preset's)")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="on a cluster: invocation K of N trains its share of every size's models; run once more "
                        "without --shard to assemble (see `difftx compare --shard`)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..compare.presets import flat_parts, text_overrides  # lazy: torch; --help stays fast
    from ..compare.report import gap_text  # lazy: torch; --help stays fast
    from ..compare.jobs import parse_shard  # lazy: torch; --help stays fast
    from ..studies.scale import default_out, primary_pair, run_scale  # lazy: torch; --help stays fast
    from ..studies.tune import parse_tune  # lazy: torch; --help stays fast

    shard = None if args.shard is None else parse_shard(args.shard)
    overrides = flat_parts(parse_overrides(args.overrides))  # --set schedule.lr=... is --set lr=...
    take_workers(args, overrides)
    if args.data is not None:  # LM on your text (text_overrides sets the mixture)
        overrides = text_overrides(overrides, args.data, args.tokenizer, args.heldout)
    elif args.tokenizer is not None or args.heldout is not None:
        raise ValueError("--tokenizer and --heldout apply with --data")
    take_arms(args, overrides)
    tune = None if args.tune is None else parse_tune(args.tune)
    if tune is not None and tune[0] in overrides:
        raise ValueError(f"--tune {tune[0]}: also given with --set; give it in one place")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()] if args.sizes else None
    out = args.out or default_out(args.preset)
    check_not_input(out, "--out", {"--data": args.data, "--heldout": args.heldout, "--tokenizer": args.tokenizer})
    res = run_scale(args.preset, sizes, args.seeds, out, tokens_per_param=args.tokens_per_param,
                    progress=not args.no_progress, workers=args.workers, shard=shard,
                    lambda_arm=not args.no_lambda_arm, tune=tune, **overrides)
    if shard is not None:
        print(f"\nshard {shard[0]}/{shard[1]} done for sizes {', '.join(res['sizes'])}; when every shard has "
              "finished, run the same command without --shard to assemble")
        return 0
    print(f"\nwrote {out}/scale.md and {out}/scale.json" + (f" and {out}/{res['plot']}" if res.get("plot") else ""))
    if res.get("kind") == "recall":
        from ..studies.scale_recall import recall_lines  # lazy: torch; --help stays fast

        print("\n".join(recall_lines(res)))
        return 0
    if res.get("tuned"):
        t = res["tuned"]
        print(f"  tuned {t['field']} (primary; gaps on {t['heldout_source']}):")
        for arm, gaps in t["tuned"]["gap"].items():
            shared = t["shared"]["gap"][arm]
            for sz, g, g0 in zip(res["sizes"], gaps, shared):
                print(f"  {arm} at {sz['name']}: gap tuned {gap_text(g)} nats, at the preset's value {gap_text(g0)}")
    ref = primary_pair(res)[1]  # the arm every other is measured against
    for arm, eff in res["efficiency"].items():
        if "skipped" in eff:
            print(f"  {arm}: {eff['skipped']}")
            continue
        fit = _fit_text(eff, ref) if eff["method"] == "floor" else "straight log-log line (2 sizes)"
        print(f"  {arm}: {fit}")
        for sz, r, g in zip(res["sizes"], eff["ratios"], res["gap"][arm]):
            value = "-" if r["value"] is None else f"{r['value']:.3f}"
            ci = "" if r["low"] is None else f" [{r['low']:.3f}, {r['high']:.3f}]"
            note = f" ({r['note']})" if r["note"] else ""
            print(f"  {arm} at {sz['name']}: gap {gap_text(g)} nats; N_{arm} / N_{ref} = {value}{ci}{note}")
    return 0


def _fit_text(eff: dict, ref: str) -> str:
    """The floor fit in one line: which model and each floor (parameters of the fit: their difference is not a
    finding, and scale.md says why); ``ref``: the arm the fit is against."""
    f = eff["fit"]
    if f.get("model", "shared") == "shared":
        return f"floor fit L = E + A N^-b, one floor E = {f['floor']:.4f} shared with the {ref}"
    return (f"floor fit L = E + A N^-b, a floor per arm: E = {f['floors']['arm']:.4f}, {ref}'s "
            f"{f['floors']['reference']:.4f} (fit parameters, not a finding: read the gap at the largest size)")
