"""``difftx convert --method dex`` (issue 40): the DEX-style conversion, the difference taken on the value side.

transformers' own random-init Llama models (GQA; tied MHA) convert with logits equal to transformers' forward of the
source, every head or the most diffuse half; the ``dex`` kind computes ``A V (I - lambda W)`` on its selected heads
and the source's attention on the others, on every kernel, stacked and with a KV cache; the warm-up factor scales
its lambda; the entropy rule picks the most diffuse heads (on the bundled text when the source has a tokenizer);
the model fine-tunes (lambda moves off 0, ``W`` off the identity); and bad head specs are refused in one line."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
import test_convert  # noqa: E402
from test_convert import (LLAMAS, TOLERANCE, VOCAB, _non_trivial, check_against_transformers,  # noqa: E402
                          check_kernels_agree, check_stack_equals_alone, fine_tune, rel_error, tokens)

from difftx import KVCache, ModelConfig, Transformer  # noqa: E402
from difftx.attention import ATTENTIONS, DexAttention, StandardAttention  # noqa: E402
from difftx.attention.registry import BUILTIN_KINDS  # noqa: E402
from difftx.checkpoint import load_model, save_model  # noqa: E402
from difftx.cli import main  # noqa: E402
from difftx.cli.convert import METHODS as CLI_METHODS  # noqa: E402
from difftx.config import arm_names, attention_parameter_delta, baseline_config  # noqa: E402
from difftx.interop import ConversionError, export_hf  # noqa: E402
from difftx.interop.convert import CONVERSION_NAME, METHODS, convert_model, head_entropies  # noqa: E402
from difftx.training.optim import set_lambda_scale  # noqa: E402

llamas = test_convert.llamas  # the transformers Llama folders, saved once for this module


@pytest.mark.parametrize("spec", ["all", "0.5"])
@pytest.mark.parametrize("family", list(LLAMAS))
def test_transformers_llama_converts_with_dex_and_the_same_logits(family, spec, llamas, tmp_path):
    folder, theirs = llamas[family]
    res = convert_model(folder, tmp_path / "out", method="dex", seed=4, dex_heads=spec)
    ours = load_model(tmp_path / "out")
    c, H = ours.config, LLAMAS[family]["num_attention_heads"]
    assert c.attention == "dex" == res.attention and c.n_heads == H and c.head_dim == 64 // H
    assert c.kv_groups == LLAMAS[family]["num_key_value_heads"] and res.max_rel_error <= TOLERANCE
    record = json.loads((tmp_path / "out" / CONVERSION_NAME).read_text())
    assert record["attention"] == "dex" and record["method"] == "dex"
    if spec == "all":
        assert c.options is None and record["dex"]["rule"] == "all"
    else:  # the most diffuse half of each layer, measured on random tokens (the fixture has no tokenizer)
        heads = c.options["heads"]
        assert [len(h) for h in heads] == [H // 2] * c.n_layers and record["dex"]["heads"] == heads
        assert "random tokens" in record["dex"]["sample"]
        for layer, entropy in zip(heads, record["dex"]["entropy"]):
            assert min(entropy[h] for h in layer) >= max(e for h, e in enumerate(entropy) if h not in layer)
    check_against_transformers(ours, theirs, f"{family} dex {spec}")
    for block in ours.layers:
        attn = block.attn
        assert isinstance(attn, DexAttention) and attn.lambda_full().item() == 0.0 and attn.lambda_reading() == 0.0
        assert torch.equal(attn.dex_map, torch.eye(c.head_dim))


def _config(heads=((0, 2), (1,)), **kw) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attention="dex", max_seq_len=40,
                       options=None if heads is None else {"heads": [list(h) for h in heads]}, **kw)


def _moved(model: Transformer) -> Transformer:
    """Lambda away from 0 (different per layer) and W away from the identity, so the value side matters."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            block.attn.lambda_q1.add_(0.3 + 0.1 * i)
            block.attn.dex_map.add_(0.3 * torch.randn(block.attn.dex_map.shape, generator=g))
    return model


def test_a_selected_head_computes_its_output_times_i_minus_lambda_w_and_the_others_the_sources():
    torch.manual_seed(0)
    attn = DexAttention(64, 4, 0, 2, heads=[[0, 2]])
    with torch.no_grad():
        for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.out_proj.weight):
            p.normal_(0, 0.1)
        attn.lambda_q1.add_(0.5)
        attn.dex_map.add_(0.2 * torch.randn(16, 16))
    lam = attn.lambda_full()
    assert lam.item() != 0
    plain = StandardAttention(64, 4, 2)  # the same q/k/v, out_proj the identity: each head's A V
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if k in plain.state_dict()})
    with torch.no_grad():
        plain.out_proj.weight.copy_(torch.eye(64))
        x = torch.randn(2, 9, 64)
        o = plain(x, backend="eager").unflatten(-1, (4, 16))  # (B, T, H, d)
        want = o.clone()
        for h in (0, 2):
            want[..., h, :] = o[..., h, :] @ (torch.eye(16) - lam * attn.dex_map)
        want = want.flatten(-2) @ attn.out_proj.weight.T
        for backend in ("eager", "chunked", "sdpa"):
            torch.testing.assert_close(attn(x, backend=backend), want, rtol=1e-5, atol=1e-6)
        set_lambda_scale(attn, 0.0)  # the first step of a lambda warm-up subtracts nothing
        torch.testing.assert_close(attn(x), o.flatten(-2) @ attn.out_proj.weight.T, rtol=1e-5, atol=1e-6)
        set_lambda_scale(attn, 0.5)
        assert torch.equal(attn.value_lambda(), 0.5 * lam) and attn.kernel_lambda() is None
        y, maps = attn(x, return_maps=True)
        eff, reported = attn.capture_maps(x, maps)
        assert torch.equal(eff, maps.probs) and torch.equal(reported, 0.5 * lam)
    assert attn.lambda_reading() == pytest.approx(lam.item())  # the trainer logs the unscaled lambda


def test_the_kind_is_built_in_matched_to_its_source_and_refused_by_export(tmp_path):
    cfg = _config()
    assert ATTENTIONS["dex"] is DexAttention and BUILTIN_KINDS["dex"] is DexAttention and DexAttention.stacks_natively()
    assert "dex" not in arm_names() and CLI_METHODS == METHODS and "dex" in METHODS
    base = baseline_config(cfg)
    assert base == cfg.replace(attention="standard", options=None)  # the source's shape
    torch.manual_seed(0)
    model = Transformer(cfg)
    torch.manual_seed(0)  # paired initialisation: the same draws by name
    source = Transformer(base)
    delta = sum(n for _, n, _ in attention_parameter_delta(cfg))
    assert delta == 16 * 16 + 4 * 16 and model.num_parameters() - source.num_parameters() == cfg.n_layers * delta
    assert [b.attn.selected for b in model.layers] == [(0, 2), (1,)]
    assert all(b.attn.lambda_full().item() == 0.0 and torch.equal(b.attn.dex_map, torch.eye(16)) for b in model.layers)
    x = tokens(shape=(2, 20))
    with torch.no_grad():  # the baseline's weights, and lambda 0
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)
    save_model(model, tmp_path / "model")
    assert load_model(tmp_path / "model").config == cfg  # the head selection is in the config
    with pytest.raises(ConversionError, match="attention='dex' cannot be exported: .* folds into o_proj: export --as llama"):
        export_hf(model, "never-written", remote_code=False)  # no transformers class (the default: difftx's code)
    bad = {"heads": [[0]]}
    with pytest.raises(ValueError, match="ModelConfig.options: heads has 1 layer lists, the model has n_layers=2"):
        cfg.replace(options=bad)
    for heads, rule in (([[0], [4]], "names a head beyond n_heads=4"), ([[1, 0], []], "sorted and without repeats"),
                        ([[0], ["a"]], "non-negative integers"), (3, "one list of head indices per layer")):
        with pytest.raises(ValueError, match=rule):
            cfg.replace(options={"heads": heads})
    with pytest.raises(ValueError, match=r"takes \['heads'\]"):
        cfg.replace(options={"head": [[0], [1]]})
    with pytest.raises(ValueError, match="ModelConfig.head_norm: true applies only"):
        cfg.replace(head_norm=True)


def test_every_kernel_the_stack_and_the_kv_cache_agree():
    from difftx.training.stacked import StackedTransformer

    torch.manual_seed(0)
    model = _moved(Transformer(_config()))
    x = tokens(shape=(2, 30))
    grads = check_kernels_agree(model, x)
    assert grads["layers.0.attn.lambda_q1"].abs().max() > 0 and grads["layers.1.attn.dex_map"].abs().max() > 0
    with torch.no_grad():
        cache = KVCache(model, 2, 32)
        pieces = [model(x[:, :7], cache=cache)] + [model(x[:, t:t + 1], cache=cache) for t in range(7, 30)]
        torch.testing.assert_close(torch.cat(pieces, 1), model(x), rtol=1e-4, atol=1e-5)
    models = [model, _moved(Transformer(_config()))]
    stack = StackedTransformer.from_models(models)
    for scale in (0.5, 1.0):  # a warm-up's factor scales each model's lambda, stacked as alone
        stack.set_lambda_scale(scale)
        for m in models:
            set_lambda_scale(m, scale)
        check_stack_equals_alone(models, stack)


def test_the_entropy_rule_picks_the_most_diffuse_heads(tmp_path):
    """A head with zero query rows attends uniformly (normalised entropy 1, the most diffuse): it is picked."""
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, attention="standard", max_seq_len=48)
    model = _non_trivial(Transformer(cfg), seed=3)
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight[2 * 16:3 * 16] = 0  # layer 0, head 2
        model.layers[1].attn.q_proj.weight[0:16] = 0  # layer 1, head 0
    entropy = head_entropies(model, tokens(shape=(2, 24)))
    assert entropy.shape == (2, 4) and entropy[0, 2].item() == pytest.approx(1.0) == entropy[1, 0].item()
    assert float(entropy.max()) <= 1.0 + 1e-6 and float(entropy.min()) > 0
    save_model(model, tmp_path / "src")
    res = convert_model(tmp_path / "src", tmp_path / "out", method="dex", dex_heads=1)
    assert res.heads == ((2,), (0,)) and load_model(tmp_path / "out").config.options == {"heads": [[2], [0]]}


def test_a_run_with_a_tokenizer_measures_on_the_bundled_text(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attention="standard",
                      max_seq_len=48)
    model = _non_trivial(Transformer(cfg), seed=5)
    save_model(model, tmp_path / "src")
    (tmp_path / "src" / "tokenizer").mkdir()
    (tmp_path / "src" / "tokenizer" / "difftx_tokenizer.json").write_text('{"type": "byte", "vocab_size": 257, '
                                                                          '"eos_id": 256}')
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--method", "dex", "--dex-heads", "0.5"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "attention='dex', method=dex" in out[0] and "DEX on 4 heads in 2 layers" in out[0]
    record = json.loads((tmp_path / "out" / CONVERSION_NAME).read_text())["dex"]
    assert record["sample"].startswith("8 rows of 48 tokens of the bundled shakespeare")
    assert record["sample"].endswith("through the source's tokenizer")
    ours = load_model(tmp_path / "out")
    assert ours.config == cfg.replace(attention="dex", options={"heads": record["heads"]})
    assert (tmp_path / "out" / "tokenizer" / "difftx_tokenizer.json").is_file()
    x = tokens(shape=(2, 48), vocab=257)
    with torch.no_grad():
        assert rel_error(ours(x), model(x)) <= TOLERANCE


def test_a_lambda_offset_holds_the_function_at_a_warmups_first_step(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, attention="standard", max_seq_len=48)
    model = _non_trivial(Transformer(cfg), seed=6)
    save_model(model, tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--method", "dex", "--lambda-init",
                 "0.5"]) == 0
    assert "does NOT compute the source's function" in capsys.readouterr().out
    ours = load_model(tmp_path / "out")
    assert ours.config == cfg.replace(attention="dex", lambda_init=0.5)
    x = tokens(shape=(2, 48))
    with torch.no_grad():
        assert rel_error(ours(x), model(x)) > 1e-2  # as loaded: each head's output times (1 - 0.5)
        set_lambda_scale(ours, 0.0)
        assert rel_error(ours(x), model(x)) <= TOLERANCE


def test_the_dex_model_fine_tunes_lambda_moves_and_w_trains(tmp_path, monkeypatch, capsys):
    start, tuned = fine_tune(tmp_path, monkeypatch, capsys, ["--method", "dex", "--dex-heads", "2"], "weight_decay=0")
    assert tuned.config == start.config and [len(h) for h in tuned.config.options["heads"]] == [2, 2, 2]
    for a, b in zip(start.layers, tuned.layers):
        lam = b.attn.lambda_reading()
        assert a.attn.lambda_reading() == 0.0 and math.isfinite(lam) and lam != 0.0
        assert torch.equal(a.attn.dex_map, torch.eye(8)) and not torch.equal(b.attn.dex_map, torch.eye(8))
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("lambda") and all(v != 0 for v in r["lambda"]) for r in logged)


@pytest.mark.parametrize("args, rule", [
    (["--method", "mirror", "--dex-heads", "2"], "--dex-heads: applies only to --method dex"),
    (["--method", "dex", "--dex-heads", "0"], "dex_heads: must be 'all', a count of heads per layer"),
    (["--method", "dex", "--dex-heads", "9"], "the source has 8 heads per layer, got '9'"),
    (["--method", "dex", "--dex-heads", "1.5"], r"dex_heads: a fraction must be in \(0, 1\]"),
    (["--method", "dex", "--dex-heads", "half"], "dex_heads: must be 'all', a count"),
])
def test_bad_head_specs_are_refused_in_one_line(args, rule, llamas, tmp_path, capsys):
    import re

    assert main(["convert", str(llamas["llama-gqa"][0]), str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(rule, err), err
    assert not (tmp_path / "out").exists()


def test_explicit_heads_and_the_python_api(llamas, tmp_path):
    folder, _ = llamas["llama-tied-mha"]
    res = convert_model(folder, tmp_path / "a", method="dex", dex_heads=[[0], [], [1, 3]])
    assert res.heads == ((0,), (), (1, 3)) and res.head_rule == "given"
    assert load_model(tmp_path / "a").config.options == {"heads": [[0], [], [1, 3]]}
    with pytest.raises(ConversionError, match="dex_heads: ModelConfig.options: heads has 2 layer lists"):
        convert_model(folder, tmp_path / "b", method="dex", dex_heads=[[0], [1]])
    with pytest.raises(ConversionError, match="dex_heads: applies only to method 'dex'"):
        convert_model(folder, tmp_path / "c", method="random", dex_heads="all")
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    convert_model(folder, tmp_path / "d", method="dex", dex_heads=1.0)  # the fraction 1: every head
    assert load_model(tmp_path / "d").config.options is None
