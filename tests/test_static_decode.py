"""The static decoding step (difftx.model.StaticKVCache, difftx.decode): the ordinary cached step's outputs at
every position, one compiled graph for every position, one read of the cache per step, clear refusals."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from difftx.attention import DiffAttention
from difftx.config import ModelConfig
from difftx.decode import check_static, compile_options, static_decoder
from difftx.generation import generate, left_pad
from difftx.model import KVCache, StaticKVCache, Transformer

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3]]  # left-padded: rows of 5, 2 and 1 real tokens

ARMS = {"diff": dict(attention="diff"), "baseline": dict(attention="standard", n_heads=4),
        "diff_v2": dict(attention="diff_v2"), "diff_gqa": dict(attention="diff", n_heads=4, n_kv_heads=2),
        "baseline_gqa": dict(attention="standard", n_heads=4, n_kv_heads=2)}


def _model(arm: str, **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=48, dim=32, n_layers=2, n_heads=2, max_seq_len=64)
    cfg.update(ARMS[arm], **kw)
    return Transformer(ModelConfig(**cfg)).eval()


def _both(model, steps: int, backend: str, v_parts_one: bool = False):
    """Logits of the ordinary cached steps and of the static steps after the same left-padded prompts."""
    tokens, mask = left_pad(PROMPTS)
    B, P = tokens.shape
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    nxt = torch.randint(0, 48, (B, steps), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = KVCache(model, B, P + steps)
        model(tokens, positions=pos, attention_mask=mask, cache=cache, backend=backend)
        static = StaticKVCache(model, B, P + steps + 3)  # a longer buffer: keys beyond the position are masked
        static.prefill(model, tokens, positions=pos, attention_mask=mask, backend=backend)
        step = static_decoder(model, static, backend=backend)
        ref, got = [], []
        for i in range(steps):
            m = torch.cat([mask, torch.ones(B, i + 1, dtype=mask.dtype)], dim=1)
            p = pos[:, -1:] + 1 + i
            ref.append(model(nxt[:, i:i + 1], positions=p, attention_mask=m, cache=cache, backend=backend)[:, -1])
            got.append(step(nxt[:, i:i + 1], p))
    return torch.stack(ref), torch.stack(got)


@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("backend", ["eager", "sdpa", "auto"])
def test_static_step_equals_the_cached_step(arm, backend):
    ref, got = _both(_model(arm), 3, backend)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_static_step_with_whole_value_rows(monkeypatch):
    """DIFF's cache as the GPU keeps it (whole 2d-wide value rows, v_parts 1), on CPU."""
    monkeypatch.setattr(DiffAttention, "cache_value_parts", lambda self, device=None: 1)
    for backend in ("eager", "sdpa"):
        ref, got = _both(_model("diff_gqa"), 2, backend)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arm", ["diff", "baseline_gqa", "diff_v2"])
def test_generate_static_greedy_and_sampled_tokens_equal(arm):
    model = _model(arm)
    for kw in (dict(temperature=0), dict(temperature=0.9, top_k=20, seed=3)):
        assert generate(model, PROMPTS, 6, static_cache=True, **kw) == generate(model, PROMPTS, 6, **kw)


class _Reads(TorchDispatchMode):
    """Counts the ops that read each of the given storages (writes by index_copy_ aside)."""

    def __init__(self, storages: dict):
        super().__init__()
        self.storages, self.reads = storages, {name: 0 for name in storages}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in (torch.ops.aten.index_copy_.default,):
            seen = set()
            for a in torch.utils._pytree.tree_leaves((args, kwargs or {})):
                if isinstance(a, torch.Tensor) and a.numel():
                    ptr = a.untyped_storage().data_ptr()
                    for name, s in self.storages.items():
                        if ptr == s and name not in seen and func not in _VIEWS:
                            seen.add(name)
                            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


_VIEWS = {torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.view.default,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.expand.default, torch.ops.aten.unflatten.int,
          torch.ops.aten._unsafe_view.default, torch.ops.aten.as_strided.default, torch.ops.aten.select.int,
          torch.ops.aten.slice.Tensor, torch.ops.aten.reshape.default, torch.ops.aten.detach.default,
          torch.ops.aten.alias.default}


@pytest.mark.parametrize("arm", ["diff", "diff_gqa"])
def test_eager_static_step_reads_keys_and_values_once(arm):
    """One product reads the keys of both maps (K1 and K2 of every group), one the values, per layer."""
    model = _model(arm, n_layers=1)
    tokens, mask = left_pad(PROMPTS)
    static = StaticKVCache(model, 3, 12)
    with torch.no_grad():
        static.prefill(model, tokens, attention_mask=mask)
        lay = static.layers[0]
        mode = _Reads({"k": lay.k.untyped_storage().data_ptr(), "v": lay.v.untyped_storage().data_ptr()})
        with mode:
            model(torch.tensor([[1], [2], [3]]), cache=static, backend="eager")
    assert mode.reads == {"k": 1, "v": 1}


def test_compiled_static_decoding_compiles_once():
    """N generated tokens, one compiled graph (no recompilation as the position moves), eager's tokens."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = _model("diff", n_layers=1)
    counter = CompileCounterWithBackend("aot_eager")
    got = generate(model, PROMPTS, 8, temperature=0, static_cache=True, compile={"backend": counter})
    assert got == generate(model, PROMPTS, 8, temperature=0)
    assert counter.frame_count == 1 and counter.op_count > 0


def test_compile_options():
    assert compile_options(False, torch.device("cpu")) is None
    assert compile_options(True, torch.device("cpu")) == {"fullgraph": True, "dynamic": False,
                                                          "options": {"realize_opcount_threshold": 2}}
    assert "options" not in compile_options({"mode": "max-autotune"}, torch.device("cpu"))
    assert compile_options(True, torch.device("cuda"))["mode"] == "reduce-overhead"
    assert "mode" not in compile_options({"backend": "aot_eager"}, torch.device("cuda"))
    with pytest.raises(ValueError, match="compile"):
        compile_options("yes", torch.device("cpu"))


def test_static_cache_refusals():
    model = _model("diff")
    tokens, mask = left_pad(PROMPTS)
    static = StaticKVCache(model, 3, 6)
    with torch.no_grad():
        with pytest.raises(ValueError, match="longer than the static cache"):
            StaticKVCache(model, 3, 4).prefill(model, tokens, attention_mask=mask)
        static.prefill(model, tokens, attention_mask=mask)
        step = static_decoder(model, static)
        step(torch.tensor([[1], [2], [3]]))
        with pytest.raises(ValueError, match="static KV cache is full"):
            step(torch.tensor([[1], [2], [3]]))
        with pytest.raises(ValueError, match="static KV cache is full"):
            model(torch.tensor([[1], [2], [3]]), cache=static)
        with pytest.raises(ValueError, match="attention_mask"):
            model(torch.tensor([[1], [2], [3]]), cache=static, attention_mask=torch.ones(3, 6))
    with pytest.raises(ValueError, match="backend: 'chunked' cannot run a static decoding step"):
        generate(model, PROMPTS, 2, static_cache=True, backend="chunked")
    with pytest.raises(ValueError, match="compile: compiled decoding needs static_cache=True"):
        generate(model, PROMPTS, 2, compile=True)
    with pytest.raises(ValueError, match="static_cache: needs use_cache=True"):
        generate(model, [[1, 2]], 2, static_cache=True, use_cache=False)
    with pytest.raises(ValueError, match="compile: expected True, False or a mapping"):
        generate(model, PROMPTS, 2, static_cache=True, compile="yes")


def test_static_cache_refuses_a_kind_that_overrides_forward(monkeypatch):
    model = _model("baseline")

    class Own(type(model.layers[0].attn)):
        def forward(self, x, **kw):
            return super().forward(x, **kw)

    model.layers[0].attn.__class__ = Own
    with pytest.raises(ValueError, match="overrides forward"):
        check_static(model)


def test_bench_decode_times_each_step_side_by_side(capsys):
    from difftx.bench import bench_decode

    torch._dynamo.reset()
    rows = bench_decode(seq_lens=(8,), dim=32, n_heads=2, n_layers=1, backends=["eager", "chunked"], repeats=1,
                        warmup=0, steps=("dynamic", "static", "compiled"), compile_opts={"backend": "aot_eager"})
    assert [r.name for r in rows] == ["baseline/sdpa", "diff/eager", "diff/chunked", "baseline/sdpa static",
                                      "diff/eager static", "baseline/sdpa compiled", "diff/eager compiled"]
    assert all(r.ms > 0 and r.mem_mib == rows[0].mem_mib for r in rows)
    assert "skipped diff/chunked static: 'chunked' cannot run a static step" in capsys.readouterr().out
    with pytest.raises(ValueError, match="steps"):
        bench_decode(seq_lens=(8,), dim=32, n_heads=2, n_layers=1, steps=("graphs",))


def test_cli_bench_decode_steps(tmp_path):
    import json

    from difftx.cli import main

    path = tmp_path / "d.json"
    assert main(["bench", "--decode", "--seq-lens", "8", "--dim", "32", "--heads", "2", "--layers", "1", "--repeats",
                 "1", "--backends", "eager", "--steps", "dynamic", "static", "--json", str(path)]) == 0
    names = [r["name"] for r in json.loads(path.read_text())["rows"]]
    assert names == ["baseline/sdpa", "diff/eager", "baseline/sdpa static", "diff/eager static"]
    assert main(["bench", "--seq-lens", "8", "--dim", "32", "--heads", "2", "--steps", "static"]) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_decoding_equals_eager_decoding():
    """On a GPU: the static step compiled with mode reduce-overhead becomes a CUDA graph (no skips) and gives
    the eager decoder's greedy tokens (float32)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _model("diff_gqa").cuda()
    skips = counters["inductor"]["cudagraph_skips"]
    got = generate(model, PROMPTS, 10, temperature=0, static_cache=True, compile=True)
    assert got == generate(model, PROMPTS, 10, temperature=0)
    assert counters["inductor"]["cudagraph_skips"] == skips
