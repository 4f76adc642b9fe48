"""GPU benchmark of the differential attention *core*: the fused Triton kernel vs the baseline.

Candidates, timed alternately inside one loop (so every ratio is measured side by side):

- ``baseline/sdpa``: the parameter-matched baseline, one causal ``scaled_dot_product_attention``
  call over ``2H`` heads of width ``d`` (FlashAttention backend on recent GPUs, bf16/fp16)
- ``baseline/flash_attn``: the same through the ``flash_attn`` package, if it is installed
- ``diff/<name>``: every DIFF backend registered in ``kernels.BACKENDS`` but ``eager`` and ``chunked``
  (``triton``, ``triton_split``, ``sdpa`` and its forms, ``flex``, ...), and ``auto``

``benchmarks/gpu_suite.py`` is the whole prepared suite (correctness, every SDPA backend of the baseline
forced, training, decode, goals); this script times the core over a range of lengths.

Per length: median time of ``fwd`` and ``fwd+bwd``, TFLOP/s and time ratio to the baseline.
FLOPs count each method's own causal matmul work (half of the full square): baseline forward
``4 B H' T^2 d`` with ``H' = 2H`` sub-heads, i.e. two ``T x T x d`` products per head over
half the square; its backward 2.5x that (five products). The fused DIFF forward doubles the
``PV`` product (two ``2d``-wide accumulators): 1.5x the baseline's; its backward forms
``(P1 - lam P2)^T dO`` and ``dO V^T`` once for both maps: the same five products as the
baseline. So the floors are 1.5x (fwd) and 8/7 = 1.14x (fwd+bwd) of the baseline's time at
equal efficiency (docs/kernels.md). Every DIFF candidate (``sdpa`` and ``flex`` too, which do
more) is credited the fused kernel's FLOPs, so its TFLOP/s is useful work per second.

Usage (CUDA only):
    python benchmarks/gpu_attention.py [--seq-lens 512 1024 2048 4096 8192 16384] [--d 128]
        [--heads 16] [--kv-heads 16] [--tokens 16384] [--dtype bf16] [--repeats 20] [--json out.json]
        [--plot out.png]
    python benchmarks/gpu_attention.py --check     # bf16 kernel vs the float32 eager oracle first
Without a GPU, ``--compile-only [--arch 90]`` compiles the kernels for that target and prints
registers, spilled bytes and shared memory per kernel (no timing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from difftx.attention import AttentionMask

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_suite  # noqa: E402  (the suite's candidates and correctness check)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def baseline_flops(B: int, T: int, H: int, d: int, mode: str) -> float:
    """Causal matmul FLOPs of the baseline: 2H heads of width d, half of the T x T square."""
    fwd = 2 * 2 * B * (2 * H) * T * T * d / 2  # QK^T and PV
    return fwd if mode == "fwd" else fwd * 3.5  # backward: five products = 2.5x forward


def diff_flops(B: int, T: int, H: int, d: int, mode: str) -> float:
    """Causal matmul FLOPs of the fused DIFF kernel (see the module docstring)."""
    base_fwd = baseline_flops(B, T, H, d, "fwd")
    fwd = 1.5 * base_fwd  # PV doubled: two 2d-wide accumulators
    return fwd if mode == "fwd" else fwd + 2.5 * base_fwd


def _candidates(B, T, H, Hkv, d, dtype, device):
    """(name, kind, make_inputs, call) for every available candidate."""
    scale = 1.0 / math.sqrt(d)
    mask = AttentionMask()

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()

    def base_inputs():
        return leaf(B, 2 * H, T, d), leaf(B, 2 * Hkv, T, d), leaf(B, 2 * Hkv, T, d)  # (B, heads, T, d)

    def base_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=H != Hkv)

    def diff_inputs():
        lam = torch.tensor(0.5, device=device, requires_grad=True)
        return leaf(B, T, 2 * H, d), leaf(B, T, 2 * Hkv, d), leaf(B, T, Hkv, 2 * d), lam  # kernel layout

    out = [("baseline/sdpa", "base", base_inputs, base_sdpa)]
    try:
        from flash_attn import flash_attn_func  # optional

        def flash_inputs():
            return leaf(B, T, 2 * H, d), leaf(B, T, 2 * Hkv, d), leaf(B, T, 2 * Hkv, d)  # (B, T, heads, d)

        out.append(("baseline/flash_attn", "base", flash_inputs,
                    lambda q, k, v: flash_attn_func(q, k, v, causal=True, softmax_scale=scale)))
    except ImportError:
        pass
    for name in gpu_suite.diff_candidates(None):  # every registered DIFF backend but eager / chunked, and auto
        fn = gpu_suite.diff_kernel(name)
        out.append((f"diff/{name}", "diff", diff_inputs, lambda q, k, v, lam, fn=fn: fn(q, k, v, lam, mask, scale)))
    return out


def bench(seq_lens, d=128, heads=16, kv_heads=None, tokens=16384, dtype="bf16", modes=("fwd", "fwd+bwd"),
          repeats=20, warmup=3) -> list[dict]:
    """Median milliseconds, TFLOP/s, peak memory and ratio to ``baseline/sdpa`` per candidate."""
    if not torch.cuda.is_available():
        raise SystemExit("gpu_attention.py needs a CUDA GPU (use --compile-only without one)")
    device, dt = torch.device("cuda"), _DTYPES[dtype]
    H, Hkv = heads, kv_heads or heads
    rows = []
    for T in seq_lens:
        B = max(1, tokens // T)
        cands = _candidates(B, T, H, Hkv, d, dt, device)
        inputs = {name: make() for name, _, make, _ in cands}
        grads = {}
        for name, _, _, call in list(cands):  # one fixed upstream gradient each, made outside the timings
            try:
                with torch.no_grad():
                    grads[name] = torch.randn_like(call(*inputs[name]))
                if "fwd+bwd" in modes:  # the backward compiles on first use too
                    call(*inputs[name]).backward(grads[name])
                    for t in inputs[name]:
                        t.grad = None
            except Exception as e:  # noqa: BLE001  (a candidate that cannot run this shape is reported)
                if name == "baseline/sdpa":
                    raise
                print(f"T={T}: skipped {name}: {type(e).__name__}: {str(e).strip()[:200]}", flush=True)
                cands = [c for c in cands if c[0] != name]
        for mode in modes:
            times = {name: [] for name, *_ in cands}
            peak = {}
            for rep in range(warmup + repeats):
                for name, _, _, call in cands:  # alternate candidates
                    args = inputs[name]
                    torch.cuda.reset_peak_memory_stats()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    if mode == "fwd":
                        with torch.no_grad():
                            call(*args)
                    else:
                        call(*args).backward(grads[name])
                    end.record()
                    torch.cuda.synchronize()
                    peak[name] = torch.cuda.max_memory_allocated() / 2 ** 20
                    if rep >= warmup:
                        times[name].append(start.elapsed_time(end))
                    for t in args:
                        t.grad = None
            base_ms = statistics.median(times["baseline/sdpa"])
            for name, kind, _, _ in cands:
                ms = statistics.median(times[name])
                flops = (baseline_flops if kind == "base" else diff_flops)(B, T, H, d, mode)
                rows.append(dict(seq_len=T, batch=B, mode=mode, name=name, ms=ms, tflops=flops / ms / 1e9,
                                 peak_mib=peak[name], ratio=ms / base_ms))
        del inputs, grads
        torch.cuda.empty_cache()
    return rows


def check(T=2048, B=2, H=8, Hkv=4, d=128, dtype="bf16") -> None:
    """Every DIFF backend in ``dtype`` against the float32 eager oracle: output and gradients (the GPU suite's
    check, ``benchmarks/gpu_suite.py``, on one shape)."""
    case = gpu_suite.Shape(f"T{T}", B, T, H, Hkv, d)
    rows = gpu_suite.check_core(case, gpu_suite.diff_candidates(None), torch.device("cuda"), _DTYPES[dtype])
    gpu_suite._print_case("core", case, rows)


def compile_report(d: int, dtype: str, arch: int) -> None:
    """Offline: registers, spilled bytes and shared memory of each kernel for ``arch`` at the default tiles
    (``triton_kernel.resource_usage``; ``benchmarks/triton_offline.py`` compares candidate tiles)."""
    from difftx.attention import triton_kernel

    config = triton_kernel.block_config(d, interpret=False, arch=arch)
    print(f"d={d} {dtype} sm_{arch}: {config}")
    for name, kernel in triton_kernel.compile_offline(d, dtype=dtype, arch=arch, config=config).items():
        use = triton_kernel.resource_usage(kernel)
        print(f"  {name:10s} registers {use['registers'] if use['registers'] is not None else '?':>4}  spilled bytes "
              f"{use['spilled'] if use['spilled'] is not None else '?':>5}  shared memory {use['shared'] / 1024:.0f} KiB"
              f"  wgmma {use.get('wgmma', '?')}")


def _table(rows: list[dict]) -> str:
    lines = ["| T | batch | mode | candidate | ms | TFLOP/s | peak MiB | ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq_len']} | {r['batch']} | {r['mode']} | {r['name']} | {r['ms']:.3f} | "
                     f"{r['tflops']:.1f} | {r['peak_mib']:.0f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--d", type=int, default=128, help="component width d (baseline head width)")
    ap.add_argument("--heads", type=int, default=16, help="differential heads H (baseline: 2H)")
    ap.add_argument("--kv-heads", type=int, default=None, help="kv groups Hkv (baseline: 2Hkv); default H")
    ap.add_argument("--tokens", type=int, default=16384, help="batch = tokens // T")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--plot", default=None, help="also plot time and ratio against T to this PNG")
    ap.add_argument("--check", action="store_true", help="first compare with the float32 eager oracle")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: offline compile report")
    ap.add_argument("--arch", type=int, default=90, help="compute capability for --compile-only")
    a = ap.parse_args()
    if a.compile_only:
        compile_report(a.d, a.dtype, a.arch)
        return
    if not torch.cuda.is_available():
        raise SystemExit("gpu_attention.py needs a CUDA GPU (use --compile-only without one)")
    if a.check:
        check(d=a.d, dtype=a.dtype)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = bench(a.seq_lens, d=a.d, heads=a.heads, kv_heads=a.kv_heads, tokens=a.tokens, dtype=a.dtype,
                 repeats=a.repeats)
    print(_table(rows))
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, a.json)
    if a.plot:
        from difftx.eval.plots import plot_benchmark

        plot_benchmark(rows, a.plot, title=f"DIFF attention core vs baseline, d={a.d}, {a.dtype}, "
                                           f"{torch.cuda.get_device_name()}")


if __name__ == "__main__":
    sys.exit(main())
