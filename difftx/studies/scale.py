"""``difftx scale``: the comparison at several model sizes, and the parameter efficiency the paper's
Fig. 3a reports (how large a baseline matches each DIFF size).

``run_scale("scale-cpu", out="runs/scale")`` (a scale preset: its sizes, seeds and settings), or
``run_scale("cpu", ["xs", "s", "m", "l"], seeds=3, out="runs/scale")`` (a compare preset at the
sizes given), runs a whole ``run_compare`` per size into ``out/size=NAME`` (each reused when
present and resumable), then fits the held-out LM loss against the non-embedding parameters as
``L = E + A N^-b`` (each arm its own floor ``E`` from 4 sizes on, one shared with 3), beside the paper's
straight line ``log L = a + b log N``, with the straight line's lack of fit
(:mod:`difftx.eval.floor_fit`), and writes ``scale.json``,
``scale.md`` and ``scale.png``. Beside each ratio: the gap in nats (the size's paired held-out NLL
difference), the fit's local slope and how far 0.01 nats moves the ratio there (:func:`sensitivity`),
and each size's DIFF regime against the paper's recipe (:mod:`difftx.compare.regime`), and the gap
along training per size. Sizes are named model shapes (:data:`SHAPES`: scaled copies, or
``DIMxLAYERSxHEADS``); the baseline is matched at each size as in every compare, and
``diff_lambda_0.8`` trains beside DIFF unless ``lambda_arm=False``. The token budget is the
preset's, the same for every size, or proportional to the parameters with ``tokens_per_param``.
With ``tune``, every size is a tuned comparison (:mod:`difftx.studies.tune`).

On a cluster, ``shard=(K, N)`` spreads every (size, seed, arm) model over N invocations (see
:func:`difftx.compare.run.run_compare`); one more run without ``shard`` assembles.

A comparison that trains associative recall without LM batches (``recall-scale-cpu``, or ``recall-cpu`` at the
sizes given) has no loss to fit: its sizes are a map of depth and width, in any order (no rule that parameters
grow), and ``scale.json`` / ``scale.md`` / ``scale.png`` give per size and arm the recall frontier, the step recall
was learned and the last layer's attention on the binding, each against the baseline as the size's compare
compared it (:mod:`difftx.studies.scale_recall`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..io import atomic_write, dumps_strict, own_folder
from ..provenance import machine
from ..compare.arms import LABELS, PRIMARY
from ..compare.presets import ComparePreset, get_preset
from ..compare.regime import regime_table
from ..compare.report import gap_text
from ..compare.schema import SCALE_SCHEMA, SCALE_VERSION, CompareResult
from .scale_recall import against_reference, primary_pair
from .tune_report import label, shown

# 2: the floor fit; the line under "loglog". 3: "kind" ("lm": the fit; "recall": the recall map, under "recall")

# named model shapes (dim, layers, DIFF heads), scaled copies: every width a multiple of 24, so the default
# feed-forward width (8/3 of it, rounded up to a multiple of 64) is exactly 8/3 of it; DIFF heads of width 24
# (two components of 12) on the CPU sizes and 128 (two of 64, the paper's) on the GPU ones; depth grows with
# width. The baseline has twice the heads, of the component width.
SHAPES: dict[str, tuple[int, int, int]] = {
    "xs": (24, 2, 1), "s": (48, 2, 2), "m": (48, 3, 2), "l": (72, 3, 3), "xl": (72, 4, 3), "xxl": (96, 4, 4),
    "10m": (384, 6, 3), "40m": (768, 6, 6), "85m": (768, 12, 6), "290m": (1152, 18, 9), "680m": (1536, 24, 12),
}
PAPER = ("the paper (Fig. 3a; 830M-13.1B parameters, the same tokens): a 6.8B DIFF matches an 11B Transformer "
         "(62.2%), a 7.8B DIFF a 13.1B one (59.5%)")


@dataclass(frozen=True)
class ScalePreset:
    """Sizes, seeds and the compare preset (with overrides) of a named scale sweep."""

    name: str
    description: str
    compare: str
    sizes: tuple
    seeds: int
    overrides: dict = field(default_factory=dict)
    tokens_per_param: Optional[float] = None


LM_ONLY = {"lm_every": 1, "icl_every": 0, "probe_every": 0}
SCALE_PRESETS: dict[str, ScalePreset] = {
    "scale-cpu": ScalePreset(
        "scale-cpu", "5 sizes as scaled copies (width 24 to 72, 2 to 4 layers, feed-forward 8/3 of the width) over "
        "18x in non-embedding parameters, LM on the bundled Shakespeare bytes, 3 seeds, DIFF, DIFF with "
        "lambda_init 0.8 and the baseline", "cpu",
        ("xs", "s", "m", "l", "xl"), 3,
        {**LM_ONLY, "steps": 2000, "warmup_steps": 100, "curve_points": 8}),
    "scale-gpu": ScalePreset(
        "scale-gpu", "5 sizes as scaled copies from about 10M to 680M non-embedding parameters, 6 to 24 layers, "
        "DIFF heads of width 128, for one GPU (untested: written for users with hardware, never run here)",
        "gpu-small", ("10m", "40m", "85m", "290m", "680m"), 3,
        {**LM_ONLY, "steps": 5000, "curve_points": 10}),
    # a depth/width map of recall, not a loss fit: width 64 at 2, 4 and 8 layers, and width 128 at 2 layers with 4
    # DIFF heads, so every size's heads have the same width (16: dim / (2 x DIFF heads))
    "recall-scale-cpu": ScalePreset(
        "recall-scale-cpu", "associative recall alone (the recall-cpu preset) at width 64 with 2, 4 and 8 layers "
        "and at width 128 with 2 layers (4 DIFF heads: every head of width 16), 7 seeds, the baseline, DIFF and DIFF "
        "with lambda_init 0.8; a map of depth and width (the frontier, the step recall was learned and the "
        "attention on the binding per size), not a loss fit", "recall-cpu",
        ("64x2x2", "64x4x2", "64x8x2", "128x2x4"), 7),
}
LAMBDA_ARM = "diff_lambda_0.8"  # scale's default extra arm: DIFF with the paper's deep-layer lambda_init at every layer


def shape(name: str) -> tuple[int, int, int]:
    """``"m"`` or ``"48x3x2"`` -> ``(dim, layers, heads)``."""
    if name in SHAPES:
        return SHAPES[name]
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", name.strip())
    if not m:
        raise ValueError(f"--sizes: unknown size {name!r}; name one of {sorted(SHAPES)} or give DIMxLAYERSxHEADS "
                         "(e.g. 64x3x2)")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def recall_without_lm(preset: ComparePreset) -> bool:
    """Whether ``preset`` trains associative recall and no LM batches: ``difftx scale`` then maps the recall
    readings over the sizes instead of fitting a loss (:mod:`difftx.studies.scale_recall`)."""
    shares = preset.resolve().mixture.shares()
    return shares["lm"] == 0 and shares["recall"] > 0


@dataclass
class SizePlan:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    preset: ComparePreset
    params: dict  # {arm: non-embedding parameters}
    regime: dict = field(default_factory=dict)  # {DIFF arm: its regime against the paper's recipe}


def plan_sizes(preset: str | ComparePreset, sizes: Sequence[str], *, tokens_per_param: Optional[float] = None,
               **overrides) -> list[SizePlan]:
    """Every size's preset, validated before anything is trained: at least 2 sizes, named once,
    heads that divide each width, and non-embedding parameters that increase with the order given;
    with each DIFF arm's regime (:mod:`difftx.compare.regime`) at the size's token budget. A preset
    that trains recall without LM batches (:func:`recall_without_lm`) fits no loss: its sizes are a
    map of depth and width, taken in any order, and ``tokens_per_param`` (LM tokens) does not apply."""
    from ..compare.regime import non_embedding_parameters, regimes
    from ..compare.jobs import check_fits
    from ..compare.train import lm_tokens

    if len(sizes) < 2:
        raise ValueError(f"--sizes: a scale sweep needs at least 2 sizes, got {list(sizes)}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"--sizes: each size once, got {list(sizes)}")
    if tokens_per_param is not None and not (isinstance(tokens_per_param, (int, float)) and tokens_per_param > 0):
        raise ValueError(f"--tokens-per-param: must be a positive number, got {tokens_per_param!r}")
    shaped = sorted({*overrides, *overrides.get("model", {})} & {"dim", "n_layers", "n_heads"})
    if shaped:
        raise ValueError(f"--set {shaped[0]}: each size sets the width, depth and heads (--sizes DIMxLAYERSxHEADS)")
    base = get_preset(preset, **overrides) if isinstance(preset, str) else preset.with_overrides(**overrides)
    recall = recall_without_lm(base)
    if recall and tokens_per_param is not None:
        raise ValueError("--tokens-per-param: counts LM tokens, and this comparison trains recall without LM batches "
                         "(give the steps with --set steps=N)")
    out: list[SizePlan] = []
    ref = base.primary[1]  # the arm the others are measured against: its parameters give the budget and the order
    for name in sizes:
        dim, layers, heads = shape(name)
        try:
            p = base.with_overrides(dim=dim, n_layers=layers, n_heads=heads,
                                    description=f"size {name} of a scale sweep: dim {dim}, {layers} layers, {heads} "
                                                f"DIFF heads; the {base.name} preset's other settings")
            plan = p.resolve()
            check_fits(plan)  # every size before the first trains
        except ValueError as e:
            raise ValueError(f"size {name} ({dim}x{layers}x{heads}): {e}") from None
        params = {arm: non_embedding_parameters(cfg) for arm, cfg in plan.arms.items()}
        if tokens_per_param is not None:
            per_step = p.batch_size * p.lm_seq_len
            steps = max(1, math.ceil(tokens_per_param * params[ref] / per_step))
            p = p.with_overrides(steps=steps, warmup_steps=min(p.warmup_steps, max(steps // 20, 1)))
        out.append(SizePlan(name, dim, layers, heads, p, params, regimes(plan.arms, lm_tokens(plan.mixture, p.steps))))
    for a, b in zip(out, out[1:]):
        if not recall and b.params[ref] <= a.params[ref]:
            raise ValueError(f"--sizes: give them from small to large; {b.name} ({b.params[ref]:,} "
                             f"non-embedding parameters) is not larger than {a.name} ({a.params[ref]:,})")
    return out


def default_out(preset: str | ComparePreset) -> Path:
    """Where :func:`run_scale` writes when not told: ``runs/scale-PRESET``."""
    return Path(f"runs/scale-{preset if isinstance(preset, str) else preset.name}")


def run_scale(preset: str | ComparePreset = "scale-cpu", sizes: Optional[Sequence[str]] = None,
              seeds: int | Sequence[int] | None = None, out: str | os.PathLike | None = None, *,
              tokens_per_param: Optional[float] = None, progress: bool = True, workers: Optional[int] = None,
              shard: Optional[tuple[int, int]] = None, lambda_arm: bool = True, tune: Optional[tuple] = None,
              **overrides) -> dict:
    """The comparison at every size, then the efficiency fit (see the module doc). With ``shard``,
    only this invocation's share of the models is trained, and nothing is assembled. ``lambda_arm``
    adds the arm :data:`LAMBDA_ARM` (DIFF with a constant ``lambda_init = 0.8``) beside DIFF, so the
    report separates differential attention from the depth schedule of ``lambda_init`` at shallow depth.
    ``tune`` (``(field, values)``): every size is a tuned comparison (:mod:`difftx.studies.tune`), and
    ``scale.json`` / ``scale.md`` open with the tuned gaps and ratios (``tuned``) beside those at the
    preset's value, both on the held-out half the tuning did not read.

    ``preset`` is a scale preset (:data:`SCALE_PRESETS`: its compare preset, sizes, seeds, field
    overrides and ``tokens_per_param`` are the defaults; ``overrides`` go on top of its own) or a
    compare preset (a name or a :class:`ComparePreset`; then ``sizes`` is needed, and ``seeds``
    defaults to 3). ``out`` defaults to :func:`default_out`.

    A preset that trains recall without LM batches (:func:`recall_without_lm`, e.g. ``recall-scale-cpu``)
    fits nothing: the sizes are a map of depth and width, and the summary is the recall readings per size
    and arm (:func:`difftx.studies.scale_recall.recall_summary`); ``tune`` is refused there."""
    from ..compare.folder import check_study_folder
    from ..compare.run import run_compare
    from ..compare.workers import refuse_in_worker_start
    from .tune import run_tuned

    refuse_in_worker_start("run_scale")
    scale = SCALE_PRESETS.get(preset) if isinstance(preset, str) else None
    if scale is None and isinstance(preset, str):
        from ..compare.presets import PRESETS

        if preset not in PRESETS:
            raise ValueError(f"--preset {preset!r}: unknown; choose a scale preset {sorted(SCALE_PRESETS)} or a "
                             f"compare preset {sorted(PRESETS)} (with --sizes)")
    if sizes is None:
        if scale is None:
            name = preset if isinstance(preset, str) else preset.name
            raise ValueError(f"--sizes: needed with the compare preset {name!r} (e.g. --sizes xs,s,m,l)")
        sizes = list(scale.sizes)
    if seeds is None:
        seeds = scale.seeds if scale else 3
    if tokens_per_param is None and scale is not None:
        tokens_per_param = scale.tokens_per_param
    out = Path(out) if out is not None else default_out(preset)
    check_study_folder(out, "--out", "scale.json", "a scale study",
                       lambda e: e.name.startswith("size=") or e.name in ("scale.md", "scale.png"))
    if scale is not None:
        preset, overrides = scale.compare, {**scale.overrides, **overrides}
    if lambda_arm:
        arms = tuple(overrides.get("arms") or dict.fromkeys([  # the preset's, and arms of your own given here
            *(get_preset(preset) if isinstance(preset, str) else preset).arms, *overrides.get("own_arms", {})]))
        if LAMBDA_ARM not in arms:
            overrides = {**overrides, "arms": (*arms, LAMBDA_ARM)}
    plans = plan_sizes(preset, sizes, tokens_per_param=tokens_per_param, **overrides)
    recall = recall_without_lm(plans[0].preset)
    if recall and tune is not None:
        raise ValueError("--tune: a recall scale (recall without LM batches) has no tuned summary; tune one size with "
                         "`difftx compare --tune`")
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if tune is not None:  # every size's grid checked before the first model trains
        from .tune import grid_points

        for sp in plans:
            grid_points(sp.preset, tune, seed_list, shard)
    results, tuned, offset = {}, {}, 0
    for sp in plans:
        where = own_folder(out / f"size={sp.name}")
        if tune is not None:
            res = run_tuned(sp.preset, seed_list, where, tune, progress=progress, workers=workers, shard=shard,
                            shard_offset=offset)
            offset += res["models"] if shard is not None else 0
            if shard is None:
                tuned[sp.name], res = res, res.result
        else:
            res = run_compare(sp.preset, seed_list, where, progress=progress, workers=workers, shard=shard,
                              shard_offset=offset)
            offset += len(seed_list) * len(sp.params)
        results[sp.name] = res
    if shard is not None:
        return {"shard": list(shard), "sizes": [sp.name for sp in plans]}
    if recall:
        from .scale_recall import plot_recall_scale, recall_summary, render_recall_scale

        summary = recall_summary(size_entries(plans), results, seed_list)
        summary["plot"] = plot_recall_scale(out / "scale.png", summary)
        summary["machine"] = machine(plans[0].preset.device)
        atomic_write(out / "scale.json", lambda p: Path(p).write_text(dumps_strict(summary, indent=1) + "\n"))
        atomic_write(out / "scale.md", lambda p: Path(p).write_text(render_recall_scale(summary)))
        return summary
    summary = summarise(plans, results, seed_list)
    if tune is not None:
        summary["tuned"] = tuned_summary(plans, tuned, seed_list)
    summary["plot"] = _plot(out / "scale.png", summary)
    summary["machine"] = machine(plans[0].preset.device)  # each size's results.json has its own and its models'
    atomic_write(out / "scale.json", lambda p: Path(p).write_text(dumps_strict(summary, indent=1) + "\n"))
    atomic_write(out / "scale.md", lambda p: Path(p).write_text(render_scale(summary)))
    return summary


def _heldout_nll(res: CompareResult, seed, arm: str) -> Optional[float]:
    task = res.run(seed, arm).tasks.get("lm", {})
    return None if "skipped" in task else task.get("heldout", {}).get("nll")


def heldout_gap(res: CompareResult, arm: str, seeds: list, reference: str) -> Optional[dict]:
    """The paired held-out NLL gap ``arm - reference`` of one size's compare (``reference``: the second arm of
    its primary pair, the baseline by default): the compare's own estimate
    (:func:`difftx.eval.stats.paired_estimate`, with the evaluation windows' noise) where it
    has one, else ``paired_estimate`` over the seeds' NLLs; ``values``: the seeds' differences.
    ``None`` when a model has no held-out NLL."""
    from ..eval.stats import paired_estimate

    a, b = ([_heldout_nll(res, s, x) for s in seeds] for x in (arm, reference))
    if None in a or None in b:
        return None
    pair = res.pair(arm, reference)
    comps = {} if pair is None else pair.metrics
    paired = comps["lm_nll"]["paired"] if "lm_nll" in comps else paired_estimate(a, b).to_dict()
    keys = ("mean", "low", "high", "p_value", "n", "n_examples", "method", "note", "interval_of", "median",
            "median_low", "median_high", "lower", "higher")
    return {**{k: paired[k] for k in keys if k in paired}, "values": [x - y for x, y in zip(a, b)]}


def sensitivity(eff: dict, i: int, arm_loss: float) -> dict:
    """How much the ratio of size ``i`` moves per 0.01 nats of the arm's loss, on the fit the ratio
    comes from, at the matching baseline size ``N_B`` (where the baseline curve is read): the floor
    fit's ``dL/dlog N = -b (L_B(N_B) - E)``, or the straight line's ``dL/dlog N = b L`` (its
    ``d log L / d log N = b``, the seeds' mean, times the arm's mean loss ``arm_loss``). A loss
    shifted by ``delta`` moves ``log N_B`` by ``delta / |dL/dlog N|``, so the ratio by the factor
    ``exp(0.01 / |dL/dlog N|)`` per 0.01 nats."""
    at = eff["matched_params"][i] or eff["params"][i]
    if eff["method"] == "floor":
        A, b = eff["fit"]["reference"]
        slope = -b * A * at ** -b
    else:
        ref = eff["loglog"]["fits"]["reference"]
        slope = sum(f[1] for f in ref) / len(ref) * arm_loss
    factor = math.exp(min(0.01 / abs(slope), 700.0)) if slope else None
    return {"fit": eff["method"], "at_params": at, "dloss_dlog_params": slope, "factor_per_0.01_nats": factor}


def _first_regime(regime: dict, first: str) -> dict:
    """The regime of the primary pair's first arm, else of the first DIFF arm that has one (``{}``: none)."""
    return regime.get(first) or next(iter(regime.values()), {})


def size_entries(plans: list[SizePlan]) -> list[dict]:
    """``scale.json``'s ``sizes``: each size's shape, steps, non-embedding parameters per arm, DIFF head width
    (``head_width``, of the primary pair's first arm where it is a DIFF arm; ``None`` without a DIFF arm's regime)
    and each DIFF arm's regime."""
    return [{"name": sp.name, "dim": sp.dim, "n_layers": sp.n_layers, "n_heads": sp.n_heads,
             "head_width": _first_regime(sp.regime, sp.preset.primary[0]).get("head_width"), "steps": sp.preset.steps,
             "params": sp.params, "regime": sp.regime} for sp in plans]


def summarise(plans: list[SizePlan], results: dict, seeds: list) -> dict:
    """``scale.json``: the sizes (each with its DIFF arms' regime, :mod:`difftx.compare.regime`),
    every model's held-out NLL, each arm's paired gap to the reference (the primary pair's second arm, the
    baseline by default) per size (``gap``: every arm but the reference, the primary's first arm first, so
    :func:`primary_pair` reads the pair back), and its parameter efficiency against the reference with the
    ratio's sensitivity per size."""
    from ..eval.floor_fit import parameter_efficiency

    arms = list(plans[0].params)
    primary = plans[0].preset.primary
    ref = primary[1]
    losses = {arm: [[_heldout_nll(results[sp.name], s, arm) for sp in plans] for s in seeds] for arm in arms}
    missing = sorted({arm for arm in arms for row in losses[arm] for v in row if v is None})
    efficiency = {}
    gaps = {arm: [heldout_gap(results[sp.name], arm, seeds, ref) for sp in plans]
            for arm in against_reference(arms, primary)}
    for arm in gaps:
        if missing:
            efficiency[arm] = {"skipped": f"no held-out LM loss for {', '.join(missing)} (LM batches needed)"}
            continue
        eff = parameter_efficiency([sp.params[arm] for sp in plans], losses[arm],
                                   [sp.params[ref] for sp in plans], losses[ref]).to_dict()
        eff["sensitivity"] = [sensitivity(eff, i, sum(row[i] for row in losses[arm]) / len(seeds))
                              for i in range(len(plans))]
        efficiency[arm] = eff
    return {"schema": SCALE_SCHEMA, "schema_version": SCALE_VERSION, "kind": "lm", "seeds": seeds, "arms": arms,
            "sizes": size_entries(plans), "heldout_nll": losses, "gap": gaps, "efficiency": efficiency,
            "gap_along_training": {arm: [results[sp.name].token_efficiency.get(arm, {}).get("gap")
                                         for sp in plans] for arm in gaps},
            "paper": PAPER}


def tuned_summary(plans: list[SizePlan], results: dict[str, "Tuned"], seeds: list) -> dict:
    """``scale.json``'s ``tuned``: the tuning per size (field, values, choices, edges) and the held-out
    NLL, gaps and efficiency of the tuned comparison (``tuned``) and of the one at the preset's value
    (``shared``), both scored on the held-out half the tuning did not read. ``results``: each size's
    :class:`~difftx.studies.tune.Tuned`."""
    keys = ("heldout_nll", "gap", "efficiency")
    tunes = {sp.name: results[sp.name].result.get("tune") for sp in plans}
    first = tunes[plans[0].name]
    out = {"field": first["field"], "validation_source": first["validation_source"],
           "heldout_source": first["heldout_source"],
           "sizes": {sp.name: {k: tunes[sp.name][k] for k in ("shared_value", "grid", "extended",
                                                                         "at_edge", "best", "chosen")}
                     for sp in plans},
           **{which: {k: v for k, v in summarise(plans, {sp.name: getattr(results[sp.name], which)
                                                         for sp in plans}, seeds).items() if k in keys}
              for which in ("tuned", "shared")}}
    for arm, eff in out["tuned"]["efficiency"].items():
        if "ratios" in eff:
            widen_for_the_choice(eff, plans, [tunes[sp.name] for sp in plans], arm, len(seeds),
                                 reference=plans[0].preset.primary[1])
    return out


def widen_for_the_choice(eff: dict, plans: list[SizePlan], tunes: list[dict], arm: str, n: int,
                         confidence: float = 0.95, reference: str = PRIMARY[1]) -> None:
    """Make the tuned ratios' intervals allow for the choice: a jackknife over seeds of the whole
    procedure (each seed's value chosen again from the other remaining seeds at every size, then the
    fit), hulled with the fit's own interval, which treats the chosen models as given (its jackknife
    refits without a seed but keeps the choices that seed's losses made). Kept under ``selection``
    (per size: the log ratio's jackknife standard error and the interval); needs 3 seeds. ``reference``: the arm
    the ratio is against (the primary pair's second arm)."""
    from ..eval.floor_fit import parameter_efficiency
    from ..eval.stats import t_quantile
    from .tune import choose

    field = tunes[0]["field"]

    def losses(who: str, idx: list[int]) -> list[list[float]]:
        rows = [[0.0] * len(plans) for _ in idx]
        for z, t in enumerate(tunes):
            val = {v: [t["validation_nll"][who][label(field, v)][i] for i in idx] for v in t["grid"][who]}
            for k, (i, v) in enumerate(zip(idx, choose(val, len(idx)))):
                rows[k][z] = t["heldout_nll"][who][label(field, v)][i]
        return rows

    def log_ratios(idx: list[int]) -> list[Optional[float]]:
        got = parameter_efficiency([sp.params[arm] for sp in plans], losses(arm, idx),
                                   [sp.params[reference] for sp in plans], losses(reference, idx))
        return [None if r.value is None else math.log(r.value) for r in got.ratios]

    if n < 3 or any(None in row for t in tunes for who in (arm, reference)
                    for row in t["heldout_nll"][who].values()):
        eff["selection"] = {"note": "no jackknife of the choice: it needs 3 seeds and every model's held-out NLL"}
        return
    full = log_ratios(list(range(n)))
    jk = [log_ratios([i for i in range(n) if i != j]) for j in range(n)]
    sel = []
    for z, r in enumerate(eff["ratios"]):
        column = [row[z] for row in jk]
        if full[z] is None or None in column:
            sel.append(None)
            continue
        centre = sum(column) / n
        se = math.sqrt((n - 1) / n * sum((c - centre) ** 2 for c in column))
        half = t_quantile(0.5 + confidence / 2, n - 1) * se
        low, high = math.exp(full[z] - half), math.exp(full[z] + half)
        sel.append({"log_ratio_se": se, "low": low, "high": high})
        if r["low"] is not None:
            r["low"], r["high"] = min(r["low"], low), max(r["high"], high)
    eff["selection"] = sel


def render_tuned(s: dict) -> str:
    """``scale.md``'s first section: per size and arm, the chosen values and the gap and ratio, tuned
    and at the preset's value."""
    t = s["tuned"]
    field, ref = t["field"], primary_pair(s)[1]
    out = [f"## Tuned `{field}` (primary)\n",
           f"Every size is a tuned comparison: each arm trained at every value of `{field}`, each seed's value chosen "
           "per arm from the other seeds' validation loss (leave-one-seed-out; "
           f"{t['validation_source']}); gaps and ratios on the held-out text the choice never read "
           f"({t['heldout_source']}), tuned and at the preset's value. The tuned ratios' intervals allow for the "
           "choice (hulled with a jackknife over seeds that redoes every choice before the fit). The sections after "
           "this one are the preset's value on the usual held-out text.\n"]
    head = ["size", "arm", f"chosen `{field}` per seed (best of all seeds)", "gap at the preset's value, nats [95%]",
            "gap tuned, nats [95%]", "ratio at the preset's value [95%]", "ratio tuned [95%]"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, sz in enumerate(s["sizes"]):
        info = t["sizes"][sz["name"]]
        for arm in s["arms"]:
            picks = ", ".join(shown(v) for v in info["chosen"][arm].values())
            edge = info["at_edge"].get(arm)
            chosen = f"{picks} ({shown(info['best'][arm])}" + (f", at the {edge} edge" if edge else "") + ")"
            if arm == ref:
                rows.append(f"| {sz['name']} | {arm} | {chosen} | | | | |")
                continue
            gaps = [gap_text((t[w]["gap"].get(arm) or [None] * len(s["sizes"]))[i]) for w in ("shared", "tuned")]
            ratios = []
            for w in ("shared", "tuned"):
                eff = t[w]["efficiency"].get(arm, {})
                ratios.append("-" if "ratios" not in eff else _ratio(eff["ratios"][i]))
            rows.append(f"| {sz['name']} | {arm} | {chosen} | {gaps[0]} | {gaps[1]} | {ratios[0]} | {ratios[1]} |")
    out.append("\n".join(rows) + "\n")
    flagged = sorted({(name, arm) for name, info in t["sizes"].items() for arm, e in info["at_edge"].items() if e})
    if flagged:
        out.append("At the edge of the grid after the extensions (the best value may lie beyond): "
                   + ", ".join(f"{arm} at {name}" for name, arm in flagged) + ".\n")
    out.append("Validation loss against the value, per size: `size=NAME/plots/tune_" + field + ".png`.\n")
    return "\n".join(out)


def _ratio(r: dict) -> str:
    if r["value"] is None:
        return "-"

    def num(x: float) -> str:  # 3 decimals; a bound far out (few seeds) in 3 significant digits
        return f"{x:.3f}" if 1e-3 <= abs(x) < 1e3 else f"{x:.3g}"

    text = num(r["value"]) if r["low"] is None else f"{num(r['value'])} [{num(r['low'])}, {num(r['high'])}]"
    return text + (" (extrapolated)" if r.get("note", "") and "extrapolated" in r["note"] else "")


def _crossover_text(c: dict, what: str) -> str:
    if c["params"] is None:
        return f"Crossover of the {what}: none ({c['note']}).\n"
    if c["low"] is None or c["high"] is None:
        ci = "unbounded"
    else:
        ci = f"[{'< 1' if c['low'] < 1 else format(c['low'], '.3g')}, {c['high']:.3g}]"
    return (f"Crossover of the {what} (where they meet): N = {c['params']:.3g}, 95% interval {ci}"
            + (f"; {c['note']}" if c["note"] else "") + ".\n")


def _curvature_text(c: dict) -> str:
    from ..eval.stats import p_text

    if c["low"] is None:
        return f"{c['value']:+.4f} ({c['note']})"
    return f"{c['value']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}], p = {p_text(c['p'])}"


FLOOR_METHOD = ("Across the sizes, the seeds' mean held-out loss of both arms is fitted as L = E + A N^-b, with one "
                "floor E shared by the arms, as 3 sizes cannot place two (least squares; E between 0 and the lowest "
                "loss). For each DIFF size, "
                "the baseline size with the same fitted loss gives the ratio N_DIFF / N_baseline (< 1: DIFF needs "
                "fewer parameters). Its 95% interval leaves out one seed at a time (jackknife standard error, t "
                "with seeds - 1 degrees of freedom): it assumes independent seeds, curves of that form and one "
                "floor; where DIFF's floor differs, the ratio is biased (`docs/efficiency.md`). A "
                "ratio whose baseline size lies outside the measured sizes is extrapolated along the fitted curve. "
                "Beside it, the paper's fit: a straight line log L = a + b log N per arm and seed, with a t "
                "interval over seeds; it is biased when the loss flattens toward a floor, which the lack of fit "
                "below measures.")
FLOOR_METHOD_SEPARATE = (
    "Across the sizes, the seeds' mean held-out loss of each arm is fitted as L = E + A N^-b with its own floor E "
    "(least squares; E between 0 and that arm's lowest loss). For each DIFF size, the baseline size with the same "
    "fitted loss gives the ratio N_DIFF / N_baseline (< 1: DIFF needs fewer parameters); where DIFF's fitted loss "
    "lies below the baseline's floor, no baseline size reaches it and there is no ratio. Its 95% interval leaves "
    "out one seed at a time and refits both floors (jackknife standard error, t with seeds - 1 degrees of "
    "freedom), widened by the lack of fit where the seeds' means stray from the curve more than their scatter "
    "allows, and made to cover the refit without the smallest size where that moves it (the fit's note says when): "
    "it assumes independent seeds, whether the floors are equal or not. It does not hold where the baseline's loss "
    "alone carries a term that fades faster than N^-b: with 0.3 N_0 / N there, the interval at the largest size "
    "covered 0.86 of simulated sweeps at 12 seeds, 0.69 with DIFF's floor 0.05 lower (`docs/efficiency.md`). A ratio "
    "whose baseline size lies outside the measured sizes is extrapolated along "
    "the fitted curve. Beside it, the paper's fit: a straight line log L = a + b log N per arm and seed, with a t "
    "interval over seeds; it is biased when the loss flattens toward a floor, which the lack of fit below "
    "measures.")


FLOORS_NOT_A_FINDING = (
    "these floors are parameters of the fitted curves, not a finding, and their difference is not reported: "
    "{k} sizes cannot tell a lower floor from a term that fades faster than N^-b in one arm, which moves a fitted "
    "floor by about 0.1 nats while the jackknife over seeds sees only their noise (`docs/efficiency.md`); "
    "what is measured is the gap at the largest size, {name}: {gap} nats")


def _floor_fit_text(f: dict, arm: str, sizes: Optional[list] = None, gap: Optional[dict] = None,
                    ref: str = PRIMARY[1]) -> str:
    """The floor fit's line in ``scale.md``: which floor model, each floor (with two, why their difference
    is not a finding, and the gap measured at the largest size of ``sizes``, ``gap``, in its place), the
    exponents and the fit's notes; ``ref``: the arm ``arm`` is measured against."""

    def without(r: Optional[list]) -> str:
        return f" ({r[0]:.4f} to {r[1]:.4f} with one seed left out)" if r else ""

    if f.get("model", "shared") == "separate":
        floors, loo = f["floors"], f.get("floors_without_one_seed") or {}
        name = sizes[-1]["name"] if sizes else "the largest size"
        head = (f"Floor fit, each arm its own floor: E = {floors['reference']:.4f} for the {ref}"
                f"{without(loo.get('reference'))}, {floors['arm']:.4f} for {arm}{without(loo.get('arm'))}; "
                + FLOORS_NOT_A_FINDING.format(k=len(sizes) if sizes else "a few", name=name, gap=gap_text(gap)))
    else:
        head = (f"Floor fit: E = {f['floor']:.4f} shared by both arms{without(f['floor_without_one_seed'])} "
                f"(fewer than 4 sizes: the floor difference is assumed 0, not measured)")
    return (head + f"; exponent b: {ref} {f['reference'][1]:.3f}, {arm} {f['arm'][1]:.3f}"
            + (f". {f['note'][0].upper()}{f['note'][1:]}" if f.get("note") else "") + ".\n")


def render_scale(s: dict) -> str:
    """``scale.md``."""
    n, (first, ref) = len(s["seeds"]), primary_pair(s)
    out = [f"# {LABELS.get(first, first)} vs {ref} across model sizes (parameter efficiency)\n", *scale_opening(s)]
    out.append(render_tuned(s) if s.get("tuned") else scale_verdicts(s))
    out.append(f"Each size is a whole `difftx compare` (its folder `size=NAME/` has the full report, and says what "
               f"its LM interval is over), {n} paired seed(s). N: parameters without the vocabulary matrices. Held-out "
               "LM NLL (nats/token), mean over seeds.\n")
    for arm, eff in s["efficiency"].items():
        out.append(f"## {arm} vs {ref}" + (" at the preset's value\n" if s.get("tuned") else "\n"))
        if "skipped" in eff:
            out.append(f"Not measured: {eff['skipped']}.\n")
            continue
        floor = eff.get("method") == "floor"
        separate = floor and (eff.get("fit") or {}).get("model") == "separate"
        out.append((FLOOR_METHOD_SEPARATE if separate else FLOOR_METHOD) + "\n" if floor else
                   "Two sizes: a floor needs at least 3, so the ratios come from the straight line log L = a + b log N "
                   "per arm and seed, with a t interval over seeds; a ratio whose baseline size lies outside the "
                   "measured sizes is extrapolated.\n")
        head = ["size", "N (arm)", f"N ({ref})", f"NLL {ref}", "NLL arm",
                "gap, nats: mean; median [95%] (per seed)", f"matching {ref} N"]
        head += ["ratio, floor fit [95%]", "ratio, straight line [95%]"] if floor else ["ratio [95%]"]
        head += [f"{ref} dL/dlog N at matching N", "0.01 nats ="]
        rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        sens = eff.get("sensitivity") or [None] * len(s["sizes"])
        for i, sz in enumerate(s["sizes"]):
            nll = {a: [row[i] for row in s["heldout_nll"][a]] for a in (ref, arm)}
            mb = eff["matched_params"][i]
            cells = [f"{sz['name']} ({sz['dim']}x{sz['n_layers']}x{sz['n_heads']})", f"{sz['params'][arm]:,}",
                     f"{sz['params'][ref]:,}", f"{sum(nll[ref]) / n:.4f}", f"{sum(nll[arm]) / n:.4f}",
                     gap_text((s.get("gap") or {}).get(arm, [None] * len(s["sizes"]))[i]),
                     "-" if mb is None else f"{mb:,.0f}", _ratio(eff["ratios"][i])]
            if floor:
                cells.append(_ratio(eff["loglog"]["ratios"][i]))
            x = sens[i]
            cells += ["-", "-"] if x is None or x["factor_per_0.01_nats"] is None else \
                [f"{x['dloss_dlog_params']:+.4f}", f"x{x['factor_per_0.01_nats']:.2f} in N"]
            rows.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(rows) + "\n")
        out.append(_sensitivity_text(eff, s["sizes"]))
        if floor:
            f, lack = eff["fit"], eff["lack_of_fit"]
            out.append(_floor_fit_text(f, arm, s["sizes"], ((s.get("gap") or {}).get(arm) or [None])[-1], ref))
            out.append("Lack of fit of the straight log-log line: the curvature c of log L = a + b x + c x^2 "
                       "(x = log N; c > 0: the curve flattens, as toward a floor), per seed, with a t interval over "
                       f"seeds: {ref} "
                       f"{_curvature_text(lack['reference'])}; {arm} {_curvature_text(lack['arm'])}. RMS residual of "
                       f"the seeds' mean losses: straight line {lack['rms']['straight_line']:.4f}, floor fit "
                       f"{lack['rms']['floor']:.4f} nats.\n")
            out.append(_crossover_text(eff["crossover"], "floor curves"))
            out.append(_crossover_text(eff["loglog"]["crossover"], "straight lines"))
        else:
            out.append(_crossover_text(eff["crossover"], "lines"))
    out.append(_gap_along_training_table(s))
    out.append(regime_table(s["sizes"]))
    out.append(f"For scale, {s['paper']}. These models are orders of magnitude smaller.\n")
    if s.get("plot"):
        out.append(f"![parameter efficiency]({s['plot']})\n")
    return "\n".join(out)


GAP_METHOD = ("Gap: the arm's held-out NLL minus the baseline's at the same size, paired over seeds (the size's "
              "compare estimate, `difftx.eval.stats.paired_estimate`, with the evaluation windows' noise): the mean, "
              "and the median seed difference with the 95% interval of the median (a loss has no bounds, so no "
              "interval of its mean holds for every distribution of seeds); without an interval, the seeds' own "
              "differences in brackets. It is measured at each size, not read off a fitted curve.")


def _sensitivity_text(eff: dict, sizes: list) -> str:
    """The sentence on how much a small gap in nats moves the ratio at the fit's slope."""
    got = [(sz["name"], x) for sz, x in zip(sizes, eff.get("sensitivity") or []) if x["factor_per_0.01_nats"]]
    if not got:
        return GAP_METHOD + "\n"
    where = ("the floor fit's slope dL/dlog N = -b (L_B - E)" if eff["method"] == "floor" else
             "the straight line's slope d log L / d log N = b, times the loss")
    lo, hi = min(got, key=lambda g: g[1]["factor_per_0.01_nats"]), max(got, key=lambda g: g[1]["factor_per_0.01_nats"])
    span = (f"x{lo[1]['factor_per_0.01_nats']:.2f} (size {lo[0]})" if lo is hi else
            f"x{lo[1]['factor_per_0.01_nats']:.2f} (size {lo[0]}) to "
            f"x{hi[1]['factor_per_0.01_nats']:.2f} (size {hi[0]})")
    return (GAP_METHOD + f" Sensitivity: at {where} of the baseline, read at the matching baseline size, 0.01 nats "
            f"of gap is a factor of {span} in parameters: the flatter the curve, the larger the ratio a small gap "
            "makes. Read the gap in nats first.\n")


def _gap_along_training_table(s: dict) -> str:
    """Per size and arm: the held-out gap to the baseline at the first point of the training curve,
    where it is largest, and at the last point (from each size's compare, paired over seeds)."""
    rows = []
    for arm, per_size in (s.get("gap_along_training") or {}).items():
        for sz, gaps in zip(s["sizes"], per_size):
            if not gaps:
                continue
            peak = max(gaps, key=lambda g: abs(g["mean"]))
            rows.append(f"| {sz['name']} | {arm} | " + " | ".join(f"{gap_text(g)} at {g['tokens']:,.0f}"
                                                                   for g in (gaps[0], peak, gaps[-1])) + " |")
    if not rows:
        return ""
    return ("## The gap along training\n\nPer size, the arm's held-out loss minus the baseline's at the same "
            "tokens (each size's curve windows, paired over seeds; `size=NAME/report.md` has every point): at the "
            "first point of the curve, where it is largest, and at the last.\n\n"
            "| size | arm | first point (nats at tokens) | largest | last point |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


def _plot(path: Path, s: dict) -> Optional[str]:
    """``scale.png`` like the paper's Fig. 3a (``None`` without matplotlib or a fit)."""
    first, ref = primary_pair(s)
    eff = s["efficiency"].get(first)
    if eff is None or "skipped" in eff:
        return None
    try:
        from ..eval.plots import plot_parameter_efficiency
    except ImportError:
        return None
    import numpy as np

    try:
        fitted = {a: e for a, e in s["efficiency"].items() if "skipped" not in e}  # every arm with its line
        names = {a: LABELS.get(a, a) for a in (*fitted, ref)}
        points = {names[a]: ([sz["params"][a] for sz in s["sizes"]], s["heldout_nll"][a]) for a in (*fitted, ref)}
        lines = {names[a]: tuple(np.mean(e["loglog"]["fits"]["arm"], 0)) for a, e in fitted.items()}
        lines[names[ref]] = tuple(np.mean(eff["loglog"]["fits"]["reference"], 0))
        if eff["method"] == "floor":  # each arm's floor curve (its own floor, or the one shared); the lines beside
            fits = {names[a]: ((e["fit"].get("floors") or {}).get("arm", e["fit"]["floor"]), *e["fit"]["arm"])
                    for a, e in fitted.items()}
            fits[names[ref]] = (eff["fit"]["floor"], *eff["fit"]["reference"])
        else:
            fits, lines = lines, None
        plot_parameter_efficiency(points, fits, path, crossover=eff["crossover"]["params"],
                                  ratios=dict(zip(eff["params"], eff["ratios"])), lines=lines)
    except ImportError:
        return None
    return path.name


# -- scale.md's opening: the answer first (issue 38) ------------------------------------------------------


def scale_opening(s: dict) -> list[str]:
    """``scale.md``'s first three lines: the primary pair's first arm against its second (the baseline by
    default) at the largest size (the held-out gap in nats and the parameter ratio, tuned where tuned), how sure
    (seeds, at how many sizes the gap's interval excludes 0) and the regime (sizes, tokens per parameter)."""
    if not s["sizes"] or len(s["arms"]) < 2:
        return []
    (arm, ref), last, n = primary_pair(s), len(s["sizes"]) - 1, len(s["seeds"])
    source = s["tuned"]["tuned"] if s.get("tuned") else s
    gaps = (source.get("gap") or {}).get(arm) or [None] * len(s["sizes"])
    eff = (source.get("efficiency") or {}).get(arm) or {}
    ratio = _ratio(eff["ratios"][last]) if "ratios" in eff else "not measured"
    far = " (extrapolated)" in ratio
    top, g = s["sizes"][last], gaps[last]
    if g is None or g.get("mean") is None:
        gap = "not measured"
    elif _printed_interval(g)[0] is None:
        gap = f"{g['mean']:+.3f} nats (no interval: {g.get('n', n)} seeds; < 0: {arm} lower)"
    else:
        gap = f"{gap_text(g)} nats (measured, not extrapolated; < 0: {arm} lower)"
    answer = (f"**{arm} vs {ref} at the largest size, {top['name']} (N {top['params'][arm]:,}):** held-out gap "
              f"{gap}; parameter ratio {ratio.replace(' (extrapolated)', '')} (N_{arm} / N_{ref} at equal loss"
              f"{', extrapolated' if far else ''}; < 1: {arm} needs fewer).")
    ends = [_printed_interval(g) for g in gaps if g]
    apart = [(lo, hi) for lo, hi in ends if lo is not None]
    clear = sum(1 for lo, hi in apart if lo > 0 or hi < 0)
    none = len(s["sizes"]) - len(apart)
    median = any(g and g.get("interval_of") == "median" for g in gaps)
    what = "the interval of the median seed difference" if median else "the gap's interval"
    sure = (f"How sure: {n} paired seed{'s' if n != 1 else ''} per size; unadjusted 95% intervals; {what} "
            f"excludes 0 at {clear} of {len(s['sizes'])} sizes"
            + (f" ({none} with too few seeds for one)" if none else "")
            + ("; each arm's value chosen leave-one-seed-out, the ratios' intervals allowing for the choice"
               if s.get("tuned") else "") + ".")
    per = [_first_regime(z["regime"], arm).get("tokens_per_param") for z in s["sizes"] if z.get("regime")]
    per = [x for x in per if x]
    params = [z["params"][arm] for z in s["sizes"]]
    regime = (f"Regime: {len(s['sizes'])} sizes, N {min(params):,}-{max(params):,}"
              + (f", {min(per):.3g}-{max(per):.3g} training tokens per parameter (the paper's 3B: about 330)"
                 if per else "") + "; the method of each number: `docs/efficiency.md` and `docs/compare.md`.")
    return [answer + "\n", sure + "\n", regime + "\n"]


def _printed_interval(g: dict) -> tuple[Optional[float], Optional[float]]:
    """The ends of the interval a gap prints (:func:`difftx.compare.report.gap_text`): the median seed
    difference's where ``interval_of`` is ``"median"``, else ``low``/``high``."""
    if g.get("interval_of") == "median":
        return g.get("median_low"), g.get("median_high")
    return g.get("low"), g.get("high")


def scale_verdicts(s: dict) -> str:
    """``scale.md``'s verdict table: per size and arm, the held-out gap with its interval and unadjusted
    p (the size's compare, paired over seeds) and the parameter ratio with its interval."""
    from ..eval.stats import p_text

    rows = ["| size | arm | gap, nats: mean; median [95%] (per seed) | p (unadjusted) | parameter ratio [95%] |",
            "|---|---|---|---|---|"]
    measured = against_reference(s["arms"], primary_pair(s))
    for i, z in enumerate(s["sizes"]):
        for arm in measured:
            g = ((s.get("gap") or {}).get(arm) or [None] * len(s["sizes"]))[i]
            eff = (s.get("efficiency") or {}).get(arm) or {}
            p = "-" if not g or g.get("p_value") is None else p_text(g["p_value"])
            rows.append(f"| {z['name']} | {arm} | {gap_text(g)} | {p} | "
                        f"{_ratio(eff['ratios'][i]) if 'ratios' in eff else '-'} |")
    return "## Answer by size\n\n" + "\n".join(rows) + "\n"
