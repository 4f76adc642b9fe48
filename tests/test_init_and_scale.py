"""The regime map's axes (issue D): ``ModelConfig.init`` ("normal" or PyTorch's module defaults) and
``ModelConfig.out_scale`` (each head's output scale, decoupled from lambda_init; the baseline scaled alike),
against the float64 references of tests/reference.py; the arms built from them; configs, presets and --tune."""

import math

import pytest
import torch

from difftx import ModelConfig, Transformer
from difftx.attention import DiffAttention, StandardAttention, kernels
from difftx.attention.modules import lambda_init_for_layer
from difftx.compare.presets import get_preset
from difftx.compare.regime import regime, regime_lines, render_regime
from difftx.studies.tune import beyond_edge, parse_tune
from difftx.studies.tune_report import label
from difftx.config import ARM_SETS, arm_config
from difftx.interop import ConversionError, export_hf
from reference import naive_diff_attention, naive_standard_scaled

BACKENDS = ["eager", "chunked", "sdpa"]


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(kernels, "CHUNK_ROWS", 4)  # several query blocks in the chunked kernel


def _randomised(m):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m.double()


def _check_against(m, ref, backend):
    x = torch.randn(2, 9, m.dim, dtype=torch.float64, requires_grad=True)
    out = m(x, backend=backend)
    want = ref(m, x)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *m.parameters()], g)
    exp = torch.autograd.grad(want, [x, *m.parameters()], g)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


# -- the modules against the equations -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lam, scale", [(0.8, 0.8), (None, 0.2), (0.4, None), (0.2, 1.5)])
def test_diff_with_a_constant_lambda_and_a_decoupled_output_scale_matches_the_equations(lam, scale, backend):
    layer = 3
    m = _randomised(DiffAttention(64, 4, layer, 2, lambda_init=lam, out_scale=scale))
    lam_init = lambda_init_for_layer(layer) if lam is None else lam
    assert m.out_scale == pytest.approx(1 - lam_init if scale is None else scale)
    # the reference takes the constants from the test, not from the module
    _check_against(m, lambda mod, x: naive_diff_attention(mod, x, lam_init=0.8 - 0.6 * math.exp(-0.9) if lam is None
                                                          else lam, out_scale=scale), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("scale", [0.2, 0.8])
def test_the_scaled_baseline_matches_the_equations(scale, norm, backend):
    m = _randomised(StandardAttention(64, 8, 2, use_subln=norm, out_scale=scale))
    _check_against(m, lambda mod, x: naive_standard_scaled(mod, x, scale, norm), backend)


def test_a_scaled_baseline_without_a_norm_is_the_baseline_with_a_scaled_output_projection():
    """A relation between two models, independent of the reference: without a norm the scale is linear."""
    base = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, max_seq_len=32)
    torch.manual_seed(3)
    plain = Transformer(arm_config(base, "baseline")).double()
    torch.manual_seed(3)
    scaled = Transformer(arm_config(base, "baseline_out_0.2")).double()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), scaled.state_dict().values()))
    with torch.no_grad():
        for block in plain.layers:
            block.attn.out_proj.weight.mul_(0.2)
    tokens = torch.randint(0, 50, (2, 11))
    torch.testing.assert_close(scaled(tokens), plain(tokens), rtol=1e-12, atol=1e-12)


def test_schedule_scales_follow_the_depth_schedule_and_other_kinds_refuse_out_scale():
    base = ModelConfig(vocab_size=50, dim=32, n_layers=4, n_heads=2, max_seq_len=32)
    want = [1 - lambda_init_for_layer(i) for i in range(4)]
    for arm in ("baseline_out_schedule", "baseline_head_norm_out_schedule", "diff"):
        model = Transformer(arm_config(base, arm))
        assert [b.attn.out_scale for b in model.layers] == pytest.approx(want), arm
    diff = Transformer(arm_config(base, "diff_lambda_0.8_out_0.8"))
    assert [(b.attn.lambda_init, b.attn.out_scale) for b in diff.layers] == [(0.8, 0.8)] * 4
    assert [b.attn.out_scale for b in Transformer(arm_config(base, "diff_out_0.2")).layers] == [0.2] * 4
    assert [b.attn.lambda_init for b in Transformer(arm_config(base, "diff_out_0.2")).layers] == pytest.approx(
        [lambda_init_for_layer(i) for i in range(4)])
    with pytest.raises(ValueError, match=r"ModelConfig.out_scale: applies only to attention in \('diff', 'standard'\)"):
        base.replace(attention="gated", out_scale=0.5)


@pytest.mark.parametrize("value", [0, -0.5, float("inf"), "sched", True])
def test_bad_out_scale_and_init_name_the_field(value):
    with pytest.raises(ValueError, match="ModelConfig.out_scale: must be a positive number, 'schedule'"):
        ModelConfig(out_scale=value)
    with pytest.raises(ValueError, match=r"ModelConfig.init: must be one of \('normal', 'torch'\)"):
        ModelConfig(init="xavier")


def test_configs_round_trip_and_older_configs_serialise_as_before():
    assert "init" not in ModelConfig().to_dict() and "out_scale" not in ModelConfig().to_dict()
    assert "init" not in ModelConfig.from_json(ModelConfig().to_json()).to_dict()
    c = ModelConfig(attention="standard", init="torch", out_scale="schedule", head_norm=True)
    assert ModelConfig.from_json(c.to_json()) == c and c.to_dict()["init"] == "torch"


@pytest.mark.parametrize("arm, match", [("diff_out_0.2", "out_scale=0.2 cannot be exported exactly"),
                                        ("baseline_out_0.8", "out_scale=0.8 is not exported")])
def test_export_refuses_a_decoupled_output_scale(arm, match, tmp_path):
    model = Transformer(arm_config(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2), arm))
    with pytest.raises(ConversionError, match=match):
        export_hf(model, tmp_path / "hf", remote_code=False)  # no Llama / DiffLlama (default: difftx's code)


# -- initialisation ---------------------------------------------------------------------------------------------

def _models(init: str, seed: int = 7) -> dict:
    cfg = ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=2, max_seq_len=64, init=init)
    out = {}
    for arm in ("baseline", "diff", "diff_lambda_0.8", "gated"):
        torch.manual_seed(seed)
        out[arm] = Transformer(arm_config(cfg, arm))
    return out


def test_torch_init_draws_pytorchs_module_defaults():
    model = _models("torch")["diff"]
    modules = dict(model.named_modules())
    seen = set()
    for name, p in model.named_parameters():
        p, owner = p.detach(), modules[name.rpartition(".")[0]]
        if isinstance(owner, torch.nn.Linear):  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            bound = 1 / math.sqrt(p.shape[1])
            assert float(p.abs().max()) <= bound and float(p.abs().max()) > 0.97 * bound, name
            assert float(p.std()) == pytest.approx(bound / math.sqrt(3), rel=0.06), name
            assert abs(float(p.mean())) < 0.05 * bound, name
            seen.add("linear")
        elif isinstance(owner, torch.nn.Embedding):
            assert float(p.std()) == pytest.approx(1.0, rel=0.03) and abs(float(p.mean())) < 0.02, name
            seen.add("embedding")
        elif name.endswith("weight"):  # the norm gains
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert "lambda_" in name, name
    assert seen == {"linear", "embedding"}
    # the same module kinds as PyTorch builds them: the same bound
    ref = torch.nn.Linear(64, 192, bias=False).requires_grad_(False)
    assert float(ref.weight.abs().max()) <= 1 / 8 and float(ref.weight.std()) == pytest.approx(1 / 8 / math.sqrt(3),
                                                                                                rel=0.06)


def test_init_is_paired_across_arms_and_the_lambda_vectors_are_drawn_alike_under_either():
    for init in ("normal", "torch"):
        states = {arm: m.state_dict() for arm, m in _models(init).items()}
        for arm, a in states.items():
            b = states["baseline"]
            shared = [k for k in a if k in b and a[k].shape == b[k].shape]
            assert len(shared) >= 3 + 6 * 2 and all(torch.equal(a[k], b[k]) for k in shared), (init, arm)
    normal, torch_ = _models("normal")["diff"].state_dict(), _models("torch")["diff"].state_dict()
    lambdas = [k for k in normal if "lambda_" in k]
    assert len(lambdas) == 8 and all(torch.equal(normal[k], torch_[k]) for k in lambdas)
    allv = torch.cat([normal[k] for k in lambdas])
    assert float(allv.std()) == pytest.approx(0.1, rel=0.25)
    w = normal["layers.0.attn.q_proj.weight"]
    assert float(w.std()) == pytest.approx(0.02, rel=0.05) and not torch.equal(w, torch_["layers.0.attn.q_proj.weight"])
    assert float(normal["tok_embeddings.weight"].std()) == pytest.approx(0.02, rel=0.05)


# -- compare: presets, --tune and the regime section ---------------------------------------------------------------

def test_a_compare_preset_initialises_every_arm_alike_and_tune_takes_init_by_name():
    plan = get_preset("smoke", init="torch", arms=ARM_SETS["regime-scale"]).resolve()
    assert {cfg.init for cfg in plan.arms.values()} == {"torch"}
    assert {cfg.init for cfg in get_preset("smoke").resolve().arms.values()} == {"normal"}
    with pytest.raises(ValueError, match="init: must be one of"):
        get_preset("smoke", init="xavier")
    assert parse_tune("init=normal,torch") == ("init", ["normal", "torch"])
    assert parse_tune("lr=0.001,0.003") == ("lr", [0.001, 0.003])
    for bad in ("init=xavier", "init=torch,torch", "init="):
        with pytest.raises(ValueError, match="--tune init: need distinct values from"):
            parse_tune(bad)
    assert beyond_edge(["normal", "torch"], {"normal": [1.0, 1.1], "torch": [2.0, 2.0]}) is None
    assert label("init", "torch") == "init=torch" and label("lr", 0.003) == "lr=0.003"


def test_the_regime_section_states_the_initialisation_the_output_scale_and_the_norm():
    base = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=32, init="torch")
    rs = {arm: regime(arm_config(base, arm), 1000, 100) for arm in ("diff", "diff_out_0.2", "diff_no_head_norm")}
    assert rs["diff"]["out_scale"] == pytest.approx([0.8, 1 - lambda_init_for_layer(1)])
    lines = regime_lines(rs)
    assert "each head's output scaled by 0.80, 0.64 (1 - lambda_init), after a per-head norm" in lines[0]
    assert "each head's output scaled by 0.20, 0.20 (out_scale=0.2), after a per-head norm" in lines[1]
    assert "with no per-head norm" in lines[2]
    text = render_regime(rs)
    assert "Initialisation `torch`: PyTorch's module defaults" in text
    assert "Initialisation `normal`: every linear map and embedding N(0, 0.02)" in render_regime(
        {"diff": regime(base.replace(init="normal"), None, 1)})
    old = {k: v for k, v in rs["diff"].items() if k not in ("init", "out_scale", "out_scale_source", "head_norm")}
    assert "scaled" not in regime_lines({"diff": old})[0] and "Initialisation" not in render_regime({"diff": old})


def test_tune_chooses_each_arms_initialisation_by_name(tmp_path):
    """`--tune init=normal,torch` on recall alone: the other value's models are initialised as it says, each seed's
    choice is one of the names (left out of its own choice), and report.md prints the names."""
    import json

    from difftx.cli import main
    from test_compare_recall import RECALL, _sets

    out = tmp_path / "tuned"
    sets = _sets({**{k: v for k, v in RECALL.items() if k != "arms"}, "arms": ["baseline", "diff"]})
    assert main(["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "1",
                 "--no-progress", "--tune", "init=normal,torch", *sets]) == 0
    tune = json.loads((out / "results.json").read_text())["tune"]
    assert tune["field"] == "init" and tune["shared_value"] == "normal"
    assert tune["grid"]["diff"] == ["normal", "torch"] and set(tune["chosen"]["diff"].values()) <= {"normal", "torch"}
    cfg = json.loads((out / "tune" / "init=torch" / "seed0" / "diff" / "model" / "config.json").read_text())
    assert cfg["init"] == "torch" and "init" not in json.loads((out / "seed0" / "diff" / "model" /
                                                                "config.json").read_text())
    report = (out / "report.md").read_text()
    assert "`init` = normal" in report and "Initialisation `normal`" in report and "edge" not in report
    assert tune["at_edge"] == {"baseline": None, "diff": None}


def test_scale_and_train_take_init():
    from difftx.studies.scale import plan_sizes
    from difftx.training import TrainConfig

    plans = plan_sizes("smoke", ["32x1x1", "48x1x1"], init="torch")
    assert {p.preset.init for p in plans} == {"torch"} and all(r["init"] == "torch" for p in plans
                                                                for r in p.regime.values())
    assert TrainConfig(model_overrides={"init": "torch"}).model_config().init == "torch"
    from difftx.compare.regime import regime_table
    from difftx.studies.scale import size_entries

    table = regime_table(size_entries(plans))
    assert "Initialisation `torch`" in table and "| 0.80 (norm) |" in table


def test_a_folder_from_before_init_resumes_as_normal_and_refuses_torch(tmp_path):
    import json

    from difftx.compare.folder import COMPARE_FILE, _check_folder
    old = get_preset("smoke").to_dict()  # as compare.json version 2 wrote it: the model's fields flat, before init
    old.pop("primary")
    old.update({k: v for k, v in old.pop("model").items() if k != "init"})
    (tmp_path / COMPARE_FILE).write_text(json.dumps({"schema_version": 2, "preset": old}))
    _check_folder(tmp_path, get_preset("smoke"))
    with pytest.raises(ValueError, match=r"other settings \(differs in \['model.init'\]\)"):
        _check_folder(tmp_path, get_preset("smoke", init="torch"))
