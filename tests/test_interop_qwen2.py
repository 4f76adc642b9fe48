"""Qwen2 exactly (issue 51, item 3): q/k/v biases (``ModelConfig.qkv_bias``) in the standard, converted and dex kinds.

transformers' Qwen2ForCausalLM is LlamaForCausalLM with a bias on q_proj, k_proj and v_proj (added before RoPE; none
on o_proj), and a sliding window that applies only with ``use_sliding_window``. The tests build tiny random Qwen2
models with transformers' own classes (biases drawn non-zero, tied and untied embeddings), save them with
``save_pretrained``, and compare difftx's float32 logits with Qwen2's own forward (max |difference| / max |logit|
<= 1e-5): ``difftx import``, export back (Qwen2ForCausalLM, the same tensors), ``difftx convert`` (every method), a
converted / dex model with lambda moved exported with difftx's modeling code (loaded here with
``trust_remote_code``) or folded by ``--as llama`` (into a Qwen2ForCausalLM); a stack with biases equals its models
alone; what difftx cannot compute (a window shorter than the context, RoPE scaling) is refused in one line, exit
status 2, nothing written. ``pytest -s`` prints each measured difference.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from difftx import KVCache, ModelConfig, Transformer  # noqa: E402
from difftx.checkpoint import load_model, save_model  # noqa: E402
from difftx.cli import main  # noqa: E402
from difftx.config import attention_parameter_delta, baseline_config  # noqa: E402
from difftx.interop import export_hf, import_hf  # noqa: E402
from difftx.interop.convert import convert_model  # noqa: E402
import test_convert  # noqa: E402  (its kernel and stack checks)
from test_interop_mistral import _one_line_refusal, rel_error  # noqa: E402
from conftest import saved_once  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
VOCAB, TOLERANCE = 257, 1e-5
QWENS = {"tied": True, "untied": False}  # Qwen2's small models tie their embeddings


def token_rows(seed: int = 3, shape=(3, 40)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _qwen2(tied: bool, seed: int = 0, **kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**{**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                tie_word_embeddings=tied,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6}), **kw})
    model = Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights of 0.08 std, norm gains far from one, biases of 0.3 std: a wrong layout shows
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.5 * noise if name.endswith("norm.weight") else 0.3 * noise if p.dim() == 1 else
                    0.08 * noise)
    return model


@pytest.fixture(scope="module")
def qwens(tmp_path_factory):
    """Each Qwen2 saved once with save_pretrained: ``{name: (folder, transformers model)}``."""
    out = saved_once(tmp_path_factory.mktemp("qwen2"), QWENS, lambda tied, seed: _qwen2(tied, seed=seed))
    for folder, _ in out.values():
        assert "model.layers.0.self_attn.q_proj.bias" in load_file(str(folder / "model.safetensors"))
    return out


@pytest.mark.parametrize("name", list(QWENS))
def test_import_and_export_back_match_qwen2(name, qwens, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    folder, theirs = qwens[name]
    capsys.readouterr()
    assert main(["import", str(folder), str(tmp_path / "difftx")]) == 0
    ours = load_model(tmp_path / "difftx")
    c = ours.config
    assert c.attention == "standard" and c.qkv_bias and c.tie_embeddings == QWENS[name]
    assert (c.n_heads, c.kv_groups, c.rope_theta, c.norm_eps) == (4, 2, 1e6, 1e-6)
    test_convert.check_against_transformers(ours, theirs, f"import qwen2 {name}")  # every kernel
    x = token_rows()
    with torch.no_grad():
        ref = theirs(x).logits
        sdpa = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa")
        assert rel_error(ours(x), sdpa.eval()(x).logits) <= TOLERANCE
        # the biases matter, and so does their RoPE permutation: without either the logits differ
        q_bias = ours.layers[0].attn.q_proj.bias
        kept = q_bias.clone()
        q_bias.copy_(kept.view(-1, 2, 8).flip(1).reshape(-1))  # not in difftx's interleaved order (d = 16)
        assert rel_error(ours(x), ref) > 1e-3
        q_bias.zero_()
        assert rel_error(ours(x), ref) > 1e-3
        q_bias.copy_(kept)
    # back to transformers: a Qwen2ForCausalLM (no custom code) holding the very same tensors
    assert main(["export", str(tmp_path / "difftx"), str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert not cfg["use_sliding_window"] and not (tmp_path / "hf" / "modeling_difftx.py").exists()
    a, b = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        err = rel_error(back(x).logits, ours(x))
    print(f"export qwen2 {name}: max relative difference {err:.2e}")
    assert err <= TOLERANCE


@pytest.mark.parametrize("method", ["mirror", "zero", "random", "dex"])
@pytest.mark.parametrize("name", list(QWENS))
def test_convert_keeps_qwen2s_function(name, method, qwens, tmp_path):
    folder, theirs = qwens[name]
    res = convert_model(folder, tmp_path / "out", method=method, seed=2)
    assert res.source == "transformers:qwen2" and res.max_rel_error <= TOLERANCE
    ours = load_model(tmp_path / "out")
    c = ours.config
    assert c.attention == ("dex" if method == "dex" else "converted") and c.qkv_bias
    assert baseline_config(c) == c.plain(attention="standard") and baseline_config(c).qkv_bias  # the source
    x = token_rows(seed=5)
    with torch.no_grad():
        err = rel_error(ours(x, backend="eager"), theirs(x).logits)
    print(f"convert qwen2 {name} {method}: max relative difference {err:.2e}")
    assert err <= TOLERANCE
    src = theirs.model.layers[0].self_attn
    attn = ours.layers[0].attn
    torch.testing.assert_close(attn.v_proj.bias, src.v_proj.bias, rtol=0, atol=0)
    if method != "dex":  # the negative component's bias: a copy for mirror, zeros otherwise (the module doc)
        neg = attn.q_proj.bias.view(4, 2, 16)[:, 1]
        assert torch.equal(neg, attn.q_proj.bias.view(4, 2, 16)[:, 0]) if method == "mirror" else not neg.any()


def _moved(model: Transformer, seed: int = 5) -> Transformer:
    """lambda (and W, and the negative components' biases) moved off their start, as fine-tuning moves them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lambda_" in name or name.endswith("dex_map") or name.endswith("_proj.bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("method", ["mirror", "dex"])
def test_a_moved_model_exports_with_difftxs_code_and_matches(method, qwens, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, _ = qwens["tied"]
    convert_model(folder, tmp_path / "conv", method=method, seed=1,
                  **({"dex_heads": [[0, 2], [1, 2, 3]]} if method == "dex" else {}))
    ours = _moved(load_model(tmp_path / "conv"))
    assert all(abs(b.attn.lambda_reading()) > 1e-3 for b in ours.layers)
    save_model(ours, tmp_path / "moved")
    assert main(["export", str(tmp_path / "moved"), str(tmp_path / "hf")]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "difftx" and cfg["qkv_bias"] is True
    assert (tmp_path / "hf" / "modeling_difftx.py").is_file()
    theirs, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True,
                                                        dtype=torch.float32, output_loading_info=True)
    theirs.eval()
    assert type(theirs).__name__ == "DifftxForCausalLM" and not info["missing_keys"] and not info["unexpected_keys"]
    x = token_rows(seed=7, shape=(2, 24))
    with torch.no_grad():
        ref = ours(x, backend="eager")
        err = rel_error(theirs(x).logits, ref)
        out = theirs(x[:, :-1], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        step = theirs(x[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1]
    print(f"export {method} (lambda moved) with difftx's modeling code: max relative difference {err:.2e}")
    assert err <= TOLERANCE and rel_error(step, ref[:, -1]) <= TOLERANCE


def test_export_as_llama_folds_into_qwen2(qwens, tmp_path):
    """``--as llama`` of a model with q/k/v biases writes a Qwen2ForCausalLM (Llama plus those biases): a converted
    model at lambda 0 gives back its source's tensors bit for bit; a dex model with lambda and W moved folds
    ``I - lambda W`` into o_proj."""
    from transformers import AutoModelForCausalLM

    folder, theirs = qwens["untied"]
    convert_model(folder, tmp_path / "conv", method="random", seed=3)
    assert main(["export", str(tmp_path / "conv"), str(tmp_path / "as_llama"), "--as", "llama"]) == 0
    cfg = json.loads((tmp_path / "as_llama" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    a, b = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "as_llama" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    convert_model(folder, tmp_path / "dex", method="dex", seed=3)
    dex = _moved(load_model(tmp_path / "dex"))
    export_hf(dex, tmp_path / "dex_hf", fold="llama")
    folded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dex_hf"), dtype=torch.float32).eval()
    assert type(folded).__name__ == "Qwen2ForCausalLM"
    x = token_rows(seed=9)
    with torch.no_grad():
        err = rel_error(folded(x).logits, dex(x))
    print(f"export --as llama of dex (lambda moved) into Qwen2: max relative difference {err:.2e}")
    assert err <= TOLERANCE


def _biased(config: ModelConfig, seed: int) -> Transformer:
    torch.manual_seed(seed)
    return _moved(Transformer(config), seed)


@pytest.mark.parametrize("kind", ["standard", "converted", "dex"])
def test_the_biases_on_every_kernel_stacked_and_cached(kind):
    """Every kernel equals eager with biases (logits and gradients); a native stack equals its models alone (loss
    and gradients, the biases' included); a KV cache equals the full forward."""
    options = {"heads": [[1, 3], [0]]} if kind == "dex" else None
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attention=kind, max_seq_len=40,
                      qkv_bias=True, options=options)
    models = [_biased(cfg, seed) for seed in (0, 1)]
    assert all(m.layers[0].attn.k_proj.bias.abs().min() > 0 for m in models)
    m = models[0]
    x = token_rows(shape=(2, 30))
    grads = test_convert.check_kernels_agree(m, x)  # flex forward only: it computes gradients on GPUs only
    assert all(grads[f"layers.1.attn.{n}_proj.bias"].abs().max() > 0 for n in "qkv")
    test_convert.check_stack_equals_alone(models)  # every parameter's gradient, the biases' included
    with torch.no_grad():
        full = m(x[:, :14])
        cache = KVCache(m, 2, 16)
        pieces = [m(x[:, :5], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(5, 14)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)


def test_the_config_field(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attention="standard")
    assert "qkv_bias" not in cfg.to_dict()  # older config.json files read as before, and stay as written
    assert ModelConfig.from_dict(cfg.to_dict()).qkv_bias is False
    biased = cfg.replace(qkv_bias=True)
    assert ModelConfig.from_json(biased.to_json()) == biased
    # each bias is counted: q (H·d), k and v (Hkv·d) per layer
    assert Transformer(biased).num_parameters() - Transformer(cfg).num_parameters() == 2 * (64 + 32 + 32)
    conv = biased.replace(attention="converted")  # its negative components' q/k biases: H·d + Hkv·d more
    assert sum(n for _, n, _ in attention_parameter_delta(conv)) == \
        sum(n for _, n, _ in attention_parameter_delta(cfg.replace(attention="converted"))) + 64 + 32
    assert Transformer(conv).num_parameters() - Transformer(biased).num_parameters() == \
        2 * sum(n for _, n, _ in attention_parameter_delta(conv))
    save_model(Transformer(conv), tmp_path / "conv")
    capsys.readouterr()
    assert main(["info", str(tmp_path / "conv")]) == 0
    out = capsys.readouterr().out
    assert f"parameters={Transformer(conv).num_parameters():,}" in out and "q_proj.bias entries" in out
    for kind in ("diff", "diff_v2", "gated", "temperature"):
        with pytest.raises(ValueError, match=r"ModelConfig.qkv_bias: applies only to attention in \('standard', "
                                             r"'converted', 'dex'\)") as e:
            cfg.replace(attention=kind, qkv_bias=True)
        assert "\n" not in str(e.value)


def test_a_window_shorter_than_the_context_is_refused_and_would_differ(tmp_path, capsys):
    """Layer 1 windowed (``max_window_layers=1``) over 16 of the 64 positions: refused by import and convert; read
    without its window, the same weights compute another function on longer rows."""
    model = _qwen2(True, seed=3, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    model.save_pretrained(tmp_path / "hf")
    pattern = (r"sliding_window=16 is shorter than the context \(max_position_embeddings=64\) in layer\(s\) \[1\] "
               r"\(layer_types, use_sliding_window=true\)")
    for command in ("import", "convert"):
        capsys.readouterr()
        _one_line_refusal([command, str(tmp_path / "hf"), str(tmp_path / "out")], capsys, pattern)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    del cfg["layer_types"]  # max_window_layers decides which layers slide: the same refusal, naming it
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    _one_line_refusal(["import", str(tmp_path / "hf"), str(tmp_path / "out")], capsys, r"\[1\] \(max_window_layers=1, ")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "max_window_layers": 2}))  # no layer slides
    ours = load_model(import_hf(tmp_path / "hf", tmp_path / "whole"))
    x = token_rows(shape=(2, 40))
    with torch.no_grad():
        assert rel_error(ours(x), model(x).logits) > 1e-3
        assert rel_error(ours(x[:, :16]), model(x[:, :16]).logits) <= TOLERANCE  # within the window: the same
    # a window as long as the context hides nothing: read
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "sliding_window": 64}))
    assert load_model(import_hf(tmp_path / "hf", tmp_path / "covered")).config.qkv_bias


@pytest.mark.parametrize("changes,pattern", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "RoPE scaling"),
    (dict(layer_types=["full_attention"]), r"layer_types must list 2 of"),
])
def test_qwen2_features_difftx_does_not_compute_are_refused(changes, pattern, qwens, tmp_path, capsys):
    import shutil

    shutil.copytree(qwens["tied"][0], tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **changes, "use_sliding_window": True,
                                                             "sliding_window": 8}))
    capsys.readouterr()
    _one_line_refusal(["import", str(tmp_path / "hf"), str(tmp_path / "out")], capsys, pattern)


def test_a_converted_qwen2_fine_tunes_and_its_biases_train(qwens, tmp_path, monkeypatch, capsys):
    """``difftx train --init-from`` a converted Qwen2 (the byte tokenizer's 257 ids): the biases are trained with
    the rest (no weight decay: they are vectors), and lambda moves off 0."""
    from difftx.training.checkpointing import resolve_checkpoint

    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    convert_model(qwens["tied"][0], tmp_path / "conv", method="mirror")
    text = tmp_path / "text.txt"
    text.write_text("Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n" * 40)
    sets = ["steps=3", "batch_size=2", "seq_len=32", "warmup_steps=1", "eval_interval=0", "ckpt_interval=0",
            "log_interval=1", "tensorboard=false", "device=cpu"]
    assert main(["train", "--init-from", str(tmp_path / "conv"), "--data", str(text), "--out", str(tmp_path / "run"),
                 "--no-progress", *[a for s in sets for a in ("--set", s)]]) == 0
    capsys.readouterr()
    start, tuned = load_model(tmp_path / "conv"), load_model(resolve_checkpoint(tmp_path / "run"))
    assert tuned.config == start.config and tuned.config.qkv_bias
    for a, b in zip(start.layers, tuned.layers):
        assert not torch.equal(a.attn.q_proj.bias, b.attn.q_proj.bias)
        assert not torch.equal(a.attn.v_proj.bias, b.attn.v_proj.bias)
        assert b.attn.lambda_reading() != 0.0
