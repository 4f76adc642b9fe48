"""The fused Triton kernel for differential attention, checked on CPU with Triton's interpreter.

Triton decides between compiled and interpreted kernels when ``triton`` and each kernel are
imported, so the interpreter cannot be switched on inside a test process that has already
imported ``difftx.attention`` (which imports the kernel module to register the ``triton``
backend). The checks that run the kernels therefore live in ``TestInterpreted``, which is
collected only when ``TRITON_INTERPRET=1`` was set before the process started;
``test_interpreter_suite`` runs that class in a child process with the variable set, so the
environment of this process and of every other test module stays as it was. To see the
individual checks: ``TRITON_INTERPRET=1 python -m pytest tests/test_triton_kernel.py``.

Oracle: ``kernels.eager`` in float64 (softmax in float64 too), against the kernel in float32
with exact ("ieee") dot products. bfloat16 is not checked here: the interpreter multiplies the
raw bit patterns of bfloat16 ``tl.dot`` operands (triton-lang/triton#11584); float16 runs the
same code path.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from difftx.attention import DiffAttention, kernels, triton_kernel as tk  # noqa: E402
from difftx.attention.masks import AttentionMask  # noqa: E402

INTERPRETED = tk.INTERPRET  # True only in a process started with TRITON_INTERPRET=1


def _inputs(B, T, S, H, Hkv, d, dtype=torch.float32, lam=0.37):
    q = torch.randn(B, T, 2 * H, d, dtype=dtype)  # (B, T, 2H, d)
    k = torch.randn(B, S, 2 * Hkv, d, dtype=dtype)  # (B, S, 2Hkv, d)
    v = torch.randn(B, S, Hkv, 2 * d, dtype=dtype)  # (B, S, Hkv, 2d)
    return q, k, v, torch.tensor(lam, dtype=torch.float32)


def _run(fn, q, k, v, lam, mask, scale, grad_out, **kw):
    """Output and gradients of (q, k, v, lam) for a fixed upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, lam)]
    out = fn(*leaves, mask, scale, **kw)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return out, grads


def _compare(B, T, S, H, Hkv, d, causal=True, config=None, atol=2e-5, bwd=None, fn=None):
    """Output and dq, dk, dv, dlam of the kernel (float32, ``bwd`` form) against float64 eager."""
    q, k, v, lam = _inputs(B, T, S, H, Hkv, d)
    mask = AttentionMask(causal=causal)
    scale = d ** -0.5
    grad_out = torch.randn(B, T, H, 2 * d, dtype=torch.float64)
    ref, ref_grads = _run(kernels.eager, q.double(), k.double(), v.double(), lam.double(), mask, scale, grad_out)
    assert tk.unsupported_reason(q, k, v, lam, mask) is None, "the kernel itself must run"
    fn = fn or functools.partial(tk.triton_attention, config=config, bwd=bwd)
    out, grads = _run(fn, q, k, v, lam, mask, scale, grad_out)
    assert out.shape == (B, T, H, 2 * d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol)
    for name, g, rg in zip(("dq", "dk", "dv", "dlam"), grads, ref_grads):
        assert g.shape == rg.shape, name
        torch.testing.assert_close(g.double(), rg, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


# (B, T, H, Hkv, d): single token, odd lengths over one and several tiles (16 rows, 8-key steps
# under the interpreter), MHA and GQA with R = 2, component widths 16 and 32.
CAUSAL_CASES = [
    (1, 1, 1, 1, 16),
    (1, 5, 2, 2, 16),
    (2, 17, 2, 1, 16),
    (1, 33, 2, 2, 32),
    (2, 33, 4, 2, 16),
]


class TestInterpreted:
    """Runs the kernels on CPU; collected only under ``TRITON_INTERPRET=1`` (see module doc)."""

    __test__ = INTERPRETED

    @pytest.mark.parametrize("B,T,H,Hkv,d", CAUSAL_CASES)
    def test_causal_forward_and_gradients_match_eager(self, B, T, H, Hkv, d):
        assert tk.BWD == "atomic"  # the default: the 5-product backward, dQ by atomic adds
        _compare(B, T, T, H, Hkv, d)

    @pytest.mark.parametrize("backend", ["triton_split", "triton_atomic_dv"])
    @pytest.mark.parametrize("B,T,S,H,Hkv,d,causal", [(2, 17, 17, 4, 2, 24, True), (1, 7, 21, 2, 1, 16, False)])
    def test_other_backward_forms_match_eager(self, backend, B, T, S, H, Hkv, d, causal):
        """The 7-product two-kernel backward (``bwd="split"``) and the 6-product one with dV in its
        own kernel (``bwd="atomic_dv"``), each through its registered backend."""
        _compare(B, T, S, H, Hkv, d, causal=causal, fn=kernels.BACKENDS[backend])

    def test_component_width_not_a_power_of_two(self):
        # d = 24 pads the tiles to 32 columns; the padding must not leak into scores or outputs
        _compare(1, 19, 19, 2, 1, 24)

    @pytest.mark.parametrize("T,S", [(19, 19), (7, 21)])
    def test_unmasked_attention_matches_eager(self, T, S):
        # no mask at all (causal=False): every key tile but a partial last one runs unmasked
        _compare(1, T, S, 2, 1, 16, causal=False)

    @pytest.mark.parametrize("bwd", ["atomic", "atomic_dv", "split"])
    def test_other_tile_sizes_give_the_same_result(self, bwd):
        # one step per program and the value in two column halves in the forward pass, other tiles
        # in the backward kernels (the atomic one owning 32 keys, stepping 16 queries), and one
        # masked loop instead of unmasked tiles then the diagonal (``one_loop``)
        config = tk.BlockConfig(fwd_own=8, fwd_step=8, kv_own=32, kv_step=16, q_own=16, q_step=4,
                                bwd_own=32, bwd_step=16, fwd_split=2, dv_own=8, dv_step=4, one_loop=True)
        _compare(1, 29, 29, 2, 1, 24 if bwd == "atomic" else 16, config=config, bwd=bwd)

    def test_autotuned_configs_reset_the_atomic_dq_buffer(self, monkeypatch):
        """The autotuned path with two forced configs each for the forward and the atomic backward:
        every timed trial runs the kernel twice, yet dq matches eager because ``DQ`` is reset to zero
        between trials and before the winner's run. The same tuner without the reset corrupts dq."""
        trials = []

        def bench(kernel_call, quantiles):
            kernel_call()
            kernel_call()
            trials.append(1)
            return [float(len(trials))] * 3  # the first config wins

        small = dataclasses.replace(tk.INTERPRET_CONFIG, fwd_own=8, fwd_step=8, fwd_split=2, bwd_own=32, bwd_step=16,
                                    one_loop=True)
        configs = [tk.INTERPRET_CONFIG, small]
        monkeypatch.setattr(tk, "AUTOTUNE", True)
        monkeypatch.setattr(tk, "_TUNERS", {("fwd", 64): tk.make_autotuner("fwd", configs[::-1], do_bench=bench),
                                            ("bwd", 64): tk.make_autotuner("bwd", configs[::-1], do_bench=bench)})
        _compare(1, 33, 33, 2, 1, 16)
        assert len(trials) == 4  # two configs for each kernel
        tuned = tk._TUNERS[("bwd", 64)].cache
        assert len(tuned) == 1 and next(iter(tuned.values())).kwargs == {"BLOCK_N": 32, "BLOCK_M": 16, "ONE_LOOP": True}
        _compare(1, 33, 33, 2, 1, 16)  # cached: no new trials
        assert len(trials) == 4
        report = tk.autotune_report()
        assert [r["kernel"] for r in report] == ["bwd", "fwd"] and report[0]["config"]["BLOCK_N"] == 32

        no_reset = triton.autotune(configs=[triton.Config(dict(BLOCK_N=16, BLOCK_M=8)),
                                            triton.Config(dict(BLOCK_N=32, BLOCK_M=8))],
                                   key=["D"], do_bench=bench)(tk._bwd_kv_kernel)
        tk._TUNERS[("bwd", 64)] = no_reset
        with pytest.raises(AssertionError, match="dq"):
            _compare(1, 17, 17, 2, 1, 16)

    def test_custom_op_compiles_without_graph_breaks(self):
        """torch.compile (aot_eager, fullgraph: a graph break would raise) over a call of the backend
        gives eager's output and gradients; the op's fake implementation gives the right shapes."""
        B, T, H, Hkv, d = 1, 13, 2, 1, 16
        q, k, v, lam = _inputs(B, T, T, H, Hkv, d)
        mask = AttentionMask()
        grad_out = torch.randn(B, T, H, 2 * d)

        def fn(q, k, v, lam, mask, scale):
            return kernels.BACKENDS["triton"](q, k, v, lam, mask, scale) * 2.0

        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        out, grads = _run(compiled, q, k, v, lam, mask, d ** -0.5, grad_out)
        ref, ref_grads = _run(kernels.eager, q, k, v, lam, mask, d ** -0.5, grad_out * 2.0)
        torch.testing.assert_close(out, ref * 2.0, rtol=1e-5, atol=1e-5)
        for name, g, rg in zip(("dq", "dk", "dv", "dlam"), grads, ref_grads):
            torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode() as mode:
            fq, fk, fv, flam = (mode.from_tensor(t) for t in (q, k, v, lam))
            o, o2, lse = torch.ops.difftx.triton_diff_fwd(fq, fk, fv, flam, 0.25, True, True, [], "atomic")
            assert o.shape == o2.shape == (B, T, H, 2 * d) and lse.shape == (B, H, 2, T)
            dq, dk, dv, dlam = torch.ops.difftx.triton_diff_bwd(o, fq, fk, fv, flam, o, o2, lse, 0.25, True, [],
                                                                "atomic")
            assert (dq.shape, dk.shape, dv.shape, dlam.shape) == (q.shape, k.shape, v.shape, ())

    def test_module_on_triton_backend_compiles_in_one_graph(self):
        """A DiffAttention layer on the ``triton`` backend under torch.compile (fullgraph): the
        custom ops keep the kernels out of the trace; output and every parameter's gradient match
        the eager backend's."""
        torch._dynamo.reset()
        m = DiffAttention(dim=64, n_heads=2, layer_idx=1, n_kv_heads=1, backend="triton")
        x = torch.randn(2, 13, 64)
        out = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        ref = m(x, backend="eager")
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for name, p in m.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    def test_bad_backward_form_is_named(self):
        q, k, v, lam = _inputs(1, 4, 4, 1, 1, 16)
        with pytest.raises(ValueError, match="bwd"):
            tk.triton_attention(q, k, v, lam, AttentionMask(), 0.25, bwd="fused")

    def test_gqa_pairs_heads_with_their_own_group(self):
        """Head h must use keys 2g, 2g+1 and value g of group g = h // R (not a naive repeat_kv)."""
        B, T, H, Hkv, d = 1, 9, 4, 2, 16
        q, k, v, lam = _inputs(B, T, T, H, Hkv, d)
        mask = AttentionMask()
        out = tk.triton_attention(q, k, v, lam, mask, d ** -0.5)
        R = H // Hkv
        k_naive = k.repeat_interleave(R, dim=2)  # (B, T, 2H, d): sub-head j reads key j // R, wrong for R > 1
        v_naive = v.repeat_interleave(R, dim=2)  # (B, T, H, 2d)
        wrong = kernels.eager(q, k_naive, v_naive, lam, mask, d ** -0.5)
        torch.testing.assert_close(out, kernels.eager(q, k, v, lam, mask, d ** -0.5), rtol=0, atol=1e-5)
        assert (out - wrong).abs().max() > 1e-2

    def test_float16_matches_float32_eager(self):
        B, T, H, Hkv, d = 1, 21, 2, 1, 16
        q, k, v, lam = _inputs(B, T, T, H, Hkv, d, dtype=torch.float16)
        mask = AttentionMask()
        grad_out = torch.randn(B, T, H, 2 * d)
        ref, ref_grads = _run(kernels.eager, q.float(), k.float(), v.float(), lam, mask, d ** -0.5, grad_out)
        out, grads = _run(tk.triton_attention, q, k, v, lam, mask, d ** -0.5, grad_out)
        assert out.dtype == torch.float16 and all(g.dtype == t.dtype for g, t in zip(grads, (q, k, v, lam)))
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-3)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g.float(), rg, rtol=1e-2, atol=5e-3)

    def test_no_grad_forward_and_strided_inputs(self):
        """Without autograd the kernel skips its saved statistics; k and v sliced from a larger
        cache buffer (non-contiguous) give the same output."""
        B, T, H, Hkv, d = 2, 11, 2, 2, 16
        q, k, v, lam = _inputs(B, T, T, H, Hkv, d)
        k_buf, v_buf = torch.randn(B, 16, 2 * Hkv, d), torch.randn(B, 16, Hkv, 2 * d)
        k_buf[:, :T], v_buf[:, :T] = k, v
        mask = AttentionMask()
        with torch.no_grad():
            out = tk.triton_attention(q, k_buf[:, :T], v_buf[:, :T], lam, mask, d ** -0.5)
        torch.testing.assert_close(out, kernels.eager(q, k, v, lam, mask, d ** -0.5), rtol=0, atol=1e-5)

    @pytest.mark.parametrize("subtract", [True, False])
    def test_module_gradients_match_eager_backend(self, subtract):
        """DiffAttention end to end: lambda's re-parameterisation, the norm and out_proj on top; and
        the no-subtraction control (subtract=False), which passes lambda = 0 through the fused kernel."""
        m = DiffAttention(dim=64, n_heads=2, layer_idx=1, n_kv_heads=1, subtract=subtract)
        x = torch.randn(2, 13, 64)
        results = {}
        for backend in ("triton", "eager"):
            m.zero_grad()
            out = m(x, backend=backend)
            out.square().sum().backward()
            results[backend] = (out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()})
        (out_t, g_t), (out_e, g_e) = results["triton"], results["eager"]
        torch.testing.assert_close(out_t, out_e, rtol=1e-5, atol=1e-5)
        assert set(g_t) == set(g_e)
        for name in g_e:
            torch.testing.assert_close(g_t[name], g_e[name], rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        q_rows = g_t["q_proj.weight"].view(2, 2, 16, 64)  # (head, component, d, D)
        if subtract:
            assert g_e["lambda_q1"].abs().max() > 0
        else:  # the second map is unused
            assert q_rows[:, 1].abs().max() == 0 and q_rows[:, 0].abs().max() > 0

    @pytest.mark.parametrize("kind", ["padding", "documents", "offset"])
    def test_other_masks_are_delegated_to_sdpa(self, kind):
        B, T, H, Hkv, d = 2, 7, 2, 1, 16
        q, k, v, lam = _inputs(B, T, T, H, Hkv, d)
        if kind == "padding":
            mask = AttentionMask(key_valid=torch.tensor([[True] * 7, [False] * 2 + [True] * 5]))
        elif kind == "documents":
            mask = AttentionMask(doc_ids=torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2]]))
        else:  # three new queries after a cached prefix of four keys
            q, mask = q[:, 4:], AttentionMask(q_offset=4)
        assert "mask" in tk.unsupported_reason(q, k, v, lam, mask)
        out = tk.triton_attention(q, k, v, lam, mask, d ** -0.5)
        torch.testing.assert_close(out, kernels.sdpa(q, k, v, lam, mask, d ** -0.5), rtol=0, atol=0)
        torch.testing.assert_close(out, kernels.eager(q, k, v, lam, mask, d ** -0.5), rtol=1e-5, atol=1e-5)

    def test_standard_attention_and_float64_are_delegated_to_sdpa(self):
        q, k, v = torch.randn(1, 6, 4, 16), torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16)
        mask = AttentionMask()
        torch.testing.assert_close(tk.triton_attention(q, k, v, None, mask, 0.25),
                                   kernels.sdpa(q, k, v, None, mask, 0.25), rtol=0, atol=0)
        q, k, v, lam = _inputs(1, 4, 4, 1, 1, 16, dtype=torch.float64)
        assert "dtypes" in tk.unsupported_reason(q, k, v, lam, mask)
        torch.testing.assert_close(tk.triton_attention(q, k, v, lam, mask, 0.25),
                                   kernels.sdpa(q, k, v, lam, mask, 0.25), rtol=0, atol=0)


def test_interpreter_suite():
    """Run ``TestInterpreted`` in a child process with ``TRITON_INTERPRET=1``."""
    if INTERPRETED:
        pytest.skip("already under the interpreter: TestInterpreted runs in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", f"{Path(__file__).resolve()}::TestInterpreted", "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", "-W", "ignore::UserWarning"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    tail = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0, f"interpreter checks failed:\n{tail}"
    passed = re.search(r"(\d+) passed", res.stdout)
    assert passed and int(passed.group(1)) >= 25 and "skipped" not in res.stdout, tail


# ----------------------------------------------------------------------------------------------
# registration and configuration (no kernel runs)


def test_registered_backend_on_cpu_delegates_to_sdpa():
    """Without the interpreter, CPU tensors go to sdpa; ``auto`` on CPU is unchanged."""
    if INTERPRETED:
        pytest.skip("checks the compiled (non-interpreter) module")
    assert kernels.BACKENDS["triton"] is tk.triton_attention
    assert kernels.BACKENDS["triton_split"] is tk.triton_split_attention
    assert kernels.BACKENDS["triton_atomic_dv"] is tk.triton_atomic_dv_attention
    # executed matrix-product units (forward, backward) the GPU suite reads: 5, 6 and 7 backward products
    assert [kernels.BACKENDS[n].products for n in ("triton", "triton_atomic_dv", "triton_split")] == \
        [(3, 5), (3, 6), (3, 7)]
    assert kernels.resolve_backend("auto", torch.device("cpu")) is kernels.chunked
    q, k, v, lam = _inputs(1, 9, 9, 2, 1, 16)
    assert "cpu" in tk.unsupported_reason(q, k, v, lam, AttentionMask())
    for name in ("triton", "triton_split", "triton_atomic_dv"):
        out = kernels.BACKENDS[name](q, k, v, lam, AttentionMask(), 0.25)
        torch.testing.assert_close(out, kernels.sdpa(q, k, v, lam, AttentionMask(), 0.25), rtol=0, atol=0)
    m = DiffAttention(dim=32, n_heads=1, layer_idx=0, backend="triton")
    x = torch.randn(1, 5, 32)
    torch.testing.assert_close(m(x), m(x, backend="eager"), rtol=1e-5, atol=1e-5)


def test_unsupported_inputs_are_named(monkeypatch):
    monkeypatch.setattr(tk, "INTERPRET", True)  # as if under the interpreter: CPU tensors qualify
    q, k, v, lam = _inputs(1, 4, 4, 1, 1, 16)
    mask = AttentionMask()
    assert tk.unsupported_reason(q, k, v, lam, mask) is None
    assert "lam is None" in tk.unsupported_reason(q, k, v, None, mask)
    assert "dtypes" in tk.unsupported_reason(q.double(), k.double(), v.double(), lam, mask)
    assert "scalar" in tk.unsupported_reason(q, k, v, torch.ones(2), mask)
    assert "d=512" in tk.unsupported_reason(*_inputs(1, 4, 4, 1, 1, 512), mask)
    assert "mask" in tk.unsupported_reason(q, k, v, lam, AttentionMask(key_valid=torch.ones(1, 4, dtype=torch.bool)))
    assert "mask" in tk.unsupported_reason(q[:, 2:], k, v, lam, AttentionMask(q_offset=2))
    monkeypatch.setattr(tk, "INTERPRET", False)
    assert "cpu" in tk.unsupported_reason(q, k, v, lam, mask)


def test_return_maps_is_refused():
    q, k, v, lam = _inputs(1, 4, 4, 1, 1, 16)
    with pytest.raises(ValueError, match="eager"):
        tk.triton_attention(q, k, v, lam, AttentionMask(), 0.25, return_maps=True)


def test_block_config_is_validated():
    with pytest.raises(ValueError, match="fwd_step"):
        tk.BlockConfig(fwd_own=16, fwd_step=12, kv_own=16, kv_step=8, q_own=16, q_step=8)
    with pytest.raises(ValueError, match="kv_own"):
        tk.BlockConfig(fwd_own=16, fwd_step=8, kv_own=8, kv_step=16, q_own=16, q_step=8)
    with pytest.raises(ValueError, match="bwd_own"):
        tk.BlockConfig(fwd_own=16, fwd_step=8, kv_own=16, kv_step=8, q_own=16, q_step=8, bwd_own=8, bwd_step=16)
    with pytest.raises(ValueError, match="fwd_split"):
        tk.BlockConfig(fwd_own=16, fwd_step=8, kv_own=16, kv_step=8, q_own=16, q_step=8, fwd_split=4)
    with pytest.raises(ValueError, match="bwd_warps"):
        tk.BlockConfig(fwd_own=16, fwd_step=8, kv_own=16, kv_step=8, q_own=16, q_step=8, bwd_warps=3)
    for d in (16, 64, 128, 256):
        cfg = tk.block_config(d, interpret=False)  # the GPU choices pass the same validation
        assert tk.BlockConfig.from_list(cfg.to_list()) == cfg
        fwd, bwd = tk.autotune_configs(d)
        assert fwd[0] == cfg and bwd[0] == cfg  # the fixed choice is always a candidate
        if d >= 64:  # tiles of at least 64 rows (what wgmma needs) up to d = 128
            assert (d > 128) == (cfg.fwd_own < 64) == (cfg.bwd_own < 64)


FULL_COMPILE = os.environ.get("DIFFTX_TEST_COMPILE") == "1"  # make test-extras


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype,d,arch,which", [
    ("bf16", 128, 90, ("fwd", "bwd")),
    pytest.param("bf16", 128, 90, tk.OFFLINE_KERNELS, marks=pytest.mark.skipif(
        not FULL_COMPILE, reason="every kernel: set DIFFTX_TEST_COMPILE=1 (make test-extras)")),
    pytest.param("fp16", 64, 80, tk.OFFLINE_KERNELS, marks=pytest.mark.skipif(
        not FULL_COMPILE, reason="set DIFFTX_TEST_COMPILE=1 (make test-extras)")),
    pytest.param("fp32", 24, 80, ("fwd", "bwd"), marks=pytest.mark.skipif(
        not FULL_COMPILE, reason="set DIFFTX_TEST_COMPILE=1 (make test-extras)")),
])
def test_kernels_compile_for_gpu_targets(dtype, d, arch, which, tmp_path, monkeypatch):
    """The compiled (non-interpreter) path, which the CPU tests never run, builds for real GPU
    targets with the tile sizes the backend would use, and fits their shared memory. On sm_90 at
    d = 128 (the goal shape) the chosen forward and atomic backward use Hopper's wgmma (no
    timing); sm_80 has no wgmma. The default run compiles those two kernels only (about 10 s)."""
    if INTERPRETED:
        pytest.skip("needs the compiled kernels")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, not from a cache
    compiled = tk.compile_offline(d, dtype=dtype, arch=arch, which=which)
    assert set(compiled) == set(which)
    for name, kernel in compiled.items():
        usage = tk.resource_usage(kernel)
        assert len(kernel.asm["cubin"]) > 0, name
        assert usage["shared"] <= (227 if arch == 90 else 163) * 1024, (name, usage)
        if arch == 90 and name in ("fwd", "bwd"):
            assert usage["wgmma"] > 0, (name, usage)
        if arch == 80:
            assert usage["wgmma"] == 0, (name, usage)


def test_package_imports_without_triton():
    """With Triton missing, ``difftx.attention`` still imports and simply lacks the backend."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import difftx.attention as a, torch\n"
            "assert not any(n.startswith('triton') for n in a.BACKENDS), a.BACKENDS\n"
            "assert callable(a.resolve_backend('auto', torch.device('cuda')))\n"
            "print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
