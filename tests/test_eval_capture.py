"""Capturing attention maps from outside the model (difftx.eval.capture)."""

import math

import pytest
import torch

from difftx import Transformer, baseline_config, preset
from difftx.attention.masks import AttentionMask
from difftx.eval.capture import AttentionCapture, layer_lambdas
from difftx.eval.diagnostics import head_redundancy, lambda_summary, model_head_redundancy
from difftx.generation import generate


KINDS = ["diff", "diff_v2", "standard"]


def _model(kind: str, **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = preset("test", **kw) if kind == "diff" else preset("test", attention=kind, **kw)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_capture_matches_eager_and_keeps_output(kind):
    model = _model(kind, n_kv_heads=1)
    tokens = torch.randint(0, 64, (2, 12))
    ref = model(tokens, backend="eager")
    with AttentionCapture(model, hidden_states=True) as cap:
        out = model(tokens, backend="sdpa")  # the capture overrides the caller's backend
    torch.testing.assert_close(out, ref)
    assert "forward" not in model.layers[0].attn.__dict__  # restored on exit
    assert len(cap.maps) == 2 and all(len(c) == 1 for c in cap.maps)
    # the maps are what the eager kernel returns for that module's input
    attn0 = model.layers[0].attn
    x0 = model.layers[0].attn_norm(model.tok_embeddings(tokens))
    _, maps = attn0(x0, backend="eager", return_maps=True)
    got = cap.last(0)
    torch.testing.assert_close(got.logits, maps.logits)
    torch.testing.assert_close(got.probs, maps.probs)
    if kind != "diff_v2":
        torch.testing.assert_close(got.effective, maps.effective)
    # hidden states are the block outputs
    assert cap.hidden[1][0].shape == (2, 12, 32)
    torch.testing.assert_close(model.norm(cap.hidden[1][0]) @ model.lm_head.weight.T, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_effective_map_reproduces_module_output(kind):
    """out_proj(norm(effective @ V)) must equal the module's output: an independent check of
    the effective map (for diff_v2 it is rebuilt from the per-token lambda)."""
    model = _model(kind, n_kv_heads=1)
    attn = model.layers[1].attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(30)  # peaky maps, so that A1 - lam*A2 has negative entries
    x = torch.randn(2, 10, 32)
    with AttentionCapture(model) as cap:
        out = attn(x)
    eff = cap.last(1).effective  # (B, H, T, S)
    B, H, T, _ = eff.shape
    Hkv = attn.v_groups
    v = attn.v_proj(x).view(B, T, Hkv, attn.v_width).transpose(1, 2)  # (B, Hkv, S, dv)
    heads = torch.stack([eff[:, h] @ v[:, h * Hkv // H] for h in range(H)], dim=2)  # (B, T, H, dv)
    if kind == "diff":
        heads = attn.head_norm(heads)
    torch.testing.assert_close(attn.out_proj(heads.flatten(2)), out, atol=1e-5, rtol=1e-5)
    if kind == "diff":
        assert float((eff < 0).sum()) > 0  # DIFF maps do have negative entries


def test_capture_during_cached_generation():
    model = _model("diff")
    prompt = [[1, 2, 3, 4, 5]]
    plain = generate(model, prompt, 4, temperature=0)
    with AttentionCapture(model) as cap:
        got = generate(model, prompt, 4, temperature=0)
    assert got == plain
    calls = cap.maps[0]
    assert len(calls) == 4  # prefill + 3 decode steps
    assert calls[0].effective.shape[-2:] == (5, 5)
    assert calls[1].q_offset == 5 and calls[1].effective.shape[-2:] == (1, 6)


def test_store_false_streams_to_callback():
    model = _model("diff")
    seen = []
    with AttentionCapture(model, store=False, callback=lambda c: seen.append(c.layer)):
        model(torch.randint(0, 64, (1, 6)))
    assert seen == [0, 1]
    with pytest.raises(ValueError, match="no attention maps"):
        AttentionCapture(model, store=False).last(0)


def test_lambda_readout():
    model = _model("diff")
    lam = layer_lambdas(model)
    assert lam == pytest.approx([float(b.attn.lambda_full().detach()) for b in model.layers])
    with AttentionCapture(model) as cap:
        model(torch.randint(0, 64, (1, 4)))
    assert float(cap.last(1).lam) == pytest.approx(lam[1])
    summ = lambda_summary(model)
    assert summ["lambda_init"] == pytest.approx([0.2, 0.8 - 0.6 * math.exp(-0.3)])
    assert layer_lambdas(Transformer(baseline_config(preset("test")))) == [None, None]


def test_head_redundancy_known_values():
    a = torch.rand(1, 1, 4, 4)
    same = torch.cat([a, a, a], dim=1)
    assert head_redundancy(same) == pytest.approx(1.0)
    disjoint = torch.zeros(1, 2, 2, 2)
    disjoint[0, 0, 0, 0] = 1.0
    disjoint[0, 1, 1, 1] = 1.0
    assert head_redundancy(disjoint) == pytest.approx(0.0)
    assert head_redundancy(torch.cat([a, -a], dim=1)) == pytest.approx(-1.0)
    # three heads: pairs (1, 1), (1, 0), (1, 0) -> mean 1/3
    assert head_redundancy(torch.cat([a, a, torch.zeros_like(a)], 1)) == pytest.approx(1 / 3)
    red = model_head_redundancy(_model("diff"), torch.randint(0, 64, (2, 8)))
    assert len(red) == 2 and all(-1 <= r <= 1 for r in red)


def test_mask_offset_recorded():
    model = _model("standard")
    attn = model.layers[0].attn
    with AttentionCapture(model) as cap:
        attn(torch.randn(1, 3, 32), mask=AttentionMask(causal=True))
    assert cap.last(0).q_offset == 0 and cap.last(0).lam is None


def test_compiled_model_is_refused_with_a_hint():
    model = _model("diff")
    with pytest.raises(ValueError, match="_orig_mod"):
        AttentionCapture(_Compiled(model))


class _Compiled(torch.nn.Module):
    """Stands in for torch.compile's wrapper, which keeps the model as ``_orig_mod``."""

    def __init__(self, model):
        super().__init__()
        self._orig_mod = model
