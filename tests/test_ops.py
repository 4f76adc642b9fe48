"""difftx.ops: each function computes for a stacked weight (leading K) what it computes for each model
alone, values and gradients; the one-model forms are PyTorch's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftx.ops import lambda_value, linear, rms_norm, stacked_like, swiglu

K = 3


def _per_model(fn, weights, inputs):
    return torch.stack([fn(x, w) for x, w in zip(inputs, weights)])


def test_stacked_like_broadcasts_a_per_model_weight():
    x = torch.zeros(K, 5, 4, 6)
    assert stacked_like(torch.zeros(6), x).shape == (6,)
    assert stacked_like(torch.zeros(K, 6), x).shape == (K, 1, 1, 6)
    assert stacked_like(torch.zeros(K, 4, 1), x, own_dims=2).shape == (K, 1, 4, 1)


def test_linear_with_and_without_a_residual():
    g = torch.Generator().manual_seed(0)
    x, w, r = torch.randn(K, 7, 5, generator=g), torch.randn(K, 4, 5, generator=g), torch.randn(K, 7, 4, generator=g)
    torch.testing.assert_close(linear(x, w), _per_model(F.linear, w, x))
    torch.testing.assert_close(linear(x, w, r), r + _per_model(F.linear, w, x))
    torch.testing.assert_close(linear(x[0], w[0], r[0]), r[0] + F.linear(x[0], w[0]))
    assert torch.equal(linear(x[0], w[0]), F.linear(x[0], w[0]))


@pytest.mark.parametrize("mean_square", [True, False])
def test_rms_norm_of_a_stack_is_each_models_own(mean_square):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(K, 6, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(K, 8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5, mean_square), (x, w))
    ours = rms_norm(x, w, 1e-5, mean_square)
    ref = _per_model(lambda xi, wi: F.rms_norm(xi, (8,), wi, 1e-5), w, x)
    torch.testing.assert_close(ours, ref)
    gx, gw = torch.autograd.grad(ours.square().sum(), (x, w))
    rx, rw = torch.autograd.grad(ref.square().sum(), (x, w))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    # one model, gradients recorded: the closed-form node (the same arithmetic as a stack's); without: PyTorch's
    one = rms_norm(x[0], w[0], 1e-5, mean_square)
    assert type(one.grad_fn).__name__ == "RMSNormFunctionBackward"
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x[0], w[0], 1e-5, mean_square), F.rms_norm(x[0], (8,), w[0], 1e-5))


def test_swiglu_recorded_or_not_and_lambda_per_model():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (a, b))
    with torch.no_grad():
        assert torch.equal(swiglu(a, b), F.silu(a) * b)
    q = [torch.randn(K, 5, dtype=torch.float64, generator=g) * 0.3 for _ in range(4)]
    stacked = lambda_value(*q, 0.2)
    for i in range(K):
        assert float(stacked[i]) == pytest.approx(float(lambda_value(*(p[i] for p in q), 0.2)), rel=1e-12)


def _vmapped_equals_each(fn, *stacked, rtol=1e-7, atol=1e-9):
    """``torch.vmap(fn)`` over the leading K of every input equals ``fn`` on each model's slice, value and
    gradients (float64): the vmap rules of the Functions are the per-model computation."""
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in stacked]
    got = torch.vmap(fn)(*ins)
    got.square().sum().backward()
    refs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in stacked]
    want = torch.stack([fn(*(t[i] for t in refs)) for i in range(K)])
    want.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for a, b in zip(ins, refs):
        if a.is_floating_point():
            torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol)


def test_every_function_maps_over_a_leading_k():
    """The ops a stack of custom kinds runs under torch.vmap (the general path of difftx.training.stacked)."""
    from difftx.attention.kernels import chunked
    from difftx.attention.masks import AttentionMask
    from difftx.attention.rope import apply_rope, rope_angles
    from difftx.ops import head_loss, lambda_value

    g = torch.Generator().manual_seed(4)
    r = lambda *shape: torch.randn(K, *shape, dtype=torch.float64, generator=g)  # noqa: E731
    for mean_square in (True, False):
        _vmapped_equals_each(lambda x, w: rms_norm(x, w, 1e-5, mean_square), r(3, 4, 8), r(8))
    _vmapped_equals_each(swiglu, r(4, 6), r(4, 6))
    _vmapped_equals_each(lambda a, b, c, d: lambda_value(a, b, c, d, 0.3), *(r(5) * 0.3 for _ in range(4)))
    cos, sin = rope_angles(torch.arange(7)[None], 8, 10000.0, torch.float64)
    _vmapped_equals_each(lambda x: apply_rope(x, cos, sin), r(2, 7, 3, 8))
    targets = torch.randint(0, 11, (K, 9), generator=g)
    _vmapped_equals_each(lambda h, w, t, wt: head_loss(h, w, t, wt), r(9, 6), r(11, 6), targets, r(9).abs())
    docs = (torch.rand(K, 2, 7, generator=g) < 0.3).cumsum(-1)
    for lam in (None, r(1)[:, 0]):
        for mask_docs in (None, docs):
            def attend(q, k, v, *rest, lam_given=lam is not None, with_docs=mask_docs is not None):
                rest = list(rest)
                lam_i = rest.pop(0) if lam_given else None
                mask = AttentionMask(doc_ids=rest.pop(0) if with_docs else None)
                return chunked(q, k, v, lam_i, mask, 0.5)
            C = 1 if lam is None else 2
            extra = [t for t in (lam, mask_docs) if t is not None]
            _vmapped_equals_each(attend, r(2, 7, 4 * C, 8), r(2, 7, 2 * C, 8), r(2, 7, 2, 8 * C), *extra)
