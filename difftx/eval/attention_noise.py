"""Attention to the answer and attention noise (SPEC section 5; paper Table 3, Figure 1).

At the query position that emits the first answer token, take the attention row (the
effective map ``A1 - lam * A2`` for DIFF, which may have negative entries) and normalise it
by its L1 norm: ``r = a / sum_j |a_j|``. Then, over the keys of a role:

- ``signed``   = ``sum_j r_j``
- ``absolute`` = ``sum_j |r_j|``
- ``positive`` = ``sum_j max(r_j, 0)``

Answer mass uses the answer needle's value tokens; noise mass the filler tokens only (not
needles, query or BOS). For softmax attention the three variants coincide. Per layer the
masses are reported as the mean over heads and the best head (largest answer mass, smallest
noise mass, each chosen separately). The sign of a DIFF map is not identifiable at tiny
scale (the model can flip the roles of the two components), hence the three variants.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..io import eval_mode
from .capture import AttentionCapture
from .needle import ROLE_ANSWER, ROLE_FILLER, ROLE_NAMES, NeedleSample, RolePrompt

VARIANTS = ("signed", "absolute", "positive")


def normalized_rows(rows: Tensor) -> Tensor:
    """Rows ``(..., S)`` divided by their L1 norm (all-zero rows stay zero)."""
    return rows / rows.abs().sum(-1, keepdim=True).clamp_min(1e-30)


def role_mass(rows: Tensor, keys: Tensor) -> dict[str, Tensor]:
    """Masses ``(...)`` of the L1-normalised ``rows`` ``(..., S)`` over the boolean ``keys``
    (``(S,)`` or broadcastable to ``rows``), for each variant of :data:`VARIANTS`."""
    r = normalized_rows(rows.float())
    k = keys.to(r.device).bool().to(r.dtype)
    return {"signed": (r * k).sum(-1), "absolute": (r.abs() * k).sum(-1),
            "positive": (r.clamp_min(0) * k).sum(-1)}


@dataclass
class LayerMass:
    """One layer's answer and noise masses; each dict maps variant -> value."""

    layer: int
    answer_mean: dict[str, float]
    answer_best: dict[str, float]
    noise_mean: dict[str, float]
    noise_best: dict[str, float]
    answer_heads: dict[str, list[float]]
    noise_heads: dict[str, list[float]]

    def to_dict(self) -> dict:
        return asdict(self)


def layer_mass(rows: Tensor, answer_keys: Tensor, noise_keys: Tensor, layer: int = 0) -> LayerMass:
    """Masses of one layer from its rows ``(H, S)`` (one per head) or ``(N, H, S)`` (N samples,
    with key masks ``(N, S)`` or ``(S,)``): per head averaged over samples, then mean and best
    over heads."""
    if rows.dim() == 2:
        rows = rows[None]
    if rows.dim() != 3:
        raise ValueError(f"rows must be (heads, keys) or (samples, heads, keys), got {tuple(rows.shape)}")

    def per_sample(mask: Tensor) -> Tensor:  # (S,) or (N, S) -> broadcastable to (N, H, S)
        return mask if mask.dim() == 1 else mask[:, None, :]

    ans = {k: v.mean(0) for k, v in role_mass(rows, per_sample(answer_keys)).items()}  # variant -> (H,)
    noi = {k: v.mean(0) for k, v in role_mass(rows, per_sample(noise_keys)).items()}
    return LayerMass(
        layer,
        answer_mean={k: float(v.mean()) for k, v in ans.items()},
        answer_best={k: float(v.max()) for k, v in ans.items()},
        noise_mean={k: float(v.mean()) for k, v in noi.items()},
        noise_best={k: float(v.min()) for k, v in noi.items()},
        answer_heads={k: v.tolist() for k, v in ans.items()},
        noise_heads={k: v.tolist() for k, v in noi.items()},
    )


@torch.no_grad()
def attention_to_answer(model: torch.nn.Module, samples: Sequence[NeedleSample | RolePrompt], *,
                        backend: str = "eager", keep_rows: int = 1) -> dict:
    """Per-layer answer / noise masses over needle ``samples`` at the last prompt position
    (the one that emits the first answer token). A sample needs ``prompt`` (token ids) and
    ``roles`` (``ROLE_*`` per position): a synthetic :class:`NeedleSample`, or a natural-language
    prompt from :func:`difftx.eval.needle_text.text_needle_probes`; prompts may differ in length.

    Returns ``{"layers": [LayerMass.to_dict(), ...], "rows": [...]}`` where ``rows`` holds, for
    the first ``keep_rows`` samples, the prompt roles and the effective rows at that position
    per layer (``layers``: head mean, ``heads``: every head), for the Figure-1-style plot.
    """
    if not samples:
        raise ValueError("attention_to_answer needs at least one needle sample")
    device = next(model.parameters()).device
    rows: list[list[Tensor]] = []  # rows[layer][sample]: (H, S)
    answer, noise, kept = [], [], []
    with eval_mode(model):
        for si, s in enumerate(samples):
            roles = torch.tensor(s.roles)
            answer.append(roles == ROLE_ANSWER)
            noise.append(roles == ROLE_FILLER)
            with AttentionCapture(model, backend=backend) as cap:
                model(torch.tensor([s.prompt], device=device))
            rows = rows or [[] for _ in cap.maps]
            for layer, calls in enumerate(cap.maps):
                # (H, S): last query position, every head; a copy, so the (H, S, S) map is freed
                rows[layer].append(calls[-1].effective[0, :, -1].clone())
            if si < keep_rows:
                kept.append({"roles": list(s.roles), "layers": [r[-1].mean(0).tolist() for r in rows],
                             "heads": [r[-1].tolist() for r in rows]})
    # prompts of different lengths: zero-pad keys to the longest (a zero adds to no L1 norm or mass)
    S = max(a.numel() for a in answer)
    A, N = _pad(answer, S), _pad(noise, S)  # (N, S)
    padded = [_pad(r, S) for r in rows]  # per layer (N, H, S)
    layers = [layer_mass(r, A, N, layer).to_dict() for layer, r in enumerate(padded)]
    # per sample: mass averaged over heads and layers (for statistics that resample prompts)
    per_sample = {role: {v: (sum(role_mass(r, keys[:, None, :])[v].mean(-1) for r in padded) / len(padded)).tolist()
                         for v in VARIANTS} for role, keys in (("answer", A), ("noise", N))}
    return {"n_samples": len(samples), "layers": layers, "rows": kept, "per_sample": per_sample}


def _pad(xs: Sequence[Tensor], S: int) -> Tensor:
    """Stack tensors ``(..., S_i)`` right-padded with zeros (False) to ``(n, ..., S)``."""
    return torch.stack([torch.nn.functional.pad(x, (0, S - x.shape[-1])) for x in xs])


def summary(result: dict, variant: str = "absolute", layer: Optional[int] = None) -> dict[str, float]:
    """``{"answer": ..., "noise": ...}`` (mean over heads) for one layer, or averaged over layers."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: must be one of {VARIANTS}, got {variant!r}")
    layers = result["layers"] if layer is None else [result["layers"][layer]]
    return {"answer": sum(x["answer_mean"][variant] for x in layers) / len(layers),
            "noise": sum(x["noise_mean"][variant] for x in layers) / len(layers)}


def best_head_row(result: dict, variant: str = "absolute", sample: int = 0) -> dict:
    """The kept row of the head with the largest answer mass (``variant``) over all layers:
    ``{"layer", "head", "row", "roles", "answer_mass"}`` (what Figure 1 shows for one query)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: must be one of {VARIANTS}, got {variant!r}")
    if not result.get("rows"):
        raise ValueError("the result keeps no rows; run attention_to_answer with keep_rows >= 1")
    best = max(((lay["answer_heads"][variant][h], li, h) for li, lay in enumerate(result["layers"])
                for h in range(len(lay["answer_heads"][variant]))))
    mass, li, h = best
    kept = result["rows"][sample]
    return {"layer": li, "head": h, "row": kept["heads"][li][h], "roles": kept["roles"], "answer_mass": mass}


def attention_report(model: torch.nn.Module, samples: Sequence[NeedleSample | RolePrompt], *,
                     backend: str = "eager") -> dict:
    """:func:`attention_to_answer` with its readings, JSON-ready: ``summary`` (``{variant:
    {"answer", "noise"}}``, head mean averaged over layers), ``best_head_row`` (absolute) and
    the kept rows' roles as names (``"filler"``, ``"answer"``, ...)."""
    res = attention_to_answer(model, samples, backend=backend)
    res["summary"] = {v: summary(res, v) for v in VARIANTS}
    res["best_head_row"] = best_head_row(res)
    for kept in (*res["rows"], res["best_head_row"]):
        kept["roles"] = [ROLE_NAMES[r] for r in kept["roles"]]
    return res
