"""Hugging Face interop: exported difftx models match transformers' own DiffLlama / Llama logits,
transformers-made models import and match, import -> export is bit-exact, and conversions that
cannot be exact are refused."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from difftx.checkpoint import load_model, save_model  # noqa: E402
from difftx.cli import main as cli_main  # noqa: E402
from difftx.config import ModelConfig  # noqa: E402
from difftx.generation import generate  # noqa: E402
from difftx.interop import ConversionError, export_hf, import_hf  # noqa: E402
from difftx.interop import hf as interop  # noqa: E402
from difftx.model import Transformer  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
VOCAB = 96


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-trivial values everywhere: lambdas large enough to matter, gains far from one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda" in name:
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # norm gains, subln included
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny(attention: str = "diff", **kw) -> ModelConfig:
    base = dict(vocab_size=VOCAB, dim=64, n_layers=3, n_heads=2, max_seq_len=64, attention=attention)
    return ModelConfig(**{**base, **kw})


def hf_load(folder, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kw).eval()


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-4) -> None:
    err = (ours - theirs).abs().max().item()
    scale = ours.abs().max().item()
    print(f"max |difftx - transformers| = {err:.2e}, max |logit| = {scale:.2f}")  # shown with pytest -s
    assert err <= rel * scale, f"max |difftx - transformers| = {err:.3g} vs logit scale {scale:.3g}"


def tokens(seed: int = 1, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


CASES = {
    "diff-mha-untied": tiny(n_heads=2),  # d = 16
    "diff-gqa-tied": tiny(n_heads=4, n_kv_heads=2, tie_embeddings=True),  # d = 8, 2 heads per kv group
    "diff-gqa1-untied": tiny(n_heads=4, n_kv_heads=1, rope_theta=500.0, norm_eps=1e-6),
    "standard-mha-tied": tiny("standard", n_heads=4, tie_embeddings=True),
    "standard-gqa-untied": tiny("standard", n_heads=4, n_kv_heads=2),
    "standard-odd-kv": tiny("standard", dim=96, n_heads=6, n_kv_heads=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_export_matches_transformers(name, tmp_path):
    cfg = CASES[name]
    model = randomize(Transformer(cfg), seed=len(name))
    out = export_hf(model, tmp_path / "hf")
    hf_cfg = json.loads((out / "config.json").read_text())
    diff = cfg.attention == "diff"
    assert hf_cfg["model_type"] == ("diffllama" if diff else "llama")
    assert hf_cfg["num_attention_heads"] == (2 * cfg.n_heads if diff else cfg.n_heads)
    assert hf_cfg["num_key_value_heads"] == (2 * cfg.kv_groups if diff else cfg.kv_groups)
    x = tokens()
    with torch.no_grad():
        ours = model(x, backend="eager")
        for impl in ("eager", "sdpa"):
            theirs = hf_load(out, attn_implementation=impl)
            assert type(theirs).__name__ == ("DiffLlamaForCausalLM" if diff else "LlamaForCausalLM")
            assert theirs.config.rope_parameters["rope_theta"] == cfg.rope_theta
            assert_logits_close(ours, theirs(x).logits)


def test_greedy_generation_matches_transformers(tmp_path):
    """transformers' generate (its own KV cache) continues a prompt like difftx's generate."""
    model = randomize(Transformer(CASES["diff-gqa-tied"]), seed=3)
    theirs = hf_load(export_hf(model, tmp_path / "hf"))
    prompt = tokens(5, (1, 10))
    ours = generate(model, prompt.tolist(), max_new_tokens=12, temperature=0)[0]
    with torch.no_grad():
        out = theirs.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out[0, 10:].tolist() == ours


@pytest.mark.parametrize("broken", ["pairing", "rope", "subln"])
def test_a_wrong_layout_is_detected(broken, tmp_path, monkeypatch):
    """The logit comparison is sensitive to each part of the layout conversion."""
    if broken == "pairing":  # adjacent pairs passed through as if they were halves
        monkeypatch.setattr(interop, "pairs_to_halves", lambda w, d: w)
    elif broken == "rope":  # interleaved RoPE rows passed through as rotate-half
        monkeypatch.setattr(interop, "rope_interleaved_to_half", lambda w, d: w)
    else:  # the norm gain dropped instead of folded into o_proj
        real = interop.to_hf_state

        def no_fold(config, state):
            return real(config, {k: (torch.ones_like(v) if k.endswith("subln.weight") else v)
                                 for k, v in state.items()})
        monkeypatch.setattr(interop, "to_hf_state", no_fold)
    model = randomize(Transformer(CASES["diff-gqa-tied"]), seed=4)
    theirs = hf_load(export_hf(model, tmp_path / "hf"))
    x = tokens()
    with torch.no_grad():
        err = (model(x) - theirs(x).logits).abs().max().item()
    assert err > 1e-2


def _transformers_model(kind: str, tie: bool, seed: int = 0):
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                  tie_word_embeddings=tie, rms_norm_eps=1e-5)
    if kind == "diffllama":
        m = DiffLlamaForCausalLM(DiffLlamaConfig(lambda_std_dev=0.4, **common))
    else:
        m = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():  # transformers initialises norm gains to one: make them matter
        for name, p in m.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(0.08 * torch.randn_like(p))
    return m.eval()


@pytest.mark.parametrize("kind,tie", [("diffllama", False), ("diffllama", True), ("llama", False)])
def test_transformers_model_imports_and_round_trips(kind, tie, tmp_path):
    theirs = _transformers_model(kind, tie)
    theirs.save_pretrained(tmp_path / "hf")
    ours_dir = import_hf(tmp_path / "hf", tmp_path / "difftx")
    ours = load_model(ours_dir)  # what `difftx train --init-from` reads
    from safetensors import safe_open

    from difftx.checkpoint import DIGEST_KEY
    with safe_open(str(ours_dir / "model.safetensors"), "pt") as f:  # written with its digest, checked on load
        assert len(f.metadata()[DIGEST_KEY]) == 64
    assert ours.config.attention == ("diff" if kind == "diffllama" else "standard")
    assert ours.config.tie_embeddings == tie
    if kind == "diffllama":
        assert (ours.config.n_heads, ours.config.kv_groups, ours.config.head_dim) == (4, 2, 8)
    x = tokens(7)
    with torch.no_grad():
        assert_logits_close(ours(x, backend="eager"), theirs(x).logits)
    # import -> export gives back the very same tensors
    export_hf(ours_dir, tmp_path / "hf2")
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    if tie:
        a.pop("lm_head.weight", None)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    c1, c2 = (json.loads((tmp_path / f / "config.json").read_text()) for f in ("hf", "hf2"))
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "vocab_size",
                "max_position_embeddings", "rope_parameters"):
        assert c1[key] == c2[key], key


def test_sharded_transformers_folder_imports(tmp_path):
    theirs = _transformers_model("diffllama", tie=False, seed=5)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_model(import_hf(tmp_path / "hf", tmp_path / "difftx"))
    x = tokens(3)
    with torch.no_grad():
        assert_logits_close(ours(x), theirs(x).logits)


def test_bfloat16_round_trip_is_bit_exact(tmp_path):
    theirs = _transformers_model("diffllama", tie=False, seed=2).to(torch.bfloat16)
    theirs.save_pretrained(tmp_path / "hf")
    export_hf(import_hf(tmp_path / "hf", tmp_path / "difftx"), tmp_path / "hf2")
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_export_and_import_with_tokenizer(tmp_path, capsys):
    """A training run (byte tokenizer in checkpoint/tokenizer/) -> `difftx export` -> transformers
    model + tokenizer -> `difftx import` -> a folder the trainer's --init-from reads."""
    from difftx.data.tokenizer import load_tokenizer

    cfg = tiny(vocab_size=257, n_heads=4, n_kv_heads=2)
    model = randomize(Transformer(cfg), seed=9)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000007"  # the trainer's layout
    save_model(model, ckpt)
    (ckpt / "tokenizer").mkdir()
    (ckpt / "tokenizer" / "difftx_tokenizer.json").write_text('{"type": "byte", "vocab_size": 257, "eos_id": 256}')
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000007")
    # a run folder means its latest checkpoint
    assert cli_main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "héllo, wörld"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8")) and tok.eos_token_id == 256
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 256
    theirs = hf_load(tmp_path / "hf")
    x = torch.tensor([ids])
    with torch.no_grad():
        assert_logits_close(model(x), theirs(x).logits)
    assert cli_main(["import", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back_tok = load_tokenizer(tmp_path / "back" / "tokenizer")  # what --init-from picks up
    assert back_tok.encode(text) == ids and back_tok.eos_id == 256
    back = load_model(tmp_path / "back")
    with torch.no_grad():
        assert_logits_close(model(x), back(x))
    # errors reach the user as a message and exit status 2, not a traceback
    capsys.readouterr()
    assert cli_main(["import", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("cfg,match", [
    (tiny("diff_v2", n_heads=4), "no Differential Transformer V2"),
    (tiny(use_subln=False), "use_subln=False"),
    (tiny(lambda_init=0.5), "lambda_init=0.5"),
])
def test_export_refuses_inexact_conversions(cfg, match, tmp_path):
    with pytest.raises(ConversionError, match=match):  # DiffLlama / Llama only (the default: difftx's own code)
        export_hf(Transformer(cfg), tmp_path / "hf", remote_code=False)
    assert not (tmp_path / "hf").exists()  # nothing written


def test_constant_lambda_init_equal_to_the_schedule_exports(tmp_path):
    cfg = tiny(n_layers=1, lambda_init=0.2)  # layer 0 of the schedule: 0.8 - 0.6 = 0.2
    model = randomize(Transformer(cfg))
    theirs = hf_load(export_hf(model, tmp_path / "hf"))
    x = tokens()
    with torch.no_grad():
        assert_logits_close(model(x), theirs(x).logits)


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,match", [
    (dict(num_key_value_heads=3, num_attention_heads=6, head_dim=8, hidden_size=48), "must both be even"),
    (dict(attention_bias=True), "no bias"),
    (dict(hidden_act="gelu"), "silu"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "RoPE scaling"),
    (dict(head_dim=4), "head_dim=4"),
    (dict(model_type="gpt2"), "not supported"),
])
def test_import_refuses_unsupported_configs(changes, match, tmp_path):
    export_hf(Transformer(tiny(n_heads=4, n_kv_heads=2)), tmp_path / "hf")
    _edit_config(tmp_path / "hf", **changes)
    with pytest.raises(ConversionError, match=match):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_reports_bad_weights(tmp_path):
    export_hf(Transformer(tiny()), tmp_path / "hf")
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del state["model.layers.1.self_attn.lambda_q2"]
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"missing \['model.layers.1.self_attn.lambda_q2'\]"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    (tmp_path / "hf" / "model.safetensors").unlink()
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConversionError, match="only safetensors"):
        import_hf(tmp_path / "hf", tmp_path / "out")


def test_permutations_are_inverse_and_match_the_spec():
    d, g = 4, 3
    w = torch.arange(2 * g * d, dtype=torch.float32)[:, None]  # row r holds r
    assert torch.equal(interop.halves_to_pairs(interop.pairs_to_halves(w, d), d), w)
    assert torch.equal(interop.rope_half_to_interleaved(interop.rope_interleaved_to_half(w, d), d), w)
    halves = interop.pairs_to_halves(w, d).flatten().long().tolist()
    # DiffLlama head c*G + j (d rows) is difftx sub-head 2j + c
    for c in range(2):
        for j in range(g):
            assert halves[(c * g + j) * d:(c * g + j + 1) * d] == list(range((2 * j + c) * d, (2 * j + c + 1) * d))
    half = interop.rope_interleaved_to_half(w[:d], d).flatten().long().tolist()
    assert half == [0, 2, 1, 3]  # rotate-half row c*d/2 + i is interleaved row 2i + c
    assert math.isclose(interop.hf_config(tiny())["lambda_std_dev"], 0.1)


def test_imported_model_fine_tunes_with_init_from(tmp_path):
    """`difftx train --init-from IMPORTED` runs and starts from the imported weights."""
    from difftx.training.config import TrainConfig
    from difftx.training.trainer import train

    export_hf(randomize(Transformer(tiny(vocab_size=257, n_heads=4, n_kv_heads=2)), seed=11), tmp_path / "hf")
    imported = import_hf(tmp_path / "hf", tmp_path / "imported")
    text = tmp_path / "text.txt"
    text.write_text("Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n" * 40)
    res = train(TrainConfig(init_from=str(imported), data_source=str(text), tokenizer="byte", steps=2, batch_size=2,
                            seq_len=32, warmup_steps=1, eval_interval=0, log_interval=1, ckpt_interval=0,
                            out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), progress=False,
                            tensorboard=False, device="cpu", doc_mask=False))
    assert res.model_config == load_model(imported).config
    assert res.step == 2 and all(math.isfinite(v) for v in res.losses.values())
    tuned, start = load_model(res.last_checkpoint), load_model(imported)
    # two small AdamW steps move each weight by at most ~2 * lr: the run started from the imported weights
    for (name, p), q in zip(tuned.named_parameters(), start.parameters()):
        assert (p - q).abs().max().item() < 5e-3, name
    assert not torch.equal(tuned.layers[0].attn.q_proj.weight, start.layers[0].attn.q_proj.weight)
    # and the fine-tuned run exports back, with the run's tokenizer
    from transformers import AutoTokenizer

    export_hf(res.out_dir, tmp_path / "hf_tuned")
    ids = AutoTokenizer.from_pretrained(str(tmp_path / "hf_tuned"))("thee", add_special_tokens=False)["input_ids"]
    assert ids == list(b"thee")
    x = torch.tensor([ids])
    with torch.no_grad():
        assert_logits_close(tuned(x), hf_load(tmp_path / "hf_tuned")(x).logits)


def test_tied_flag_with_its_own_head_imports_as_transformers_loads_it(tmp_path):
    """config.json says tie_word_embeddings, yet the weights hold an lm_head that differs from the
    embedding: transformers keeps that head (it does not tie them), so the import does too, and the
    logits match. (Before: the head was dropped, logits off by 0.67.)"""
    from transformers import AutoModelForCausalLM

    theirs = _transformers_model("diffllama", True)
    theirs.save_pretrained(tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    weights["lm_head.weight"] = 0.08 * torch.randn_like(weights["model.embed_tokens.weight"])
    from safetensors.torch import save_file

    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = load_model(import_hf(tmp_path / "hf", tmp_path / "difftx"))
    assert not ours.config.tie_embeddings
    x = tokens(7)
    with torch.no_grad():
        assert_logits_close(ours(x, backend="eager"), loaded(x).logits)


def test_missing_norm_eps_takes_transformers_default(tmp_path):
    from transformers import AutoModelForCausalLM

    export_hf(Transformer(tiny(n_heads=4, n_kv_heads=2)), tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    del cfg["rms_norm_eps"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    ours = load_model(import_hf(tmp_path / "hf", tmp_path / "out"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert ours.config.norm_eps == theirs.config.rms_norm_eps == 1e-5
    with torch.no_grad():
        assert_logits_close(ours(tokens(5), backend="eager"), theirs(tokens(5)).logits)


@pytest.mark.parametrize("changes,match", [
    (dict(sliding_window=16), "sliding_window=16"),
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be an integer >= 1, got 0"),
    (dict(hidden_size="64"), "hidden_size must be an integer >= 1, got '64'"),
    (dict(rope_parameters="default"), "rope_parameters must be an object"),
])
def test_import_refuses_what_it_cannot_map(changes, match, tmp_path):
    export_hf(Transformer(tiny(n_heads=4, n_kv_heads=2)), tmp_path / "hf")
    _edit_config(tmp_path / "hf", **changes)
    with pytest.raises(ConversionError, match=match):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_tokenizer_wider_than_the_vocabulary(tmp_path, capsys):
    """A tokenizer that produces ids the model has no rows for is refused before anything is written (transformers
    would fail with an IndexError on ordinary text)."""
    from difftx.data.tokenizer import byte_tokenizer_json
    from difftx.interop.hf_tokenizer import tokenizer_size

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(byte_tokenizer_json())
    assert tokenizer_size(tok / "tokenizer.json") == 257
    torch.manual_seed(0)
    save_model(Transformer(ModelConfig(vocab_size=200, dim=32, n_layers=1, n_heads=2, max_seq_len=16)),
               tmp_path / "model")
    with pytest.raises(ConversionError, match="ids up to 256, but the model's vocabulary has 200 rows"):
        export_hf(tmp_path / "model", tmp_path / "out", tokenizer_dir=tok)
    assert not (tmp_path / "out").exists()
    assert cli_main(["export", str(tmp_path / "model"), str(tmp_path / "out2"), "--tokenizer", str(tok)]) == 2
    assert "vocabulary has 200 rows" in capsys.readouterr().err and not (tmp_path / "out2").exists()
    save_model(Transformer(ModelConfig(vocab_size=257, dim=32, n_layers=1, n_heads=2, max_seq_len=16)),
               tmp_path / "model257")
    export_hf(tmp_path / "model257", tmp_path / "out3", tokenizer_dir=tok)  # as wide as the vocabulary: fine


def test_an_exported_folder_records_its_digest_and_a_damaged_one_is_refused_on_import(tmp_path):
    """Export writes the weights' SHA-256 into their header (transformers ignores it); import verifies it, so a
    damaged export is refused instead of re-imported with a fresh digest."""
    from difftx.checkpoint import DIGEST_KEY
    from safetensors import safe_open

    torch.manual_seed(0)
    export_hf(Transformer(tiny()), tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        assert len(f.metadata()[DIGEST_KEY]) == 64 and f.metadata()["format"] == "pt"
    import_hf(tmp_path / "hf", tmp_path / "ok")  # intact: imports
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x40  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match="the bytes changed since they were written"):
        import_hf(tmp_path / "hf", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
