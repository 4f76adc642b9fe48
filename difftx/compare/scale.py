"""``difftx scale``: the comparison at several model sizes, and the parameter efficiency the paper's
Fig. 3a reports (how large a baseline matches each DIFF size).

``run_scale("cpu", ["xs", "s", "m", "l"], seeds=3, out_dir="runs/scale")`` runs a whole
``run_compare`` per size into ``out_dir/size=NAME`` (each reused when present and resumable), then
fits, per arm and seed, ``log L = a + b log N`` to the held-out LM loss against the non-embedding
parameters (:mod:`difftx.eval.efficiency`), and writes ``scale.json``, ``scale.md`` and
``scale.png``. Sizes are named model shapes (:data:`SHAPES`, or ``DIMxLAYERSxHEADS``); the baseline
is matched at each size as in every compare. The token budget is the preset's, the same for every
size, or proportional to the parameters with ``tokens_per_param``.

On a cluster, ``shard=(K, N)`` spreads every (size, seed, arm) model over N invocations (see
:func:`difftx.compare.run.run_compare`); one more run without ``shard`` assembles.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..io import atomic_write, dumps_strict
from .presets import ComparePreset, get_preset

SCALE_SCHEMA, SCALE_VERSION = "difftx.compare.scale", 1

# named model shapes: (dim, layers, DIFF heads); the baseline has twice the heads of the same width
SHAPES: dict[str, tuple[int, int, int]] = {
    "xs": (32, 2, 1), "s": (48, 2, 2), "m": (64, 3, 2), "l": (96, 3, 3), "xl": (128, 4, 4),
    "20m": (384, 8, 6), "50m": (512, 12, 8), "120m": (768, 12, 12), "350m": (1024, 24, 16),
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
        "scale-cpu", "4 sizes over a 10x span of non-embedding parameters, LM on the bundled Shakespeare bytes, "
        "3 seeds, 2 arms (55 min on 2 CPU cores, measured with other work beside it)", "cpu", ("xs", "s", "m", "l"), 3,
        {**LM_ONLY, "steps": 2000, "warmup_steps": 100, "curve_points": 8}),
    "scale-gpu": ScalePreset(
        "scale-gpu", "4 sizes from about 20M to 350M parameters for one GPU (untested: written for users with "
        "hardware, never run here)", "gpu-small", ("20m", "50m", "120m", "350m"), 3,
        {**LM_ONLY, "steps": 5000, "curve_points": 10}),
}


def shape(name: str) -> tuple[int, int, int]:
    """``"m"`` or ``"64x3x2"`` -> ``(dim, layers, heads)``."""
    if name in SHAPES:
        return SHAPES[name]
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", name.strip())
    if not m:
        raise ValueError(f"--sizes: unknown size {name!r}; name one of {sorted(SHAPES)} or give DIMxLAYERSxHEADS "
                         "(e.g. 64x3x2)")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def non_embedding_parameters(cfg) -> int:
    """Parameters without the vocabulary matrices (the token embedding, and the LM head unless tied):
    the ``N`` of the paper's fit, counted on the meta device."""
    import torch

    from ..model import Transformer

    with torch.device("meta"):
        total = Transformer(cfg).num_parameters()
    return total - cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)


@dataclass
class SizePlan:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    preset: ComparePreset
    params: dict  # {arm: non-embedding parameters}


def plan_sizes(preset: str | ComparePreset, sizes: Sequence[str], *, tokens_per_param: Optional[float] = None,
               **overrides) -> list[SizePlan]:
    """Every size's preset, validated before anything is trained: at least 2 sizes, named once,
    heads that divide each width, and non-embedding parameters that increase with the order given."""
    if len(sizes) < 2:
        raise ValueError(f"--sizes: a fit needs at least 2 sizes, got {list(sizes)}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"--sizes: each size once, got {list(sizes)}")
    if tokens_per_param is not None and not (isinstance(tokens_per_param, (int, float)) and tokens_per_param > 0):
        raise ValueError(f"--tokens-per-param: must be a positive number, got {tokens_per_param!r}")
    base = get_preset(preset, **overrides) if isinstance(preset, str) else preset.with_overrides(**overrides)
    out: list[SizePlan] = []
    for name in sizes:
        dim, layers, heads = shape(name)
        try:
            p = base.with_overrides(dim=dim, n_layers=layers, n_heads=heads,
                                    description=f"size {name} of a scale sweep: dim {dim}, {layers} layers, {heads} "
                                                f"DIFF heads; the {base.name} preset's other settings")
            plan = p.resolve()
        except ValueError as e:
            raise ValueError(f"size {name} ({dim}x{layers}x{heads}): {e}") from None
        params = {arm: non_embedding_parameters(cfg) for arm, cfg in plan.arms.items()}
        if tokens_per_param is not None:
            per_step = p.batch_size * p.lm_seq_len
            steps = max(1, math.ceil(tokens_per_param * params["baseline"] / per_step))
            p = p.with_overrides(steps=steps, warmup_steps=min(p.warmup_steps, max(steps // 20, 1)))
        out.append(SizePlan(name, dim, layers, heads, p, params))
    for a, b in zip(out, out[1:]):
        if b.params["baseline"] <= a.params["baseline"]:
            raise ValueError(f"--sizes: give them from small to large; {b.name} ({b.params['baseline']:,} "
                             f"non-embedding parameters) is not larger than {a.name} ({a.params['baseline']:,})")
    return out


def run_scale(preset: str | ComparePreset, sizes: Sequence[str], seeds: int | Sequence[int],
              out_dir: str | os.PathLike, *, tokens_per_param: Optional[float] = None, progress: bool = True,
              workers: Optional[int] = None, shard: Optional[tuple[int, int]] = None, **overrides) -> dict:
    """The comparison at every size, then the efficiency fit (see the module doc). With ``shard``,
    only this invocation's share of the models is trained, and nothing is assembled."""
    from .run import run_compare

    plans = plan_sizes(preset, sizes, tokens_per_param=tokens_per_param, **overrides)
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    out = Path(out_dir)
    results, offset = {}, 0
    for sp in plans:
        res = run_compare(sp.preset, seed_list, out / f"size={sp.name}", progress=progress, workers=workers,
                          shard=shard, shard_offset=offset)
        offset += len(seed_list) * len(sp.params)
        results[sp.name] = res
    if shard is not None:
        return {"shard": list(shard), "sizes": [sp.name for sp in plans]}
    summary = summarise(plans, results, seed_list)
    summary["plot"] = _plot(out / "scale.png", summary)
    atomic_write(out / "scale.json", lambda p: Path(p).write_text(dumps_strict(summary, indent=1) + "\n"))
    atomic_write(out / "scale.md", lambda p: Path(p).write_text(render_scale(summary)))
    return summary


def _heldout_nll(res: dict, seed, arm: str) -> Optional[float]:
    task = res["runs"][str(seed)][arm]["tasks"].get("lm", {})
    return None if "skipped" in task else task.get("heldout", {}).get("nll")


def summarise(plans: list[SizePlan], results: dict, seeds: list) -> dict:
    """``scale.json``: the sizes, every model's held-out NLL, and each arm's parameter efficiency
    against the baseline."""
    from ..eval.efficiency import parameter_efficiency

    arms = list(plans[0].params)
    losses = {arm: [[_heldout_nll(results[sp.name], s, arm) for sp in plans] for s in seeds] for arm in arms}
    missing = sorted({arm for arm in arms for row in losses[arm] for v in row if v is None})
    efficiency = {}
    for arm in (a for a in arms if a != "baseline"):
        if missing:
            efficiency[arm] = {"skipped": f"no held-out LM loss for {', '.join(missing)} (LM batches needed)"}
            continue
        eff = parameter_efficiency([sp.params[arm] for sp in plans], losses[arm],
                                   [sp.params["baseline"] for sp in plans], losses["baseline"])
        efficiency[arm] = eff.to_dict()
    return {"schema": SCALE_SCHEMA, "schema_version": SCALE_VERSION, "seeds": seeds, "arms": arms,
            "sizes": [{"name": sp.name, "dim": sp.dim, "n_layers": sp.n_layers, "n_heads": sp.n_heads,
                       "steps": sp.preset.steps, "params": sp.params} for sp in plans],
            "heldout_nll": losses, "efficiency": efficiency, "paper": PAPER}


def _ratio(r: dict) -> str:
    if r["value"] is None:
        return "-"
    text = f"{r['value']:.3f}" if r["low"] is None else f"{r['value']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"
    return text + (" (extrapolated)" if r.get("note", "") and "extrapolated" in r["note"] else "")


def render_scale(s: dict) -> str:
    """``scale.md``."""
    n = len(s["seeds"])
    out = ["# DIFF vs baseline across model sizes (parameter efficiency)\n",
           f"Each size is a whole `difftx compare` (its folder `size=NAME/` has the full report), {n} paired seed(s). "
           "N: parameters without the vocabulary matrices. Held-out LM NLL (nats/token), mean over seeds. Per arm "
           "and seed, a line log L = a + b log N is fitted over the sizes; for each DIFF size, the baseline size "
           "with the same fitted loss gives the ratio N_DIFF / N_baseline (< 1: DIFF needs fewer parameters), "
           "with a 95% interval over seeds. A ratio whose baseline size lies outside the measured sizes is "
           "extrapolated.\n"]
    for arm, eff in s["efficiency"].items():
        out.append(f"## {arm} vs baseline\n")
        if "skipped" in eff:
            out.append(f"Not measured: {eff['skipped']}.\n")
            continue
        rows = ["| size | N (arm) | N (baseline) | NLL baseline | NLL arm | matching baseline N | ratio [95%] |",
                "|---|---|---|---|---|---|---|"]
        for i, sz in enumerate(s["sizes"]):
            nll = {a: [row[i] for row in s["heldout_nll"][a]] for a in ("baseline", arm)}
            mb = eff["matched_params"][i]
            rows.append(f"| {sz['name']} ({sz['dim']}x{sz['n_layers']}x{sz['n_heads']}) | {sz['params'][arm]:,} | "
                        f"{sz['params']['baseline']:,} | {sum(nll['baseline']) / n:.4f} | {sum(nll[arm]) / n:.4f} | "
                        f"{'-' if mb is None else f'{mb:,.0f}'} | {_ratio(eff['ratios'][i])} |")
        out.append("\n".join(rows) + "\n")
        c = eff["crossover"]
        if c["params"] is None:
            out.append(f"Crossover: none ({c['note']}).\n")
        else:
            ci = "unbounded" if c["low"] is None or c["high"] is None else f"[{c['low']:.3g}, {c['high']:.3g}]"
            out.append(f"Crossover (the lines meet): N = {c['params']:.3g}, 95% interval {ci}"
                       + (f"; {c['note']}" if c["note"] else "") + ".\n")
    out.append(f"For scale, {s['paper']}. These models are orders of magnitude smaller.\n")
    if s.get("plot"):
        out.append(f"![parameter efficiency]({s['plot']})\n")
    return "\n".join(out)


def _plot(path: Path, s: dict) -> Optional[str]:
    """``scale.png`` like the paper's Fig. 3a (``None`` without matplotlib or a fit)."""
    eff = s["efficiency"].get("diff")
    if eff is None or "skipped" in eff:
        return None
    try:
        from ..eval.plots import plot_parameter_efficiency
    except ImportError:
        return None
    import numpy as np

    try:
        fitted = {a: e for a, e in s["efficiency"].items() if "skipped" not in e}  # every arm with its line
        names = {a: ("DIFF" if a == "diff" else a) for a in fitted}
        points = {names[a]: ([sz["params"][a] for sz in s["sizes"]], s["heldout_nll"][a]) for a in fitted}
        points["baseline"] = ([sz["params"]["baseline"] for sz in s["sizes"]], s["heldout_nll"]["baseline"])
        fits = {names[a]: tuple(np.mean(e["fits"]["arm"], 0)) for a, e in fitted.items()}
        fits["baseline"] = tuple(np.mean(eff["fits"]["reference"], 0))
        plot_parameter_efficiency(points, fits, path, crossover=eff["crossover"]["params"],
                                  ratios=dict(zip(eff["params"], eff["ratios"])))
    except ImportError:
        return None
    return path.name
