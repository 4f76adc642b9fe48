"""``difftx convert`` (issue 40, first slice): a standard-attention model made differential with the same function.

transformers' own random-init Llama models (GQA; tied MHA) saved with ``save_pretrained`` convert with logits equal
to transformers' forward of the source, for each method; a difftx ``standard`` model converts the same; the
``converted`` kind runs on every kernel, stacked and with a KV cache; the converted model fine-tunes with
``difftx train --init-from`` and its lambda moves off 0; and what cannot be converted exactly is refused in one
line, with nothing written."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from difftx import KVCache, ModelConfig, Transformer  # noqa: E402
from difftx.attention import ATTENTIONS, ConvertedAttention  # noqa: E402
from difftx.attention.registry import BUILTIN_KINDS  # noqa: E402
from difftx.checkpoint import load_model, save_model  # noqa: E402
from difftx.cli import main  # noqa: E402
from difftx.cli.convert import METHODS as CLI_METHODS  # noqa: E402
from difftx.config import arm_names, attention_parameter_delta, baseline_config  # noqa: E402
from difftx.interop import ConversionError, export_hf  # noqa: E402
from difftx.interop.convert import CONVERSION_NAME, METHODS, convert_model  # noqa: E402
from conftest import saved_once  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
VOCAB = 96
TOLERANCE = 1e-5  # max |converted - transformers| / max |transformers| over the logits


def rel_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def tokens(seed: int = 1, shape=(3, 40), vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _non_trivial(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of 0.08 std and norm gains far from one, so that a wrong layout shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model.eval()


LLAMAS = {  # transformers Llama configs: GQA (2 query heads per kv head, d = 8), tied MHA (d = 16)
    "llama-gqa": dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
    "llama-tied-mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
}


def _llama(kw: dict, seed: int = 0, vocab: int = VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      max_position_embeddings=64, rms_norm_eps=1e-5, **kw)
    return _non_trivial(LlamaForCausalLM(cfg), seed)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Each family saved once with save_pretrained: ``{name: (folder, transformers model)}``."""
    return saved_once(tmp_path_factory.mktemp("llamas"), LLAMAS, lambda kw, seed: _llama(kw, seed=seed))


def check_against_transformers(ours: Transformer, theirs, label: str) -> None:
    """``ours``' logits on each kernel within :data:`TOLERANCE` of transformers' forward ``theirs`` (printed with
    ``label`` under ``pytest -s``)."""
    x = tokens()
    with torch.no_grad():
        ref = theirs(x).logits
        for backend in ("eager", "chunked", "sdpa"):
            err = rel_error(ours(x, backend=backend), ref)
            print(f"{label} {backend}: max relative difference to transformers {err:.2e}")
            assert err <= TOLERANCE, (backend, err)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "dex"])  # dex: tests/test_convert_dex.py
@pytest.mark.parametrize("family", list(LLAMAS))
def test_transformers_llama_converts_with_the_same_logits(family, method, llamas, tmp_path):
    folder, theirs = llamas[family]
    res = convert_model(folder, tmp_path / "out", method=method, seed=4)
    ours = load_model(tmp_path / "out")  # what `difftx train --init-from` reads
    c = ours.config
    kw = LLAMAS[family]
    assert c.attention == "converted" and c.n_heads == kw["num_attention_heads"]
    assert c.kv_groups == kw["num_key_value_heads"] and c.head_dim == 64 // c.n_heads
    assert c.tie_embeddings == kw["tie_word_embeddings"]
    assert res.max_rel_error <= TOLERANCE and res.method == method and res.source == "transformers:llama"
    record = json.loads((tmp_path / "out" / CONVERSION_NAME).read_text())
    assert record["method"] == method and record["seed"] == 4 and record["logits_check"]["tolerance"] == TOLERANCE
    check_against_transformers(ours, theirs, f"{family} {method}")
    for block in ours.layers:
        attn = block.attn
        assert isinstance(attn, ConvertedAttention) and attn.lambda_full().item() == 0.0
        d, D = c.head_dim, c.dim
        q = attn.q_proj.weight.view(c.n_heads, 2, d, D)
        pos, neg = q[:, 0], q[:, 1]
        if method == "zero":
            assert not neg.any()
        elif method == "mirror":
            assert torch.equal(neg, pos)
        else:  # normal draws with the model's init_std (transformers' initializer_range, 0.02)
            assert abs(neg.std().item() - c.init_std) < 0.2 * c.init_std


def test_a_conversion_that_changes_the_function_is_not_written(llamas, tmp_path, monkeypatch):
    """The logits check sees a wrong layout: here the two components of every query head swapped."""
    from difftx.interop import convert

    real = convert.converted_state

    def swapped(config, state, method, seed):
        out = real(config, state, method, seed)
        for i in range(config.n_layers):
            name = f"layers.{i}.attn.q_proj.weight"
            out[name] = out[name].view(config.n_heads, 2, -1).flip(1).reshape(out[name].shape)
        return out

    monkeypatch.setattr(convert, "converted_state", swapped)
    with pytest.raises(ConversionError, match=r"logits check: .* differ from the source's by .* above 1e-05"):
        convert_model(llamas["llama-gqa"][0], tmp_path / "out", method="random")
    assert not (tmp_path / "out").exists()


def test_a_bfloat16_source_keeps_its_dtype(tmp_path):
    _llama(LLAMAS["llama-gqa"], seed=6).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    res = convert_model(tmp_path / "hf", tmp_path / "out", method="mirror")
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert state["layers.0.attn.q_proj.weight"].dtype == torch.bfloat16 == state["tok_embeddings.weight"].dtype
    assert state["layers.0.attn.lambda_q1"].dtype == torch.float32
    assert res.max_rel_error <= TOLERANCE


def test_a_seed_draws_the_same_conversion(llamas, tmp_path):
    folder, _ = llamas["llama-gqa"]
    for out, seed in (("a", 7), ("b", 7), ("c", 8)):
        convert_model(folder, tmp_path / out, method="random", seed=seed)
    a, b, c = (load_file(str(tmp_path / o / "model.safetensors")) for o in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.q_proj.weight"], c["layers.0.attn.q_proj.weight"])


def test_difftx_standard_run_converts_with_its_tokenizer(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attention="standard",
                      max_seq_len=48, rope_theta=500.0)
    model = _non_trivial(Transformer(cfg), seed=5)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"  # the trainer's layout
    save_model(model, ckpt)
    (ckpt / "tokenizer").mkdir()
    (ckpt / "tokenizer" / "difftx_tokenizer.json").write_text('{"type": "byte", "vocab_size": 257, "eos_id": 256}')
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000003")
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "out"), "--method", "mirror", "--seed", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "difftx:standard" in out[0] and "logits check: max relative difference" in out[0]
    ours = load_model(tmp_path / "out")
    assert ours.config == cfg.replace(attention="converted")
    assert (tmp_path / "out" / "tokenizer" / "difftx_tokenizer.json").is_file()
    x = tokens(shape=(2, 48))
    with torch.no_grad():
        err = rel_error(ours(x), model(x))
    print(f"difftx standard mirror: max relative difference {err:.2e}")
    assert err <= TOLERANCE


def test_a_lambda_offset_says_it_holds_the_function_only_at_a_warmups_first_step(tmp_path, capsys):
    from difftx.training.optim import set_lambda_scale

    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, attention="standard", max_seq_len=48)
    model = _non_trivial(Transformer(cfg), seed=6)
    save_model(model, tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--lambda-init", "0.8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and "with lambda scaled to 0" in out[0]
    assert out[1].startswith("note: lambda_init=0.8") and "does NOT compute the source's function" in out[1]
    record = json.loads((tmp_path / "out" / CONVERSION_NAME).read_text())
    assert record["lambda_init"] == 0.8 and record["logits_check"]["lambda_scale"] == 0.0
    ours = load_model(tmp_path / "out")
    assert ours.config == cfg.replace(attention="converted", lambda_init=0.8)
    x = tokens(shape=(2, 48))
    with torch.no_grad():
        assert rel_error(ours(x), model(x)) > 1e-2  # as loaded: lambda 0.8
        set_lambda_scale(ours, 0.0)
        assert rel_error(ours(x), model(x)) <= TOLERANCE
    for bad in ("1.0", "-0.1"):
        assert main(["convert", str(tmp_path / "src"), str(tmp_path / f"bad{bad}"), "--lambda-init", bad]) == 2
        assert "lambda_init: must be a number in [0, 1)" in capsys.readouterr().err
        assert not (tmp_path / f"bad{bad}").exists()


def test_the_kind_is_built_in_matched_to_its_source_and_refused_by_export():
    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attention="converted")
    assert ATTENTIONS["converted"] is ConvertedAttention and BUILTIN_KINDS["converted"] is ConvertedAttention
    assert "converted" not in arm_names()  # it needs a source: no compare arm of its own
    assert ConvertedAttention.stacks_natively()
    assert CLI_METHODS == METHODS
    base = baseline_config(cfg)
    assert base == cfg.replace(attention="standard")  # the source's shape
    model, source = Transformer(cfg), Transformer(base)
    delta = sum(n for _, n, _ in attention_parameter_delta(cfg))
    assert model.num_parameters() - source.num_parameters() == cfg.n_layers * delta
    assert [b.attn.lambda_full().item() for b in model.layers] == [0.0, 0.0]  # a fresh one starts at lambda 0 too
    with pytest.raises(ConversionError, match="attention='converted' cannot be exported"):
        export_hf(model, "never-written", remote_code=False)  # no transformers class (the default: difftx's code)
    with pytest.raises(ValueError, match="ModelConfig.head_norm: true applies only"):
        cfg.replace(head_norm=True)
    with pytest.raises(ValueError, match=r"ModelConfig.lambda_init: a converted model's lambda offset must be in "):
        cfg.replace(lambda_init=1.0)
    assert baseline_config(cfg.replace(lambda_init=0.5)) == base  # an offset reached by a warm-up (TrainConfig)


def _moved(model: Transformer) -> Transformer:
    """Lambda away from 0 (and different per layer), so the second map matters."""
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            block.attn.lambda_q1.add_(0.3 + 0.1 * i)
    return model


def test_every_kernel_the_stack_and_the_kv_cache_take_a_d_wide_value():
    from difftx.attention import AttentionMask
    from difftx.attention.triton_kernel import unsupported_reason

    cfg = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, attention="converted",
                      max_seq_len=40)
    torch.manual_seed(0)
    model = _moved(Transformer(cfg))
    assert all(abs(b.attn.lambda_full().item()) > 0.01 for b in model.layers)
    grads = check_kernels_agree(model, tokens(shape=(2, 30)))
    assert grads["layers.0.attn.lambda_q1"].abs().max() > 0
    # the fused kernel is written for DIFF's 2d-wide values: it hands these calls to sdpa
    q, k, v = torch.zeros(1, 4, 8, 16), torch.zeros(1, 4, 4, 16), torch.zeros(1, 4, 2, 16)
    assert "value width 16 is not 2d = 32" in unsupported_reason(q, k, v, torch.tensor(0.5), AttentionMask())
    # stacked: each model's loss and gradients as its own
    check_stack_equals_alone([model, _moved(Transformer(cfg))])


def check_kernels_agree(model: Transformer, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every kernel's logits and gradients on ``x`` equal the eager kernel's; returns the eager gradients."""
    with torch.no_grad():
        ref = model(x, backend="eager")
        for backend in ("chunked", "sdpa", "flex"):
            torch.testing.assert_close(model(x, backend=backend), ref, rtol=1e-5, atol=1e-6)
    grads = {}
    for backend in ("eager", "chunked", "sdpa"):
        model.zero_grad()
        model(x, backend=backend).square().mean().backward()
        grads[backend] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for backend in ("chunked", "sdpa"):
        for name, g in grads[backend].items():
            torch.testing.assert_close(g, grads["eager"][name], rtol=1e-4, atol=1e-7, msg=f"{backend} {name}")
    return grads["eager"]


def check_stack_equals_alone(models: list, stack=None) -> None:
    """A native stack of ``models`` (or ``stack``, built of them) computes each one's loss and gradients."""
    from difftx.training.stacked import StackedTransformer

    stack = StackedTransformer.from_models(models) if stack is None else stack
    assert stack.native
    seq = tokens(3, shape=(len(models), 2, 17))
    stack.zero_grad()
    losses = stack.losses(seq)
    losses.sum().backward()
    for i, m in enumerate(models):
        m.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(seq[i, :, :-1]).flatten(0, 1), seq[i, :, 1:].flatten())
        loss.backward()
        assert float(losses[i].detach()) == pytest.approx(float(loss.detach()), rel=1e-5)
        for name, p in stack.named_stacked():
            ref_grad = dict(m.named_parameters())[name].grad
            torch.testing.assert_close(p.grad[i], ref_grad, rtol=1e-4, atol=1e-6 * float(ref_grad.abs().max()) + 1e-9)


@pytest.mark.parametrize("moved", [False, True])
def test_kv_cache_decoding_equals_the_full_forward(moved, llamas, tmp_path):
    convert_model(llamas["llama-gqa"][0], tmp_path / "out", method="random")
    model = load_model(tmp_path / "out")
    if moved:
        _moved(model)
    x = tokens(shape=(2, 14))
    with torch.no_grad():
        full = model(x)
        cache = KVCache(model, 2, 16)
        pieces = [model(x[:, :5], cache=cache)] + [model(x[:, t:t + 1], cache=cache) for t in range(5, 14)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)


def fine_tune(tmp_path: Path, monkeypatch, capsys, convert_args: list[str], *sets: str) -> tuple:
    """``(converted, tuned)``: a GQA Llama (byte vocabulary) converted with ``convert_args``, then 3 steps of
    ``difftx train --init-from`` (``sets`` added) on a short text."""
    from difftx.training.checkpointing import resolve_checkpoint

    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    _llama(LLAMAS["llama-gqa"], seed=3, vocab=257).save_pretrained(tmp_path / "hf")  # the byte tokenizer's vocab
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "conv"), *convert_args]) == 0
    text = tmp_path / "text.txt"
    text.write_text("Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n" * 40)
    sets = ["steps=3", "batch_size=2", "seq_len=32", "warmup_steps=1", "eval_interval=0", "ckpt_interval=0",
            "log_interval=1", "tensorboard=false", "device=cpu", *sets]
    assert main(["train", "--preset", "test", "--init-from", str(tmp_path / "conv"), "--data", str(text),
                 "--out", str(tmp_path / "run"), "--no-progress", *[a for s in sets for a in ("--set", s)]]) == 0
    capsys.readouterr()
    return load_model(tmp_path / "conv"), load_model(resolve_checkpoint(tmp_path / "run"))


def test_the_converted_model_fine_tunes_and_its_lambda_moves(tmp_path, monkeypatch, capsys):
    start, tuned = fine_tune(tmp_path, monkeypatch, capsys, ["--method", "zero"])
    assert tuned.config == start.config
    for a, b in zip(start.layers, tuned.layers):
        lam = b.attn.lambda_reading()
        assert a.attn.lambda_reading() == 0.0 and math.isfinite(lam) and lam != 0.0
        # zero method: Q2 = K2 = 0 gives each of them a zero gradient, so the second map stays uniform (documented)
        d, H, Hkv, D = tuned.config.head_dim, tuned.config.n_heads, tuned.config.kv_groups, tuned.config.dim
        assert not b.attn.q_proj.weight.view(H, 2, d, D)[:, 1].any()
        assert not b.attn.k_proj.weight.view(Hkv, 2, d, D)[:, 1].any()
        assert not torch.equal(a.attn.q_proj.weight, b.attn.q_proj.weight)  # the positive rows trained


# -- refusals: one line, exit status 2, nothing written ----------------------------------------------------------

def _edit(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _weights(folder: Path, edit) -> None:
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _small(name: str, **kw):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    cls = getattr(transformers, f"{name}ForCausalLM")
    return cls(getattr(transformers, f"{name}Config")(**{**common, **kw}))


def _make(case: str, src: Path) -> None:
    if case == "qwen2-window":  # layer 0 windowed (max_window_layers=0); a Qwen2 without one converts
        _small("Qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0).save_pretrained(src)
    elif case == "llama-attention-bias":  # Llama's switch biases o_proj too
        _small("Llama", attention_bias=True).save_pretrained(src)
    elif case == "mistral-window":
        _small("Mistral", sliding_window=16).save_pretrained(src)
    elif case == "diffllama":
        _small("DiffLlama").save_pretrained(src)
    elif case.startswith("difftx-"):
        kw = {"difftx-diff": dict(attention="diff"), "difftx-head-norm": dict(attention="standard", head_norm=True)}
        save_model(Transformer(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, **kw[case])), src)
    else:
        _small("Llama").save_pretrained(src)
        if case == "gpt2":
            _edit(src, model_type="gpt2")
        elif case == "rope-scaling":
            _edit(src, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
        elif case == "missing-weight":
            _weights(src, lambda s: s.pop("model.layers.0.self_attn.k_proj.weight"))
        elif case == "wrong-shape":
            _weights(src, lambda s: s.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(40, 32)}))
        elif case == "not-empty":
            (src.parent / "out").mkdir()
            (src.parent / "out" / "notes.txt").write_text("mine")


REFUSALS = {
    "gpt2": "model_type 'gpt2' is not supported",
    "diffllama": "model_type 'diffllama' is differential attention already",
    "qwen2-window": r"sliding_window=16 is shorter than the context \(max_position_embeddings=64\) in layer\(s\) "
                    r"\[0\]",  # test_interop_qwen2: a longer one converts
    "llama-attention-bias": "attention_bias=true: difftx's projections have no bias",
    "mistral-window": "sliding_window=16 is shorter than the context",  # a longer one converts: test_interop_mistral
    "rope-scaling": "RoPE scaling",
    "missing-weight": r"missing \['model.layers.0.self_attn.k_proj.weight'\]",
    "wrong-shape": "wrong shape",
    "difftx-diff": "attention='diff'; convert turns 'standard' models",
    "difftx-head-norm": "head_norm=true",
    "not-empty": "not empty",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_cannot_be_converted_exactly_is_refused_in_one_line(case, tmp_path, capsys):
    import re

    src = tmp_path / "src"
    _make(case, src)
    capsys.readouterr()  # transformers' own progress lines
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["convert", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("difftx convert: error: "), err
    assert re.search(REFUSALS[case], err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    if case == "not-empty":
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", str(tmp_path), str(tmp_path / "out"), "--method", "halves"])
    assert e.value.code == 2 and "--method" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(["convert", str(tmp_path), str(tmp_path / "out"), "--seed", "-1"]) == 2
    assert "--seed: must be a non-negative integer" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="method: must be one of"):
        convert_model(tmp_path, tmp_path / "out", method="halves")
    assert not (tmp_path / "out").exists()
