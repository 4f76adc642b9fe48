"""The SDPA forms of differential attention (pad, halves, wide) against the eager oracle, the copies they make
before the kernel, and the measured table that picks a backend (``auto``) and a form (``sdpa``) on CUDA."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from difftx.attention import AttentionMask, DiffAttention, gpu_table, kernels

FORMS = ["sdpa_pad", "sdpa_halves", "sdpa_wide", "sdpa"]
MASKS = ["causal", "none", "padding", "documents", "offset"]


def _mask(kind, B, T, S, gen):
    if kind == "causal":
        return AttentionMask()
    if kind == "none":
        return AttentionMask(causal=False)
    if kind == "padding":
        return AttentionMask(key_valid=torch.rand(B, S, generator=gen) > 0.3)
    if kind == "documents":
        return AttentionMask(doc_ids=(torch.arange(S) >= S // 2).long().expand(B, S))
    return AttentionMask(q_offset=S - T)  # a KV cache: T new queries after S - T cached keys


def _inputs(B, T, S, H, Hkv, d, dv, gen, lam_shape=()):
    q = torch.randn(B, T, 2 * H, d, generator=gen, dtype=torch.float64)
    k = torch.randn(B, S, 2 * Hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, dv, generator=gen, dtype=torch.float64)
    lam = (torch.rand(lam_shape, generator=gen, dtype=torch.float64) * 0.8).float()
    return q, k, v, lam


def _check(fn, q, k, v, lam, mask, scale):
    """Output and the gradients of q, k, v (and lam) of ``fn`` against eager's."""
    outs = []
    for kernel in (kernels.eager, fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, lam) if t is not None]
        out = kernel(*leaves[:3], leaves[3] if lam is not None else None, mask, scale)
        g = torch.ones_like(out) + torch.arange(out.numel(), dtype=out.dtype).view(out.shape).sin()
        outs.append((out, torch.autograd.grad(out, leaves, g)))
    (ref, ref_grads), (out, grads) = outs
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    for name, a, b in zip("qkvl", grads, ref_grads):  # lam is float32: its gradient too
        tol = dict(rtol=1e-7, atol=1e-9) if name != "l" else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("form", FORMS)
def test_form_matches_eager_forward_and_gradients(form, mask_kind):
    """Every form, every mask: T in {1, 5, 17}, d in {8, 16}, MHA and GQA (R 2), a scalar and a (G,) lambda,
    the value 2d wide (DIFF) and d wide (a converted model)."""
    gen = torch.Generator().manual_seed(0)
    fn = kernels.BACKENDS[form]
    i = 0
    for T in (1, 5, 17):
        for d in (8, 16):
            for Hkv, R in ((2, 1), (1, 2)):
                lam_shape, dv = [((), 2 * d), ((2,), 2 * d), ((), d), ((2,), d)][i % 4]
                i += 1
                S = T + 3 if mask_kind == "offset" else T
                mask = _mask(mask_kind, 2, T, S, gen)
                _check(fn, *_inputs(2, T, S, Hkv * R, Hkv, d, dv, gen, lam_shape), mask, d ** -0.5)


@pytest.mark.parametrize("form", FORMS)
def test_standard_attention_is_one_call(form, monkeypatch):
    """lam None: the one SDPA call of standard attention (GQA, padding), whatever the form."""
    gen = torch.Generator().manual_seed(1)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q = torch.randn(2, 6, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 6, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 6, 2, 8, generator=gen, dtype=torch.float64)
    for mask in (AttentionMask(), AttentionMask(key_valid=torch.rand(2, 6, generator=gen) > 0.3)):
        calls.clear()
        _check(kernels.BACKENDS[form], q, k, v, None, mask, 0.3)
        assert len(calls) == 1


# ---------------------------------------------------------------------------------------------------------------
# copies before the kernel

COPIES = {"constant_pad_nd", "clone", "copy_", "_to_copy", "cat", "stack", "repeat", "repeat_interleave",
          "index_select", "expand_copy"}


class _Recorder(TorchDispatchMode):
    """The aten ops dispatched outside SDPA's own kernel, with whether one reads q, k or v's storage."""

    def __init__(self, inputs):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in inputs}
        self.inside = False
        self.ops = []  # (op name, reads an input's storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside:
            tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            reads = any(t.untyped_storage().data_ptr() in self.storages for t in tensors)
            self.ops.append((func.overloadpacket.__name__, reads))
        return func(*args, **kwargs)


def _copies_of_inputs(form, q, k, v, lam, mask, monkeypatch):
    rec = _Recorder((q, k, v))
    real = F.scaled_dot_product_attention
    fed = []

    def sdpa(*args, **kw):  # the kernel's internals are its own business: not recorded
        fed.append(all(t.untyped_storage().data_ptr() in rec.storages for t in args[:3]))
        rec.inside = True
        try:
            return real(*args, **kw)
        finally:
            rec.inside = False

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    with rec:
        kernels.BACKENDS[form](q, k, v, lam, mask, 0.25)
    # a copy of an input, or any padding (of a copy too)
    return sorted({name for name, reads in rec.ops if name in COPIES and (reads or name == "constant_pad_nd")}), fed


@pytest.mark.parametrize("form", ["sdpa_halves", "sdpa_wide"])
@pytest.mark.parametrize("Hkv", [2, 1])
def test_forms_feed_views_of_q_k_v(form, Hkv, monkeypatch):
    """No pad, expand-and-copy or clone of q, k or v: every SDPA call reads their storage (views)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, lam = _inputs(2, 9, 9, 2, Hkv, 8, 16, gen, (2,))
    for mask in (AttentionMask(), AttentionMask(key_valid=torch.rand(2, 9, generator=gen) > 0.3)):
        copies, fed = _copies_of_inputs(form, q, k, v, lam, mask, monkeypatch)
        assert copies == [], f"{form} copies its inputs: {copies}"
        assert fed and all(fed)
        assert len(fed) == (4 if form == "sdpa_halves" else 2)


def test_the_recorder_sees_pad_forms_copies(monkeypatch):
    """The check above can fail: the pad form pads q and k and copies the expanded v."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, lam = _inputs(1, 5, 5, 2, 2, 8, 16, gen)
    copies, fed = _copies_of_inputs("sdpa_pad", q, k, v, lam, AttentionMask(), monkeypatch)
    assert {"clone", "constant_pad_nd"} <= set(copies) and fed == [False]


# ---------------------------------------------------------------------------------------------------------------
# the measured table

def _entry(card="NVIDIA H200", dtype="bfloat16", d=128, T=4096, mode="train", backend="sdpa_pad", **cands):
    cands = cands or {backend: 1.0}
    return {"card": card, "dtype": dtype, "d": d, "T": T, "mode": mode, "backend": backend,
            "ratio": cands.get(backend), "candidates": cands, "source": "test"}


TABLE = [
    _entry(d=128, T=4096, backend="sdpa_halves", sdpa_halves=2.1, sdpa_pad=3.5, triton=6.9),
    _entry(d=128, T=1024, mode="infer", backend="flex", flex=1.9, sdpa_wide=2.5),
    _entry(d=64, T=2048, backend="sdpa_wide", sdpa_wide=1.4, sdpa_halves=1.8),
    _entry(card="NVIDIA A100-SXM4-80GB", d=128, T=4096, backend="chunked", chunked=9.0),
    _entry(card="NVIDIA H200", dtype="float16", d=128, T=4096, backend="eager", eager=5.0),
]


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A table file of TABLE, named by $DIFFTX_GPU_CHOICES; choices forgotten before and after."""
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"choices": TABLE}))
    monkeypatch.setenv(gpu_table.ENV, str(path))
    gpu_table.reload()
    yield path
    gpu_table.reload()


def test_choose_by_card_dtype_d_and_T(table):
    def choose(*a, **kw):  # among the registered backends unless told otherwise
        return gpu_table.choose(*a, **{"eligible": kernels.BACKENDS.__contains__, **kw})

    assert gpu_table.model_token("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_table.model_token("NVIDIA A100-SXM4-80GB") == "A100"
    assert choose("NVIDIA A100 80GB PCIe", "bfloat16", 128, 4096, True) == "chunked"  # its own card first
    assert choose("NVIDIA H200", "bfloat16", 128, 8192, True) == "sdpa_halves"
    assert choose("NVIDIA H100 80GB HBM3", torch.bfloat16, 64, 4096, True) == "sdpa_wide"  # any card; nearest d
    assert choose("NVIDIA H200", "float16", 128, 4096, True) == "eager"  # dtype before d and T
    assert choose("NVIDIA H200", "float32", 96, 2896, True) == "sdpa_halves"  # no float32: nearest d, then T
    # inference: only the infer entry counts; flex not eligible -> its next candidate
    assert choose("NVIDIA H200", "bfloat16", 128, 512, False, eligible=lambda n: n != "flex") == "sdpa_wide"
    assert choose("NVIDIA H200", "bfloat16", 128, 512, False, eligible=lambda n: n == "flex") == "flex"
    # a backend that cannot take the call passes to the next candidate, then to the next entry, then sdpa_pad
    assert choose("NVIDIA H200", "bfloat16", 128, 4096, True, eligible=lambda n: n == "triton") == "triton"
    assert choose("NVIDIA H200", "bfloat16", 128, 4096, True, eligible=lambda n: n == "chunked") == "chunked"
    assert choose("NVIDIA H200", "bfloat16", 128, 4096, True, eligible=lambda n: False) == "sdpa_pad"
    assert choose("NVIDIA H200", "bfloat16", 128, 4096, True, table=[]) == "sdpa_pad"


def test_shipped_table_parses_and_picks_sdpa_for_training():
    entries = gpu_table.read(gpu_table.TABLE)
    assert entries and {e.mode for e in entries} == {"train", "infer"}

    def pick(T, train):
        return gpu_table.choose("NVIDIA H200", "bfloat16", 128, T, train, eligible=lambda n: True, table=entries)

    assert pick(4096, True) == "sdpa_pad"
    assert pick(1024, False) == "triton" and pick(4096, False) == "sdpa_pad"


@pytest.mark.parametrize("text, match", [
    ("{not json", "malformed JSON"),
    ('{"entries": []}', "no 'choices'"),
    ('{"choices": [{"card": "X"}]}', r"choices\[0\]: missing"),
    ('[{"card": "X", "dtype": "bfloat16", "d": 0, "T": 1, "mode": "train", "backend": "sdpa"}]', "'d' must"),
    ('[{"card": "X", "dtype": "bfloat16", "d": 8, "T": 1, "mode": "fit", "backend": "sdpa"}]', "'mode' must"),
])
def test_malformed_table_names_the_file(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        gpu_table.read(path)
    assert str(path) in str(err.value)


def test_merge_replaces_and_adds(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"about": "kept", "choices": TABLE[:2]}))
    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps({"card": "NVIDIA H200", "choices": [
        _entry(d=128, T=4096, backend="sdpa_wide", sdpa_wide=1.7, sdpa_halves=2.0),  # same key: replaces
        _entry(d=64, T=4096, backend="sdpa_halves")]}))  # new
    assert gpu_table.main(["merge", str(suite), "--table", str(path)]) == 0
    assert "1 entries added, 1 replaced" in capsys.readouterr().out
    raw = json.loads(path.read_text())
    assert raw["about"] == "kept" and len(raw["choices"]) == 3
    entries = gpu_table.read(path)
    assert gpu_table.choose("NVIDIA H200", "bfloat16", 128, 4096, True, table=entries) == "sdpa_wide"
    assert gpu_table.main(["show", "--table", str(path)]) == 0
    assert "| NVIDIA H200 | bfloat16 | train | 128 | 4096 | sdpa_wide | 1.70 |" in capsys.readouterr().out
    bad = tmp_path / "bad_suite.json"
    bad.write_text("[1]")
    assert gpu_table.main(["merge", str(bad), "--table", str(path)]) == 2
    assert str(bad) in capsys.readouterr().err


def test_auto_on_cuda_dispatches_by_the_table(table, monkeypatch):
    """resolve_backend('auto', cuda) is the dispatcher; on a (pretended) H200 it runs the table's backend for
    the call's dtype, d, T and training, memoised, and computes eager's result."""
    assert kernels.resolve_backend("auto", torch.device("cuda")) is kernels.auto_cuda
    assert kernels.resolve_backend("auto", torch.device("cpu"), q_len=64) is kernels.chunked  # CPU unchanged
    monkeypatch.setattr(gpu_table, "card_name", lambda index: "NVIDIA H200")
    monkeypatch.delitem(kernels.BACKENDS, "flex", raising=False)  # as where it is not installed
    ran = []
    for name in ("sdpa_halves", "sdpa_wide", "chunked", "eager", "sdpa"):
        real = kernels.BACKENDS[name]
        monkeypatch.setitem(kernels.BACKENDS, name, lambda *a, _n=name, _f=real, **kw: ran.append(_n) or _f(*a, **kw))
    gen = torch.Generator().manual_seed(4)
    # float64 (nothing measured): nearest d (64 -> the d-64 entry) for training
    q, k, v, lam = _inputs(1, 6, 6, 2, 2, 64, 128, gen)
    _check(kernels.auto_cuda, q, k, v, lam, AttentionMask(), 0.125)
    assert ran == ["sdpa_wide"]  # the table's pick (the oracle is called directly)
    # without gradients: the infer entry's flex is not registered -> its next candidate
    with torch.no_grad():
        ran.clear()
        kernels.auto_cuda(q, k, v, lam, AttentionMask(), 0.125)
        assert ran == ["sdpa_wide"]
    assert sum(key[0] == "auto" for key in gpu_table._memo) == 2
    ran.clear()  # standard attention: sdpa's one call, no table
    _check(kernels.auto_cuda, q, k[:, :, :2].contiguous(), v[..., :64].contiguous(), None, AttentionMask(), 0.125)
    assert ran == []


def test_auto_runs_triton_only_where_it_takes_the_call(tmp_path, monkeypatch):
    """A fused kernel that would hand the call to sdpa is passed over for the table's next candidate."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps([_entry(backend="triton", triton=1.5, sdpa_halves=2.0)]))
    monkeypatch.setenv(gpu_table.ENV, str(path))
    gpu_table.reload()
    monkeypatch.setattr(gpu_table, "card_name", lambda index: "NVIDIA H200")
    monkeypatch.setitem(kernels.BACKENDS, "triton", kernels.eager)
    q, k, v, lam = _inputs(1, 3, 3, 1, 1, 8, 16, torch.Generator().manual_seed(6))
    for reason, want in ((None, "triton"), ("a padding mask", "sdpa_halves")):
        monkeypatch.setitem(kernels.DECLINES, "triton", lambda *a, _r=reason: _r)
        assert kernels.cuda_choice(q, k, v, lam, AttentionMask()) == want
    gpu_table.reload()


def test_sdpa_form_on_cuda_by_the_table(table, monkeypatch):
    monkeypatch.setattr(gpu_table, "card_name", lambda index: "NVIDIA H100 80GB HBM3")
    gen = torch.Generator().manual_seed(5)
    q, k, v, lam = _inputs(1, 4, 4, 2, 2, 128, 256, gen)
    q.requires_grad_()
    assert gpu_table.sdpa_form_for(q, k, v, lam, kernels.SDPA_FORMS) == "halves"  # the d-128 train entry's best sdpa form
    q64 = q[..., :64].detach()
    assert gpu_table.sdpa_form_for(q64, k, v, lam, kernels.SDPA_FORMS) == "wide"  # inference -> the infer entry's sdpa_wide
    monkeypatch.setenv(gpu_table.ENV, str(table.with_name("none.json")))
    table.with_name("none.json").write_text('{"choices": []}')
    gpu_table.reload()
    assert gpu_table.sdpa_form_for(q, k, v, lam, kernels.SDPA_FORMS) == "pad"  # nothing measured


def test_new_backends_by_name():
    for name in ("sdpa_pad", "sdpa_halves", "sdpa_wide"):
        assert name in kernels.backend_names()
    torch.manual_seed(0)
    m = DiffAttention(32, 2, 0, 1, backend="sdpa_halves").double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(m(x), m(x, backend="eager"))
