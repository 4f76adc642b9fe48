"""The model's per-model arithmetic, written once for one model and for a stack of ``K`` models.

A *stacked* weight carries a leading ``K`` dimension (model ``i``'s weight is ``w[i]``) and its
activations a leading ``K`` too (``(K, N, ...)``, :mod:`difftx.training.stacked`). Each function
here takes either form and computes, for a stack, exactly what it computes for each model alone:

- :func:`linear`: ``F.linear`` (a ``(out, in)`` weight, an optional ``(out,)`` bias) or one batched product per
  model (``(K, out, in)`` against ``(K, N, in)``, a bias ``(K, out)``);
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

__all__ = ["HEAD_PAD", "HeadLoss", "LambdaFunction", "RMSNormFunction", "at_least_fp32", "batch_first", "embedding",
           "head_loss", "is_mapped", "lambda_value", "linear", "records_grad", "rms_norm", "rms_norm_backward",
           "rms_rstd", "stacked_like", "swiglu"]


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` promoted to at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def is_mapped(t: Tensor) -> bool:
    """True for a tensor that ``torch.vmap`` maps over: its values cannot be read (``.item()``, data
    pointers), and a Function's ``vmap`` rule sees the whole batch."""
    return torch._C._functorch.is_batchedtensor(t)


def records_grad(*tensors: Tensor) -> bool:
    """True when autograd records an op on ``tensors``: gradients enabled and one of them requires a
    gradient, or is mapped by ``torch.vmap`` (whose tensors do not say whether they do)."""
    return torch.is_grad_enabled() and any(t.requires_grad or is_mapped(t) for t in tensors)


def stacked_like(w: Tensor, x: Tensor, own_dims: int = 1) -> Tensor:
    """A per-model weight ready to broadcast against ``x``: ``w`` itself when it has ``own_dims``
    dimensions (one model), else ``(K, 1, ..., 1, *own)`` for ``x`` ``(K, ..., *own)`` (a stack)."""
    if w.dim() == own_dims:
        return w
    return w.view(w.shape[0], *([1] * (x.dim() - w.dim())), *w.shape[1:])


def linear(x: Tensor, w: Tensor, residual: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
    """``residual + x @ w^T + bias`` (no residual: ``x @ w^T + bias``; no bias: without it): ``F.linear`` for a
    weight ``(out, in)`` and a bias ``(out,)``; for a stacked weight ``(K, out, in)``, a bias ``(K, out)`` and ``x``
    ``(K, ..., in)``, each model's product in one batched call (``(K, ..., out)``, the residual and the bias added
    by the product itself)."""
    if w.dim() == 2:
        y = F.linear(x, w, bias)
        return y if residual is None else residual + y
    x3 = x.reshape(x.shape[0], -1, x.shape[-1])  # (K, N, in)
    add = None if residual is None else residual.reshape(x3.shape[0], x3.shape[1], -1)
    if bias is not None:
        add = bias[:, None] if add is None else add + bias[:, None]  # (K, 1, out) broadcasts over the rows
    y = torch.bmm(x3, w.transpose(1, 2)) if add is None else torch.baddbmm(add, x3, w.transpose(1, 2))
    return y.view(*x.shape[:-1], y.shape[-1])


def embedding(tokens: Tensor, w: Tensor) -> Tensor:
    """Rows of the embedding ``w`` ``(V, D)`` for ``tokens``; stacked ``(K, V, D)`` with ``tokens`` ``(K, ...)``:
    each model's rows of its own table (one lookup in the ``K * V`` rows)."""
    if w.dim() == 2:
        return F.embedding(tokens, w)
    K, V, D = w.shape
    offsets = torch.arange(K, device=tokens.device).mul_(V).view(K, *([1] * (tokens.dim() - 1)))
    return F.embedding(tokens + offsets, w.reshape(K * V, D))


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


def batch_first(info, in_dims, *tensors):
    """A vmap rule's inputs with the mapped dimension first: a tensor vmap does not map over is
    expanded to ``info.batch_size`` copies (a view); None stays None."""
    out = []
    for t, dim in zip(tensors, in_dims):
        if t is None or not isinstance(t, Tensor):
            out.append(t)
        elif dim is None:
            out.append(t.expand(info.batch_size, *t.shape))
        else:
            out.append(t.movedim(dim, 0))
    return out


class _Saved:
    """What a Function's forward keeps for its backward, handed to ``setup_context`` as a second
    output (the form :mod:`torch.func` transforms need: ``forward`` without ``ctx``)."""

    def __init__(self, **items):
        self.__dict__.update(items)


class RMSNormFunction(torch.autograd.Function):
    """``RMSNorm(x) * w`` over the last dimension of ``x``, ``w`` ``(n,)`` or stacked ``(K, n)`` (``x``
    then ``(K, ..., n)``), with the closed-form backward; keeps ``x * rstd`` and ``rstd`` (as much memory
    as keeping ``x``). ``mean_square``: ``torch.rms_norm``'s ``mean(x^2)``; else ``||x||^2 / n``.
    Under ``torch.vmap`` the mapped dimension becomes the stack's ``K`` (one call of the stacked form)."""

    @staticmethod
    def forward(x, w, eps, mean_square):
        rstd = rms_rstd(x, eps, mean_square)  # (..., 1)
        xhat = x * rstd
        wb = stacked_like(w, x)
        return xhat * wb, _Saved(xhat=xhat, rstd=rstd, wb=wb, stacked=w.dim() > 1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.saved = output[1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, _):
        s = ctx.saved
        dw = None
        if ctx.needs_input_grad[1]:
            gx = g * s.xhat
            dw = gx.flatten(1, -2).sum(1) if s.stacked else gx.reshape(-1, s.xhat.shape[-1]).sum(0)
        return rms_norm_backward(g, s.xhat, s.rstd, s.wb), dw, None, None

    @staticmethod
    def vmap(info, in_dims, x, w, eps, mean_square):
        x, w = batch_first(info, in_dims[:2], x, w)
        if w.dim() == 3:  # a stacked gain inside the map: (vmap K, stack K, n) is one stack of K * K'
            raise NotImplementedError("rms_norm: a stacked gain under torch.vmap")
        out, saved = RMSNormFunction.apply(x, w, eps, mean_square)
        return (out, saved), (0, None)


def rms_norm(x: Tensor, w: Tensor, eps: float, mean_square: bool = True) -> Tensor:
    """``RMSNorm(x) * w`` in ``x``'s dtype. A one-model gain with ``mean_square`` (the block norms) runs
    PyTorch's ``rms_norm``; otherwise (a stacked gain, or the per-head norm's ``||x||^2 / n``) while
    gradients are recorded :class:`RMSNormFunction`; the per-head norm's inference runs PyTorch's too. While
    torch.compile traces: plain differentiable ops (``torch.rms_norm``, decomposed by the compiler), whose backward
    the compiler derives and fuses with what is around them."""
    if w.dim() == 1 and (not records_grad(x, w) or (mean_square and torch.compiler.is_compiling())):
        return torch.rms_norm(x, (x.shape[-1],), w, eps)
    if torch.compiler.is_compiling():
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * stacked_like(w, x)
    return RMSNormFunction.apply(x, w, eps, mean_square)[0]


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(a, b):
        sa = F.silu(a)
        return sa * b, sa

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(inputs[0], inputs[1], output[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, _):
        a, b, sa = ctx.saved_tensors
        return torch.ops.aten.silu_backward(g * b, a), g * sa

    @staticmethod
    def vmap(info, in_dims, a, b):
        return _SwiGLU.apply(*batch_first(info, in_dims, a, b)), (0, 0)


def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b`` (the gate and up projections' outputs), one autograd node while gradients are
    recorded. ``a`` and ``b`` come from two products, not halves of one: ``silu_backward`` on a strided
    half runs at half the speed. While torch.compile traces, the plain product (the compiler derives its backward)."""
    if records_grad(a, b) and not torch.compiler.is_compiling():
        return _SwiGLU.apply(a, b)[0]
    return F.silu(a) * b


class LambdaFunction(torch.autograd.Function):
    """``exp(q1.k1) - exp(q2.k2) + lambda_init`` in float32 (float64 for float64 parameters), with
    its gradient written out: one autograd node instead of the dozen autograd would record. Vectors
    ``(d,)`` give a scalar; stacked ``(K, d)`` give one lambda per model ``(K,)`` (each dot product
    on its own, as the one model computes it)."""

    @staticmethod
    def forward(q1, k1, q2, k2, lambda_init):
        acc = at_least_fp32(q1.dtype)
        q1, k1, q2, k2 = (p if p.dtype == acc else p.to(acc) for p in (q1, k1, q2, k2))
        if q1.dim() == 1:
            e1, e2 = torch.exp(torch.dot(q1, k1)), torch.exp(torch.dot(q2, k2))
        else:
            e1 = torch.exp(torch.stack([torch.dot(a, b) for a, b in zip(q1, k1)]))
            e2 = torch.exp(torch.stack([torch.dot(a, b) for a, b in zip(q2, k2)]))
        return e1 - e2 + lambda_init, _Saved(vectors=(q1, k1, q2, k2), e1=e1, e2=e2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.saved = output[1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, _):
        (q1, k1, q2, k2), e1, e2 = ctx.saved.vectors, ctx.saved.e1, ctx.saved.e2
        g1, g2 = g * e1, -g * e2
        if q1.dim() > 1:
            g1, g2 = g1[:, None], g2[:, None]
        return k1 * g1, q1 * g1, k2 * g2, q2 * g2, None

    @staticmethod
    def vmap(info, in_dims, q1, k1, q2, k2, lambda_init):
        value, saved = LambdaFunction.apply(*batch_first(info, in_dims[:4], q1, k1, q2, k2), lambda_init)
        return (value, saved), (0, None)


def lambda_value(q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, lambda_init: float) -> Tensor:
    """DIFF's lambda (:class:`LambdaFunction`): a scalar for vectors ``(d,)``, ``(K,)`` for stacked ones."""
    return LambdaFunction.apply(q1, k1, q2, k2, lambda_init)[0]


# The LM head's width is padded to a multiple of this (zero rows, their logits -inf) inside the loss: a width that
# is not a multiple ran at half the speed in MKL on the project's CPU (docs/results.md, "Stacked seeds: throughput").
HEAD_PAD = 64


class HeadLoss(torch.autograd.Function):
    """``sum_n weight_n * nll_n``: each row's next-token cross-entropy from hidden states ``h`` ``(N, D)`` and
    the LM head ``w`` ``(V, D)``, or stacked ``(K, N, D)`` / ``(K, V, D)`` (then ``(K,)``). One node: the head's
    product, ``log_softmax`` in float32 (as ``F.cross_entropy``) and the closed-form backward
    ``(softmax - onehot) * weight`` into both products. Under ``torch.vmap`` the mapped dimension is ``K``."""

    @staticmethod
    def forward(h, w, targets, weights):
        one = h.dim() == 2
        if one:
            h, w, targets, weights = h[None], w[None], targets[None], weights[None]
        V = w.shape[1]
        Vp = -(-V // HEAD_PAD) * HEAD_PAD
        wp = w if w.dtype == h.dtype else w.to(h.dtype)  # autocast: the head in the activations' dtype
        wp = wp if Vp == V else F.pad(wp, (0, 0, 0, Vp - V))
        logits = torch.bmm(h, wp.transpose(1, 2))  # (K, N, Vp)
        if Vp != V:
            logits[..., V:] = float("-inf")
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = logp.gather(-1, targets[..., None]).squeeze(-1).neg_()  # (K, N)
        # summed in float64 (each float32 product exact there): a model's loss does not depend on how many
        # zero-weight rows pad it to the longest of a stack, which would reorder a float32 sum
        loss = (nll.double() * weights.double()).sum(1).to(nll.dtype)
        return loss[0] if one else loss, _Saved(h=h, wp=wp, logp=logp, one=one, V=V, w_dtype=w.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.saved = output[1]
        ctx.targets, ctx.weights = inputs[2], inputs[3]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, _):
        s = ctx.saved
        targets, weights = (ctx.targets[None], ctx.weights[None]) if s.one else (ctx.targets, ctx.weights)
        g = g.reshape(-1, 1)  # (K, 1)
        row = (g * weights).to(s.logp.dtype)  # (K, N): dL/dnll_n
        if torch.compiler.is_compiling():  # one pointwise expression, fused with the cast (a scatter is not)
            hit = torch.arange(s.logp.shape[-1], device=targets.device) == targets[..., None]
            dlogits = (s.logp.exp() - hit.to(s.logp.dtype)) * row[..., None]
        else:
            dlogits = s.logp.exp_().mul_(row[..., None])  # logp is this node's own: reused in place
            dlogits.scatter_add_(-1, targets[..., None], -row[..., None])
        dlogits = dlogits.to(s.wp.dtype)
        dh = torch.bmm(dlogits, s.wp) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(dlogits.transpose(1, 2), s.h)[:, :s.V].to(s.w_dtype)
        if s.one:
            dh, dw = (None if t is None else t[0] for t in (dh, dw))
        return dh, dw, None, None

    @staticmethod
    def vmap(info, in_dims, h, w, targets, weights):
        loss, saved = HeadLoss.apply(*batch_first(info, in_dims, h, w, targets, weights))
        return (loss, saved), (0, None)


def head_loss(h: Tensor, w: Tensor, targets: Tensor, weights: Tensor) -> Tensor:
    """:class:`HeadLoss`: ``sum_n weights_n * nll_n`` of the LM head ``w`` on rows ``h``."""
    return HeadLoss.apply(h, w, targets, weights)[0]
