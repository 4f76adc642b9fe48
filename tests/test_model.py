"""The model: config validation, parameter matching, KV-cache decoding, overfitting, checkpoints."""

import json

import pytest
import torch

import difftx
from difftx import KVCache, ModelConfig, Transformer, baseline_config, lm_loss, preset
from difftx.checkpoint import CheckpointError, load_model, save_model
from difftx.generation import generate, left_pad, sample_next

KINDS = ["diff", "diff_v2", "standard"]


def _tiny(kind="diff", **kw):
    return ModelConfig(**{**dict(vocab_size=50, dim=32, n_layers=2, n_heads=2, max_seq_len=32, attention=kind), **kw})


@pytest.mark.parametrize("kwargs, field, rule", [
    (dict(dim=30), "dim", "divisible by 2\\*n_heads"),
    (dict(dim=24, n_heads=4), "dim", "must be even"),
    (dict(n_heads=4, n_kv_heads=3, dim=64), "n_kv_heads", "divisible"),
    (dict(attention="diff_v2", dim=96, n_heads=3, n_kv_heads=2), "n_kv_heads", "divisible"),
    (dict(backend="magic"), "backend", "unknown attention backend"),
    (dict(attention="linear"), "attention", "must be one of"),
    (dict(n_layers=0), "n_layers", "positive"),
    (dict(attention="standard", lambda_init=0.5), "lambda_init", "only"),
])
def test_invalid_configs_name_field_and_rule(kwargs, field, rule):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}.*{rule}"):
        _tiny(**kwargs)


def test_config_json_round_trip_and_unknown_fields():
    cfg = preset("cpu-5m", n_kv_heads=2, tie_embeddings=True)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_head": 3})
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")
    for name in difftx.PRESETS:  # every preset is valid and has a valid baseline
        baseline_config(preset(name))


@pytest.mark.parametrize("n_kv", [None, 2, 1])
@pytest.mark.parametrize("tie", [False, True])
def test_baseline_parameter_count_matches_up_to_lambda_and_subln(n_kv, tie):
    cfg = preset("cpu-5m", n_kv_heads=n_kv, tie_embeddings=tie)
    base = baseline_config(cfg)
    assert base.attention == "standard" and base.head_dim == cfg.head_dim
    assert base.n_heads == 2 * cfg.n_heads and base.kv_groups == 2 * cfg.kv_groups
    m, b = Transformer(cfg), Transformer(base)
    d = cfg.head_dim
    extra = cfg.n_layers * (4 * d + 2 * d)  # lambda_q1, k1, q2, k2 (d each) + subln gain (2d)
    assert m.num_parameters() - b.num_parameters() == extra
    # and the shared parameters have identical names and shapes
    extra_names = {n for n, _ in m.named_parameters() if "lambda_" in n or "subln" in n}
    assert {n: p.shape for n, p in m.named_parameters() if n not in extra_names} == \
        {n: p.shape for n, p in b.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_kv", [2, 1])
def test_kv_cache_decoding_matches_full_forward(kind, n_kv):
    model = Transformer(_tiny(kind, n_kv_heads=n_kv)).eval()
    tokens = torch.randint(0, 50, (2, 12))
    full = model(tokens)
    cache = KVCache(model, 2, 16)
    pieces = [model(tokens[:, :5], cache=cache)]
    for t in range(5, 12):
        pieces.append(model(tokens[:, t:t + 1], cache=cache))
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_batch_matches_each_sequence_alone(kind):
    model = Transformer(_tiny(kind)).eval()
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13]]
    tokens, mask = left_pad(prompts, pad_id=0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = KVCache(model, 2, 12)
    logits = model(tokens, positions=positions, attention_mask=mask, cache=cache)
    nxt = torch.tensor([[1], [2]])
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    step = model(nxt, positions=positions[:, -1:] + 1, attention_mask=mask2, cache=cache)
    for i, p in enumerate(prompts):
        alone = model(torch.tensor([p + [int(nxt[i])]]))
        torch.testing.assert_close(logits[i, -len(p):], alone[0, :len(p)], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(step[i, 0], alone[0, -1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_greedy_equals_argmax_of_full_forward_and_padding_is_invisible(kind):
    model = Transformer(_tiny(kind)).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    batch = generate(model, prompts, 6, temperature=0)
    for p, out in zip(prompts, batch):
        seq = list(p)
        for _ in range(6):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert out == seq[len(p):]
        assert generate(model, [p], 6, temperature=0)[0] == out


def test_generate_sampling_is_seeded_and_stops():
    model = Transformer(_tiny()).eval()
    a = generate(model, [[1, 2]], 10, temperature=1.0, top_k=10, top_p=0.9, seed=3)
    b = generate(model, [[1, 2]], 10, temperature=1.0, top_k=10, top_p=0.9, seed=3)
    assert a == b and len(a[0]) == 10
    stop = a[0][2]
    c = generate(model, [[1, 2]], 10, temperature=1.0, top_k=10, top_p=0.9, seed=3, stop_tokens=[stop])
    assert c[0] == a[0][:a[0].index(stop) + 1]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[1, 99]], 2)


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    assert sample_next(logits, temperature=0).item() == 2
    assert all(sample_next(logits, top_k=1).item() == 2 for _ in range(5))
    # top_p=0.5: token 2 alone already holds more than half the mass
    assert all(sample_next(logits, top_p=0.5).item() == 2 for _ in range(5))
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, top_p=0.0)


def test_a_tiny_temperature_samples_the_largest_logit():
    """``logits / 1e-40`` overflowed float32 to inf, and the softmax of inf is NaN: multinomial raised."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [3.0, -1.0, 0.5, 2.9999]])
    for t in (1e-30, 1e-40, 1e-300, 5e-324):
        assert sample_next(logits, temperature=t).tolist() == [2, 0]
    torch.manual_seed(0)
    wide = torch.randn(3, 50) * 4
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    shifted = torch.softmax((wide - wide.amax(-1, keepdim=True)) / 0.7, -1)
    torch.testing.assert_close(shifted, torch.softmax(wide / 0.7, -1))  # the same distribution
    assert torch.equal(sample_next(wide, temperature=0.7, generator=g1),
                       torch.multinomial(shifted, 1, generator=g2).squeeze(-1))


def test_generate_takes_a_tensor_of_prompts_one_stop_id_and_any_module_without_a_cache():
    model = Transformer(_tiny()).eval()
    rows = [[1, 2, 3], [4, 5, 6]]
    want = generate(model, rows, 5, temperature=0)
    assert generate(model, torch.tensor(rows), 5, temperature=0) == want
    for bad in (torch.tensor([1, 2, 3]), torch.tensor([[1.0, 2.0]])):
        with pytest.raises(ValueError, match=r"prompts: a tensor of prompts must hold integer token ids \(B, T\)"):
            generate(model, bad, 2)
    stop = want[0][1]
    assert generate(model, rows[:1], 5, temperature=0, stop_tokens=stop)[0] == want[0][:want[0].index(stop) + 1]

    class Logits(torch.nn.Module):  # "any module mapping tokens (B, T) to logits (B, T, V)"
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, tokens):
            return self.inner(tokens)

    assert generate(Logits(), rows, 5, temperature=0, use_cache=False) == want


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_model_overfits_one_batch(kind):
    torch.manual_seed(0)
    model = Transformer(_tiny(kind, vocab_size=32, dim=64))
    tokens = torch.randint(0, 32, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(120):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 3.0 and losses[-1] < losses[0] / 10, (losses[0], losses[-1])


def test_doc_ids_isolate_packed_documents():
    model = Transformer(_tiny()).eval()
    a, b = torch.randint(0, 50, (1, 5)), torch.randint(0, 50, (1, 6))
    packed = model(torch.cat([a, b], 1), doc_ids=torch.tensor([[0] * 5 + [1] * 6]),
                   positions=torch.tensor([list(range(5)) + list(range(6))]))
    torch.testing.assert_close(packed[:, 5:], model(b), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed[:, :5], model(a), rtol=1e-4, atol=1e-5)


def test_forward_input_errors():
    model = Transformer(_tiny())
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="KV cache is full"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=KVCache(model, 1, 8))
    for bad, got in ((torch.arange(4), r"\(4,\)"), (torch.zeros(3, 4, dtype=torch.long), r"\(3, 4\)"),
                     ([[0, 1, 2, 3]], "list")):  # a bare IndexError deep in RoPE before
        with pytest.raises(ValueError, match=rf"positions must be a tensor of shape \(2, 4\) or \(1, 4\) .*got {got}"):
            model(torch.zeros(2, 4, dtype=torch.long), positions=bad)
    with pytest.raises(TypeError, match="ModelConfig"):
        Transformer({"dim": 3})


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_logits_at_equals_indexing_the_full_logits(kind):
    torch.manual_seed(0)
    model = Transformer(_tiny(kind))
    x = torch.randint(0, 50, (3, 7))
    at = torch.rand(3, 7) < 0.3
    at[0, -1] = True  # at least one position
    got = model(x, logits_at=at)  # (N, V)
    assert got.shape == (int(at.sum()), 50)
    torch.testing.assert_close(got, model(x)[at], rtol=1e-5, atol=1e-6)
    assert model(x, logits_at=torch.zeros(3, 7, dtype=torch.bool)).shape == (0, 50)
    with pytest.raises(ValueError, match="logits_at must be a bool tensor"):
        model(x, logits_at=at.long())


@pytest.mark.parametrize("tie", [False, True])
def test_checkpoint_round_trip_and_errors(tmp_path, tie):
    model = Transformer(_tiny(tie_embeddings=tie))
    save_model(model, tmp_path / "ck")
    loaded = load_model(tmp_path / "ck")
    x = torch.randint(0, 50, (1, 6))
    torch.testing.assert_close(loaded(x), model(x))
    assert not list((tmp_path / "ck").glob("*.tmp"))
    with pytest.raises(CheckpointError, match="config"):
        load_model(tmp_path / "missing")
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps({**cfg, "dim": 7}))
    with pytest.raises(CheckpointError, match="invalid model config"):
        load_model(tmp_path / "ck")


@pytest.mark.parametrize("other", ["baseline", "diff_v2", "standard"])
def test_paired_initialisation(other):
    """After the same torch.manual_seed, every same-named, same-shaped parameter of two arms starts
    identical (initialisation noise leaves the paired difference); another seed changes them."""
    from difftx.config import baseline_config

    cfg = preset("tiny")
    other_cfg = baseline_config(cfg) if other == "baseline" else cfg.replace(attention=other)
    torch.manual_seed(5)
    a = Transformer(cfg).state_dict()
    torch.manual_seed(5)
    b = Transformer(other_cfg).state_dict()
    shared = [k for k in a if k in b and a[k].shape == b[k].shape]
    assert len(shared) >= 3 + 7 * cfg.n_layers - 3  # embeddings, projections, MLP, norms, head
    assert all(torch.equal(a[k], b[k]) for k in shared)
    torch.manual_seed(6)
    c = Transformer(cfg).state_dict()
    assert not torch.equal(a["layers.0.attn.q_proj.weight"], c["layers.0.attn.q_proj.weight"])
    w = a["layers.0.mlp.up_proj.weight"]
    assert abs(float(w.std()) - cfg.init_std) < 0.1 * cfg.init_std and abs(float(w.mean())) < 0.1 * cfg.init_std
    assert abs(float(a["layers.0.attn.lambda_q1"].std()) - 0.1) < 0.05


@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_in_another_dtype_than_the_model(kind):
    """``KVCache(..., dtype=)`` takes any dtype: the kernels read the cached keys and values in the model's. Before,
    every backend but flex raised "expected scalar type Float but found BFloat16"."""
    torch.manual_seed(0)
    model = Transformer(_tiny(kind)).eval()
    x = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        full = model(x)

        def decode(dtype):
            cache = KVCache(model, 2, 12, dtype=dtype)
            steps = [model(x[:, :5], cache=cache)[:, -1]]
            return torch.stack(steps + [model(x[:, t:t + 1], cache=cache)[:, -1] for t in range(5, 9)], 1)

        same = decode(None)
        assert torch.equal(decode(torch.float64), same)  # float32 keys and values survive float64 exactly
        torch.testing.assert_close(same, full[:, 4:], rtol=0, atol=1e-5)
        torch.testing.assert_close(decode(torch.bfloat16), full[:, 4:], rtol=0, atol=0.05)
