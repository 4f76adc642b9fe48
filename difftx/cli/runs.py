"""``difftx runs RUN [RUN ...]``: training runs side by side (``difftx.training.summary``); ``difftx runs --pool
FOLDER ...``: one metric's paired difference pooled across compare folders (a random-effects meta-analysis,
``difftx.eval.pool``)."""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path

from ..tasks.lm import LMSettings, interval_about, nll_interval, scored_tokens
from ..tasks.subject import TRAIN_RECORD
from .args import check_not_input, check_not_owned, check_output_file, check_plot_format, plot_file
from .train import strict_unknown_flags


def register(sub) -> None:
    p = sub.add_parser("runs", help="training runs side by side: params, tokens, tokens/s, losses; --plot curves; "
                                    "--pool: one metric pooled across compare folders",
                       description="Summarise training run folders (what `difftx train --out` wrote) side by side: "
                                   "attention kind, parameters, steps, tokens seen, tokens/s over the whole run, "
                                   "last training loss, best and final validation loss with their steps, "
                                   "validation size. Read from the folders; nothing is recomputed. With --pool, "
                                   "the arguments are compare folders, and one metric's paired difference (a "
                                   "primary pair's) is pooled across them: a random-effects meta-analysis with "
                                   "the Hartung-Knapp-Sidik-Jonkman interval, the between-comparison SD tau, I^2 "
                                   "and a prediction interval for a new comparison.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (e.g. a DIFF run and its baseline); with "
                                                          "--pool, compare folders (or their results.json)")
    p.add_argument("--plot", metavar="FILE.png", help="also write the training and validation curves (matplotlib); "
                                                      "with --pool, the forest plot")
    p.add_argument("--pool", action="store_true",
                   help="pool one metric's paired difference across the compare folders given (each folder's "
                        "mean difference over its seeds and its standard error SD/sqrt(seeds)); folders that cannot "
                        "be compared with the first are refused, each in one line")
    p.add_argument("--metric", metavar="KEY", help="with --pool: the metric (default: the pair's first primary one)")
    p.add_argument("--pair", metavar='"A vs B"',
                   help="with --pool: the pair of arms, A - B (default: the first folder's primary pair)")
    p.add_argument("--by", metavar="FIELD",
                   help=f"with --pool: pool within each value of a field the folders record and test the "
                        f"difference between them: {', '.join(POOL_FIELDS)}, or preset.NAME (any preset field, "
                        f"e.g. preset.lr)")
    p.add_argument("--tau-method", choices=("pm", "dl"), default=None,
                   help="with --pool: the estimator of tau^2: pm (Paule-Mandel, default) or dl (DerSimonian-Laird)")
    p.add_argument("--hksj", choices=("floored", "plain"), default=None,
                   help="with --pool: the HKSJ factor q kept at least 1 (floored, default: never narrower than the "
                        "ordinary random-effects interval; benchmarks/pool_coverage.py) or HKSJ's own (plain)")
    p.add_argument("--json", metavar="FILE", help="with --pool: also write the whole analysis as JSON")
    p.add_argument("--nll", action="store_true",
                   help="also score each run's latest checkpoint on held-out text (`difftx eval lm`): mean NLL with "
                        "its 95%% interval, and each run minus the first, window by window on the same text, with "
                        "its 95%% interval; the intervals are about text like the scored one, with blocks of "
                        "windows spanning at least 8,192 tokens of text as their units")
    p.add_argument("--data", metavar="FILE",
                   help="with --nll: score every token of this file (default: each run's own validation split; give "
                        "one file to compare runs on the same text)")
    p.add_argument("--windows", type=int, default=None,
                   help="with --nll: disjoint windows spread over the held-out split (default 512, or as many as "
                        "fit; with --data every token)")
    p.set_defaults(func=run)
    strict_unknown_flags(p)


def run(args: argparse.Namespace) -> int:
    if args.pool:
        return run_pool(args)
    pool_only = [f for f, v in (("--metric", args.metric), ("--pair", args.pair), ("--by", args.by),
                                ("--json", args.json), ("--tau-method", args.tau_method), ("--hksj", args.hksj))
                 if v is not None]
    if pool_only:
        raise ValueError(f"{', '.join(pool_only)}: apply with --pool")
    from ..training.summary import (  # lazy: torch; --help stays fast
        DEFAULT_COLUMNS, LEGEND, comparability_notes, format_table, plot_runs, summarize_run,
    )

    args.plot = plot_file(args.plot)  # FILE.png for a name without a suffix: say so, and check that file
    check_output_file(args.plot, "--plot")
    check_not_owned(args.plot, "--plot")
    check_not_input(args.plot, "--plot", {"the run": list(args.runs), "--data": args.data})
    check_plot_format(args.plot, "--plot")
    # ValueError naming a folder that is not a run; a compare model's model/ stands for its train/ run
    summaries = [summarize_run(_compare_run(Path(r)) or r) for r in args.runs]
    columns, notes = extra_columns(args, summaries)
    if any(s.final_lambda for s in summaries):  # DIFF runs: the λ each layer learned, at the last log record
        from ..training.summary import Column, lambda_text  # lazy: torch; --help stays fast

        columns = [Column("final λ per layer", lambda s: lambda_text(s.final_lambda), "<"), *columns]
    print(format_table(summaries))
    print(f"({LEGEND})")
    if columns:  # a table of their own, so that no row is much wider than 100 characters
        print()
        print(format_table(summaries, columns=DEFAULT_COLUMNS[:1], extra=columns))
    for note in notes:
        print(note)
    for note in comparability_notes(summaries):
        print(f"note: {note}")
    if args.plot:  # without matplotlib: a ModuleNotFoundError, which the boundary (difftx.cli.main) reports
        print(f"wrote {plot_runs(summaries, args.plot)}")
    return 0


def extra_columns(args: argparse.Namespace, summaries: list) -> tuple[list, list[str]]:
    """Columns measured beyond what the run folders record, appended to the table: with
    ``--nll``, the held-out NLL of each run's latest checkpoint (the ``lm`` task of
    ``difftx.tasks``, as ``difftx eval lm`` computes it) with its 95% interval, and every run's
    paired difference from the first, window by window on the same text. The intervals are over
    blocks of windows (``difftx.tasks.lm.nll_interval``, ``difftx.eval.blocks``).
    Returns the columns and the lines that explain them."""
    if not args.nll:
        if args.data or args.windows is not None:
            raise ValueError("--data and --windows apply with --nll")
        return [], []
    from ..tasks.runner import evaluate_checkpoint  # lazy: --help stays fast
    from ..training.summary import Column  # lazy: torch; --help stays fast

    if args.windows is not None and args.windows < 0:
        raise ValueError(f"--windows: must be >= 0, got {args.windows}")
    settings = LMSettings(windows=args.windows, extrapolation_factors=(1,))
    # a compare model's run folder keeps no checkpoint once trained: its model/ is scored
    results = {s.path: evaluate_checkpoint("lm", s.path if s.checkpoint else _compare_model(s.path) or s.path,
                                           settings=settings, data=args.data, progress=False) for s in summaries}
    notes = [f"held-out NLL of {s.path}: {scored_tokens(results[s.path])} of {results[s.path]['source']}"
             for s in summaries]
    abouts = {interval_about(r, nll_interval(r)) for r in results.values()}
    notes += [textwrap.fill(f"- the NLL interval: {a}", 100, subsequent_indent="  ") for a in sorted(abouts)]
    first = summaries[0].path
    paired = {s.path: paired_nll(results[s.path], results[first]) for s in summaries[1:]}
    if paired:
        notes.append(f"- first run: each run's NLL minus {first}'s, window by window on the same text, with the same\n"
                     "  units (text noise only: one trained model per run, so seed noise is not in it)")
    if any(isinstance(p, str) for p in paired.values()):
        notes.append("not paired: the runs were scored on different held-out texts (their own validation splits);\n"
                     "  pass --data FILE to score every run on one text")

    def cell(s) -> str:
        return _with_interval(results[s.path]["heldout"]["nll"], *_window_interval(results[s.path]), "{:.4f}")

    def vs_first(s) -> str:
        if s.path == first:
            return "(reference)"
        p = paired[s.path]
        return p if isinstance(p, str) else _with_interval(*p, "{:+.4f}")

    return [Column("held-out NLL [95% CI]", cell), Column("- first run [95% CI]", vs_first)], notes


def _compare_run(path) -> "Path | None":
    """The ``train/`` run folder of the compare model whose ``model/`` folder is ``path`` (else None)."""
    folder = path.parent
    return folder / "train" if path.name == "model" and (folder / TRAIN_RECORD).is_file() and \
        (folder / "train").is_dir() else None


def _compare_model(run) -> "Path | None":
    """The ``model/`` folder of the compare model whose ``train/`` run folder is ``run`` (else None)."""
    folder = run.parent
    return folder / "model" if (folder / TRAIN_RECORD).is_file() and (folder / "model").is_dir() else None


def _window_interval(res: dict) -> tuple:
    """The interval of a run's NLL (``difftx.tasks.lm.nll_interval``), as offsets from its mean."""
    ci = nll_interval(res)
    return (None, None) if ci.low is None else (ci.low - ci.mean, ci.high - ci.mean)


def _with_interval(value: float, lo, hi, fmt: str) -> str:
    if lo is None:
        return fmt.format(value)
    return f"{fmt.format(value)} [{fmt.format(value + lo)}, {fmt.format(value + hi)}]"


def paired_nll(res: dict, ref: dict):
    """``(mean, low offset, high offset)`` of ``res`` minus ``ref`` over the same windows
    (token-weighted mean; interval over blocks of windows: ``difftx.tasks.lm.nll_interval``), or
    why they cannot be paired."""
    tokens = res["records"]["window_tokens"]
    if res.get("text_id") != ref.get("text_id") or tokens != ref["records"]["window_tokens"]:
        return "not paired: other text"
    ci = nll_interval(res, ref)
    return (ci.mean, None, None) if ci.low is None else (ci.mean, ci.low - ci.mean, ci.high - ci.mean)


# -- difftx runs --pool: one metric pooled across compare folders (difftx.eval.pool) --

# what the folders record that --by can group on (each folder's value: :func:`_provenance`)
POOL_FIELDS = ("init", "lambda_schedule", "lambda_init", "n_layers", "dim", "parameters", "text", "tokenizer", "preset",
               "machine")


def run_pool(args: argparse.Namespace) -> int:
    """``difftx runs --pool``: the table (per folder, then the pooled estimate), the refused folders, and with
    ``--json`` / ``--plot`` the analysis as JSON and the forest plot."""
    if args.nll or args.data or args.windows is not None:
        raise ValueError("--nll, --data and --windows do not apply with --pool")
    args.plot = plot_file(args.plot)
    for flag in ("--plot", "--json"):
        out = getattr(args, flag[2:])
        check_output_file(out, flag)
        check_not_owned(out, flag)
        check_not_input(out, flag, {"the compare folder": list(args.runs)}, folder=False)
    if args.plot and args.json and Path(args.plot).resolve() == Path(args.json).resolve():
        raise ValueError("--plot and --json: the same file")
    check_plot_format(args.plot, "--plot")
    analysis = pool_folders(args.runs, metric=args.metric, pair=args.pair, by=args.by, method=args.tau_method or "pm",
                            floor=args.hksj != "plain")
    print(format_pool(analysis))
    if args.json:
        from ..io import atomic_write, dumps_strict

        text = dumps_strict(analysis, indent=1) + "\n"
        atomic_write(args.json, lambda p: Path(p).write_text(text))
        print(f"wrote {args.json}")
    if args.plot:
        from ..eval.pool_plot import plot_forest

        print(f"wrote {plot_forest(analysis, args.plot, lambda r: provenance_text(r['provenance']))}")
    return 0


def pool_folders(folders: list, metric: "str | None" = None, pair: "str | None" = None, by: "str | None" = None,
                 method: str = "pm", floor: bool = True) -> dict:
    """Pool ``metric`` of ``pair`` (defaults: the first readable folder's primary pair and its first primary
    metric) across compare ``folders``: ``{"metric", "label", "unit", "lower_is_better", "pair", "names",
    "tokenizer", "first", "folders": [per folder: path, estimate, se, seeds, weight, provenance, note],
    "refused": [{"path", "why"}], "pooled": Pooled.to_dict(), "by", "subgroups"}``. ``by``: a field of
    :data:`POOL_FIELDS` or ``preset.NAME``; each of its values pooled on its own, and the difference between them
    tested (:func:`difftx.eval.pool.subgroup_test`). A folder that cannot be compared with the first (another unit
    or direction, no such pair or metric, fewer than 2 seeds, a metric in nats of another tokenizer, a machine
    measurement not compared there, the same folder twice) or cannot be read is refused with why; ValueError when
    the metric or pair is unknown in the first, or when no folder is left."""
    from ..compare.schema import read_results
    from ..eval.pool import pool, study_estimate, subgroup_test

    if by is not None and by not in POOL_FIELDS and not (by.startswith("preset.") and len(by) > 7):
        raise ValueError(f"--by: one of {', '.join(POOL_FIELDS)} or preset.NAME, got {by!r}")
    refused, rows, seen = [], [], {}
    ref = None
    for folder in folders:
        path = Path(folder)
        file = path if path.is_file() else path / "results.json"
        key = str(file.resolve())
        if key in seen:
            refused.append({"path": str(folder), "why": f"the same results as {seen[key]}: counted once"})
            continue
        if not file.is_file():
            refused.append({"path": str(folder), "why": f"no results.json ({file}): not a finished compare folder"})
            continue
        try:
            result = read_results(file)
        except ValueError as e:
            refused.append({"path": str(folder), "why": str(e)})
            continue
        seen[key] = str(folder)
        if ref is None:
            ref = _reference(result, metric, pair, folder)
        row = _pool_row(result, ref, folder)
        if isinstance(row, str):
            refused.append({"path": str(folder), "why": row})
            continue
        if by is not None and by.startswith("preset."):
            name = by[len("preset."):]  # a preset field, or a model field (preset.dim, preset.model.lambda_init)
            row["provenance"][by] = result.preset.get(name, result.preset["model"].get(name.removeprefix("model."),
                                                                                       "-"))
        try:
            row["estimate"], row["se"], row["seeds"] = study_estimate(row.pop("differences"))
        except ValueError as e:
            refused.append({"path": str(folder), "why": str(e).replace("differences: ", "")})
            continue
        if not row["se"] > 0:
            refused.append({"path": str(folder), "why": f"its {row['seeds']} seeds' differences are all equal (SE 0): "
                                                        "no weight can be given to it"})
            continue
        rows.append(row)
    if not rows:
        why = "; ".join(f"{r['path']}: {r['why']}" for r in refused)
        what = "" if ref is None else f" {ref['metric']} of {ref['pair']}" + (
            " (the first folder's first primary metric; --metric KEY pools another)" if metric is None else "")
        raise ValueError(f"--pool: no folder left to pool{what} ({why})")
    pooled = pool([r["estimate"] for r in rows], [r["se"] for r in rows], method, floor=floor)
    for r, w in zip(rows, pooled.weights):
        r["weight"] = w
    keys = ("metric", "label", "unit", "lower_is_better", "pair", "names", "digits", "tokenizer")
    out = {**{k: ref[k] for k in keys},
           "first": ref["folder"],
           "folders": rows, "refused": refused, "pooled": pooled.to_dict(), "by": by, "subgroups": None}
    if by is not None:
        groups: dict = {}
        for r in rows:
            groups.setdefault(str(r["provenance"][by]), []).append(r)
        fits = {g: pool([r["estimate"] for r in rs], [r["se"] for r in rs], method, floor=floor)
                for g, rs in groups.items()}
        out["subgroups"] = {"groups": {g: {**f.to_dict(), "folders": [r["path"] for r in groups[g]]}
                                       for g, f in fits.items()}, "test": subgroup_test(fits)}
    return out


def _reference(result, metric, pair, folder) -> dict:
    """What every folder is compared with: the pair, the metric and its unit and direction, from the first folder
    read (a ValueError listing the choices when ``metric`` or ``pair`` is not in it)."""
    key = pair or result.primary.key
    comp = result.comparisons.get(key)
    if comp is None:
        raise ValueError(f"--pair: {key!r} is not a pair of {folder} (its pairs: "
                         f"{', '.join(repr(k) for k in result.comparisons)})")
    if metric is None:
        metric = next((k for k, c in comp.metrics.items() if c.get("primary")), None)
        if metric is None:
            raise ValueError(f"--metric: the pair {key!r} of {folder} has no primary metric; choose one of "
                             f"{', '.join(comp.metrics)}")
    if metric not in comp.metrics:
        raise ValueError(f"--metric: {metric!r} is not a metric of the pair {key!r} in {folder} (its metrics: "
                         f"{', '.join(comp.metrics)})")
    c = comp.metrics[metric]
    return {"metric": metric, "label": c.get("label", metric), "unit": c.get("unit", ""),
            "lower_is_better": bool(c.get("lower_is_better")), "pair": key, "digits": c.get("digits"),
            "names": [result.label(a) for a in comp.arms], "tokenizer": _tokenizer(result), "folder": str(folder)}


def _tokenizer(result) -> str:
    text = result.get("text")
    return (text or {}).get("tokenizer") or "the bundled corpus's"


def _pool_row(result, ref: dict, folder) -> "dict | str":
    """One folder's row (its per-seed differences, still to be summarised), or why it is refused."""
    from ..compare.summary import DIFFERENT_RUNS, NOT_MEASURED, ONE_PER_STACK

    comp = result.comparisons.get(ref["pair"])
    if comp is None:
        return f"no pair {ref['pair']!r} (its pairs: {', '.join(repr(k) for k in result.comparisons)})"
    c = comp.metrics.get(ref["metric"])
    if c is None:
        return f"no metric {ref['metric']!r} in its pair {ref['pair']!r}"
    unit, lower = c.get("unit", ""), bool(c.get("lower_is_better"))
    if (unit, lower) != (ref["unit"], ref["lower_is_better"]):
        def said(u, lo):
            return f"unit {u or 'none'!r}, {'lower' if lo else 'higher'} is better"
        return f"{ref['metric']} in {said(unit, lower)}, the first folder's ({ref['folder']}) in " \
               f"{said(ref['unit'], ref['lower_is_better'])}"
    if unit == "nats" and _tokenizer(result) != ref["tokenizer"]:
        return (f"{ref['metric']} is in nats per token of its tokenizer ({_tokenizer(result)}), the first folder's "
                f"of another ({ref['tokenizer']}): not comparable (lm_bpb is)")
    gated = c.get("gated") or ""
    if gated.startswith((NOT_MEASURED, DIFFERENT_RUNS, ONE_PER_STACK)):
        return f"{ref['metric']} not compared there: {gated}"
    a, b = comp.arms
    va, vb = (c.get("values") or {}).get(a), (c.get("values") or {}).get(b)
    if not va or not vb or len(va) != len(vb) or any(x is None for x in list(va) + list(vb)):
        return f"{ref['metric']} has no value for every seed of {a} and {b}"
    if len(va) < 2:
        return f"{len(va)} seed: no standard error over seeds (it needs at least 2)"
    return {"path": str(folder), "differences": [x - y for x, y in zip(va, vb)], "provenance": _provenance(result, a),
            "note": gated or None}


def _provenance(result, arm: str) -> dict:
    """Where a folder's comparison comes from: the fields of :data:`POOL_FIELDS` and its size, commit and
    preset."""
    cfg = result.arms[arm].config if arm in result.arms else {}
    regimes = result.get("regime") or {}
    reg = regimes.get(arm) or next(iter(regimes.values()), None) or {}
    text = result.get("text")
    machine = result.get("machine") or {}
    cuda = machine.get("cuda") or {}
    looks = result.looks or []
    lam = reg.get("lambda_init_mean")
    return {
        "init": reg.get("init") or cfg.get("init") or result.preset["model"].get("init") or "-",
        "lambda_schedule": reg.get("lambda_schedule") or "-",
        "lambda_init": "-" if lam is None else round(float(lam), 2),
        "n_layers": cfg.get("n_layers", result.preset["model"].get("n_layers")),
        "dim": cfg.get("dim", result.preset["model"].get("dim")),
        "text": Path(str(text["source"])).name if text and text.get("source") else "bundled",
        "tokenizer": _tokenizer(result),
        "preset": result.preset.get("name") or "-",
        "machine": cuda.get("device") or " ".join(str(machine[k]) for k in ("cpu", "cpu_capability")
                                                   if machine.get(k)) or "not recorded",
        "parameters": result.arms[arm].parameters if arm in result.arms else None,
        "commit": (looks[-1].get("commit") or "")[:7] if looks else "",
    }


def provenance_text(p: dict) -> str:
    """A folder's provenance in a few words: text, size, machine, commit, regime."""
    size = f"{p['parameters'] / 1e3:,.0f}k params" if p.get("parameters") else "size ?"
    lam = "" if p["lambda_schedule"] == "-" else f", λ {p['lambda_schedule']}"
    return (f"{p['text']}, {size} d{p['dim']} L{p['n_layers']}, {p['machine']}, {p['commit'] or 'no commit'}, "
            f"init {p['init']}{lam}")


def _num(x, d: int, sign: bool = True) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:+.{d}f}" if sign else f"{x:.{d}f}"


def format_pool(a: dict) -> str:
    """The printed table of :func:`pool_folders`: one row per folder, then the pooled estimate, tau, I^2 and the
    prediction interval, the subgroups and the refused folders."""
    d = max(int(3 if a.get("digits") is None else a["digits"]), 3)
    unit = f" {a['unit']}" if a["unit"] else ""
    better = "lower" if a["lower_is_better"] else "higher"
    k = len(a["folders"])
    lines = [f"{a['label']} ({a['metric']}{',' + unit if unit else ''}, {better} is better): "
             f"{a['names'][0]} - {a['names'][1]} (pair {a['pair']!r}), pooled over {k} compare folder"
             f"{'s' if k != 1 else ''}", ""]
    rows = [[r["path"], _num(r["estimate"], d), _num(r["se"], d, False), str(r["seeds"]), f"{100 * r['weight']:.1f}%",
             provenance_text(r["provenance"]) + (f" ({r['note'].split(':')[0]})" if r.get("note") else "")]
            for r in a["folders"]]
    lines += _aligned(rows, ["folder", "estimate", "SE", "seeds", "weight", "text, size, machine, commit, regime"])
    lines.append("")
    lines += _pooled_lines(a["pooled"], d, unit)
    if a["pooled"]["k"] > 1:
        lines.append(f"(each folder's SE is taken as exact; from {min(r['seeds'] for r in a['folders'])} seeds it is "
                     "not, and tau's interval and I^2 read its noise as spread between folders: "
                     "benchmarks/pool_coverage.py measures it)")
    two = [r["path"] for r in a["folders"] if r["seeds"] == 2]
    if two:
        lines.append(f"(2 seeds in {', '.join(two)}: an SE on 1 degree of freedom, below the 3-14 seeds per folder "
                     "whose coverage benchmarks/pool_coverage.py checks)")
    if a.get("subgroups"):
        s = a["subgroups"]
        lines += ["", f"by {a['by']}:"]
        for g, p in s["groups"].items():
            lines += [f"  {a['by']} = {g} ({p['k']} folder{'s' if p['k'] != 1 else ''}):"]
            lines += ["    " + x for x in _pooled_lines(p, d, unit)]
        t = s["test"]
        if t["q_between"] is None:
            lines.append(f"  difference between subgroups: {t['note']}")
        else:
            lines.append(f"  difference between subgroups: Q_between {t['q_between']:.2f} on {t['df']} df, "
                         f"p {t['p']:.3g} ({t['note']})")
    if a["refused"]:
        lines += ["", "refused:"] + [f"  {r['path']}: {r['why']}" for r in a["refused"]]
    return "\n".join(lines)


def _aligned(rows: list, header: list) -> list[str]:
    """Rows of text as columns: the first and last left-aligned, the numbers between right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r):
        return "  ".join(c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [line(header), "  ".join("-" * w for w in widths), *map(line, rows)]


def _pooled_lines(p: dict, d: int, unit: str) -> list[str]:
    if p["k"] == 1:
        return [f"pooled: {_num(p['mean'], d)}{unit} (SE {_num(p['se'], d, False)}): " + "; ".join(p["notes"])]
    pct = f"{100 * p['confidence']:g}%"
    out = [f"pooled ({p['interval']}; tau^2 {p['tau2_method']}): {_num(p['mean'], d)}{unit} "
           f"[{pct}: {_num(p['low'], d)}, {_num(p['high'], d)}] (SE {_num(p['se'], d, False)}, t on {p['df']} df)",
           f"tau (between-comparison SD) {_num(p['tau'], d, False)}{unit} [Q-profile {pct}: "
           f"{_num(p['tau_low'], d, False)}, {_num(p['tau_high'], d, False)}]; I^2 {100 * p['i2']:.0f}%; "
           f"Cochran's Q {p['q']:.2f} on {p['df']} df (p {p['q_p']:.3g})"]
    if p["pi_low"] is None:
        out.append("prediction interval for a new comparison: none (" + "; ".join(p["notes"]) + ")")
    else:
        out.append(f"prediction interval for a new comparison: [{_num(p['pi_low'], d)}, {_num(p['pi_high'], d)}]"
                   f"{unit} ({pct}, over {p['prediction']}; plug-in t on {p['prediction_plugin_df']} df: "
                   f"[{_num(p['pi_plugin_low'], d)}, {_num(p['pi_plugin_high'], d)}])")
    return out
