"""`difftx export --as llama`: exact folds into a plain transformers Llama (no custom code).

Each case is a tiny random GQA model (4 heads over 2 kv groups, 2 layers) saved as a difftx folder and exported by
the CLI with `--as llama`; transformers' own LlamaForCausalLM loads the result (no trust_remote_code) and its
float32 logits on random tokens agree with difftx's within 1e-5 relative (max |difference| / max |logit|);
greedy generate() equals difftx's. Measured (transformers 5.24.0, CPU, eager; printed with -s): dex 6.8e-7 (some
heads, lambda_init 0.2) and 4.8e-7 (every head), temperature (tied) 5.5e-7, converted mirror 6.9e-7, converted
random (tied) 5.2e-7. A converted model at lambda 0 exports its source's weights bit for bit. What would change
the function is refused in one line, exit status 2, nothing written."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from difftx.checkpoint import save_model  # noqa: E402
from difftx.cli import main as cli_main  # noqa: E402
from difftx.config import ModelConfig  # noqa: E402
from difftx.generation import generate  # noqa: E402
from difftx.interop import ConversionError, export_hf  # noqa: E402
from difftx.interop.convert import converted_config, converted_state, dex_config, dex_state  # noqa: E402
from difftx.model import Transformer  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
VOCAB, REL, NEW = 97, 1e-5, 6
BASE = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def randomize(model: Transformer, seed: int) -> Transformer:
    """Non-trivial weights: norm gains away from one, log-temperatures away from 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("log_temperature"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()


def source(tie: bool = False) -> Transformer:
    return randomize(Transformer(ModelConfig(attention="standard", tie_embeddings=tie, **BASE)), seed=7 + tie)


def move(model: Transformer, what: str, seed: int = 5) -> Transformer:
    """Move the parameters whose name contains ``what`` off their start, as fine-tuning would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if what in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def built(config: ModelConfig, state: dict) -> Transformer:
    model = Transformer(config)
    model.load_state_dict(state)
    return model.eval()


def converted(method: str, tie: bool = False) -> tuple[Transformer, Transformer]:
    """``(source, its conversion)``: lambda exactly 0, as convert leaves it."""
    src = source(tie)
    cfg = src.config
    return src, built(converted_config(cfg), converted_state(cfg, src.state_dict(), method, seed=1))


SOME = [[0, 2], [1, 2, 3]]  # dex's selected heads per layer


def dex(lambda_init: float = 0.0, heads=SOME) -> Transformer:
    """A dex model on ``heads`` (None: all), its lambda vectors and map W moved (lambda far from 0, W from I)."""
    src = source()
    cfg = src.config
    model = built(dex_config(cfg, heads, lambda_init), dex_state(cfg, src.state_dict(), seed=1))
    return move(move(model, ".lambda_"), "dex_map", seed=6)


def tokens(seed: int = 1, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def export_cli(model: Transformer, tmp_path, capsys, *extra: str):
    """``(exit code, stderr, OUT)`` of `difftx export FOLDER OUT --as llama` on ``model`` saved as a folder."""
    folder, out = tmp_path / "model", tmp_path / "hf"
    save_model(model, folder)
    capsys.readouterr()
    code = cli_main(["export", str(folder), str(out), "--as", "llama", *extra])
    return code, capsys.readouterr().err, out


def assert_same_function(model: Transformer, out) -> float:
    """transformers' own Llama from ``out`` against ``model``: logits within REL relative, greedy generate equal;
    returns the relative difference."""
    from transformers import LlamaForCausalLM

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "auto_map" not in cfg
    assert not (out / "modeling_difftx.py").exists()
    theirs = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager").eval()
    x = tokens()
    with torch.no_grad():
        ours = model(x, backend="eager")
        rel = ((ours - theirs(x).logits).abs().max() / ours.abs().max()).item()
        print(f"max |difftx - transformers Llama| / max |logit| = {rel:.2e}")  # shown with pytest -s
        assert rel <= REL
        prompt = tokens(3, (1, 8))
        got = theirs.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert got[0, 8:].tolist() == generate(model, prompt.tolist(), max_new_tokens=NEW, temperature=0)[0]
    return rel


@pytest.mark.parametrize("heads,lambda_init", [(SOME, 0.2), (None, 0.0)])
def test_dex_folds_into_o_proj(heads, lambda_init, tmp_path, capsys):
    model = dex(lambda_init, heads)
    with torch.no_grad():
        lams = [float(block.attn.value_lambda()) for block in model.layers]
    assert min(abs(v) for v in lams) > 0.05  # the fold is not the identity
    code, err, out = export_cli(model, tmp_path, capsys)
    assert code == 0, err
    assert_same_function(model, out)
    if heads is None:
        return
    # without the fold the logits would differ: the test sees the map
    plain = export_hf(built(model.config.plain(attention="standard"),
                            {k: v for k, v in model.state_dict().items() if "lambda" not in k and "dex" not in k}),
                      tmp_path / "unfolded")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    changed = sorted(k for k in a if not torch.equal(a[k], b[k]))
    assert changed == ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"]
    # layer 0 folds heads 0 and 2 only: the columns of heads 1 and 3 are the unfolded ones
    d = model.config.head_dim
    o, p = a[changed[0]].view(-1, 4, d), b[changed[0]].view(-1, 4, d)
    assert torch.equal(o[:, [1, 3]], p[:, [1, 3]]) and not torch.equal(o[:, 0], p[:, 0])


def test_temperature_folds_into_q_proj(tmp_path, capsys):
    model = randomize(Transformer(ModelConfig(attention="temperature", tie_embeddings=True, **BASE)), seed=11)
    assert model.layers[0].attn.log_temperature.abs().min() > 0.01
    code, err, out = export_cli(model, tmp_path, capsys)
    assert code == 0, err
    assert_same_function(model, out)


@pytest.mark.parametrize("method,tie", [("mirror", False), ("random", True)])
def test_converted_at_lambda_zero_is_its_source(method, tie, tmp_path, capsys):
    src, model = converted(method, tie)
    assert all(block.attn.lambda_reading() == 0.0 for block in model.layers)
    code, err, out = export_cli(model, tmp_path, capsys)
    assert code == 0, err
    assert_same_function(model, out)
    a = load_file(str(out / "model.safetensors"))
    b = load_file(str(export_hf(src, tmp_path / "source") / "model.safetensors"))  # the source's own export
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_standard_exports_as_before(tmp_path):
    model = source()
    a = load_file(str(export_hf(model, tmp_path / "plain") / "model.safetensors"))
    b = load_file(str(export_hf(model, tmp_path / "folded", fold="llama") / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _refused(code: int, err: str, out, *words: str) -> None:
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert not out.exists()


def test_converted_with_lambda_moved_is_refused(tmp_path, capsys):
    _, model = converted("mirror")
    code, err, out = export_cli(move(model, ".lambda_q2"), tmp_path, capsys)
    _refused(code, err, out, "--as llama", "attention='converted'", "layer 0's lambda is", "not 0")


def test_diff_is_refused(tmp_path, capsys):
    model = randomize(Transformer(ModelConfig(attention="diff", **BASE)), seed=2)
    code, err, out = export_cli(model, tmp_path, capsys)
    _refused(code, err, out, "--as llama", "attention='diff'", "second softmax map")


def test_as_llama_with_remote_code_is_refused(tmp_path, capsys):
    code, err, out = export_cli(source(), tmp_path, capsys, "--remote-code")
    _refused(code, err, out, "--as llama", "--remote-code")


@pytest.mark.parametrize("cfg,match", [
    (dict(attention="dex", rope=False), "rope=false"),
    (dict(attention="gated"), "sigmoid"),
    (dict(attention="standard", head_norm=True), "head_norm=true"),
    (dict(attention="standard", out_scale=0.5), "out_scale=0.5"),
])
def test_other_models_are_refused(cfg, match, tmp_path):
    with pytest.raises(ConversionError, match=match):
        export_hf(Transformer(ModelConfig(**{**BASE, **cfg})), tmp_path / "hf", fold="llama")
    assert not (tmp_path / "hf").exists()


def test_a_warm_up_in_progress_is_refused(tmp_path):
    from difftx.training.optim import set_lambda_scale

    model = dex()
    set_lambda_scale(model, 0.5)
    with pytest.raises(ConversionError, match="lambda_scale is 0.5"):
        export_hf(model, tmp_path / "hf", fold="llama")
    with pytest.raises(ConversionError, match="must be one of"):
        export_hf(source(), tmp_path / "hf", fold="mistral")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind", ["temperature", "diff"])
def test_a_fold_in_bf16_says_it_rounds(kind, tmp_path):
    """"Exact folds" are exact in float32; bf16 weights round each folded product (logits about 1e-3 apart), which
    was silent. Without a product to round (gains of one, float32) nothing is said."""
    model = randomize(Transformer(ModelConfig(attention=kind, **BASE)), seed=12)
    fold = "llama" if kind == "temperature" else None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        export_hf(model, tmp_path / "f32", fold=fold)
        assert not said
        export_hf(model.to(torch.bfloat16), tmp_path / "bf16", fold=fold)
    assert [str(w.message).split(":")[0] for w in said] == ["the weights are torch.bfloat16"]
    assert "logits differ from this model's by about 1e-3 (relative); exact in float32" in str(said[0].message)
