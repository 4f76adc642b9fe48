"""``difftx map``: the regime map as one command (cells of compare folders, trained where missing)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .args import output_dir, positive_int


def register(sub) -> None:
    p = sub.add_parser("map", help="the regime map: a compare per cell (init, depth, width, task), trained where "
                                   "missing; map.md, map.png, map.json",
                       description="Train the cells of a map spec whose compare folder (--out/CELL) is missing or "
                                   "unfinished (each is a `difftx compare`, reused and resumed as compare does), read "
                                   "every finished one, and write --out/map.md (the answer per task: where each DIFF "
                                   "arm does better than the baseline, where worse, where neither learns), map.png "
                                   "(a grid of cells, each arm minus the baseline with its verdict) and map.json "
                                   "(every cell's arms, frontier or held-out NLL, interval, verdict, learned seeds, "
                                   "first layer's output/residual at initialisation, and where its numbers come "
                                   "from). The spec names each cell by its axes: init, depth, width and task; "
                                   "lambda_init, the output scale and the per-head norm are each arm's. Cells "
                                   "measured before whose folders were not kept are recorded (the spec's "
                                   "\"recorded\" file) and stand in for a missing folder; a finished folder wins. "
                                   "See docs/compare.md, \"The regime map\".")
    p.add_argument("--spec", default=None, metavar="FILE",
                   help="the map spec (JSON; default: the shipped recall and LM map, configs/maps/regime-map.json)")
    p.add_argument("--out", default=None, type=output_dir, help="the map's folder: one compare folder per cell, "
                                                                 "and map.md, map.png, map.json (default runs/map)")
    p.add_argument("--seeds", type=positive_int, default=None, help="paired seeds of every cell (default: the spec's)")
    p.add_argument("--workers", type=int, default=None, help="processes side by side in each compare (default: "
                                                             "its preset's)")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="on a cluster: invocation K of N trains its share of every cell's models (every N-th (cell, "
                        "seed, arm)) and writes no map; run once more without --shard to finish and write the map")
    p.add_argument("--dry-run", action="store_true",
                   help="list each cell (present, partial, missing; recorded), where its numbers come from and its "
                        "compare command, with a note where a cell to train has too few seeds for any verdict among its arms' "
                        "comparisons; train nothing")
    p.add_argument("--no-train", action="store_true",
                   help="write the map from the finished folders and recorded cells alone; train nothing")
    p.add_argument("--no-recorded", action="store_true",
                   help="leave the recorded cells out: every cell without a finished folder is trained")
    p.add_argument("--table", action="store_true",
                   help="print the markdown table of docs/compare.md's regime map: the spec's recorded cells alone "
                        "(no folder read; add finished folders to them with --record), and train nothing")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="after writing the map, add the cells read from folders to this recorded map (e.g. "
                        "docs/regime-map.json), so their numbers outlive the folders")
    p.add_argument("--cells", default=None, metavar="NAME[,NAME...]",
                   help="train only these cells, and --record only these; the map still reads every cell "
                        "(default: every cell)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..compare.jobs import parse_shard  # lazy: torch; --help stays fast
    from ..studies.map import (DEFAULT_OUT, check_cells, docs_map, dry_run_lines, load_recorded, load_spec,  # lazy
                               map_table, plan_map, record_cells, run_map)

    shard = None if args.shard is None else parse_shard(args.shard)
    looks = [f for f, on in (("--dry-run", args.dry_run), ("--table", args.table)) if on]
    if args.table and args.cells is not None:
        raise ValueError("--table prints the recorded cells alone: it goes without --cells")
    if len(looks) > 1 or looks and (shard is not None or args.record):
        raise ValueError(f"{looks[0]} trains and writes nothing: it goes without --shard, --record and "
                         + ("--table" if looks[0] == "--dry-run" else "--dry-run"))
    if shard is not None and (args.no_train or args.record):
        raise ValueError("--shard trains and writes no map: it goes without --no-train and --record")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers: must be a positive integer, got {args.workers}")
    spec = load_spec(args.spec)
    cells = check_cells(spec, args.cells)
    out = Path(args.out) if args.out is not None else DEFAULT_OUT
    if not (args.dry_run or args.table):  # what the map writes never lands on the spec or its recorded cells
        from .args import check_not_input

        inputs = {"the map spec": spec.path, "the recorded cells": spec.recorded}
        for name in ("map.json", "map.md", "map.png"):
            check_not_input(out / name, "--out", inputs)
        check_not_input(args.record, "--record", {"the map spec": spec.path})
        if args.record:  # before any training: a file it cannot write or read is said now, not after the hours
            from .args import check_output_file

            check_output_file(args.record, "--record")
            if Path(args.record).is_file():
                load_recorded(Path(args.record))
    recorded = {} if args.no_recorded else load_recorded(spec.recorded)
    if args.dry_run:
        print("\n".join(dry_run_lines(plan_map(spec, out, args.seeds, recorded, cells=cells), recorded)))
        return 0
    if args.table:
        print(map_table(docs_map(spec)), end="")
        return 0
    m = run_map(spec, out, seeds=args.seeds, workers=args.workers, shard=shard, use_recorded=not args.no_recorded,
                train=not args.no_train, progress=not args.no_progress, cells=cells)
    if m is None:
        print(f"\nshard {shard[0]}/{shard[1]} done; when every shard has finished, run the same command without "
              "--shard to finish the cells and write the map")
        return 0
    sources = {s: [c["name"] for c in m["cells"] if c["source"] == s] for s in ("folder", "recorded", None)}
    print(f"\nwrote {out}/map.md, {out}/map.json" + (f" and {out}/{m['plot']}" if m.get("plot") else ""))
    print(f"  read from folders: {', '.join(sources['folder']) or 'none'}")
    print(f"  recorded (folders not kept): {', '.join(sources['recorded']) or 'none'}")
    print(f"  not measured: {', '.join(sources[None]) or 'none'}")
    if args.record:
        names = record_cells(m, Path(args.record), cells)
        print(f"  recorded into {args.record}: {', '.join(names) or 'no cell read from a folder'}")
    return 0
