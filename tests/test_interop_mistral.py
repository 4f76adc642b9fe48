"""Mistral folders (issue 40): read exactly when the sliding window covers the context, refused in one line otherwise.

transformers' MistralForCausalLM is LlamaForCausalLM without bias switches plus a sliding-window mask (query ``i``
sees keys ``i - sliding_window + 1 .. i``). With a null window, or one of at least ``max_position_embeddings`` (which
becomes difftx's ``max_seq_len``), the mask hides nothing from any sequence that long, so ``difftx import`` and
``difftx convert`` read the folder as a Llama one. The tests build tiny random GQA models with transformers' own
classes, save them with ``save_pretrained``, and compare difftx's logits with transformers' float32 forward; a
shorter window is refused in one line, exit status 2, nothing written (Qwen2: tests/test_interop_qwen2.py).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from difftx.checkpoint import load_model  # noqa: E402
from difftx.cli import main  # noqa: E402
from difftx.interop import ConversionError, export_hf, import_hf  # noqa: E402
from difftx.interop.convert import METHODS, convert_model  # noqa: E402
from conftest import saved_once  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
VOCAB = 80
TOLERANCE = 1e-5  # max |difftx - transformers| / max |transformers| over the logits, float32


def rel_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def token_rows(T: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(seed))


# tiny Mistral configs, all GQA: no window (Mistral 7B v0.2 and later ship sliding_window null), and a window exactly
# as long as the context (the boundary: position T - 1 of a T = max_position_embeddings row sees all T keys)
MISTRALS = {
    "no-window": dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=None, max_position_embeddings=64,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False),
    "window-equals-context": dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=32,
                                  max_position_embeddings=32, tie_word_embeddings=True, rms_norm_eps=1e-5),
}


def _mistral(seed: int = 0, **kw):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(**{**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2), **kw})
    model = MistralForCausalLM(cfg).eval()
    with torch.no_grad():  # weights of 0.08 std and norm gains far from one, so that a wrong layout shows
        for p in model.parameters():
            p.copy_(1.0 + 0.5 * torch.randn_like(p) if p.dim() == 1 else 0.08 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def mistrals(tmp_path_factory):
    """Each config saved once with save_pretrained: ``{name: (folder, transformers model)}``."""
    return saved_once(tmp_path_factory.mktemp("mistrals"), MISTRALS, lambda kw, seed: _mistral(seed=seed, **kw))


def _transformers_logits(folder: Path, x: torch.Tensor) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    out = {}
    for impl in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation=impl)
        assert type(model).__name__ == "MistralForCausalLM"
        with torch.no_grad():
            out[impl] = model.eval()(x).logits
    return out


@pytest.mark.parametrize("name", list(MISTRALS))
def test_import_matches_transformers(name, mistrals, tmp_path):
    folder, theirs = mistrals[name]
    kw = MISTRALS[name]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ours_dir = import_hf(folder, tmp_path / "difftx")
    window = kw["sliding_window"]  # a window that covers the context: the model matches up to the window alone
    assert [str(w.message).split(": ", 1)[1] for w in said] == ([] if window is None else [
        f"sliding_window={window}: the model read computes Mistral's function on sequences of up to {window} tokens; "
        f"on longer ones difftx attends to every key, Mistral to the last {window} only"])
    ours = load_model(ours_dir)
    c = ours.config
    assert c.attention == "standard" and c.n_heads == kw["num_attention_heads"]
    assert c.kv_groups == kw["num_key_value_heads"] and c.max_seq_len == kw["max_position_embeddings"]
    assert c.tie_embeddings == kw["tie_word_embeddings"] and c.norm_eps == theirs.config.rms_norm_eps
    assert c.rope_theta == theirs.config.rope_parameters["rope_theta"]
    x = token_rows(c.max_seq_len)  # full-length rows: the longest sequence the window must cover
    for impl, ref in _transformers_logits(folder, x).items():
        with torch.no_grad():
            for backend in ("eager", "sdpa"):
                err = rel_error(ours(x, backend=backend), ref)
                print(f"import {name} vs transformers {impl}, difftx {backend}: max relative difference {err:.2e}")
                assert err <= TOLERANCE, (impl, backend, err)
    # exported back it is a Llama folder holding the very same tensors (a covered window changes nothing)
    export_hf(ours_dir, tmp_path / "llama")
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"
    a, b = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "llama" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(MISTRALS))
def test_convert_matches_transformers(name, method, mistrals, tmp_path):
    folder, theirs = mistrals[name]
    res = convert_model(folder, tmp_path / "out", method=method, seed=2)
    assert res.source == "transformers:mistral" and res.max_rel_error <= TOLERANCE
    ours = load_model(tmp_path / "out")
    assert ours.config.attention == ("dex" if method == "dex" else "converted")
    x = token_rows(ours.config.max_seq_len, seed=5)
    with torch.no_grad():
        err = rel_error(ours(x, backend="eager"), theirs(x).logits)
    print(f"convert {name} {method}: max relative difference to transformers {err:.2e}")
    assert err <= TOLERANCE


def _one_line_refusal(argv: list[str], capsys, pattern: str) -> None:
    import re

    out = Path(argv[-1])
    before = sorted(p.name for p in out.parent.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"difftx {argv[0]}: error: "), err
    assert re.search(pattern, err), err
    assert sorted(p.name for p in out.parent.iterdir()) == before  # nothing written


def test_a_window_shorter_than_the_context_is_refused_and_would_differ(tmp_path, capsys):
    model = _mistral(seed=3, num_attention_heads=4, num_key_value_heads=1, sliding_window=16,
                     max_position_embeddings=64)
    model.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    pattern = r"sliding_window=16 is shorter than the context \(max_position_embeddings=64\)"
    _one_line_refusal(["import", str(tmp_path / "hf"), str(tmp_path / "out")], capsys, pattern)
    # (`difftx convert` gives the same line: tests/test_convert.py, case mistral-window.) Why refuse: read
    # without its window, the same weights compute another function on rows longer than 16 tokens
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    ours = load_model(import_hf(tmp_path / "hf", tmp_path / "whole"))
    x = token_rows(40)
    with torch.no_grad():
        assert rel_error(ours(x), model(x).logits) > 1e-3
        assert rel_error(ours(x[:, :16]), model(x[:, :16]).logits) <= TOLERANCE  # within the window: the same


def test_missing_fields_take_mistrals_defaults(tmp_path):
    """A config.json without sliding_window, num_key_value_heads or rms_norm_eps reads as transformers reads it
    (4096, 8, 1e-6); without max_position_embeddings too, the context is 131072 and the default window is short."""
    from transformers import AutoModelForCausalLM

    _mistral(seed=4, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64).save_pretrained(
        tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("sliding_window", "num_key_value_heads", "rms_norm_eps"):
        del cfg[key]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert (theirs.config.sliding_window, theirs.config.num_key_value_heads) == (4096, 8)
    ours = load_model(import_hf(tmp_path / "hf", tmp_path / "out"))
    assert ours.config.kv_groups == 8 and ours.config.norm_eps == theirs.config.rms_norm_eps == 1e-6
    x = token_rows(64)
    with torch.no_grad():
        assert rel_error(ours(x), theirs(x).logits) <= TOLERANCE
    del cfg["max_position_embeddings"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    assert AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(
        str(tmp_path / "hf"))).config.max_position_embeddings == 131072
    with pytest.raises(ConversionError, match=r"sliding_window=4096 is shorter .*max_position_embeddings=131072"):
        import_hf(tmp_path / "hf", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("changes,pattern", [
    (dict(head_dim=32), r"head_dim=32 \* num_attention_heads=4 != hidden_size=64"),  # Mistral NeMo's wider heads
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "RoPE scaling"),
    (dict(sliding_window=0), "sliding_window must be null or an integer >= 1, got 0"),
])
def test_mistral_features_difftx_does_not_compute_are_refused(changes, pattern, tmp_path, capsys):
    _mistral(seed=5, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64).save_pretrained(
        tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **changes}))
    capsys.readouterr()
    _one_line_refusal(["import", str(tmp_path / "hf"), str(tmp_path / "out")], capsys, pattern)

