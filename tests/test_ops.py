"""difftx.ops: each function computes for a stacked weight (leading K) what it computes for each model
alone, values and gradients; the one-model forms are PyTorch's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftx.ops import LambdaFunction, linear, rms_norm, stacked_like, swiglu

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
    # one model, gradients recorded: the per-head form is the closed-form node, the block form PyTorch's
    one = rms_norm(x[0], w[0], 1e-5, mean_square)
    assert (type(one.grad_fn).__name__ == "RMSNormFunctionBackward") != mean_square


def test_swiglu_recorded_or_not_and_lambda_per_model():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (a, b))
    with torch.no_grad():
        assert torch.equal(swiglu(a, b), F.silu(a) * b)
    q = [torch.randn(K, 5, dtype=torch.float64, generator=g) * 0.3 for _ in range(4)]
    stacked = LambdaFunction.apply(*q, 0.2)
    for i in range(K):
        assert float(stacked[i]) == pytest.approx(float(LambdaFunction.apply(*(p[i] for p in q), 0.2)), rel=1e-12)
