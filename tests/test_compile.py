"""torch.compile on the whole model: every built-in kind traces into one graph (no graph break) for the training
step (forward, the fused loss, backward) and for the no-grad forward, and computes what the eager model computes;
the lambda warm-up's factor is an input of the graph (changing it does not recompile); the compiled per-head norm
fuses with the core's combine; the trainer's AdamW is fused on CUDA and multi-tensor elsewhere.

The fullgraph checks use the ``aot_eager`` backend (dynamo and AOT autograd, no code generation: a few seconds a
kind). The default run checks ``standard`` and ``diff``; ``DIFFTX_TEST_COMPILE=1`` (``make test-extras``) every
built-in kind, their variants and the inductor checks, which generate and build C++ (tens of seconds each)."""

from __future__ import annotations

import os
import re
import types

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from difftx.attention import ATTENTIONS, DiffAttention
from difftx.attention.registry import BUILTIN_KINDS
from difftx.config import ModelConfig
from difftx.model import Transformer
from difftx.training.config import TrainConfig
from difftx.training.optim import adamw_implementation, build_optimizer, set_lambda_scale

FULL = os.environ.get("DIFFTX_TEST_COMPILE") == "1"
full_only = pytest.mark.skipif(not FULL, reason="set DIFFTX_TEST_COMPILE=1 (make test-extras) to run")
BUILTIN = [name for name, cls in ATTENTIONS.items() if cls in BUILTIN_KINDS.values()]
# (kind, backend): sdpa is the GPU's path, eager the oracle (chunked, CPU-only, among the variants)
CASES = [(k, b) for k in BUILTIN for b in ("sdpa", "eager")] if FULL else \
    [("standard", "sdpa"), ("diff", "sdpa"), ("diff", "eager")]
TOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(kind: str, backend: str, n_layers: int = 1, **overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=n_layers, n_heads=2, attention=kind,
                                   backend=backend, max_seq_len=16, **overrides))


def _batch(B: int = 2, T: int = 16):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)


def _loss_and_grads(model, fn, **kw):
    model.zero_grad(set_to_none=True)
    loss = fn(**kw)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _check_compiled(model, counter, **kw):
    """One graph for the training step and one for the no-grad forward (``fullgraph`` raises at a graph break),
    each equal to the eager model's, gradients included."""
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    tokens, targets = _batch()
    loss, grads = _loss_and_grads(model, lambda: compiled(tokens, targets=targets, **kw))
    ref, ref_grads = _loss_and_grads(model, lambda: model(tokens, targets=targets, **kw))
    torch.testing.assert_close(loss, ref, rtol=TOL, atol=TOL)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=TOL, atol=TOL, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens, **kw), model(tokens, **kw), rtol=TOL, atol=TOL)
    assert counter.frame_count == 2, counter.frame_count  # training and no-grad: one graph each, no break


@pytest.mark.parametrize("kind, backend", CASES)
def test_every_kind_compiles_to_one_graph_and_matches_eager(kind, backend):
    _check_compiled(_model(kind, backend), CompileCounterWithBackend("aot_eager"))


VARIANTS = {  # the options that take other code paths
    "diff_gqa_docs": ("diff", "sdpa", {"n_kv_heads": 1}, True),
    "diff_no_subtract_no_norm": ("diff", "sdpa", {"subtract": False, "head_norm": False}, False),
    "diff_chunked": ("diff", "chunked", {}, True),
    "standard_head_norm_scale": ("standard", "sdpa", {"head_norm": True, "out_scale": 0.5, "qkv_bias": True}, False),
    "gated_headwise": ("gated", "eager", {"gate": "headwise"}, False),
    "dex_some_heads": ("dex", "sdpa", {"n_layers": 2, "options": {"heads": [[1], []]}}, False),
}


@full_only
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kind_variants_compile_to_one_graph(variant):
    kind, backend, overrides, docs = VARIANTS[variant]
    kw = {"doc_ids": torch.tensor([[0] * 7 + [1] * 9, [0] * 16])} if docs else {}
    _check_compiled(_model(kind, backend, **overrides), CompileCounterWithBackend("aot_eager"), **kw)


@pytest.mark.parametrize("kind", ["diff", "converted", "dex"] if FULL else ["diff"])
def test_lambda_warmup_factor_changes_without_recompiling(kind):
    """The trainer sets the factor before each step (set_lambda_scale); the compiled model reads it as a tensor: three
    factors, one graph, each step's loss and gradients the eager model's at that factor."""
    model = _model(kind, "sdpa")
    if kind != "diff":  # lambda is exactly 0 at conversion: move it, so that the factor changes the loss
        with torch.no_grad():
            for block in model.layers:
                block.attn.lambda_q1.add_(0.3)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    tokens, targets = _batch()
    losses = []
    for scale in (0.0, 0.25, 1.0):
        set_lambda_scale(model, scale)
        loss, grads = _loss_and_grads(model, lambda: compiled(tokens, targets=targets))
        ref, ref_grads = _loss_and_grads(model, lambda: model(tokens, targets=targets))
        torch.testing.assert_close(loss, ref, rtol=TOL, atol=TOL)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=TOL, atol=TOL, msg=name)
        losses.append(float(loss))
    assert counter.frame_count == 1
    assert len(set(losses)) == 3  # the factor did change what the graph computed
    assert "_lambda_factor" not in str(model.state_dict().keys())  # never saved
    assert model.layers[0].attn.lambda_scale == 1.0


def test_training_config_takes_a_lambda_warmup_with_compile(tmp_path):
    config = TrainConfig(model={"dim": 32, "n_layers": 1, "n_heads": 2, "attention": "converted"}, steps=10,
                         warmup_steps=1, lambda_warmup=5, compile=True, out_dir=str(tmp_path))
    assert config.lambda_warmup == 5 and config.compile


def test_adamw_is_fused_on_cuda_only(tmp_path):
    """fused on CUDA when every parameter is a floating CUDA tensor (decided from the parameters: faked here),
    foreach otherwise; the CPU default unchanged (tests/test_trainer_trajectory.py pins its trajectory)."""
    cuda = types.SimpleNamespace(device=torch.device("cuda", 0), is_floating_point=lambda: True)
    cuda_int = types.SimpleNamespace(device=torch.device("cuda", 0), is_floating_point=lambda: False)
    cpu = torch.zeros(2)
    assert adamw_implementation([cuda, cuda]) == "fused"
    assert adamw_implementation([cuda, cpu]) == "foreach"
    assert adamw_implementation([cuda, cuda_int]) == "foreach"
    assert adamw_implementation([]) == "foreach"
    model = _model("diff", "eager")
    config = TrainConfig(model={"dim": 32, "n_layers": 1, "n_heads": 2}, steps=2, warmup_steps=1,
                         out_dir=str(tmp_path))
    plain = build_optimizer(model, config)
    assert plain.defaults["foreach"] is True and not plain.defaults["fused"]
    fused = build_optimizer(model, config, implementation="fused")  # the choice as on CUDA (PyTorch fuses on CPU too)
    assert fused.defaults["fused"] is True and not fused.defaults["foreach"]
    with pytest.raises(ValueError, match="implementation"):
        build_optimizer(model, config, implementation="fast")


def _inductor_code(fn, *args):
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn, *args)[1]


@full_only
def test_head_norm_and_combine_fuse_under_inductor():
    """One DiffAttention layer in bfloat16 (autocast) under CPU inductor: the forward writes no float32 tensor larger
    than one value per row and head (the norm's statistics); the core's combine ``O1 - lam O2``, the per-head RMSNorm
    and ``(1 - lambda_init)`` are one generated loop with one reduction."""
    torch.manual_seed(0)
    B, T, D, H = 2, 32, 64, 2
    layer = DiffAttention(D, H, 3, backend="sdpa")
    x = torch.randn(B, T, D, requires_grad=True)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.compile(layer, fullgraph=True)(x)
        y.float().square().sum().backward()
        return y

    forward = _inductor_code(step, x)[0]
    call = forward[forward.index("def call("):]
    for shape, dtype in re.findall(r"empty_strided_cpu\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)", call):
        numel = 1
        for n in filter(None, (s.strip() for s in shape.split(","))):
            numel *= int(n)
        assert dtype != "float32" or numel <= B * T * H, (shape, dtype)
    fused = [k for k in re.findall(r"(cpp_fused_\w+) = async_compile", forward) if "rsqrt" in k]
    assert len(fused) == 1 and "sub" in fused[0], fused
