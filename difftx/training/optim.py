"""AdamW parameter groups, gradient clipping, the update that ends a step (with the divergence check) and the
learning-rate schedule, for one model or a stack of K (:mod:`difftx.training.stacked`)."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..attention.modules import AttentionKind
from .config import TrainConfig


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Parameters kept out of weight decay: every vector (norm gains incl. ``subln``), every
    lambda parameter (V1's ``lambda_q1/k1/q2/k2`` and V2's ``lambda_proj``: decay would pull
    lambda towards its initial value / sigmoid(0) for no modelling reason) and the token
    embeddings (rows of rare tokens would shrink only because they are rarely seen). All other
    matrices, including the LM head when it is not tied, are decayed."""
    leaf = name.rsplit(".", 2)
    is_lambda = any(part.startswith("lambda_") for part in leaf)
    return param.ndim < 2 or is_lambda or name.endswith("tok_embeddings.weight")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices and the rest (see :func:`no_decay`). ``model`` is one model
    or a stack of K (:class:`difftx.training.stacked.StackedTransformer`), whose weights carry a
    leading model dimension: each is decided on one model's slice, as that model's own would be."""
    stacked = hasattr(model, "named_stacked")
    decay, keep = [], []
    for name, p in (model.named_stacked() if stacked else model.named_parameters()):  # tied ones appear once
        if p.requires_grad:
            (keep if no_decay(name, p[0] if stacked else p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


ADAMW_IMPLEMENTATIONS = ("foreach", "fused")


def adamw_implementation(params) -> str:
    """``"fused"`` (PyTorch's one-kernel AdamW) when every parameter is a floating-point CUDA tensor, else
    ``"foreach"`` (the multi-tensor implementation): what :func:`build_optimizer` picks for ``params``."""
    params = list(params)
    on_cuda = bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)
    return "fused" if on_cuda else "foreach"


def build_optimizer(model: nn.Module, config: TrainConfig, implementation: str | None = None) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups` of one model or of a stack (equal to one AdamW per model of
    the stack: every AdamW update is elementwise). ``implementation`` (default :func:`adamw_implementation` of the
    parameters): ``"fused"`` on CUDA, one kernel for the whole update; ``"foreach"`` elsewhere, the multi-tensor
    implementation, faster on the small CPU models of ``difftx compare`` than the per-tensor loop PyTorch picks on
    CPU. PyTorch's ``fused`` CPU kernel was not taken: a run that saved checkpoints drifted from one that did not in
    the last float32 bit, which breaks the bitwise resume guarantee. (Measured: docs/results.md, "2026-11-27:
    Timings moved out of docstrings"; whether the CUDA kernel keeps the guarantee is not measured yet.) The
    optimizer's ``difftx_implementation`` names the one taken (the run's banner shows it)."""
    groups = param_groups(model, config.weight_decay)
    if implementation is None:
        implementation = adamw_implementation(p for g in groups for p in g["params"])
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(f"implementation: must be one of {ADAMW_IMPLEMENTATIONS} or None, got {implementation!r}")
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                                  **{implementation: True})
    optimizer.difftx_implementation = implementation
    return optimizer


@torch.no_grad()
def clip_grad_norms_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradient of one model, or of each model of a stack, to 2-norm ``max_norm`` (``inf``:
    no clipping) and return the norm before clipping (a stack: its ``K`` norms). One model:
    ``torch.nn.utils.clip_grad_norm_`` (sharded parameters included). A stack: each model's norm
    over its own gradients, and its gradients scaled by ``min(1, max_norm / (norm + 1e-6))``, as
    ``clip_grad_norm_`` does for one model."""
    if not hasattr(model, "named_stacked"):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(model.k)
    per_tensor = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)  # (K, P)
    norms = torch.linalg.vector_norm(per_tensor, dim=1)  # (K,): each a contiguous row, summed as for K = 1
    coef = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
    return norms


class TrainingDivergedError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the step stopped before applying its update (no model
    changed). ``what``: ``"loss"`` or ``"gradient norm"``; ``models``: the models it happened to (indices in
    a stack, ``[0]`` for one model); ``values``: every model's value."""

    def __init__(self, message: str, what: str = "", models: Sequence[int] = (), values: Sequence[float] = ()):
        super().__init__(message)
        self.what, self.models, self.values = what, list(models), list(values)


def _stop_unless_finite(optimizer: torch.optim.Optimizer, what: str, values: list[float]) -> None:
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        optimizer.zero_grad(set_to_none=True)
        raise TrainingDivergedError(f"{what} is {values[bad[0]]}", what, bad, values)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def update(model: nn.Module, optimizer: torch.optim.Optimizer, losses: Sequence[float], grad_clip: float,
           scaler=None, norm_of: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> list[float]:
    """The end of one optimizer step of one model or a stack, after the backward passes: stop before the update
    if a loss is not finite, clip each model's gradient to ``grad_clip`` (<= 0: no clipping), stop if a norm is
    not finite (not with a float16 loss ``scaler``, which skips such a step itself), step and ``zero_grad``.
    Returns each model's gradient norm before clipping. ``norm_of`` assembles a sharded norm (FSDP2)."""
    _stop_unless_finite(optimizer, "loss", list(losses))
    if scaler is not None:
        scaler.unscale_(optimizer)
    norms = norm_of(clip_grad_norms_(model, grad_clip if grad_clip > 0 else float("inf")))
    values = [float(norms)] if norms.dim() == 0 else norms.tolist()
    if scaler is None:
        _stop_unless_finite(optimizer, "gradient norm", values)
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return values


def lambda_scale_at(step: int, config: TrainConfig) -> float:
    """The lambda warm-up factor of optimizer step ``step`` (counted from 1): ``(step - 1) / lambda_warmup``
    up to 1, so the first step's forward subtracts nothing (a converted model computes its source's function
    there); 1 without a warm-up."""
    n = config.lambda_warmup
    return 1.0 if not n else min(1.0, (step - 1) / n)


def set_lambda_scale(model: nn.Module, scale: float) -> None:
    """Set the lambda warm-up factor of every attention layer of ``model`` (a model or a stack's tree): a kind with
    a lambda then subtracts ``scale * lambda`` (:meth:`~difftx.attention.modules.AttentionKind.set_lambda_scale`)."""
    for m in model.modules():
        if isinstance(m, AttentionKind):
            m.set_lambda_scale(scale)


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (counted from 1): linear warmup over
    ``warmup_steps`` to ``lr``, then cosine / linear decay to ``min_lr`` at ``steps`` (or constant)."""
    if config.warmup_steps and step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    if config.decay == "constant":
        return config.lr
    span = max(1, config.steps - config.warmup_steps)
    frac = min(1.0, max(0.0, (step - config.warmup_steps) / span))
    scale = 0.5 * (1.0 + math.cos(math.pi * frac)) if config.decay == "cosine" else 1.0 - frac
    return config.min_lr + (config.lr - config.min_lr) * scale
