"""The CPU fast paths of issue 16 against the ``eager`` oracle (float64): the chunked kernel with
stored and recomputed block maps, its no-grad path and cached decoding, the fused lambda and head
norm, no dtype round trips on float32, and the benchmarks' memory and FLOP measurements."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from difftx import KVCache, Transformer
from difftx.attention import AttentionMask, DiffAttention, DiffAttentionV2, LayerKV, StandardAttention, kernels
from difftx.attention import modules
from difftx.ops import lambda_value, rms_norm
from difftx.config import ModelConfig, baseline_config


class _Ops(TorchDispatchMode):
    """Records every aten op (with its first argument) run inside the context."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args[0] if args else None))
        return func(*args, **(kwargs or {}))


def _randomise(m):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m


def _module(kind, D=64, H=4, Hkv=2):
    m = {"diff": lambda: DiffAttention(D, H, 2, Hkv), "standard": lambda: StandardAttention(D, 2 * H, 2 * Hkv),
         "diff_v2": lambda: DiffAttentionV2(D, H, Hkv)}[kind]()
    return _randomise(m).double()


def _masks(B, T):
    key_valid = torch.ones(B, T, dtype=torch.bool)
    key_valid[0, :3] = False
    doc_ids = torch.tensor([[0] * 5 + [1] * (T - 5), [0] * 2 + [1] * 6 + [2] * (T - 8)])
    return {"causal": AttentionMask(), "padding": AttentionMask(key_valid=key_valid),
            "documents": AttentionMask(doc_ids=doc_ids), "unmasked": AttentionMask(causal=False)}


@pytest.mark.parametrize("store", [0, 6, 10 ** 9], ids=["recompute-all", "mixed", "store-all"])
@pytest.mark.parametrize("kind", ["diff", "standard", "diff_v2"])
@pytest.mark.parametrize("mask_name", ["causal", "padding", "documents", "unmasked"])
def test_chunked_matches_eager_with_stored_and_recomputed_maps(monkeypatch, kind, mask_name, store):
    monkeypatch.setattr(kernels, "CHUNK_ROWS", 4)
    monkeypatch.setattr(kernels, "STORE_MAX_KEYS", store)
    m = _module(kind)
    B, T = 2, 13
    mask = _masks(B, T)[mask_name]
    x = torch.randn(B, T, 64, dtype=torch.float64, requires_grad=True)
    ref, out = m(x, mask=mask, backend="eager"), m(x, mask=mask, backend="chunked")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-11)
    g = torch.randn_like(out)
    want = torch.autograd.grad(ref, [x, *m.parameters()], g)
    got = torch.autograd.grad(out, [x, *m.parameters()], g)
    for (name, _), a, b in zip([("x", x), *m.named_parameters()], got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda s, n=name: f"grad {n}: {s}")


def test_chunked_keeps_maps_only_of_short_blocks(monkeypatch):
    monkeypatch.setattr(kernels, "STORE_MAX_KEYS", 16)
    q = torch.randn(1, 32, 4, 8, requires_grad=True)
    k = torch.randn(1, 32, 4, 8, requires_grad=True)
    v = torch.randn(1, 32, 2, 16, requires_grad=True)
    lam = torch.tensor(0.4, requires_grad=True)
    out = kernels._ChunkedAttention.apply(q, k, v, lam, None, None, True, 0, 8 ** -0.5, 8)[0]
    blocks = out.grad_fn.blocks  # the node is the autograd Function's context
    assert [(s, stored is not None) for _, _, s, stored in blocks] == [(8, True), (16, True), (24, False),
                                                                     (32, False)]
    with torch.no_grad():  # inference: the plain forward, nothing kept and no autograd node
        plain = kernels.chunked(q, k, v, lam, AttentionMask(), 8 ** -0.5)
    assert plain.grad_fn is None
    torch.testing.assert_close(plain, out.detach())


def test_chunked_backward_uses_only_public_ops():
    """The softmax backward is the public formula dP*P - P*rowsum(dP*P), not a private ATen op."""
    m = _module("diff").float()
    x = torch.randn(2, 9, 64, requires_grad=True)
    out = m(x, backend="chunked")
    with _Ops() as ops:
        out.sum().backward()
    names = {str(f) for f, _ in ops.calls}
    assert not any("_softmax_backward_data" in n for n in names), names


@pytest.mark.parametrize("backend", ["chunked", "eager"])
def test_float32_inputs_issue_no_casts(backend):
    """On float32 the softmax, lambda and norm already compute in float32: no tensor is converted
    between floating dtypes (the one cast left turns the integer RoPE positions into floats)."""
    m = DiffAttention(64, 2, 1)
    x = torch.randn(2, 24, 64, requires_grad=True)
    with _Ops() as ops:
        m(x, backend=backend).sum().backward()
    casts = [(a.dtype, a.shape) for f, a in ops.calls
             if f in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and a.is_floating_point()]
    assert casts == []


def test_low_precision_chunked_keeps_float32_softmax():
    """bfloat16 inputs take the casting path: close to float32 eager."""
    m = _randomise(DiffAttention(64, 2, 1))
    x = torch.randn(2, 20, 64)
    ref = m(x, backend="eager")
    mb = DiffAttention(64, 2, 1)
    mb.load_state_dict(m.state_dict())
    mb = mb.to(torch.bfloat16)
    for p in (mb.lambda_q1, mb.lambda_k1, mb.lambda_q2, mb.lambda_k2):
        p.data = p.data.float()  # lambda parameters stay float32 (SPEC section 1)
    xb = x.to(torch.bfloat16).requires_grad_()
    out = mb(xb, backend="chunked")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    out.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in mb.parameters())
    assert mb.lambda_q1.grad.dtype == torch.float32


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_cached_decoding_with_chunked_matches_eager_full_forward(monkeypatch, kind):
    """Prefill and decode through the chunked kernel's no-grad path (cache offset masks)."""
    monkeypatch.setattr(kernels, "CHUNK_ROWS", 4)
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, max_seq_len=32)
    model = Transformer(cfg if kind == "diff" else baseline_config(cfg)).double().eval()
    tokens = torch.randint(0, 50, (2, 14))
    with torch.no_grad():
        full = model(tokens, backend="eager")
        cache = KVCache(model, 2, 16)
        pieces = [model(tokens[:, :9], cache=cache, backend="chunked")]
        for t in range(9, 14):
            pieces.append(model(tokens[:, t:t + 1], cache=cache, backend="chunked"))
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-11)


def test_lambda_and_head_norm_gradients():
    d = 6
    params = [torch.randn(d, dtype=torch.float64, requires_grad=True) * 0.3 for _ in range(4)]
    params = [p.detach().requires_grad_() for p in params]
    assert torch.autograd.gradcheck(lambda *p: lambda_value(*p, 0.35), params)
    o = torch.randn(3, 5, 2, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda o, w: rms_norm(o, w, 1e-5, False), (o, w))
    want = torch.nn.functional.rms_norm(o, (8,), w, 1e-5)
    torch.testing.assert_close(rms_norm(o, w, 1e-5, False), want)


def test_peak_memory_of_chunked_training_is_linear_in_T_and_matches_the_baseline():
    from difftx.bench import peak_memory_mib

    torch.manual_seed(0)
    diff, base = DiffAttention(64, 2, 1), StandardAttention(64, 4)
    peaks = {}
    for T in (512, 1024):
        x = torch.randn(1, T, 64, requires_grad=True)
        for name, m in (("diff", diff), ("base", base)):
            def step(m=m):
                m(x, backend="chunked").sum().backward()
            step()
            peaks[name, T] = peak_memory_mib(step, torch.device("cpu"))
    assert peaks["diff", 1024] <= 1.1 * peaks["base", 1024], peaks
    assert peaks["diff", 1024] < 2.5 * peaks["diff", 512], peaks  # T x T maps kept would make it about 4x
    assert peaks["diff", 512] > 0


def test_flop_model_of_the_throughput_benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "train_throughput.py"
    spec = importlib.util.spec_from_file_location("train_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=2, max_seq_len=512)
    diff, base = Transformer(cfg), Transformer(baseline_config(cfg))
    for T in (64, 300):
        # equal matrix products in chunked and eager: the FLOP ratio is exactly 1
        assert bench.step_flops(diff, 2, T, "chunked") == bench.step_flops(base, 2, T, "chunked")
        assert bench.step_flops(diff, 2, T, "eager") == bench.step_flops(base, 2, T, "eager")
    # the linear part by hand: 6 * tokens * weights
    lin = sum(p.numel() for n, p in base.named_parameters() if n.endswith("proj.weight") or n == "lm_head.weight")
    core = bench.step_flops(base, 1, 64, "chunked") - 6 * 64 * lin
    d, heads = 16, 4
    assert core == 2 * 6 * (2 * heads * 64 * 64 * d)  # 2 layers, one block: (QK + PV) x 3
    assert bench.step_flops(diff, 1, 64, "sdpa") > bench.step_flops(base, 1, 64, "sdpa")


def test_decode_breakdown_benchmark_runs_and_restores_the_library(capsys):
    from difftx.attention import modules

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_breakdown.py"
    spec = importlib.util.spec_from_file_location("decode_breakdown", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    norm, lam = modules.DiffAttention.head_norm, modules.DiffAttention.lambda_full
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--seq-len", "8", "--rounds", "6"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for row in ("| baseline/sdpa |", "| diff |", "| ... and a constant lambda |"):
        assert row in out
    assert "| baseline/sdpa | " in out and "1.000 [1.000, 1.000]" in out  # 6 rounds: an interval exists
    # the cost probes patched the library only inside each call
    assert modules.DiffAttention.head_norm is norm and modules.DiffAttention.lambda_full is lam
    assert bench.PROBE not in kernels.BACKENDS


def test_inference_lambda_is_kept_with_a_cache_until_a_parameter_changes():
    m = DiffAttention(32, 2, 1)
    kept = modules._KEPT.set({})  # as a forward that writes into a KV cache sets it
    try:
        with torch.no_grad():
            first = m.lambda_full()
            assert m.lambda_full() is first  # kept
            m.lambda_q1.add_(0.5)  # in-place update (as an optimizer step does)
            second = m.lambda_full()
            assert second is not first
            with torch.enable_grad():  # grad mode: computed afresh, the same value
                torch.testing.assert_close(second, m.lambda_full().detach())
            m.load_state_dict({k: v.clone() * 0.5 for k, v in m.state_dict().items()})
            third = m.lambda_full()
    finally:
        modules._KEPT.reset(kept)
    assert not torch.equal(third, second)
    torch.testing.assert_close(third, m.lambda_full().detach())
    with torch.no_grad():  # without a cache: computed at every call
        assert m.lambda_full() is not m.lambda_full()
    assert m.lambda_full().requires_grad  # training still differentiates through lambda


@pytest.mark.parametrize("diff, values", [(True, "whole"), (True, "split"), (False, "whole")])
@pytest.mark.parametrize("mask_name", ["causal", "key_valid", "doc_ids"])
def test_eager_without_gradients_equals_its_recorded_path(diff, values, mask_name):
    """``eager`` without autograd (the lean ``bmm`` path decoding takes) gives the recorded path's values bit for bit:
    GQA, one and several query rows, batch > 1, a stack's lambda per sequence, whole and split values, every mask."""
    torch.manual_seed(0)  # split values: DIFF V1's cache layout
    B, S, Hkv, R, d = 3, 9, 2, 2, 8
    C = 2 if diff else 1
    for T, lam in ((1, torch.tensor(0.4)), (4, torch.tensor([0.2, 0.7, -0.1]))):
        lam = lam if diff else None
        q, k = torch.randn(B, T, Hkv * R * C, d), torch.randn(B, S, Hkv * C, d)
        store = torch.randn(B, Hkv * 2, S + 3, d)[:, :, :S]  # a cache buffer's prefix
        v = store.unflatten(1, (Hkv, 2)).permute(0, 3, 1, 2, 4) if values == "split" else torch.randn(B, S, Hkv, C * d)
        extra = {"causal": {}, "key_valid": {"key_valid": torch.rand(B, S) > 0.3},
                 "doc_ids": {"doc_ids": torch.randint(0, 2, (B, S)).sort(-1).values}}[mask_name]
        mask = AttentionMask(q_offset=S - T, **extra)
        with torch.no_grad():
            fast = kernels.eager(q, k, v, lam, mask, 0.3)
        recorded = kernels.eager(q.clone().requires_grad_(), k, v, lam, mask, 0.3)
        assert recorded.requires_grad and fast.shape == recorded.shape
        assert torch.equal(fast, recorded.detach())


def test_inference_head_norm_gain_is_kept_with_a_cache_until_a_parameter_changes():
    m = _randomise(DiffAttention(32, 2, 1))
    o = torch.randn(2, 3, 2, 16)
    kept = {}
    token = modules._KEPT.set(kept)
    try:
        with torch.no_grad():
            first = m.head_norm(o)
            gain = kept["_gain_cache"][1]
            assert torch.equal(m.head_norm(o), first) and kept["_gain_cache"][1] is gain  # kept
            m.subln.weight.mul_(2.0)  # in-place update (as an optimizer step does)
            second = m.head_norm(o)
    finally:
        modules._KEPT.reset(token)
    torch.testing.assert_close(second, 2 * first)
    assert torch.equal(second, m.head_norm(o.requires_grad_()).detach())  # the recorded path: the same values


@pytest.mark.parametrize("attention", ["diff", "diff_v2"])
def test_a_write_through_data_is_read_by_the_next_forward_and_generation(attention):
    """``p.data.fill_`` (EMA code, hand-made loaders) moves no version counter: lambda and the gain, once kept on the
    module, outlived it in every later forward without gradients (1.15 apart on the logits) and in generate."""
    from difftx.generation import generate

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=32, attention=attention)
    model = Transformer(cfg).eval()
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        model(x)
    generate(model, [[1, 2, 3]], max_new_tokens=4, temperature=0)
    for layer in model.layers:
        for name, p in layer.attn.named_parameters():
            if name.startswith("lambda_") or name == "subln.weight":
                p.data.mul_(1.7).add_(0.3)
    with torch.no_grad():
        no_grad = model(x)
    torch.testing.assert_close(no_grad, model(x).detach(), rtol=0, atol=1e-6)
    fresh = Transformer(cfg).eval()
    fresh.load_state_dict(model.state_dict())
    assert generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=6, temperature=0) == \
        generate(fresh, [[1, 2, 3], [4, 5]], max_new_tokens=6, temperature=0)
    cache = KVCache(model, 1, 16)
    with torch.no_grad():
        steps = [model(x[:1, :4], cache=cache)[:, -1]]
        steps += [model(x[:1, t:t + 1], cache=cache)[:, -1] for t in range(4, 8)]
    torch.testing.assert_close(torch.stack(steps, 1), model(x[:1]).detach()[:, 3:], rtol=0, atol=1e-5)


# --- issue 16, decode: DIFF V1's value cache kept as two contiguous d-wide halves per group on CPU ---


@pytest.mark.parametrize("R", [1, 2])
def test_eager_reads_split_values_like_whole_rows(R):
    """``eager`` on split values ``(B, S, Hkv, 2, d)`` (strided, as the cache hands them over) equals
    ``eager`` on the joined ``(B, S, Hkv, 2d)`` values: decode and multi-row calls, maps included."""
    torch.manual_seed(0)
    B, S, Hkv, d = 3, 9, 2, 4
    for T in (1, 3):
        q = torch.randn(B, T, 2 * Hkv * R, d, dtype=torch.float64)
        k = torch.randn(B, S, 2 * Hkv, d, dtype=torch.float64)
        store = torch.randn(B, 2 * Hkv, S + 2, d, dtype=torch.float64)[:, :, :S]  # a cache buffer's prefix
        v_split = store.unflatten(1, (Hkv, 2)).permute(0, 3, 1, 2, 4)  # (B, S, Hkv, 2, d), a view
        v_joined = v_split.flatten(3)  # (B, S, Hkv, 2d), a copy
        key_valid = torch.ones(B, S, dtype=torch.bool)
        key_valid[1, :2] = False
        mask = AttentionMask(key_valid=key_valid, q_offset=S - T)
        lam = torch.tensor(0.37, dtype=torch.float64)
        out, maps = kernels.eager(q, k, v_split, lam, mask, d ** -0.5, return_maps=True)
        ref, ref_maps = kernels.eager(q, k, v_joined, lam, mask, d ** -0.5, return_maps=True)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(maps.effective, ref_maps.effective, rtol=0, atol=0)
        assert kernels.eager.split_values and not getattr(kernels.chunked, "split_values", False)


def test_diff_cache_stores_value_halves_on_cpu_and_baseline_layout_is_unchanged():
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=32)
    diff, base = Transformer(cfg).eval(), Transformer(baseline_config(cfg)).eval()
    d = cfg.head_dim
    tokens = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        cache = KVCache(diff, 2, 8)
        diff(tokens, cache=cache)
        lay, attn = cache.layers[0], diff.layers[0].attn
        assert lay.v_parts == 2 and lay.v.shape == (2, 2, 8, d)  # (B, 2*Hkv, S_max, d)
        assert lay.v.numel() == 2 * 1 * 8 * 2 * d  # the same bytes as the whole-row layout
        x = diff.layers[0].attn_norm(diff.tok_embeddings(tokens))
        v = attn.v_proj(x).view(2, 5, 1, 2 * d)  # (B, T, Hkv, 2d)
        torch.testing.assert_close(lay.v[:, 0, :5], v[:, :, 0, :d])
        torch.testing.assert_close(lay.v[:, 1, :5], v[:, :, 0, d:])
        bcache = KVCache(base, 2, 8)
        assert bcache.layers[0].v_parts == 1 and bcache.layers[0].v.shape == (2, 2, 8, d)
    assert attn.cache_value_parts(torch.device("cpu")) == 2
    assert attn.cache_value_parts(torch.device("meta")) == 1  # GPU kernels read whole rows
    with pytest.raises(ValueError, match="v_parts"):
        LayerKV.empty(1, 4, (2, 4), (1, 6), v_parts=4)


_DECODE_VARIANTS = {
    "diff": {},
    "diff_nosub": dict(subtract=False),
    "diff_nonorm": dict(head_norm=False),
    "diff_v2": dict(attention="diff_v2"),
    "standard": dict(attention="standard"),
}


@pytest.mark.parametrize("variant", list(_DECODE_VARIANTS))
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("n_kv", [2, 1])
@pytest.mark.parametrize("backend", [None, "chunked", "sdpa"])
def test_cached_decoding_with_split_value_cache_matches_eager_full_forward(variant, batch, n_kv, backend):
    """Prefill, a 3-token continuation and single-token steps through the cache (its split values
    read in place by ``eager``, joined for the other kernels) equal the uncached ``eager`` forward,
    with left padding of different lengths per row, with and without GQA."""
    torch.manual_seed(batch + 10 * n_kv)
    cfg = ModelConfig(**{**dict(vocab_size=50, dim=32, n_layers=2, n_heads=2, n_kv_heads=n_kv, max_seq_len=32),
                         **_DECODE_VARIANTS[variant]})
    model = Transformer(cfg).double().eval()
    L = 14
    tokens = torch.randint(1, 50, (batch, L))
    pad = torch.arange(batch) % 4  # left padding: 0..3 tokens per row
    mask = (torch.arange(L)[None] >= pad[:, None]).long()  # (B, L)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(tokens, positions=positions, attention_mask=mask, backend="eager")
        cache = KVCache(model, batch, 16)
        pieces, t = [], 0
        for n in (6, 3, 1, 1, 1, 1, 1):
            pieces.append(model(tokens[:, t:t + n], positions=positions[:, t:t + n], attention_mask=mask[:, :t + n],
                                cache=cache, backend=backend))
            t += n
    assert t == L and cache.length == L
    valid = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[valid], full[valid], rtol=1e-10, atol=1e-11)
