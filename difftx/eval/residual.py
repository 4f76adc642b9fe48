"""How large each attention layer's output is against the residual stream it is added to.

A block computes ``x + attn(attn_norm(x))`` (then its MLP): :func:`attention_residual_ratio` reads,
per layer and at chosen positions, the RMS over the model width of ``attn(attn_norm(x))`` (what the
attention adds to the residual stream) divided by the RMS of ``x`` (the stream it is added to).
A ratio near 0 means the layer barely changes the stream there; DIFF's heads are scaled by
``1 - lambda_init`` and normalised per head, so the ratio shows what that does to a layer's say.
Read with forward hooks on an ordinary :class:`difftx.Transformer` (``model.layers[i]`` and its
``attn``): nothing in the model changes, and no random state is touched.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from ..io import eval_mode


def _blocks(model: torch.nn.Module) -> list:
    blocks = getattr(model, "layers", None)
    if blocks is None or not len(blocks) or not all(hasattr(b, "attn") for b in blocks):
        raise ValueError(f"attention_residual_ratio: needs a difftx Transformer (blocks in .layers, each with .attn), "
                         f"got {type(model).__name__}")
    return list(blocks)


@torch.no_grad()
def attention_residual_ratio(model: torch.nn.Module, tokens: Tensor, at: Optional[Tensor] = None, *,
                             batch_size: int = 64, device: Union[str, torch.device, None] = None) -> dict:
    """Per layer, at the positions ``at`` (``(N, T)`` bool, default every position) of ``tokens``
    ``(N, T)``: ``ratio``, the mean over those positions of ``RMS(attention output) / RMS(residual
    stream)`` (the block's attention output, before it is added, against the block's input);
    ``attention_rms`` and ``residual_rms``, the mean of each RMS. Also ``positions``, how many were
    read. Eval mode inside (the model's mode is restored), no gradients, ``batch_size`` rows a forward."""
    blocks = _blocks(model)
    if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(f"attention_residual_ratio: tokens must be a (rows, positions) tensor, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__}")
    if at is None:
        at = torch.ones(tokens.shape, dtype=torch.bool)
    if not isinstance(at, Tensor) or at.dtype != torch.bool or tuple(at.shape) != tuple(tokens.shape):
        raise ValueError(f"attention_residual_ratio: at must be a bool tensor of shape {tuple(tokens.shape)}, got "
                         f"{getattr(at, 'dtype', type(at).__name__)} {tuple(getattr(at, 'shape', ()))}")
    if not bool(at.any()):
        raise ValueError("attention_residual_ratio: at selects no position")
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"attention_residual_ratio: batch_size must be a positive integer, got {batch_size!r}")
    device = next(model.parameters()).device if device is None else torch.device(device)
    L = len(blocks)
    sums = torch.zeros(3, L, dtype=torch.float64)  # ratio, attention RMS, residual RMS, summed over positions
    state: dict = {}

    def rms(v: Tensor) -> Tensor:  # (N, D) -> (N,), in float32 (float64 is not on every device)
        return v.float().pow(2).mean(-1).sqrt()

    def block_input(layer: int):
        def hook(_module, args):
            state[layer] = args[0]
        return hook

    def attention_output(layer: int):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            mask = state["at"]
            a, x = rms(out[mask]), rms(state.pop(layer)[mask])
            sums[:, layer] += torch.stack([(a / x.clamp_min(1e-30)).sum(), a.sum(), x.sum()]).cpu().double()
        return hook

    hooks = [b.register_forward_pre_hook(block_input(i)) for i, b in enumerate(blocks)]
    hooks += [b.attn.register_forward_hook(attention_output(i)) for i, b in enumerate(blocks)]
    try:
        with eval_mode(model):
            for start in range(0, tokens.shape[0], batch_size):
                x = tokens[start:start + batch_size].to(device)
                state["at"] = at[start:start + batch_size].to(device)
                if bool(state["at"].any()):
                    model(x, logits_at=state["at"])
    finally:
        for h in hooks:
            h.remove()
    n = int(at.sum())
    mean = (sums / n).tolist()
    return {"positions": n, "ratio": mean[0], "attention_rms": mean[1], "residual_rms": mean[2]}
