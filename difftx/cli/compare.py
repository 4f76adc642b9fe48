"""``difftx compare``: DIFF against its parameter-matched baseline, paired seeds, a report."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..overrides import parse_overrides, parse_value, split_override
from .args import check_not_input, output_dir, positive_int


def register(sub) -> None:
    p = sub.add_parser("compare", help="train DIFF and its matched baseline over paired seeds, evaluate, report",
                       description="Train a DIFF model and its parameter-matched baseline per seed (same seed, same "
                                   "batches), run the paper's evaluations on both and write results.json, report.md "
                                   "and plots/ into --out. Re-running with the same --out resumes: finished "
                                   "trainings and evaluations are not redone.")
    p.add_argument("--preset", default=None,
                   help="smoke | cpu | recall-cpu | from-cpu | gpu-small (default cpu: about 3 min per seed on 2 CPU "
                        "cores, 8 seeds: 25 min; with --from: from-cpu)")
    p.add_argument("--seeds", type=positive_int, default=1,
                   help="number of paired seeds 0..K-1 (default 1; intervals from 6 seeds, verdicts on the 3 primaries "
                        "from 7; make demo uses 8; seeds already in --out are reused)")
    p.add_argument("--out", default=None, type=output_dir,
                   help="output folder (default runs/compare-PRESET): new, empty, or one compare wrote (then it "
                        "resumes); another non-empty folder, a `difftx train` run or one inside --data is refused")
    p.add_argument("--workers", type=int, default=None,
                   help="processes side by side (default: the preset's); on a CPU each trains one arm's seeds as one "
                        "stacked model (--set stack=1: every model alone)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a preset field, e.g. --set steps=500 (a field of the schedule or the execution, "
                        "also schedule.steps=500, execution.workers=2), a field of the DIFF arm's model, e.g. "
                        "--set model.lambda_init=0.3 (every arm derives from it; dim, n_layers, n_heads and init "
                        "also without model.), or a task setting, e.g. --set "
                        "tasks.needle.samples_per_cell=20 (repeatable; the grammar of `difftx train --set`: "
                        "dotted keys, JSON/YAML scalars, else text such as --set tasks.needle.grid=1/1,2/2)")
    p.add_argument("--arms", default=None, metavar="ARMS",
                   help="the arms trained for every seed: comma-separated names (the primary pair always "
                        "included: baseline and diff unless --set primary=...) and named sets: default "
                        "(baseline,diff), paper-ablations (paper Table 6), "
                        "alternatives (diff_v2, gated, gated_matched, gated_headwise, no_subtraction), "
                        "recall-controls (diff_lambda_0.8, temperature, diff_nope, baseline_nope), all; see "
                        "`difftx info --arms`. Arms of your own: --set own_arms.NAME.model.FIELD=VALUE (an arm's "
                        "config with ModelConfig changes; from diff unless own_arms.NAME.from=ARM), trained beside "
                        "the preset's arms")
    p.add_argument("--sweep", default=None, metavar="FIELD=V1,V2,...",
                   help="a budget check: the whole comparison at each value of one preset field, e.g. --sweep "
                        "lr=0.001,0.003,0.006 (lr brings min_lr along in proportion), each in --out/FIELD=VALUE/, "
                        "and --out/sweep.md: every arm's primary metrics per value and at its own best value")
    p.add_argument("--tune", default=None, metavar="FIELD=V1,V2,...",
                   help="each arm at its own value of one training field, e.g. --tune lr=0.0015,0.003,0.006 (also "
                        "schedule.lr=...) or --tune init=normal,torch (the "
                        "preset's value is always added; lr brings min_lr along): every arm trains at every value "
                        "(--out/tune/FIELD=VALUE/; --out itself is the comparison at the preset's value), each seed's "
                        "value is chosen per arm from the other seeds' validation loss (first half of the validation "
                        "split), a best number at the grid's edge adds one beyond it (x2 or /2, twice at most), and "
                        "report.md opens with the tuned comparison on the held-out second half beside the one at "
                        "the preset's value (and tune.json, plots/tune_FIELD.png)")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="on a cluster: invocation K of N trains and evaluates only its share of the models (every "
                        "N-th (seed, arm), from the K-th; it prints them and stacks them) into the shared --out and "
                        "writes no report; each model is locked, so "
                        "nothing is done twice. Run once more without --shard to assemble the report (see "
                        "docs/compare.md for a Slurm job array)")
    p.add_argument("--data", metavar="PATH",
                   help="does DIFF help on my text? train every arm on this text instead of the synthetic tasks and "
                        "Shakespeare: what `difftx train --data` takes (a text file, a folder of them, a JSONL file); "
                        "LM only unless --synthetic (default --out runs/compare-PRESET-NAME)")
    p.add_argument("--tokenizer", metavar="DIR|byte", help="with --data: 'byte' (default) or a tokenizer.json / folder "
                                                           "from `difftx tokenizer train`")
    p.add_argument("--heldout", metavar="FILE",
                   help="with --data: the held-out text, every token scored once (default: the corpus's validation "
                        "split, every token once)")
    p.add_argument("--synthetic", action="store_true",
                   help="with --data: also train and evaluate the preset's synthetic needle and ICL tasks (its "
                        "mixture, your text in place of Shakespeare; --set lm_every=... changes it); with --from: "
                        "recall batches between the LM batches, and the recall grid (from-cpu's mixture)")
    p.add_argument("--from", dest="source", metavar="SRC",
                   help="is a converted model better than its source fine-tuned the same way? SRC is a difftx "
                        "'standard' model or run folder or a transformers Llama folder; per seed, the source (arm "
                        "baseline) and its conversion (arm diff, `difftx convert`) are fine-tuned on --data with the "
                        "same steps, batches and learning rate, language modelling only, and compared on held-out "
                        "NLL (--synthetic adds recall batches and the recall grid); the preset's model fields are "
                        "not used (default preset from-cpu, --out runs/compare-from-SRCNAME-DATANAME)")
    p.add_argument("--method", default=None, metavar="NAME",
                   help="with --from: the conversion method (difftx convert --method: zero, mirror, random, or dex "
                        "on every head; default mirror)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def take_workers(args: argparse.Namespace, overrides: dict) -> None:
    """``--set workers=N`` is ``--workers N`` (one setting, two spellings); both at once is refused."""
    if "workers" not in overrides:
        return
    if args.workers is not None:
        raise ValueError("--workers and --set workers=...: give the number of workers in one place")
    workers = overrides.pop("workers")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"--set workers={workers!r}: must be a positive integer")
    args.workers = workers


def parse_arms(text: str, primary=None, own=()) -> tuple[str, ...]:
    """``"paper-ablations"``, ``"gated,no_subtraction"`` or ``"alternatives,diff_lambda_0.8"`` -> arm names (a set's
    name stands for its arms), the ``primary`` pair first (its second arm,
    then its first; default: the presets' primary pair, baseline then diff); ``own``: the names of arms of your own
    (``--set own_arms.NAME...``)."""
    from ..compare import ComparePreset  # lazy: torch; --help stays fast
    from ..config import ARM_SETS, arm_names  # lazy: torch; --help stays fast

    names = [arm for item in (a.strip() for a in text.split(",")) if item  # a set's name stands for its arms
             for arm in (ARM_SETS[item] if item in ARM_SETS else (item,))]
    unknown = [a for a in names if a not in arm_names() and a not in own]
    if unknown or not names:
        raise ValueError(f"--arms {text!r}: unknown arm(s) {unknown}; choose from {arm_names()}, a set "
                         f"{list(ARM_SETS)} or an arm of your own (--set own_arms.NAME.model.FIELD=VALUE; your own "
                         f"attention kinds: difftx --kinds FILE)")
    pair = ComparePreset.primary if primary is None else primary  # not a pair: the preset's check says so
    lead = [a for a in reversed(pair) if isinstance(a, str)] if isinstance(pair, (tuple, list)) else []
    return tuple(dict.fromkeys([*lead, *names]))


def take_arms(args: argparse.Namespace, overrides: dict) -> None:
    """``--arms`` into ``overrides["arms"]`` (the primary pair first), arms of your own (``--set own_arms...``) among
    the names it takes (without ``--arms`` they join the preset's arms: :meth:`ComparePreset.with_overrides`)."""
    from ..compare.presets import PRESETS  # lazy: torch; --help stays fast

    if args.arms is None:
        return
    if "arms" in overrides:
        raise ValueError("--arms and --set arms=...: give the arms in one place")
    base = PRESETS.get(args.preset)
    own = overrides.get("own_arms") if isinstance(overrides.get("own_arms"), dict) else {}
    overrides["arms"] = parse_arms(args.arms, overrides.get("primary", base.primary if base else None), own)


def run(args: argparse.Namespace) -> int:
    from ..compare import ComparePreset, run_compare  # lazy: torch; --help stays fast
    from ..compare.jobs import parse_shard  # lazy: torch; --help stays fast
    from ..compare.presets import flat_parts  # lazy: torch; --help stays fast
    from ..studies.tune import parse_tune, run_tuned  # lazy: torch; --help stays fast
    from ..studies.tune_report import tune_summary  # lazy: torch; --help stays fast

    if args.seeds <= 0:
        raise ValueError("--seeds must be positive")
    args.preset = args.preset or ("from-cpu" if args.source is not None else "cpu")
    shard = None if args.shard is None else parse_shard(args.shard)
    if shard is not None and args.sweep:
        raise ValueError("--shard and --sweep: shard each point's folder on its own (--out DIR/FIELD=VALUE --set ...)")
    if args.sweep and args.tune:
        raise ValueError("--sweep and --tune: choose one (--tune chooses each arm's value without selection bias)")
    tune = None if args.tune is None else parse_tune(args.tune)
    overrides = flat_parts(parse_overrides(args.overrides))  # --set schedule.lr=... is --set lr=...
    known = {*ComparePreset.field_defaults(), "training"}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"--set: unknown preset field(s) {bad}; known: {sorted(known)} (task settings: "
                         "tasks.TASK.SETTING, see `difftx eval TASK --help`)")
    take_workers(args, overrides)
    take_arms(args, overrides)
    if args.source is not None:
        _from_source(args, overrides)
    elif args.method is not None:
        raise ValueError("--method goes with --from (the conversion of a source)")
    if args.data is not None:
        from ..compare.presets import text_overrides  # lazy: torch; --help stays fast

        overrides = text_overrides(overrides, args.data, args.tokenizer, args.heldout,
                                   synthetic=args.synthetic)
    elif args.tokenizer is not None or args.heldout is not None or args.synthetic:
        raise ValueError("--tokenizer, --heldout and --synthetic go with --data (your own text)")
    out = args.out or f"runs/compare-{args.preset}" + (f"-{_stem(args.data)}" if args.data is not None else "")
    if args.source is not None and args.out is None:
        from ..compare.source import default_name  # lazy: torch; --help stays fast

        out = f"runs/compare-{default_name(args.source)}-{_stem(args.data)}"
    check_not_input(out, "--out", {"--data": args.data, "--heldout": args.heldout, "--tokenizer": args.tokenizer,
                                   "--from": args.source})
    if args.sweep:
        return _sweep(args, out, overrides)
    if tune is not None:
        if tune[0] in overrides:
            raise ValueError(f"--tune {tune[0]}: also given with --set; give it in one place")
        res = run_tuned(args.preset, args.seeds, out, tune, progress=not args.no_progress, workers=args.workers,
                        shard=shard, **overrides)
        res = res if shard is not None else res.result  # the comparison at the preset's value, with its tuning
    else:
        res = run_compare(args.preset, args.seeds, out, progress=not args.no_progress, workers=args.workers,
                          shard=shard, **overrides)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 alone reports
        return 0
    if shard is not None and tune is not None:
        print(f"\nshard {shard[0]}/{shard[1]} done for every value of {tune[0]}; when every shard has finished, run "
              "the same command without --shard to assemble (it trains any value added at a grid's edge)")
        return 0
    if shard is not None:
        ran = res["this_run"]
        skipped = sum(1 for d in ran.values() if d.get("skipped"))
        print(f"\nshard {shard[0]}/{shard[1]}: {len(ran) - skipped} of its {len(ran)} model(s) done here"
              + (f", {skipped} held by another invocation" if skipped else "")
              + f" ({res['wall_s']:.0f} s). When every shard has finished, run the same command without --shard "
                "to assemble the report.")
        return 0
    print(f"\nwrote {out}/report.md, {out}/results.json and {len(res.get('plots', {}))} plots "
          f"({res.wall_s:.0f} s)")
    if res.get("text"):
        lm = res.run(res.seeds[0], res.primary.arms[0]).tasks["lm"]
        print(f"  held-out: {lm['source']}: {lm['distinct_tokens']:,} distinct tokens, each scored once, in windows of "
              f"{lm['window']}")
    if tune is not None:
        print(tune_summary(res.get("tune")))
    for comparison in res.comparisons.values():  # every pair's primary verdicts, each naming its pair (the rest: report)
        for c in comparison.metrics.values():
            if c["primary"]:
                pair = " - ".join(res.label(a) for a in c["arms"])
                text = c["verdict"] if pair in c["verdict"] else f"{pair}: {c['verdict']}"
                print("  " + text + (f" (at the preset's {tune[0]})" if tune is not None else ""))
    return 0


def _from_source(args: argparse.Namespace, overrides: dict) -> None:
    """``--from``: the source and method as preset fields."""
    if args.data is None:
        raise ValueError("--from SRC needs your text: --data TEXT (the source and its conversion are fine-tuned on it)")
    if args.arms is not None:
        raise ValueError("--arms goes without --from (a comparison from a source has two arms of its own, the source "
                         "and its conversion)")
    for name in ("source", "convert_method"):
        if name in overrides:
            raise ValueError(f"--set {name}=...: give it as --from / --method")
    overrides["source"] = args.source
    if args.method is not None:
        overrides["convert_method"] = args.method


def _stem(path: str) -> str:
    """``runs/compare-cpu-mybook`` for ``--data path/to/mybook.txt``."""
    name = Path(path).name
    return name.split(".")[0] or "data"


def _sweep(args: argparse.Namespace, out: str, overrides: dict) -> int:
    from ..compare import ComparePreset  # lazy: torch; --help stays fast
    from ..compare.presets import flat_field, model_fields  # lazy: torch; --help stays fast
    from ..studies.sweep import run_sweep  # lazy: torch; --help stays fast

    field, text = split_override(args.sweep)
    field = flat_field(field)  # schedule.lr is lr
    if field.startswith("model.") and field[len("model."):] not in model_fields() or not field.startswith(
            "model.") and (field not in ComparePreset.field_defaults() or field in ("tasks", "name", "model",
                                                                                   "schedule", "execution")):
        raise ValueError(f"--sweep {args.sweep!r}: {field!r} is not a preset field that can be swept (a preset "
                         f"field such as lr, or model.FIELD for a field of the model: {', '.join(model_fields())})")
    values = [parse_value(v.strip()) for v in text.split(",") if v.strip()]
    summary = run_sweep(args.preset, field, values, args.seeds, out, progress=not args.no_progress,
                        workers=args.workers, **overrides)
    print(f"\nwrote {out}/sweep.md and {out}/sweep.json ({len(values)} comparisons in {out}/{field}=...)")
    b = summary["best"]
    if b:
        from ..compare.arms import LABELS  # lazy: torch; --help stays fast

        print(f"  best {field} by {b['label']}: "  # the primary pair's arms, its second first
              + ", ".join(f"{LABELS.get(a, a)} {v}" for a, v in b["value"].items()))
    return 0
