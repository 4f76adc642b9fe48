"""Diagnostics (SPEC section 5): learned lambda per layer and head redundancy.

Head redundancy of one layer: the mean pairwise cosine similarity between its heads' attention
maps (the effective maps, each head's ``T x S`` map flattened; masked entries are zero), per
sequence, averaged over the batch. 1 means every head attends alike; with softmax maps the value
is non-negative, DIFF maps can give negative values.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..io import eval_mode
from .capture import AttentionCapture, layer_lambdas

__all__ = ["head_redundancy", "layer_lambdas", "model_head_redundancy"]


def head_redundancy(maps: Tensor) -> float:
    """Mean pairwise cosine similarity of heads' maps ``(B, H, T, S)`` (NaN for one head)."""
    if maps.dim() != 4:
        raise ValueError(f"maps must be (batch, heads, T, S), got {tuple(maps.shape)}")
    H = maps.shape[1]
    if H < 2:
        return float("nan")
    flat = F.normalize(torch.nan_to_num(maps.float(), neginf=0.0).flatten(2), dim=-1)  # (B, H, T*S)
    sim = flat @ flat.transpose(1, 2)  # (B, H, H)
    off = ~torch.eye(H, dtype=torch.bool)
    return float(sim[:, off].mean())


@torch.no_grad()
def model_head_redundancy(model: torch.nn.Module, tokens: Tensor, backend: str = "eager",
                          batch_size: Optional[int] = None) -> list[float]:
    """:func:`head_redundancy` per layer on ``tokens`` ``(B, T)``, in forwards of ``batch_size``
    sequences (default: all at once; a smaller one bounds the memory of the captured maps). The
    value is a mean over sequences, so it does not depend on ``batch_size``."""
    per_chunk = []  # (sequences, [value per layer])
    with eval_mode(model):
        for chunk in tokens.split(batch_size or len(tokens)):
            with AttentionCapture(model, backend=backend) as cap:
                model(chunk.to(next(model.parameters()).device))
            per_chunk.append((len(chunk), [head_redundancy(calls[-1].effective) for calls in cap.maps]))
    return [sum(n * v[layer] for n, v in per_chunk) / len(tokens) for layer in range(len(per_chunk[0][1]))]


def lambda_summary(model: torch.nn.Module) -> dict[str, list[Optional[float]]]:
    """``{"lambda": [...], "lambda_init": [...]}`` per layer (``None`` where not applicable)."""
    from .capture import attention_modules

    inits = [getattr(m, "lambda_init", None) for m in attention_modules(model)]
    return {"lambda": layer_lambdas(model), "lambda_init": inits}
