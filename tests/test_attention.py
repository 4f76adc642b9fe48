"""Attention modules and kernels against the naive float64 formulations of tests/reference.py."""

import pytest
import torch

from difftx.attention import AttentionMask, DiffAttention, DiffAttentionV2, StandardAttention, kernels
from reference import naive_allowed, naive_diff_attention, naive_diff_v2, naive_standard_attention

BACKENDS = ["eager", "chunked", "sdpa"]


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    # several query blocks even at test lengths, so the chunked kernel's block logic is exercised
    monkeypatch.setattr(kernels, "CHUNK_ROWS", 4)


def _randomise(m):
    """Non-trivial values for every parameter (norm gains and lambda included)."""
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def _build(kind, D, H, Hkv, layer):
    if kind == "diff":
        m = DiffAttention(D, H, layer, Hkv)
    elif kind == "diff_v2":
        m = DiffAttentionV2(D, H, Hkv)
    else:
        m = StandardAttention(D, H, Hkv)
    return _randomise(m).double()


NAIVE = {"diff": naive_diff_attention, "diff_v2": naive_diff_v2, "standard": naive_standard_attention}

# (kind, D, H, Hkv, layer): MHA and GQA with n_rep 2 and 4, several layer indices
CASES = [
    ("diff", 32, 2, 2, 0), ("diff", 64, 4, 2, 3), ("diff", 64, 4, 1, 7), ("diff", 48, 3, 3, 1),
    ("standard", 32, 4, 4, 0), ("standard", 64, 8, 2, 0),
    ("diff_v2", 32, 2, 2, 0), ("diff_v2", 64, 4, 2, 0), ("diff_v2", 64, 4, 1, 0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 7, 13])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-D{c[1]}-H{c[2]}-kv{c[3]}-l{c[4]}")
def test_matches_naive_forward_and_backward(case, T, backend):
    kind, D, H, Hkv, layer = case
    m = _build(kind, D, H, Hkv, layer)
    x = torch.randn(2, T, D, dtype=torch.float64, requires_grad=True)
    out = m(x, backend=backend)
    ref = NAIVE[kind](m, x)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *m.parameters()], g)
    want = torch.autograd.grad(ref, [x, *m.parameters()], g, allow_unused=True)
    names = ["x", *[n for n, _ in m.named_parameters()]]
    for name, a, b in zip(names, got, want):
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=lambda s, n=name: f"grad {n}: {s}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["diff", "standard", "diff_v2"])
def test_padding_and_document_masks_match_naive(kind, backend):
    m = _build(kind, 64, 4, 2, 2)
    B, T = 2, 11
    x = torch.randn(B, T, 64, dtype=torch.float64)
    key_valid = torch.ones(B, T, dtype=torch.bool)
    key_valid[0, :3] = False  # left padding in row 0
    doc_ids = torch.tensor([[0] * 5 + [1] * 6, [0] * 2 + [1] * 4 + [2] * 5])
    for mask, allowed in [
        (AttentionMask(key_valid=key_valid), naive_allowed(B, T, key_valid=key_valid)),
        (AttentionMask(doc_ids=doc_ids), naive_allowed(B, T, doc_ids=doc_ids)),
        (AttentionMask(causal=False), naive_allowed(B, T, causal=False)),
    ]:
        out = m(x, mask=mask, backend=backend)
        torch.testing.assert_close(out, NAIVE[kind](m, x, allowed=allowed), rtol=1e-9, atol=1e-10)


def test_eager_maps_are_the_paper_quantities():
    m = _build("diff", 32, 2, 1, 4)
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    out, maps = m(x, return_maps=True)
    torch.testing.assert_close(out, m(x, backend="chunked"))
    B, C_H, T, S = maps.probs.shape
    assert (C_H, T, S) == (4, 6, 6)
    torch.testing.assert_close(maps.probs.sum(-1), torch.ones(1, 4, 6, dtype=torch.float64))
    assert torch.isinf(maps.logits[0, 0, 0, 1]) and maps.probs[0, 0, 0, 1] == 0  # causal
    lam = m.lambda_full()
    torch.testing.assert_close(maps.effective[:, 1], maps.probs[:, 2] - lam * maps.probs[:, 3])
    assert (maps.effective < 0).any(), "a differential map with lambda > 0 has negative entries"


def test_gqa_pairs_keys_of_the_right_group():
    """Head h must use keys 2g, 2g+1 of group g = h // n_rep (not a naive repeat_kv)."""
    m = _build("diff", 64, 4, 2, 0)
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    _, maps = m(x, return_maps=True)
    from difftx.attention.rope import apply_rope, rope_angles

    q = m.q_proj(x).view(1, 5, 8, 8)
    k = m.k_proj(x).view(1, 5, 4, 8)
    cos, sin = rope_angles(torch.arange(5)[None], 8, m.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    for h in range(4):
        g = h // 2
        for c in range(2):
            want = q[0, :, 2 * h + c] @ k[0, :, 2 * g + c].T / 8 ** 0.5
            got = maps.logits[0, 2 * h + c].double()
            tri = torch.tril(torch.ones(5, 5, dtype=torch.bool))
            torch.testing.assert_close(got[tri], want[tri].float().double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["chunked", "sdpa"])
def test_float32_backends_match_eager(backend):
    m = _build("diff", 128, 4, 2, 5).float()
    x = torch.randn(2, 37, 128, requires_grad=True)
    ref = m(x, backend="eager")
    out = m(x, backend=backend)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    gx_ref, = torch.autograd.grad(ref.sum(), x)
    gx, = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-5)


def test_lambda_schedule_and_norm_factor():
    from difftx.attention import lambda_init_for_layer
    assert lambda_init_for_layer(0) == pytest.approx(0.2)
    assert lambda_init_for_layer(100) == pytest.approx(0.8)
    m = DiffAttention(32, 2, 3)
    assert m.lambda_init == pytest.approx(0.8 - 0.6 * torch.exp(torch.tensor(-0.9)).item())
    assert m.lambda_q1.dtype == torch.float32 and m.lambda_q1.std() > 0
    assert set(dict(m.named_parameters())) == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight",
        "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln.weight"}


@pytest.mark.parametrize("kwargs, field", [
    (dict(dim=30, n_heads=2, layer_idx=0), "dim"),           # 30 not divisible by 4
    (dict(dim=24, n_heads=4, layer_idx=0), "dim"),           # component width 3 is odd
    (dict(dim=64, n_heads=4, layer_idx=0, n_kv_heads=3), "n_heads"),
    (dict(dim=64, n_heads=4, layer_idx=-1), "layer_idx"),
    (dict(dim=64, n_heads=4, layer_idx=0, backend="cuda-magic"), "backend"),
])
def test_invalid_module_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DiffAttention(**kwargs)


def test_v2_rejects_pairs_across_groups():
    with pytest.raises(ValueError, match="across groups"):
        DiffAttentionV2(96, 3, 2)  # 6 query heads in 2 groups of 3: pair (2, 3) straddles


def test_maps_only_from_eager():
    m = DiffAttention(32, 2, 0)
    with pytest.raises(ValueError, match="eager"):
        m(torch.randn(1, 3, 32), backend="sdpa", return_maps=True)


def test_optional_backend_name_is_valid_without_its_package(monkeypatch):
    """A config naming 'triton' loads anywhere; without Triton it warns and runs 'auto'."""
    monkeypatch.delitem(kernels.BACKENDS, "triton", raising=False)
    monkeypatch.setattr(kernels, "_warned", set())
    m = DiffAttention(32, 2, 0, backend="triton")
    with pytest.warns(UserWarning, match="unavailable"):
        fn = kernels.resolve_backend("triton", torch.device("cpu"))
    assert fn is kernels.chunked
    assert m(torch.randn(1, 3, 32)).shape == (1, 3, 32)


def test_auto_backend_on_cpu_follows_the_number_of_query_rows(monkeypatch):
    """auto: eager for decoding-sized calls (<= AUTO_EAGER_MAX_ROWS query rows), chunked beyond."""
    cpu = torch.device("cpu")
    n = kernels.AUTO_EAGER_MAX_ROWS
    assert kernels.resolve_backend("auto", cpu, q_len=1) is kernels.eager
    assert kernels.resolve_backend("auto", cpu, q_len=n) is kernels.eager
    assert kernels.resolve_backend("auto", cpu, q_len=n + 1) is kernels.chunked
    assert kernels.resolve_backend("auto", cpu) is kernels.chunked
    assert kernels.resolve_backend("chunked", cpu, q_len=1) is kernels.chunked  # a named backend is kept
    # the module passes its query length: record which kernel each call of a decode resolves to
    seen = []
    real = kernels.resolve_backend

    def spy(name, device, q_len=None):
        fn = real(name, device, q_len)
        seen.append((q_len, fn.__name__))
        return fn

    import difftx.attention.modules as modules

    monkeypatch.setattr(modules, "resolve_backend", spy)
    m = DiffAttention(32, 2, 0)
    m(torch.randn(1, n + 1, 32))
    m(torch.randn(1, 1, 32))
    assert seen == [(n + 1, "chunked"), (1, "eager")]
