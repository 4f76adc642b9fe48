"""Where a DIFF config sits against the paper's recipe: its ``lambda_init`` per layer and their
mean (the depth schedule ``0.8 - 0.6 exp(-0.3 (l - 1))``, ``l`` counted from 1, reaches a mean of
about 0.70 only in a deep model: 0.28 at 2 layers), its DIFF heads and their width, its context
length, its feed-forward width as a multiple of the model width (the default rounds 8/3 of the
width up to a multiple of 64: exactly 8/3 only at widths that are multiples of 24, as every named
scale size is), and the tokens it trained on per non-embedding parameter.
``difftx compare`` (``report.md``, ``results.json`` under ``regime``) and ``difftx scale``
(``scale.md``, ``scale.json``, per size) print it from :func:`regime_of`, so a gap measured far from
the recipe is read as such."""

from __future__ import annotations

from typing import Optional

from ..attention.modules import head_output_scale, lambda_init_for_layer
from ..config import ModelConfig

PAPER_LAYERS = 24  # the depth the schedule's mean is compared with (the paper's models are 24-28 layers deep)
PAPER_LAMBDA_MEAN = sum(lambda_init_for_layer(i) for i in range(PAPER_LAYERS)) / PAPER_LAYERS
PAPER_RECIPE = ("the paper's 3B model: 12 DIFF heads of width 128, 4,096-token contexts, 1T tokens (about 330 per "
                f"parameter); lambda_init's mean over {PAPER_LAYERS} layers {PAPER_LAMBDA_MEAN:.2f}")


def regime(cfg: ModelConfig, tokens: Optional[float], non_embedding: int) -> dict:
    """The regime of one DIFF config trained on ``tokens`` text tokens (``None``: not recorded)
    with ``non_embedding`` parameters outside the vocabulary matrices."""
    if cfg.lambda_init is not None:
        lambdas, schedule = [float(cfg.lambda_init)] * cfg.n_layers, f"constant {cfg.lambda_init:g}"
    else:
        lambdas, schedule = [lambda_init_for_layer(i) for i in range(cfg.n_layers)], "depth schedule"
    scales = [head_output_scale(cfg.out_scale, i, 1.0 - lam) for i, lam in enumerate(lambdas)]
    return {"attention": cfg.attention, "init": cfg.init, "init_std": cfg.init_std, "n_layers": cfg.n_layers,
            "lambda_init": lambdas, "lambda_schedule": schedule, "out_scale": scales,
            "out_scale_source": "1 - lambda_init" if cfg.out_scale is None else f"out_scale={cfg.out_scale}",
            "head_norm": cfg.uses_head_norm,
            "lambda_init_mean": sum(lambdas) / len(lambdas), "paper_lambda_init_mean": PAPER_LAMBDA_MEAN,
            "paper_layers": PAPER_LAYERS, "diff_heads": cfg.n_heads, "head_width": cfg.head_dim,
            "context": cfg.max_seq_len, "ffn_hidden": cfg.hidden_dim, "ffn_ratio": cfg.hidden_dim / cfg.dim,
            "tokens": tokens, "non_embedding_params": non_embedding,
            "tokens_per_param": None if tokens is None else tokens / non_embedding}


def regimes(configs: dict, tokens) -> dict:
    """``{arm: regime}`` for every DIFF V1 arm of ``configs`` (``{arm: ModelConfig}``), trained on
    ``tokens`` text tokens (``{arm: tokens}``, or one number for all)."""
    return {arm: regime(cfg, tokens.get(arm) if isinstance(tokens, dict) else tokens, non_embedding_parameters(cfg))
            for arm, cfg in configs.items() if cfg.attention == "diff"}


def regime_of(result) -> dict:
    """:func:`regimes` of a compare's results (:class:`~.schema.CompareResult`): every arm's config, and the text
    tokens its seed-0 model trained on (from its training history)."""
    first = result.seeds[0]
    return regimes({arm: ModelConfig.from_dict(a.config) for arm, a in result.arms.items()},
                   {arm: ((result.run(first, arm).train.get("history") or [{}])[-1]).get("tokens")
                    for arm in result.arms})


def regime_lines(regimes: dict) -> list[str]:
    """One sentence per DIFF arm, e.g. ``diff: 2 layers, lambda_init 0.20, 0.36 (depth schedule; mean
    0.28 against 0.70 over 24 layers); 2 DIFF heads of width 12; context 128; feed-forward width 128
    (2.67 x dim ...); 4,096,000 training tokens, 73.6 per non-embedding parameter ...``."""
    out = []
    for arm, r in regimes.items():
        lams = _values(r["lambda_init"])
        scale = ("" if "out_scale" not in r else  # results written before the output scale was recorded
                 f"; each head's output scaled by {_values(r['out_scale'])} ({r['out_scale_source']}), "
                 f"{'after a' if r['head_norm'] else 'with no'} per-head norm")
        tokens = ("training tokens not recorded" if r["tokens"] is None else
                  f"{r['tokens']:,.0f} training tokens, {r['tokens_per_param']:.3g} per non-embedding parameter "
                  f"({r['non_embedding_params']:,})")
        out.append(f"{arm}: {r['n_layers']} layer(s), lambda_init {lams} ({r['lambda_schedule']}; mean "
                   f"{r['lambda_init_mean']:.2f} against {r['paper_lambda_init_mean']:.2f} over {r['paper_layers']} "
                   f"layers){scale}; {r['diff_heads']} DIFF head(s) of width {r['head_width']}; "
                   f"context {r['context']}; "
                   f"feed-forward width {r['ffn_hidden']} ({r['ffn_ratio']:.2f} x dim; the paper's 8/3 = 2.67); "
                   f"{tokens}")
    return out


REGIME_NOTE = ("Against the paper's recipe (" + PAPER_RECIPE + "). A gap measured far from it may be the regime's "
               "(depth, lambda_init, head width, budget) as much as the architecture's.")


def _values(xs: list) -> str:
    return ", ".join(f"{x:.2f}" for x in xs[:8]) + (", ..." if len(xs) > 8 else "")


def init_line(regimes: dict) -> str:
    """How the weights were drawn (``ModelConfig.init``, the same for every arm of a comparison), or '' for
    results written before it was recorded."""
    r = next((r for r in regimes.values() if "init" in r), None)
    if r is None:
        return ""
    if r["init"] == "torch":
        return ("Initialisation `torch`: PyTorch's module defaults (each linear map uniform in +-1/sqrt(fan_in), "
                "embeddings N(0, 1)), lambda vectors N(0, 0.1); paired across arms (same draws for shared tensors).")
    return (f"Initialisation `normal`: every linear map and embedding N(0, {r['init_std']:g}), lambda vectors "
            f"N(0, 0.1); paired across arms (same draws for shared tensors).")


def render_regime(regimes: dict) -> str:
    """The report section (compare and scale)."""
    if not regimes:
        return ""
    init = init_line(regimes)
    return "\n".join(["## Regime (against the paper's recipe)\n", REGIME_NOTE + (" " + init if init else "") + "\n"]
                     + [f"- {line}" for line in regime_lines(regimes)]) + "\n"


def non_embedding_parameters(cfg) -> int:
    """Parameters without the vocabulary matrices (the token embedding, and the LM head unless tied):
    the ``N`` of the paper's fit, counted on the meta device."""
    import torch

    from ..model import Transformer

    with torch.device("meta"):
        total = Transformer(cfg).num_parameters()
    return total - cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)


def regime_table(sizes: list) -> str:
    """The regime section of ``scale.md``: each size's DIFF regime against the paper's recipe (:func:`regime`, one
    dict per size with its ``name`` and ``regime``), and the initialisation."""
    rows = []
    for sz in sizes:
        for arm, r in (sz.get("regime") or {}).items():
            tpp = "-" if r["tokens_per_param"] is None else f"{r['tokens_per_param']:.3g}"
            scale = "-" if "out_scale" not in r else (", ".join(f"{x:.2f}" for x in r["out_scale"][:8])
                                                       + ("..." if r["n_layers"] > 8 else "")
                                                       + (" (norm)" if r["head_norm"] else " (no norm)"))
            rows.append(f"| {sz['name']} | {arm} | {r['n_layers']} | "
                        + ", ".join(f"{x:.2f}" for x in r["lambda_init"][:8]) + ("..." if r["n_layers"] > 8 else "")
                        + f" (mean {r['lambda_init_mean']:.2f}) | {scale} | {r['diff_heads']} x {r['head_width']} | "
                        f"{r['context']} | {r['ffn_hidden']} ({r['ffn_ratio']:.2f} x dim) | {tpp} |")
    if not rows:
        return ""
    head = ("| size | arm | layers | lambda_init per layer (mean) | head output scale per layer | DIFF heads x width | "
            "context | feed-forward width | tokens per non-embedding parameter |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    init = init_line(sizes[0].get("regime") or {})
    return ("## Regime (against the paper's recipe)\n\n" + REGIME_NOTE + (" " + init if init else "") + "\n\n" + head
            + "\n".join(rows) + "\n")
