"""The arms beyond DIFF and its baseline (SPEC section 5b, docs/design.md §5b): output-gated
attention, DIFF's no-subtraction control and the baseline with a per-head norm, against the
float64 references of tests/reference.py (written from the equations, no shared code); every
backend each option runs on; KV-cache decoding; paired initialisation; config validation and
old configs; arm_config; export refusals; ``difftx info``."""

import json

import pytest
import torch

from difftx import KVCache, ModelConfig, Transformer, baseline_config, preset
from difftx.attention import AttentionMask, DiffAttention, GatedAttention, StandardAttention, kernels
from difftx.attention import flex as flex_mod
from difftx.checkpoint import load_model, save_model
from difftx.cli import main
from difftx.config import ARM_SETS, ARMS, arm_config, attention_parameter_delta
from difftx.generation import generate
from difftx.interop import ConversionError, export_hf
from reference import naive_allowed, naive_gated_attention, naive_no_subtraction, naive_standard_head_norm

# "triton" on CPU (and for float64) hands the call to sdpa: its plumbing is checked here, its kernel with
# lambda = 0 in tests/test_triton_kernel.py (interpreter)
BACKENDS = ["eager", "chunked", "sdpa"] + (["triton"] if "triton" in kernels.BACKENDS else [])


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(kernels, "CHUNK_ROWS", 4)  # several query blocks in the chunked kernel


def _module(kind, D, H, Hkv, layer=2):
    """A float64 module with non-trivial values in every parameter (gains and gate included)."""
    if kind in ("gated", "gated_headwise"):
        m = GatedAttention(D, H, Hkv, gate="elementwise" if kind == "gated" else "headwise")
    elif kind == "no_subtraction":
        m = DiffAttention(D, H, layer, Hkv, subtract=False)
    elif kind == "no_subtraction_no_norm":
        m = DiffAttention(D, H, layer, Hkv, subtract=False, use_subln=False)
    else:
        assert kind == "standard_head_norm"
        m = StandardAttention(D, H, Hkv, use_subln=True)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m.double()


NAIVE = {"gated": naive_gated_attention, "gated_headwise": naive_gated_attention,
         "no_subtraction": naive_no_subtraction, "no_subtraction_no_norm": naive_no_subtraction,
         "standard_head_norm": naive_standard_head_norm}

# (kind, D, H, Hkv): MHA and GQA (2 and 4 heads per kv group); H counts ordinary heads for gated and
# standard, differential heads for the control
CASES = [
    ("gated", 32, 4, 4), ("gated", 64, 8, 2), ("gated_headwise", 64, 8, 2), ("gated_headwise", 32, 4, 1),
    ("no_subtraction", 32, 2, 2), ("no_subtraction", 64, 4, 2), ("no_subtraction", 64, 4, 1),
    ("no_subtraction_no_norm", 64, 4, 2), ("standard_head_norm", 32, 4, 4), ("standard_head_norm", 64, 8, 2),
]
KINDS = sorted(NAIVE)


def _ids(c):
    return f"{c[0]}-D{c[1]}-H{c[2]}-kv{c[3]}"


def _grads(out, m, x, g):
    return torch.autograd.grad(out, [x, *m.parameters()], g, allow_unused=True)


def _assert_grads_close(got, want, names, rtol=1e-8, atol=1e-9):
    for name, a, b in zip(names, got, want):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda s, n=name: f"grad {n}: {s}")


# -- the modules against the equations -------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_module_matches_reference_forward_and_backward(case, T, backend):
    kind, D, H, Hkv = case
    m = _module(kind, D, H, Hkv)
    x = torch.randn(2, T, D, dtype=torch.float64, requires_grad=True)
    out = m(x, backend=backend)
    ref = NAIVE[kind](m, x)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(out)
    names = ["x", *[n for n, _ in m.named_parameters()]]
    _assert_grads_close(_grads(out, m, x, g), _grads(ref, m, x, g), names)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_padding_document_and_bidirectional_masks_match_reference(kind, backend):
    m = _module(kind, 64, 4, 2)
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
        torch.testing.assert_close(m(x, mask=mask, backend=backend), NAIVE[kind](m, x, allowed=allowed),
                                   rtol=1e-9, atol=1e-10)


needs_flex = pytest.mark.skipif(not flex_mod.available(), reason="needs torch.nn.attention.flex_attention")


@needs_flex
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_flex_forward_matches_reference(case):
    kind, D, H, Hkv = case
    m = _module(kind, D, H, Hkv)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 3 + [1] * 4, [0] * 7])
    with torch.no_grad():  # PyTorch's flex_attention has no backward pass on CPU
        torch.testing.assert_close(m(x, backend="flex"), NAIVE[kind](m, x), rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(m(x, mask=AttentionMask(doc_ids=doc_ids), backend="flex"),
                                   NAIVE[kind](m, x, allowed=naive_allowed(2, 7, doc_ids=doc_ids)),
                                   rtol=1e-9, atol=1e-10)


@needs_flex
@pytest.mark.parametrize("kind", KINDS)
def test_flex_gradients_match_eager_with_a_stand_in(kind, monkeypatch):
    """The flex backend's own plumbing (components, GQA, lambda = 0) under a differentiable stand-in
    for flex_attention with its calling convention (see tests/test_flex.py)."""
    from test_flex import _sdpa_stand_in

    monkeypatch.setattr(flex_mod, "_flex_fn", lambda device, needs_grad: _sdpa_stand_in)
    m = _module(kind, 64, 4, 2)
    x = torch.randn(2, 7, 64, dtype=torch.float64, requires_grad=True)
    mask = AttentionMask(doc_ids=torch.tensor([[0] * 3 + [1] * 4, [0] * 7]))
    out, ref = m(x, mask=mask, backend="flex"), m(x, mask=mask, backend="eager")
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(out)
    _assert_grads_close(_grads(out, m, x, g), _grads(ref, m, x, g), ["x", *[n for n, _ in m.named_parameters()]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_backends_match_eager(backend):
    for kind in KINDS:
        m = _module(kind, 64, 4, 2).float()
        x = torch.randn(2, 21, 64, requires_grad=True)
        ref, out = m(x, backend="eager"), m(x, backend=backend)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5 * float(ref.detach().abs().max()), msg=kind)
        gx_ref, = torch.autograd.grad(ref.sum(), x)
        gx, = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-5 * float(gx_ref.abs().max()), msg=kind)


def test_no_subtraction_control_has_lambda_zero_and_leaves_the_second_map_unused():
    m = _module("no_subtraction", 64, 4, 2)
    assert not any("lambda" in n for n, _ in m.named_parameters())
    assert set(dict(m.named_parameters())) == {"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                "out_proj.weight", "subln.weight"}
    lam = m.lambda_full()
    assert lam.dtype == torch.float64 and float(lam) == 0.0 and not lam.requires_grad
    x = torch.randn(1, 6, 64, dtype=torch.float64)
    out, maps = m(x, return_maps=True)  # eager: both maps are computed, the effective one is A1
    assert maps.probs.shape[1] == 8
    torch.testing.assert_close(maps.effective, maps.probs[:, 0::2], rtol=0, atol=0)
    # the second components' q/k projection rows get exactly zero gradient, on every backend
    for backend in BACKENDS:
        m.zero_grad()
        m(x, backend=backend).square().sum().backward()
        q = m.q_proj.weight.grad.view(4, 2, 8, 64)  # (head, component, d, D)
        k = m.k_proj.weight.grad.view(2, 2, 8, 64)  # (group, component, d, D)
        assert q[:, 1].abs().max() == 0 and k[:, 1].abs().max() == 0, backend
        assert q[:, 0].abs().max() > 0 and k[:, 0].abs().max() > 0, backend


def test_no_subtraction_equals_diff_with_lambda_zero():
    """The control computes what DIFF computes with the same weights and lambda = 0."""
    ctrl = _module("no_subtraction", 64, 4, 2, layer=3)
    diff = DiffAttention(64, 4, 3, 2).double()
    diff.load_state_dict(ctrl.state_dict(), strict=False)
    with torch.no_grad():  # lambda = exp(0) - exp(q2.k2) + lambda_init = 0
        for p in diff.lambda_parameters():
            p.zero_()
        diff.lambda_q2.fill_(1.0)
        diff.lambda_k2[0] = torch.log(torch.tensor(1.0 + diff.lambda_init, dtype=torch.float64))
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    assert abs(float(diff.lambda_full().detach())) < 1e-15
    torch.testing.assert_close(ctrl(x), diff(x), rtol=1e-12, atol=1e-12)


def test_headwise_gate_at_zero_halves_the_standard_output():
    """sigmoid(0) = 1/2 for every head: a relation between two modules, independent of the reference."""
    std = _module("standard_head_norm", 64, 8, 2)
    std.subln = None
    gated = GatedAttention(64, 8, 2, gate="headwise").double()
    gated.load_state_dict({**std.state_dict(), "gate_proj.weight": torch.zeros(8, 64, dtype=torch.float64)})
    assert gated.gate_proj.weight.shape == (8, 64)
    assert GatedAttention(64, 8, 2).gate_proj.weight.shape == (64, 64)  # elementwise: D -> H*d
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    torch.testing.assert_close(gated(x), 0.5 * std(x), rtol=1e-12, atol=1e-12)


def test_standard_attention_has_no_head_norm_by_default():
    m = StandardAttention(32, 4)
    assert m.subln is None and set(dict(m.named_parameters())) == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"}
    assert StandardAttention(32, 4, use_subln=True).subln.weight.shape == (8,)
    with pytest.raises(ValueError, match="gate: must be one of"):
        GatedAttention(32, 4, gate="channel")


# -- models: arms, decoding, paired initialisation -----------------------------------------------------------

def _base(**kw):
    return ModelConfig(**{**dict(vocab_size=50, dim=32, n_layers=2, n_heads=2, max_seq_len=32), **kw})


MODEL_ARMS = ["gated", "gated_headwise", "no_subtraction", "baseline_head_norm", "diff_no_head_norm", "temperature",
              "baseline_wide_head_norm", "diff_nope", "baseline_nope", "diff_lambda_0.8_out_0.8",
              "baseline_head_norm_out_schedule"]


@pytest.mark.parametrize("arm", MODEL_ARMS)
@pytest.mark.parametrize("n_kv", [None, 1])
def test_kv_cache_decoding_matches_full_forward(arm, n_kv):
    model = Transformer(arm_config(_base(n_kv_heads=n_kv), arm)).eval()
    tokens = torch.randint(0, 50, (2, 12))
    full = model(tokens)
    cache = KVCache(model, 2, 16)
    pieces = [model(tokens[:, :5], cache=cache)]
    for t in range(5, 12):
        pieces.append(model(tokens[:, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arm", MODEL_ARMS)
def test_generation_with_left_padding_matches_each_prompt_alone(arm):
    model = Transformer(arm_config(_base(n_kv_heads=1), arm)).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    batch = generate(model, prompts, 5, temperature=0)
    for p, out in zip(prompts, batch):
        seq = list(p)
        for _ in range(5):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert out == seq[len(p):]


@pytest.mark.parametrize("arm", ["gated", "gated_headwise", "no_subtraction", "baseline_head_norm"])
def test_paired_initialisation(arm):
    """After the same torch.manual_seed, every same-named, same-shaped parameter equals the baseline's
    and DIFF's; the new parameters (gate_proj, subln) come from the per-name generators too."""
    cfg = preset("tiny")
    states = {}
    for name in ("baseline", "diff", arm):
        torch.manual_seed(5)
        states[name] = Transformer(arm_config(cfg, name)).state_dict()
    a = states[arm]
    for other in ("baseline", "diff"):
        b = states[other]
        shared = [k for k in a if k in b and a[k].shape == b[k].shape]
        assert len(shared) >= 3 + 6 * cfg.n_layers  # embeddings, final norm, head, MLP, block norms ...
        assert all(torch.equal(a[k], b[k]) for k in shared), other
    assert "layers.0.attn.q_proj.weight" in [k for k in a if k in states["baseline"]]
    torch.manual_seed(6)
    c = Transformer(arm_config(cfg, arm)).state_dict()
    assert not torch.equal(a["layers.0.attn.q_proj.weight"], c["layers.0.attn.q_proj.weight"])
    if arm.startswith("gated"):
        w = a["layers.0.attn.gate_proj.weight"]
        assert abs(float(w.std()) - cfg.init_std) < 0.15 * cfg.init_std  # N(0, init_std) like the projections
        assert not torch.equal(w, c["layers.0.attn.gate_proj.weight"])
        assert not torch.equal(w, a["layers.1.attn.gate_proj.weight"])  # its own generator per name
    if arm == "baseline_head_norm":
        assert torch.equal(a["layers.0.attn.subln.weight"], torch.ones(cfg.head_dim))


@pytest.mark.parametrize("arm", ["gated", "no_subtraction"])
def test_arm_trains(arm):
    from difftx.model import lm_loss
    from difftx.training.metrics import lambda_per_layer

    torch.manual_seed(0)
    model = Transformer(arm_config(_base(vocab_size=32, dim=64), arm))
    tokens = torch.randint(0, 32, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2, (losses[0], losses[-1])
    assert lambda_per_layer(model) == ([0.0, 0.0] if arm == "no_subtraction" else None)


# -- configs ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field, rule", [
    (dict(attention="gated", gate="channel"), "gate", "must be one of"),
    (dict(gate="headwise"), "gate", "only to attention='gated'"),
    (dict(attention="standard", gate="elementwise"), "gate", "only to attention='gated'"),
    (dict(attention="standard", subtract=False), "subtract", "only to attention='diff'"),
    (dict(attention="gated", subtract=False), "subtract", "only to attention='diff'"),
    (dict(attention="diff_v2", subtract=False), "subtract", "only to attention='diff'"),
    (dict(attention="diff_v2", head_norm=True), "head_norm", "applies only to attention in"),
    (dict(attention="gated", head_norm=True), "head_norm", "applies only to attention in"),
    (dict(use_subln=False, head_norm=True), "head_norm", "contradicts use_subln=false"),
    (dict(attention="standard", use_subln=False), "use_subln", "only to attention='diff'"),
    (dict(attention="gated", lambda_init=0.8), "lambda_init", r"only to attention in \('diff', 'converted', 'dex'\)"),
    (dict(head_norm="yes"), "head_norm", "true, false or null"),
    (dict(subtract="no"), "subtract", "true or false"),
    (dict(lambda_init=float("nan")), "lambda_init", "finite number"),
    (dict(lambda_init=1.0), "lambda_init", r"in \(0, 1\).*got 1.0"),
    (dict(lambda_init=2.0), "lambda_init", r"in \(0, 1\)"),
    (dict(lambda_init=-0.5), "lambda_init", r"in \(0, 1\)"),
    (dict(lambda_init=0), "lambda_init", r"in \(0, 1\)"),
    (dict(attention="gated", dim=30, n_heads=4), "dim", "divisible by n_heads"),
])
def test_invalid_combinations_name_the_field(kwargs, field, rule):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}: .*{rule}"):
        _base(**kwargs)


def test_valid_combinations_and_what_they_resolve_to():
    assert _base().uses_head_norm and _base().gate_kind is None
    assert not _base(head_norm=False).uses_head_norm and not _base(use_subln=False).uses_head_norm
    assert _base(attention="standard", head_norm=True).uses_head_norm
    for kind in ("standard", "gated", "diff_v2"):  # off by default, and False is accepted for every kind
        assert not _base(attention=kind).uses_head_norm and not _base(attention=kind, head_norm=False).uses_head_norm
    assert _base(attention="gated").gate_kind == "elementwise"
    assert _base(attention="gated", gate="headwise").gate_kind == "headwise"
    c = _base(subtract=False, head_norm=False, lambda_init=0.5)  # options of diff combine
    m = Transformer(c)
    assert m.layers[0].attn.subln is None and not m.layers[0].attn.subtract
    assert m(torch.randint(0, 50, (1, 4))).shape == (1, 4, 50)


def test_old_configs_load_unchanged(tmp_path):
    """config.json files written before these options existed (no gate / head_norm / subtract keys;
    baselines with use_subln=true) load to the same model; configs that do not use the options
    still serialise without those keys (resuming compares these dicts)."""
    old_keys = {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "attention", "ffn_hidden", "max_seq_len",
                "rope_theta", "norm_eps", "tie_embeddings", "init_std", "backend", "lambda_init", "use_subln"}
    for cfg in (preset("tiny"), baseline_config(preset("tiny")), preset("tiny", attention="diff_v2")):
        assert set(cfg.to_dict()) == old_keys
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    old_baseline = ModelConfig.from_dict({**baseline_config(preset("tiny")).to_dict(), "use_subln": True})
    assert not old_baseline.uses_head_norm
    assert "subln" not in "".join(Transformer(old_baseline).state_dict())
    old_ablation = ModelConfig.from_dict({**preset("tiny").to_dict(), "use_subln": False})
    assert not old_ablation.uses_head_norm
    assert not any("subln" in k for k in Transformer(old_ablation).state_dict())
    # a checkpoint whose config.json is in the old form loads and computes the same logits
    model = Transformer(_base(attention="standard", n_heads=4))
    save_model(model, tmp_path / "ck")
    data = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert not {"gate", "head_norm", "subtract"} & set(data)
    x = torch.randint(0, 50, (1, 6))
    torch.testing.assert_close(load_model(tmp_path / "ck")(x), model(x))
    # options in use are written, and read back
    for arm in ("gated_headwise", "no_subtraction", "baseline_head_norm"):
        cfg = arm_config(preset("tiny"), arm)
        assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert arm_config(preset("tiny"), "gated").to_dict()["gate"] == "elementwise"
    assert arm_config(preset("tiny"), "no_subtraction").to_dict()["subtract"] is False


# tiny preset (D=64, L=2, DIFF H=2, d=16): parameters of each arm and what it adds to its own baseline
TINY_COUNTS = {
    "baseline": (139_584, 0), "diff": (139_776, 2 * (4 * 16 + 2 * 16)),
    "diff_v2": (148_288, 2 * (64 * 4 * 16 + 64 * 4)), "gated": (147_776, 2 * 64 * 4 * 16),
    "gated_headwise": (140_096, 2 * 64 * 4), "no_subtraction": (139_648, 2 * 2 * 16),
    "diff_no_head_norm": (139_712, 2 * 4 * 16), "diff_lambda_0.8": (139_776, 192), "diff_lambda_0.5": (139_776, 192),
    "baseline_head_norm": (139_616, 2 * 16), "baseline_wide": (139_584, 0),
    "baseline_wide_head_norm": (139_648, 2 * 32),
    "gated_matched": (139_712, 2 * 64 * 4 * 16),  # gate +8,192, SwiGLU 192 -> 171 hidden units: -8,064
    "temperature": (139_592, 2 * 4), "diff_nope": (139_776, 192), "baseline_nope": (139_584, 0),
    **{a: (139_776, 192) for a in ("diff_lambda_0.2", "diff_lambda_0.4", "diff_lambda_0.6", "diff_out_0.2",
                                   "diff_lambda_0.8_out_0.8")},
    **{f"baseline_out_{v}": (139_584, 0) for v in ("0.2", "0.8", "schedule")},
    **{f"baseline_head_norm_out_{v}": (139_616, 2 * 16) for v in ("0.2", "0.8", "schedule")},
}


@pytest.mark.parametrize("base", [preset("tiny"), _base(dim=64, n_heads=4, n_kv_heads=2, tie_embeddings=True)],
                         ids=["tiny", "gqa-tied"])
def test_every_arm_builds_with_the_documented_parameter_count(base):
    assert set(TINY_COUNTS) == set(ARMS)
    assert ARM_SETS["default"] == ("baseline", "diff")
    assert all(set(arms) <= set(ARMS) for arms in ARM_SETS.values())
    assert set(ARM_SETS["paper-ablations"]) >= {"baseline", "baseline_head_norm", "diff", "diff_no_head_norm",
                                                "diff_lambda_0.8", "diff_lambda_0.5"}
    D, L, H, d = base.dim, base.n_layers, base.n_heads, base.head_dim  # DIFF's heads and component width
    expected_delta = {  # per layer, from docs/design.md
        "baseline": 0, "diff": 6 * d, "diff_v2": D * 2 * H * d + D * 2 * H, "gated": D * 2 * H * d,
        "gated_headwise": D * 2 * H, "no_subtraction": 2 * d, "diff_no_head_norm": 4 * d, "diff_lambda_0.8": 6 * d,
        "diff_lambda_0.5": 6 * d, "baseline_head_norm": d, "baseline_wide": 0, "baseline_wide_head_norm": 2 * d,
        "gated_matched": D * 2 * H * d, "temperature": 2 * H, "diff_nope": 6 * d, "baseline_nope": 0,
        **{a: 6 * d for a in ("diff_lambda_0.2", "diff_lambda_0.4", "diff_lambda_0.6", "diff_out_0.2",
                              "diff_lambda_0.8_out_0.8")},
        **{f"baseline_out_{v}": 0 for v in ("0.2", "0.8", "schedule")},
        **{f"baseline_head_norm_out_{v}": d for v in ("0.2", "0.8", "schedule")},
    }
    n_baseline = Transformer(baseline_config(base)).num_parameters()
    for arm in ARMS:
        cfg = arm_config(base, arm)
        model = Transformer(cfg)
        n = model.num_parameters()
        delta = n - Transformer(baseline_config(cfg)).num_parameters()
        assert delta == L * expected_delta[arm] == L * sum(r[1] for r in attention_parameter_delta(cfg)), arm
        if arm == "gated_matched":  # its narrower MLP pays for the gate: within one hidden unit (3 D) per layer
            assert abs(n - n_baseline) <= L * 3 * D and cfg.hidden_dim < base.hidden_dim
        elif arm in ("diff_nope", "baseline_nope"):  # their baseline is the baseline without RoPE
            assert baseline_config(cfg) == baseline_config(base).replace(rope=False), arm
        elif arm not in ("baseline_wide", "baseline_wide_head_norm"):
            assert baseline_config(cfg) == baseline_config(base), arm  # one shared baseline
        else:
            assert n - n_baseline == L * expected_delta[arm], arm  # H heads of 2d: the baseline's count
        if base == preset("tiny"):
            assert (n, delta) == TINY_COUNTS[arm], arm
        assert model(torch.randint(0, cfg.vocab_size, (1, 5))).shape == (1, 5, cfg.vocab_size)
    assert arm_config(base, "diff") is base
    assert arm_config(base, "diff_v2").head_dim == d and arm_config(base, "diff_v2").kv_groups == 2 * base.kv_groups
    assert arm_config(base, "baseline_wide").head_dim == 2 * d


def test_arm_config_errors():
    with pytest.raises(ValueError, match="unknown arm 'gate'"):
        arm_config(preset("tiny"), "gate")
    with pytest.raises(ValueError, match="must be a DIFF V1 ModelConfig"):
        arm_config(baseline_config(preset("tiny")), "gated")


# -- export ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arm, match", [
    ("gated", "attention='gated' \\(gate='elementwise'\\) cannot be exported"),
    ("gated_headwise", "attention='gated' \\(gate='headwise'\\) cannot be exported"),
    ("no_subtraction", "subtract=False .* cannot be exported faithfully"),
    ("baseline_head_norm", "attention='standard' with head_norm=True cannot be exported"),
    ("baseline_wide_head_norm", "attention='standard' with head_norm=True cannot be exported"),
    ("diff_no_head_norm", "head_norm=False \\(use_subln=False\\) cannot be exported"),
    ("diff_lambda_0.8", "lambda_init=0.8 .*cannot be exported"),
    ("diff_lambda_0.5", "lambda_init=0.5 .*cannot be exported"),
    ("diff_v2", "no Differential Transformer V2"),
])
def test_export_refuses_arms_without_a_transformers_equivalent(arm, match, tmp_path):
    model = Transformer(arm_config(preset("tiny"), arm))
    with pytest.raises(ConversionError, match=match) as e:
        export_hf(model, tmp_path / "hf", remote_code=False)  # the default writes difftx's modeling code
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)
    assert not (tmp_path / "hf").exists()  # nothing written


def test_export_of_a_folder_is_refused_before_writing_and_exportable_arms_export(tmp_path, capsys):
    save_model(Transformer(arm_config(preset("tiny"), "gated")), tmp_path / "gated")
    assert main(["export", str(tmp_path / "gated"), str(tmp_path / "hf"), "--no-remote-code"]) == 2
    err = capsys.readouterr().err
    assert "attention='gated'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()
    for arm, model_type in [("baseline", "llama"), ("diff", "diffllama"), ("baseline_wide", "llama")]:
        out = export_hf(Transformer(arm_config(preset("tiny"), arm)), tmp_path / arm)
        assert json.loads((out / "config.json").read_text())["model_type"] == model_type


# -- difftx info ---------------------------------------------------------------------------------------------

def test_info_shows_each_arm_against_its_baseline(capsys):
    assert main(["info", "tiny", "--arms"]) == 0
    out = capsys.readouterr().out
    for arm, (n, delta) in TINY_COUNTS.items():
        line = next(row for row in out.splitlines() if row.startswith(arm + " "))
        assert f"{n:,}" in line and f"{delta:+,}" in line, line
    assert "D·H·d = 64·4·16 = 4,096" in out and "D·H = 64·4 = 256" in out
    assert main(["info", "tiny", "--arms", "paper-ablations"]) == 0
    listed = [row.split()[0] for row in capsys.readouterr().out.splitlines()[2:-1]]
    assert listed == list(ARM_SETS["paper-ablations"])
    assert main(["info", "tiny", "--arm", "gated"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.split("\nmodel")[0])["attention"] == "gated"
    assert "model - baseline = +8,192 = 2 layers x (D·H·d = 64·4·16 = 4,096" in out
    assert main(["info", "tiny", "--set", "attention=gated", "--set", "gate=headwise", "--set", "n_heads=4"]) == 0
    assert "parameters=140,096 gate=headwise" in capsys.readouterr().out
    assert main(["info", "tiny", "--attention", "standard", "--set", "head_norm=true", "--set", "n_heads=4"]) == 0
    assert "model - baseline = +32" in capsys.readouterr().out
    for kind, arm in [("temperature", "temperature"), ("gated", "gated"), ("diff_v2", "diff_v2"),
                      ("standard", "baseline")]:  # --attention KIND is the compare arm of KIND (issue 50)
        assert main(["info", "tiny", "--attention", kind]) == 0
        shown = capsys.readouterr().out
        assert main(["info", "tiny", "--arm", arm]) == 0
        assert shown == capsys.readouterr().out, kind
    for bad, message in [(["--set", "gate=headwise"], "ModelConfig.gate"), (["--set", "colour=1"], "unknown"),
                         (["--arm", "nope"], "unknown arm"), (["--arms", "nope"], "unknown arm set")]:
        assert main(["info", "tiny", *bad]) == 2
        assert message in capsys.readouterr().err


def test_train_baseline_flag_drops_the_new_options(capsys):
    """`difftx train --baseline` of a control / gated model trains the plain baseline; for a model
    without the options the saved overrides are what they were (resuming older runs compares them)."""
    for sets, extra in [(["model_overrides.subtract=false"], {"subtract": True}),
                        (["model_overrides.attention=gated", "model_overrides.gate=headwise"], {"gate": None}),
                        ([], {})]:
        argv = ["train", "--preset", "tiny", "--baseline", "--print-config"]
        for s in sets:
            argv += ["--set", s]
        assert main(argv) == 0
        overrides = json.loads(capsys.readouterr().out)["model_overrides"]
        assert overrides["attention"] == "standard"
        assert {k: overrides[k] for k in ("gate", "head_norm", "subtract") if k in overrides} == extra
