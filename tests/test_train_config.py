"""TrainConfig validation, file / override loading, presets, LR schedule, weight-decay groups."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from difftx import Transformer, preset
from difftx.training import TRAIN_PRESETS, TrainConfig, load_train_config, train_preset
from difftx.training.optim import lr_at, no_decay, param_groups
from difftx.training.trainer import resolve_dtype


@pytest.mark.parametrize("name", sorted(TRAIN_PRESETS))
def test_presets_are_valid(name):
    cfg = train_preset(name)
    m = cfg.model_config(vocab_size=257)
    assert cfg.seq_len <= m.max_seq_len
    assert TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg  # round trip through the saved form
    if name.startswith("gpu"):
        assert (cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip) == (0.9, 0.95, 0.1, 1.0)
        assert cfg.dtype == "bfloat16" and cfg.device == "cuda"


@pytest.mark.parametrize("field, value, rule", [
    ("batch_size", 0, "positive integer"),
    ("seq_len", 2.5, "positive integer"),
    ("steps", -1, "positive integer"),
    ("seed", 2 ** 64, "below 2**64"),  # "Overflow when unpacking long long" in torch.manual_seed before
    ("lr", -1e-3, "positive"),
    ("lr", float("nan"), "positive"),
    ("min_lr", 1.0, "[0, lr"),
    ("beta2", 1.0, "[0, 1)"),
    ("weight_decay", -0.1, "non-negative"),
    ("decay", "step", "one of"),
    ("device", "tpu", "one of"),
    ("dtype", "int8", "one of"),
    ("parallel", "tp", "one of"),
    ("warmup_steps", 5000, "must not exceed steps"),
    ("model", "gpt5", "unknown model preset"),
    ("model_overrides", {"dim": 33}, "dim"),
    ("model_overrides", {"nonsense": 1}, "unknown ModelConfig field"),
    ("doc_mask", "yes", "true or false"),
    ("allow_new_data", 1, "true or false"),
    ("val_fraction", 1.5, "[0, 1)"),
    ("val_fraction", -0.1, "[0, 1)"),
    ("seq_len", 4096, "max_seq_len"),
    ("steps", 10 ** 10, "more optimizer steps than a run can take"),
    ("lr", float("inf"), "positive"),
    # a model that cannot learn: inf / 1e300 trained a constant loss (ln V) with exit 0 once
    ("model_overrides", {"norm_eps": float("inf")}, "ModelConfig.norm_eps: must be a finite positive number"),
    ("model_overrides", {"norm_eps": 1e300}, "is not a small epsilon"),
    ("model_overrides", {"rope_theta": float("inf")}, "ModelConfig.rope_theta: must be a finite positive number"),
    ("model_overrides", {"init_std": float("nan")}, "ModelConfig.init_std: must be a finite positive number"),
])
def test_invalid_fields_name_field_and_rule(field, value, rule):
    with pytest.raises(ValueError) as e:
        TrainConfig(**{field: value})
    assert f"TrainConfig.{field if field != 'model_overrides' else 'model'}" in str(e.value)
    assert rule in str(e.value)


def test_bf16_refused_on_cpu():
    with pytest.raises(ValueError, match="TrainConfig.dtype: bfloat16 autocast is GPU-only"):
        TrainConfig(device="cpu", dtype="bfloat16")
    if not torch.cuda.is_available():  # device=auto resolved to the CPU at run time
        with pytest.raises(ValueError, match="GPU-only"):
            resolve_dtype(TrainConfig(dtype="float16"), torch.device("cpu"))
    assert resolve_dtype(TrainConfig(), torch.device("cpu")) == torch.float32


def test_unknown_field_rejected():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['learning_rate'\]"):
        TrainConfig.from_dict({"learning_rate": 1e-3})


def test_yaml_file_with_preset_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    # PyYAML reads 1e-3 (no dot) as a string and 2 as an int: both must become floats
    path.write_text("preset: test\nlr: 1e-3\nmin_lr: 0\nbatch_size: 8\nmodel_overrides:\n  attention: standard\n")
    cfg = load_train_config(path, ["steps=30", "model.dim=64", "tensorboard=false", "data_source=/x/y.txt"])
    assert cfg.lr == 1e-3 and isinstance(cfg.lr, float) and cfg.min_lr == 0.0
    assert cfg.batch_size == 8 and cfg.steps == 30 and cfg.tensorboard is False
    assert cfg.seq_len == TRAIN_PRESETS["test"].seq_len  # from the preset
    assert cfg.model == "test" and cfg.model_overrides == {"attention": "standard", "dim": 64}
    assert cfg.data_source == "/x/y.txt"
    m = cfg.model_config(vocab_size=257)
    assert (m.attention, m.dim, m.vocab_size) == ("standard", 64, 257)


def test_json_file_full_model_mapping(tmp_path):
    model = preset("test", dim=64).to_dict()
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": model, "steps": 5, "warmup_steps": 1, "seq_len": 32}))
    cfg = load_train_config(path, ["model.n_layers=3"])
    m = cfg.model_config(vocab_size=257)
    assert m.n_layers == 3 and m.dim == 64
    assert m.vocab_size == model["vocab_size"]  # given explicitly in the mapping: kept


def test_bad_files_and_overrides_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1, 2\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        load_train_config(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"batch_size": 0}))
    with pytest.raises(ValueError, match=r"wrong\.json.*batch_size"):
        load_train_config(wrong)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_train_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        load_train_config(None, ["lr"])
    with pytest.raises(ValueError, match="unknown TrainConfig field 'lrr'"):
        load_train_config(None, ["lrr=3"])


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, steps=110, decay="cosine")
    assert lr_at(1, cfg) == pytest.approx(0.1)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert lr_at(110, cfg) == pytest.approx(0.1)
    lin = cfg.replace(decay="linear")
    assert lr_at(35, lin) == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_at(200, cfg.replace(decay="constant")) == 1.0
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs[:-1], lrs[1:], strict=True)) and all(math.isfinite(x) for x in lrs)


@pytest.mark.parametrize("attention", ["diff", "diff_v2", "standard"])
def test_weight_decay_groups(attention):
    model = Transformer(preset("test", attention=attention))
    decay, keep = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    kept = {names[id(p)] for p in keep["params"]}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0.0
    assert "tok_embeddings.weight" in kept and "norm.weight" in kept
    assert "layers.0.attn_norm.weight" in kept and "layers.1.mlp_norm.weight" in kept
    assert "layers.0.attn.q_proj.weight" in decayed and "lm_head.weight" in decayed
    assert "layers.0.mlp.gate_proj.weight" in decayed
    if attention == "diff":
        assert {"layers.0.attn.lambda_q1", "layers.1.attn.lambda_k2", "layers.0.attn.subln.weight"} <= kept
    if attention == "diff_v2":
        assert "layers.0.attn.lambda_proj.weight" in kept
    assert len(kept) + len(decayed) == len(list(model.parameters()))
    assert no_decay("x.norm.weight", torch.zeros(3)) and not no_decay("x.q_proj.weight", torch.zeros(3, 3))


def test_cli_config_precedence_and_baseline(tmp_path):
    from difftx.cli import build_parser
    from difftx.cli.train import build_config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"preset": "test", "lr": 0.002, "out_dir": "from_file"}))
    args = build_parser().parse_args(["train", "--config", str(path), "--set", "lr=0.003", "--out", "flag_out",
                                      "--baseline"])
    cfg = build_config(args)
    assert cfg.lr == 0.003 and cfg.out_dir == "flag_out"
    explicit = build_config(build_parser().parse_args(["train", "--config", str(path), "--preset", "cpu-5m"]))
    assert explicit.model == "cpu-5m" and explicit.lr == 0.002  # --preset replaces the file's, fields still apply
    diff = TRAIN_PRESETS["test"].model_config(257)
    base = cfg.model_config(257)
    assert base.attention == "standard" and base.n_heads == 2 * diff.n_heads
    assert Transformer(base).num_parameters() <= Transformer(diff).num_parameters()


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.*")),
                         ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = load_train_config(path)
    m = cfg.model_config(vocab_size=257)
    assert cfg.seq_len <= m.max_seq_len and cfg.out_dir.startswith("runs/")


def test_lambda_per_layer_matches_the_modules():
    from difftx.attention import DiffAttention
    from difftx.training.metrics import lambda_per_layer

    model = Transformer(preset("test", n_layers=3))
    got = lambda_per_layer(model)
    want = [float(m.lambda_full().detach()) for m in model.modules() if isinstance(m, DiffAttention)]
    assert len(got) == 3 and got == pytest.approx(want, abs=1e-6)
    assert lambda_per_layer(Transformer(preset("test", attention="standard"))) is None


def test_allow_new_data_is_one_resumes_permission_not_a_change_of_the_run():
    """``allow_new_data`` (``--allow-new-data``) may differ from the saved config on resume, either way."""
    from difftx.training.config import check_resume_changes

    saved = train_preset("test")
    assert check_resume_changes(saved, saved.replace(allow_new_data=True)).allow_new_data is True
    assert check_resume_changes(saved.replace(allow_new_data=True), saved).allow_new_data is False
