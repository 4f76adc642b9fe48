"""The ``flex`` backend (PyTorch flex_attention) against the naive float64 oracle.

PyTorch runs flex_attention's backward on GPUs only, so on CPU the forward pass is compared
directly, and the backend's own plumbing (component split, GQA, lambda) is checked for
gradients with a differentiable stand-in for flex_attention that has its calling convention.
"""

import pytest
import torch

from difftx.attention import AttentionMask, kernels
from difftx.attention import flex as flex_mod
from reference import naive_allowed

pytestmark = pytest.mark.skipif(not flex_mod.available(), reason="needs torch.nn.attention.flex_attention")

from test_attention import CASES, NAIVE, _build  # noqa: E402


@pytest.mark.parametrize("T", [1, 7, 13])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-D{c[1]}-H{c[2]}-kv{c[3]}-l{c[4]}")
def test_forward_matches_naive(case, T):
    kind, D, H, Hkv, layer = case
    m = _build(kind, D, H, Hkv, layer)
    x = torch.randn(2, T, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(m(x, backend="flex"), NAIVE[kind](m, x), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_padding_and_document_masks_match_naive(kind):
    m = _build(kind, 64, 4, 2, 2)
    B, T = 2, 11
    x = torch.randn(B, T, 64, dtype=torch.float64)
    key_valid = torch.ones(B, T, dtype=torch.bool)
    key_valid[0, :3] = False
    doc_ids = torch.tensor([[0] * 5 + [1] * 6, [0] * 2 + [1] * 4 + [2] * 5])
    with torch.no_grad():
        for mask, allowed in [
            (AttentionMask(key_valid=key_valid), naive_allowed(B, T, key_valid=key_valid)),
            (AttentionMask(doc_ids=doc_ids), naive_allowed(B, T, doc_ids=doc_ids)),
            (AttentionMask(doc_ids=doc_ids, key_valid=key_valid),
             naive_allowed(B, T, doc_ids=doc_ids, key_valid=key_valid)),
            (AttentionMask(causal=False), naive_allowed(B, T, causal=False)),
        ]:
            out = m(x, mask=mask, backend="flex")
            torch.testing.assert_close(out, NAIVE[kind](m, x, allowed=allowed), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_one_row_masks_and_0_1_key_valid_match_eager(kind):
    """A ``(1, S)`` key_valid or doc_ids serves every sequence (``AttentionMask.check`` allows it, every other
    backend reads it so); a key_valid of 0/1 in another dtype reads as the other backends read it. flex indexed
    the one row by batch (IndexError) and took only bool."""
    m = _build(kind, 64, 4, 2, 2)
    B, T = 3, 9
    x = torch.randn(B, T, 64, dtype=torch.float64)
    one_valid = torch.tensor([[False, True] + [True] * (T - 2)])
    one_docs = torch.tensor([[0] * 4 + [1] * (T - 4)])
    full_valid = torch.rand(B, T) > 0.3
    with torch.no_grad():
        for mask in (AttentionMask(key_valid=one_valid), AttentionMask(doc_ids=one_docs),
                     AttentionMask(doc_ids=one_docs, key_valid=full_valid),
                     AttentionMask(key_valid=full_valid.long()), AttentionMask(key_valid=one_valid.to(torch.uint8))):
            torch.testing.assert_close(m(x, mask=mask, backend="flex"), m(x, mask=mask, backend="eager"),
                                       rtol=1e-9, atol=1e-10)


def test_batch_block_mask_is_rebuilt_for_a_new_mask():
    """Per-batch block masks are reused only for the same mask object (one forward's layers)."""
    doc_a = torch.tensor([[0, 0, 1, 1, 1]])
    doc_b = torch.tensor([[0, 1, 1, 1, 1]])
    ma, mb = AttentionMask(doc_ids=doc_a), AttentionMask(doc_ids=doc_b)
    bm_a = flex_mod.block_mask(ma, 1, 5, 5, torch.device("cpu"))
    assert flex_mod.block_mask(ma, 1, 5, 5, torch.device("cpu")) is bm_a
    bm_b = flex_mod.block_mask(mb, 1, 5, 5, torch.device("cpu"))
    assert bm_b is not bm_a
    dense = lambda bm: bm.to_dense()  # noqa: E731  (block-level view; equal here: one block)
    assert torch.equal(dense(bm_a), dense(bm_b))  # same tiles touched, different element mask
    assert flex_mod.block_mask(AttentionMask(causal=False), 1, 5, 5, torch.device("cpu")) is None


def test_decode_with_kv_cache_matches_eager():
    """Generation: left-padded prompts (padding mask), then one query row per step over a
    growing cache (offset mask)."""
    from difftx.config import ModelConfig
    from difftx.generation import generate
    from difftx.model import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=64)
    model = Transformer(cfg).eval()
    prompts = [[5, 9, 12, 3, 40, 7, 1, 2, 8], [11, 4, 30]]
    outs = {b: generate(model, prompts, max_new_tokens=6, temperature=0.0, backend=b) for b in ("eager", "flex")}
    assert outs["eager"] == outs["flex"]


def _sdpa_stand_in(q, k, v, block_mask=None, scale=None, enable_gqa=False):
    """flex_attention's calling convention, differentiable on CPU (dense mask from the BlockMask)."""
    allowed = None
    if block_mask is not None:
        from torch.nn.attention.flex_attention import create_mask

        allowed = create_mask(block_mask.mask_mod, q.shape[0] if block_mask.shape[0] > 1 else None, None,
                              q.shape[2], k.shape[2], device=q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                            enable_gqa=enable_gqa)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "diff_v2"], ids=lambda c: f"{c[0]}-H{c[2]}-kv{c[3]}")
def test_backend_gradients_with_a_stand_in(case, monkeypatch):
    kind, D, H, Hkv, layer = case
    monkeypatch.setattr(flex_mod, "_flex_fn", lambda device, needs_grad: _sdpa_stand_in)
    m = _build(kind, D, H, Hkv, layer)
    x = torch.randn(2, 7, D, dtype=torch.float64, requires_grad=True)
    doc_ids = torch.tensor([[0] * 3 + [1] * 4, [0] * 7])
    mask = AttentionMask(doc_ids=doc_ids)
    out = m(x, mask=mask, backend="flex")
    ref = m(x, mask=mask, backend="eager")
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, [x, *m.parameters()], g), torch.autograd.grad(ref, [x, *m.parameters()], g)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_cpu_training_is_refused_with_a_clear_error():
    m = _build("diff", 32, 2, 2, 0)
    x = torch.randn(1, 5, 32, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="no backward pass on CPU.*chunked"):
        m(x, backend="flex")


def test_flex_is_a_named_backend_but_never_auto():
    assert "flex" in kernels.backend_names()
    assert kernels.resolve_backend("flex", torch.device("cpu")) is flex_mod.flex
    for q_len in (1, 100, None):
        assert kernels.resolve_backend("auto", torch.device("cpu"), q_len) is not flex_mod.flex
