"""Attention to answer / noise, outliers and low-bit logits on hand-made tensors and tiny models."""

import math

import pytest
import torch

from difftx import Transformer, preset
from difftx.attention.kernels import BACKENDS, eager
from difftx.attention.masks import AttentionMask
from difftx.eval.attention_noise import (
    attention_to_answer,
    best_head_row,
    layer_mass,
    normalized_rows,
    role_mass,
    summary,
)
from difftx.eval.capture import AttentionCapture
from difftx.eval.lm import evaluate_lm
from difftx.eval.needle import ROLE_ANSWER, ROLE_FILLER, NeedleBlock, evaluate_needles, needle_samples
from difftx.eval.outliers import MagnitudeStats, activation_outliers, magnitude_stats
from difftx.eval.quant import absmax_quantize, quantization_sweep, quantized_kernel, register_quantized_backend


# ---------------------------------------------------------------------------------------------
# attention to answer / noise
# ---------------------------------------------------------------------------------------------

def test_role_mass_with_negative_entries():
    # keys: BOS, answer, filler, filler, needle
    row = torch.tensor([0.2, 0.8, -0.4, 0.4, 0.2])  # L1 norm 2.0
    answer = torch.tensor([0, 1, 0, 0, 0], dtype=torch.bool)
    noise = torch.tensor([0, 0, 1, 1, 0], dtype=torch.bool)
    torch.testing.assert_close(normalized_rows(row), row / 2)
    a, n = role_mass(row, answer), role_mass(row, noise)
    assert float(a["signed"]) == pytest.approx(0.4)
    assert float(a["absolute"]) == pytest.approx(0.4)
    assert float(a["positive"]) == pytest.approx(0.4)
    assert float(n["signed"]) == pytest.approx(0.0)  # -0.2 + 0.2
    assert float(n["absolute"]) == pytest.approx(0.4)
    assert float(n["positive"]) == pytest.approx(0.2)
    # a sign-flipped map (the components swapped) keeps absolute mass, flips signed mass
    neg = role_mass(-row, answer)
    assert float(neg["signed"]) == pytest.approx(-0.4) and float(neg["absolute"]) == pytest.approx(0.4)
    assert float(neg["positive"]) == pytest.approx(0.0)


def test_layer_mass_mean_and_best_heads():
    answer = torch.tensor([False, True, False, False])
    noise = torch.tensor([False, False, True, True])
    rows = torch.tensor([[0.0, 1.0, 0.0, 0.0],      # head 0: all on the answer
                         [0.5, 0.0, 0.25, 0.25],    # head 1: half noise
                         [0.0, 0.5, -0.5, 0.0]])    # head 2: a DIFF head with a negative entry
    m = layer_mass(rows, answer, noise, layer=3)
    assert m.layer == 3
    assert m.answer_heads["signed"] == pytest.approx([1.0, 0.0, 0.5])
    assert m.answer_mean["signed"] == pytest.approx(0.5)
    assert m.answer_best["signed"] == pytest.approx(1.0)
    assert m.noise_heads["signed"] == pytest.approx([0.0, 0.5, -0.5])
    assert m.noise_heads["absolute"] == pytest.approx([0.0, 0.5, 0.5])
    assert m.noise_heads["positive"] == pytest.approx([0.0, 0.5, 0.0])
    assert m.noise_best["absolute"] == pytest.approx(0.0)
    assert m.noise_mean["absolute"] == pytest.approx(1 / 3)
    # softmax rows: the three variants coincide
    p = torch.softmax(torch.randn(2, 4), -1)
    s = layer_mass(p, answer, noise)
    assert s.answer_mean["signed"] == pytest.approx(s.answer_mean["absolute"]) == \
        pytest.approx(s.answer_mean["positive"])
    # per-sample masks: (N, H, S) rows with (N, S) masks average per head over samples
    two = layer_mass(torch.stack([rows, rows.flip(-1)]), torch.stack([answer, answer.flip(-1)]),
                     torch.stack([noise, noise.flip(-1)]))
    assert two.answer_heads["signed"] == pytest.approx(m.answer_heads["signed"])


def test_attention_to_answer_keeps_no_whole_map(monkeypatch):
    """Only the last-position row of each prompt's map is kept: once the loop is done, every
    captured (H, S, S) map but the last prompt's (still held by the capture) has been freed."""
    import gc
    import weakref

    from difftx.eval import attention_noise

    task = NeedleBlock(n_keys=16, n_filler=20, context_len=48)
    torch.manual_seed(0)
    model = Transformer(preset("test", vocab_size=task.vocab_size)).eval()
    samples = needle_samples(task, 2, 1, 0.5, 4, seed=0)
    refs: list[list] = []  # per prompt: weak references to its captured maps

    class Recording(AttentionCapture):
        def __exit__(self, *exc):
            refs.append([weakref.ref(c.effective) for calls in self.maps for c in calls])
            return super().__exit__(*exc)

    def check(*args, **kw):  # called after the loop, while the kept rows are alive
        gc.collect()
        alive = [i for i, rs in enumerate(refs[:-1]) if any(r() is not None for r in rs)]
        assert alive == [], f"prompts {alive} still hold their whole attention map"
        return layer_mass(*args, **kw)

    monkeypatch.setattr(attention_noise, "AttentionCapture", Recording)
    monkeypatch.setattr(attention_noise, "layer_mass", check)
    attention_to_answer(model, samples, keep_rows=1)
    assert len(refs) == 4 and all(refs)


def test_attention_to_answer_on_tiny_model():
    task = NeedleBlock(n_keys=16, n_filler=20, context_len=48)
    torch.manual_seed(0)
    model = Transformer(preset("test", vocab_size=task.vocab_size)).eval()
    samples = needle_samples(task, 2, 1, 0.5, 3, seed=0)
    res = attention_to_answer(model, samples, keep_rows=1)
    assert res["n_samples"] == 3 and len(res["layers"]) == 2 and len(res["rows"]) == 1
    assert len(res["rows"][0]["layers"][0]) == 48 and len(res["rows"][0]["roles"]) == 48
    # recompute layer 1, head-mean signed answer mass, by hand from a capture
    manual = []
    for s in samples:
        with AttentionCapture(model) as cap:
            model(torch.tensor([s.prompt]))
        row = cap.last(1).effective[0, :, -1]  # (H, S)
        r = row / row.abs().sum(-1, keepdim=True)
        manual.append(r[:, torch.tensor(s.roles) == ROLE_ANSWER].sum(-1))
    expect = torch.stack(manual).mean(0)
    assert res["layers"][1]["answer_heads"]["signed"] == pytest.approx(expect.tolist(), abs=1e-6)
    assert res["layers"][1]["answer_mean"]["signed"] == pytest.approx(float(expect.mean()), abs=1e-6)
    best = best_head_row(res)
    heads = res["layers"][best["layer"]]["answer_heads"]["absolute"]
    assert best["answer_mass"] == max(max(x["answer_heads"]["absolute"]) for x in res["layers"])
    assert heads[best["head"]] == best["answer_mass"] and len(best["row"]) == 48
    mean_row = torch.tensor(res["rows"][0]["heads"][1]).mean(0)
    assert mean_row.tolist() == pytest.approx(res["rows"][0]["layers"][1], abs=1e-6)
    # an untrained model spreads attention: noise mass dwarfs answer mass
    sm = summary(res, "absolute")
    n_fill = sum(r == ROLE_FILLER for r in samples[0].roles)
    assert sm["noise"] > sm["answer"] and n_fill > 20


# ---------------------------------------------------------------------------------------------
# outliers
# ---------------------------------------------------------------------------------------------

def test_magnitude_stats_hand_made():
    v = torch.arange(1, 1001, dtype=torch.float32)
    v = v * torch.where(torch.arange(1000) % 2 == 0, 1.0, -1.0)  # signs do not matter
    v = torch.cat([v, torch.tensor([float("-inf"), float("nan")])])  # masked entries are ignored
    s = magnitude_stats(v[torch.randperm(v.numel())])
    assert (s["top1"], s["top2"], s["top3"], s["top10"], s["top100"]) == (1000, 999, 998, 991, 901)
    assert s["median"] == pytest.approx(500.5)
    assert s["top1_over_median"] == pytest.approx(1000 / 500.5)
    assert s["count"] == 1000 and s["median_exact"]
    # streaming in pieces gives the same exact answer
    st = MagnitudeStats()
    for chunk in v.split(77):
        st.update(chunk)
    assert st.result()["top100"] == 901 and st.result()["median"] == pytest.approx(500.5)


def test_magnitude_stats_subsampled_median_is_close_and_seeded():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(200_000, generator=g) * 10  # |x| uniform on [0, 10]: median 5
    a, b = MagnitudeStats(sample_size=20_000, seed=1), MagnitudeStats(sample_size=20_000, seed=1)
    for chunk in x.split(30_000):
        a.update(chunk)
        b.update(chunk)
    ra = a.result()
    assert not ra["median_exact"] and abs(ra["median"] - 5.0) < 0.15
    assert ra["median"] == b.result()["median"]  # seeded
    assert ra["top1"] == pytest.approx(float(x.max()))


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_activation_outliers_on_tiny_model(kind):
    torch.manual_seed(0)
    cfg = preset("test") if kind == "diff" else preset("test", attention="standard", n_heads=4)
    model = Transformer(cfg).eval()
    windows = torch.randint(0, 64, (3, 10))
    out = activation_outliers(model, windows, batch_size=2)
    maps = 4  # diff: 2 heads x 2 maps; standard: 4 heads
    assert out["attention_logits"]["count"] == 2 * maps * 3 * (10 * 11 // 2)  # causal entries only
    assert out["hidden_states"]["count"] == 2 * 3 * 10 * 32
    with AttentionCapture(model, hidden_states=True) as cap:
        model(windows)
    top = max(float(c[0].logits[torch.isfinite(c[0].logits)].abs().max()) for c in cap.maps)
    assert out["attention_logits"]["top1"] == pytest.approx(top)
    assert out["hidden_states"]["top1"] == pytest.approx(max(float(h[0].abs().max()) for h in cap.hidden))
    assert activation_outliers(model, windows, token_budget=10)["tokens"] == 10


# ---------------------------------------------------------------------------------------------
# low-bit attention logits
# ---------------------------------------------------------------------------------------------

def test_absmax_quantize_exact_values():
    inf = float("inf")
    x = torch.tensor([[1.0, -0.5, 0.26, -inf],
                      [0.1, 0.05, 0.0, -0.1]])
    # 3 bits: qmax 3; row 0 step 1/3: 1 -> 1, -0.5 -> round(-1.5) = -2 steps, 0.26 -> 1 step
    q = absmax_quantize(x, 3, "row")
    torch.testing.assert_close(q[0, :3], torch.tensor([1.0, -2 / 3, 1 / 3]))
    assert q[0, 3] == -inf  # masked entries stay masked
    # row 1 has its own step 0.1/3: 0.05 -> round(1.5) = 2 steps
    torch.testing.assert_close(q[1], torch.tensor([0.1, 2 * 0.1 / 3, 0.0, -0.1]))
    # per tensor: one step for the whole map (1/3): row 1 collapses to 0
    qt = absmax_quantize(x, 3, "tensor")
    torch.testing.assert_close(qt[1], torch.zeros(4))
    torch.testing.assert_close(qt[0, :3], q[0, :3])
    # an all-zero row stays zero; a maps batch (B, H, T, S) is quantised per map
    assert absmax_quantize(torch.zeros(2, 3), 4).abs().sum() == 0
    y = torch.randn(2, 3, 5, 7)
    y2 = y.clone()
    y2[1] *= 100  # another sequence's scale must not change this one's quantisation
    torch.testing.assert_close(absmax_quantize(y, 4, "tensor")[0], absmax_quantize(y2, 4, "tensor")[0])
    # 16 bits: error within half a step
    big = torch.randn(4, 64) * 30
    err = (absmax_quantize(big, 16) - big).abs()
    step = big.abs().amax(-1, keepdim=True) / (2 ** 15 - 1)
    assert bool((err <= step / 2 + 1e-6).all())
    # levels: at most 2 * qmax + 1 distinct values per row
    assert absmax_quantize(big, 4)[0].unique().numel() <= 15
    with pytest.raises(ValueError, match="bits"):
        absmax_quantize(big, 1)
    with pytest.raises(ValueError, match="granularity"):
        absmax_quantize(big, 8, "channel")


@pytest.mark.parametrize("diff", [True, False])
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_quantized_kernel_equals_eager_on_quantised_logits(diff, granularity):
    torch.manual_seed(1)
    B, T, H, Hkv, d = 2, 6, 4, 2, 8
    C = 2 if diff else 1
    q = torch.randn(B, T, C * H, d) * 2
    k = torch.randn(B, T, C * Hkv, d) * 2
    v = torch.randn(B, T, Hkv, C * d)
    lam = torch.tensor(0.7) if diff else None
    mask = AttentionMask(key_valid=torch.tensor([[1] * 6, [0, 1, 1, 1, 1, 1]]).bool())
    _, ref = eager(q, k, v, lam, mask, 0.3, return_maps=True)
    kern = quantized_kernel(4, granularity)
    out, maps = kern(q, k, v, lam, mask, 0.3, return_maps=True)
    # oracle: quantise eager's logits, softmax, combine the maps, apply to the values
    ql = absmax_quantize(ref.logits, 4, granularity)
    torch.testing.assert_close(maps.logits, ql)
    p = torch.softmax(ql, -1)  # (B, C*H, T, S)
    eff = p[:, 0::2] - lam * p[:, 1::2] if diff else p
    torch.testing.assert_close(maps.effective, eff)
    R = H // Hkv
    manual = torch.stack([eff[:, h] @ v[:, :, h // R] for h in range(H)], dim=2)  # (B, T, H, dv)
    torch.testing.assert_close(out, manual, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, eager(q, k, v, lam, mask, 0.3), atol=1e-3)  # 4 bits does change it
    torch.testing.assert_close(quantized_kernel(16, granularity)(q, k, v, lam, mask, 0.3),
                               eager(q, k, v, lam, mask, 0.3), atol=1e-3, rtol=1e-3)


def test_quantized_backend_in_model_nll_and_needles():
    torch.manual_seed(0)
    model = Transformer(preset("test")).eval()
    with torch.no_grad():
        for b in model.layers:
            b.attn.q_proj.weight.mul_(60)  # spread-out logits so that low bits matter
    windows = torch.randint(0, 64, (2, 17))
    name = register_quantized_backend(8, "row")
    assert name in BACKENDS
    full = evaluate_lm(model, windows, backend="eager").nll
    assert evaluate_lm(model, windows, backend=register_quantized_backend(16, "tensor")).nll == \
        pytest.approx(full, abs=1e-4)
    sweep = quantization_sweep(lambda b: evaluate_lm(model, windows, backend=b).nll, bits=(16, 3))
    assert sweep["full"] == pytest.approx(full)
    assert set(sweep) == {"full", "row", "tensor"} and set(sweep["row"]) == {"16", "3"}
    assert abs(sweep["tensor"]["3"] - full) > 1e-3
    task = NeedleBlock(n_keys=16, n_filler=20, context_len=48)
    m2 = Transformer(preset("test", vocab_size=task.vocab_size)).eval()
    res = evaluate_needles(m2, task, grid=((2, 1),), depths=(0.5,), samples_per_cell=2, backend=name,
                           use_cache=False)
    assert res.cells[0].n_keys == 2
    assert math.isfinite(res.accuracy(2, 1))
