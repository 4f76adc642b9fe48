"""The model's per-model arithmetic, written once for one model and for a stack of ``K`` models.

A *stacked* weight carries a leading ``K`` dimension (model ``i``'s weight is ``w[i]``) and its
activations a leading ``K`` too (``(K, N, ...)``, :mod:`difftx.training.stacked`). Each function
here takes either form and computes, for a stack, exactly what it computes for each model alone:

- :func:`linear`: ``F.linear`` (a ``(out, in)`` weight) or one batched product per model
  (``(K, out, in)`` against ``(K, N, in)``);
- :func:`rms_norm`: RMSNorm with a gain ``(n,)`` or ``(K, n)``, through :class:`RMSNormFunction`
  (one autograd node, closed-form backward) or PyTorch's own kernel;
- :func:`swiglu`: ``silu(a) * b`` in one node;
- :class:`LambdaFunction`: DIFF's re-parameterised ``lambda`` from vectors ``(d,)`` (a scalar) or
  ``(K, d)`` (one per model).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LambdaFunction", "RMSNormFunction", "at_least_fp32", "linear", "rms_norm", "rms_norm_backward",
           "rms_rstd", "stacked_like", "swiglu"]


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` promoted to at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def stacked_like(w: Tensor, x: Tensor, own_dims: int = 1) -> Tensor:
    """A per-model weight ready to broadcast against ``x``: ``w`` itself when it has ``own_dims``
    dimensions (one model), else ``(K, 1, ..., 1, *own)`` for ``x`` ``(K, ..., *own)`` (a stack)."""
    if w.dim() == own_dims:
        return w
    return w.view(w.shape[0], *([1] * (x.dim() - w.dim())), *w.shape[1:])


def linear(x: Tensor, w: Tensor, residual: Optional[Tensor] = None) -> Tensor:
    """``residual + x @ w^T`` (no residual: ``x @ w^T``): ``F.linear`` for a weight ``(out, in)``; for a
    stacked weight ``(K, out, in)`` and ``x`` ``(K, N, in)``, each model's product in one batched call
    (``(K, N, out)``, the residual added by the product itself)."""
    if w.dim() == 2:
        y = F.linear(x, w)
        return y if residual is None else residual + y
    if residual is None:
        return torch.bmm(x, w.transpose(1, 2))
    return torch.baddbmm(residual, x, w.transpose(1, 2))


def rms_rstd(x: Tensor, eps: float, mean_square: bool = False) -> Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dimension, keepdim: as ``||x||^2 / n`` (the per-head
    norm's arithmetic), or with ``mean_square`` as ``mean(x^2)`` (``torch.rms_norm``'s, the block norms')."""
    if mean_square:
        return x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()


def rms_norm_backward(g: Tensor, xhat: Tensor, rstd: Tensor, w: Tensor) -> Tensor:
    """The closed-form input gradient of ``xhat * w`` (``xhat = x * rstd``): ``rstd * (g w - xhat
    mean(g w xhat))``."""
    gw = g * w
    mean = (gw * xhat).mean(-1, keepdim=True)
    return torch.addcmul(gw, xhat, mean, value=-1.0).mul_(rstd)


class RMSNormFunction(torch.autograd.Function):
    """``RMSNorm(x) * w`` over the last dimension of ``x``, ``w`` ``(n,)`` or stacked ``(K, n)`` (``x``
    then ``(K, ..., n)``), with the closed-form backward; keeps ``x * rstd`` and ``rstd`` (as much memory
    as keeping ``x``). ``mean_square``: ``torch.rms_norm``'s ``mean(x^2)``; else ``||x||^2 / n``."""

    @staticmethod
    def forward(ctx, x, w, eps, mean_square):
        rstd = rms_rstd(x, eps, mean_square)  # (..., 1)
        xhat = x * rstd
        wb = stacked_like(w, x)
        ctx.save_for_backward(xhat, rstd, wb)
        ctx.stacked = w.dim() > 1
        return xhat * wb

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, wb = ctx.saved_tensors
        dw = None
        if ctx.needs_input_grad[1]:
            gx = g * xhat
            dw = gx.flatten(1, -2).sum(1) if ctx.stacked else gx.reshape(-1, xhat.shape[-1]).sum(0)
        return rms_norm_backward(g, xhat, rstd, wb), dw, None, None


def rms_norm(x: Tensor, w: Tensor, eps: float, mean_square: bool = True) -> Tensor:
    """``RMSNorm(x) * w`` in ``x``'s dtype. A one-model gain with ``mean_square`` (the block norms) runs
    PyTorch's ``rms_norm``; otherwise (a stacked gain, or the per-head norm's ``||x||^2 / n``) while
    gradients are recorded :class:`RMSNormFunction`; the per-head norm's inference runs PyTorch's too."""
    if w.dim() == 1 and (mean_square or not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return torch.rms_norm(x, (x.shape[-1],), w, eps)
    return RMSNormFunction.apply(x, w, eps, mean_square)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        sa = F.silu(a)
        ctx.save_for_backward(a, b, sa)
        return sa * b

    @staticmethod
    def backward(ctx, g):
        a, b, sa = ctx.saved_tensors
        return torch.ops.aten.silu_backward(g * b, a), g * sa


def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b`` (the gate and up projections' outputs), one autograd node while gradients are
    recorded. ``a`` and ``b`` come from two products, not halves of one: ``silu_backward`` on a strided
    half runs at half the speed."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _SwiGLU.apply(a, b)
    return F.silu(a).mul_(b)


class NoContext:
    """Stands in for an autograd context when a Function's forward runs without autograd."""

    @staticmethod
    def save_for_backward(*tensors) -> None:
        pass


class LambdaFunction(torch.autograd.Function):
    """``exp(q1.k1) - exp(q2.k2) + lambda_init`` in float32 (float64 for float64 parameters), with
    its gradient written out: one autograd node instead of the dozen autograd would record. Vectors
    ``(d,)`` give a scalar; stacked ``(K, d)`` give one lambda per model ``(K,)`` (each dot product
    on its own, as the one model computes it)."""

    @staticmethod
    def forward(ctx, q1, k1, q2, k2, lambda_init):
        acc = at_least_fp32(q1.dtype)
        q1, k1, q2, k2 = (p if p.dtype == acc else p.to(acc) for p in (q1, k1, q2, k2))
        if q1.dim() == 1:
            e1, e2 = torch.exp(torch.dot(q1, k1)), torch.exp(torch.dot(q2, k2))
        else:
            e1 = torch.exp(torch.stack([torch.dot(a, b) for a, b in zip(q1, k1)]))
            e2 = torch.exp(torch.stack([torch.dot(a, b) for a, b in zip(q2, k2)]))
        ctx.save_for_backward(q1, k1, q2, k2, e1, e2)
        return e1 - e2 + lambda_init

    @staticmethod
    def backward(ctx, g):
        q1, k1, q2, k2, e1, e2 = ctx.saved_tensors
        g1, g2 = g * e1, -g * e2
        if q1.dim() > 1:
            g1, g2 = g1[:, None], g2[:, None]
        return k1 * g1, q1 * g1, k2 * g2, q2 * g2, None
