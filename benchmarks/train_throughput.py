"""Training throughput: DIFF vs its parameter-matched baseline, full optimizer steps.

Usage:
    python benchmarks/train_throughput.py                      # CPU: presets tiny and cpu-5m
    python benchmarks/train_throughput.py --sizes compare-cpu,tiny,cpu-5m,cpu-17m,cpu-30m --threads 1 --clock cpu
    python benchmarks/train_throughput.py --sizes cpu-17m --steps 10 --batch-size 16
    python benchmarks/train_throughput.py --device cuda        # GPU: gpu-1b, bf16, with MFU
    python benchmarks/train_throughput.py --device cuda --backends triton sdpa flex   # one row per backend

Both models of a size are built side by side and stepped *alternately* (DIFF, baseline,
baseline, DIFF, ...), so a neighbour that slows the machine down slows both equally; the
ratio is the number to read. With several ``--backends`` the one DIFF model takes one step
per backend in each round. A step is forward + backward + gradient clipping + AdamW on
random tokens (data loading is not measured). Tokens/s is the median over the timed steps.
The ``paired`` columns pair each DIFF step with the baseline step of the same round: the median of
those per-round ratios with its distribution-free 95% interval (order statistics; from 6 rounds on),
which a machine whose speed drifts between rounds does not bias.
``--baselines`` times the baseline with several backends (the first is the ratios' reference).

Sizes are the model presets of ``difftx.config`` plus ``compare-cpu`` (the model of the ``cpu``
preset of ``difftx compare``: D = 64, 2 layers, 2 heads, its 623-token vocabulary, sequences of 64
tokens in batches of 16 unless ``--seq-len`` / ``--batch-size`` say otherwise) and ``cpu-30m``
(D = 512, 9 layers, 4 heads, bytes: 29M parameters; batches of 4 by default).

FLOP model (the ``FLOP ratio`` column): matrix-product FLOPs of one forward + backward pass,
read from each arm's config, for the attention backend it runs. Linear layers (projections,
SwiGLU, LM head): ``6 * tokens * weights``. Attention core per layer and sequence, as the kernel
computes it: ``chunked`` (what ``auto`` runs on CPU) takes blocks of ``CHUNK_ROWS`` query rows
against the keys up to the block's last row; per block of ``t`` rows and ``s`` keys the forward
costs ``QK = 2 t s d`` per query sub-head and ``PV = 2 t s dv`` per output head; the backward
``2 QK + 2 PV`` (dQ, dK, dV, dP), plus ``QK`` again where the block's maps are recomputed
(more than ``STORE_MAX_KEYS`` keys). ``eager``: one block of all ``T`` rows and ``T`` keys.
``sdpa``: causal half-square, backward with recomputation; DIFF pads q/k to ``2d`` over ``2H``
heads (twice the products). DIFF and its baseline have ``2H`` query sub-heads of width ``d`` and
``H * 2d = 2H * d`` output columns, so their ``chunked``/``eager`` FLOPs are equal: the FLOP ratio
is 1 up to the lambda dot products; elementwise work (softmax, norms, the optimizer) is not
counted. ``quotient`` = measured ratio / FLOP ratio (1 = DIFF costs exactly its FLOPs).

MFU (CUDA only) = model FLOPs per second / peak: 6 N + 12 L D T FLOPs per token (PaLM's
definition; N = parameters without the token embedding, attention counted non-causal),
peak from ``--peak-tflops`` or a small table of dense bf16 peaks by GPU name. The CUDA path
has not been run on a GPU by its author (none was available); treat its first run as a check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from difftx import Transformer, baseline_config, lm_loss, preset
from difftx.config import ModelConfig
from difftx.eval.stats import median_interval
from difftx.training.config import TrainConfig
from difftx.training.optim import build_optimizer

# dense bf16 tensor-core peaks (TFLOP/s), by a substring of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "4090": 165.0}


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value if dtype in (torch.bfloat16, torch.float16) else value / 2  # tf32 is half of bf16
    return None


def flops_per_token(model: Transformer, seq_len: int) -> float:
    c = model.config
    n = model.num_parameters() - model.tok_embeddings.weight.numel()
    return 6.0 * n + 12.0 * c.n_layers * c.dim * seq_len


def attention_core_flops(attn, seq_len: int, backend: str) -> float:
    """Forward + backward matrix-product FLOPs of one attention layer's core on one sequence
    (see the module docstring)."""
    from difftx.attention import kernels

    C = 2 if hasattr(attn, "lambda_full") and not hasattr(attn, "lambda_proj") else 1  # V1 DIFF: two maps per head
    d, hq = attn.head_dim, attn.q_heads  # query sub-heads of width d
    out_cols = (hq // C) * attn.v_width  # output heads x value width (DIFF V1: H x 2d; baseline: 2H x d)
    T = seq_len
    if backend in ("auto", "chunked"):
        rows, store = kernels.CHUNK_ROWS, getattr(kernels, "STORE_MAX_KEYS", None)
        total = 0.0
        for r0 in range(0, T, rows):
            t, s = min(T, r0 + rows) - r0, min(T, r0 + rows)
            qk, pv = 2.0 * hq * t * s * d, 2.0 * out_cols * t * s
            total += 3 * qk + 3 * pv + (qk if store is not None and s > store else 0.0)
        return total
    if backend == "eager":
        qk, pv = 2.0 * hq * T * T * d, 2.0 * out_cols * T * T
        return 3 * qk + 3 * pv
    if backend == "sdpa":
        half = T * (T + 1) / 2
        if C == 2:  # q, k zero-padded to 2d over 2H sub-heads, each with the 2d-wide value
            qk, pv = 2.0 * hq * half * 2 * d, 2.0 * hq * half * 2 * d
        else:
            qk, pv = 2.0 * hq * half * d, 2.0 * out_cols * half
        return 4 * qk + 3 * pv  # forward QK, PV; backward QK again, dP, dV, dQ, dK
    raise ValueError(f"no FLOP model for backend {backend!r}")


def step_flops(model: Transformer, batch: int, seq_len: int, backend: str) -> float:
    """Matrix-product FLOPs of one forward + backward pass of ``model`` on ``batch x seq_len`` tokens."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    core = sum(attention_core_flops(block.attn, seq_len, backend) for block in model.layers)
    return 6.0 * batch * seq_len * linear + batch * core


def _step(model, opt, tokens, dtype, device, backend=None):
    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs and next-token targets
    ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with ctx:
        loss = lm_loss(model(x, backend=backend), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def size_config(name: str, attention: str) -> tuple[ModelConfig, int | None, int | None]:
    """``(DIFF config, default seq_len, default batch)`` of a size name (``None``: the CLI default)."""
    if name == "compare-cpu":
        from difftx.compare.presets import get_preset

        p = get_preset("cpu")
        return p.resolve().arms["diff"].replace(attention=attention), p.context_len, p.batch_size
    if name == "cpu-30m":
        cfg = ModelConfig(vocab_size=256, dim=512, n_layers=9, n_heads=4, max_seq_len=256, attention=attention)
        return cfg, None, 4
    return preset(name, attention=attention), None, None


def bench_size(name: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    cfg0, seq0, batch0 = size_config(name, args.attention)
    seq_len = args.seq_len or seq0 or (2048 if device.type == "cuda" else 256)
    batch_size = args.batch_size or batch0 or (4 if device.type == "cuda" else 8)
    diff_cfg = cfg0.replace(max_seq_len=max(seq_len, cfg0.max_seq_len))
    cfgs = {"diff": diff_cfg, "baseline": baseline_config(diff_cfg)}
    models, opts = {}, {}
    tc = TrainConfig(model="test", seq_len=16, warmup_steps=0)  # only its optimizer settings are used
    for key, cfg in cfgs.items():
        torch.manual_seed(0)
        m = Transformer(cfg).to(device)
        models[key] = torch.compile(m) if args.compile else m
        opts[key] = build_optimizer(m, tc)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, diff_cfg.vocab_size, (batch_size, seq_len + 1), generator=gen).to(device)
    # one model and optimizer per arm, stepped once per backend in turn (step time does not depend on the weights)
    base_cands = [("baseline" if i == 0 else f"baseline/{b}", "baseline", None if b == "auto" else b)
                  for i, b in enumerate(args.baselines)]
    cands = base_cands + [(f"diff/{b}", "diff", b) for b in args.backends]
    nb = len(base_cands)
    for label, key, backend in list(cands[nb:]):  # a backend that cannot train this model is reported, not fatal
        try:
            _step(models[key], opts[key], tokens, dtype, device, backend)
        except Exception as e:  # noqa: BLE001
            opts[key].zero_grad(set_to_none=True)
            print(f"# {name}: skipped {label}: {type(e).__name__}: {str(e).strip()[:200]}", flush=True)
            cands.remove((label, key, backend))
    if len(cands) == nb:
        raise SystemExit(f"{name}: no DIFF backend could run a training step")
    timer = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {label: [] for label, _, _ in cands}
    order = list(cands)
    for i in range(args.warmup + args.steps):
        for label, key, backend in order:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = timer()
            loss = _step(models[key], opts[key], tokens, dtype, device, backend)
            float(loss.detach())  # waits for the step on any device
            if i >= args.warmup:
                times[label].append(timer() - t0)
        order.reverse()  # ABBA: no candidate always runs first
    tokens_per_step = batch_size * seq_len
    out = {"size": name, "attention": args.attention, "batch_size": batch_size, "seq_len": seq_len,
           "clock": args.clock, "threads": torch.get_num_threads(), "candidates": {}}
    for label, key, backend in cands:
        raw = models[key]._orig_mod if args.compile else models[key]
        tps = tokens_per_step / statistics.median(times[label])
        res = out["candidates"][label] = {"params": raw.num_parameters(), "tokens_per_s": tps}
        kb = backend or raw.config.backend
        if kb == "auto":
            kb = "chunked" if device.type == "cpu" and seq_len > 16 else ("eager" if device.type == "cpu" else None)
        try:
            res["step_flops"] = step_flops(raw, batch_size, seq_len, kb) if kb else None
        except ValueError:
            res["step_flops"] = None
        if device.type == "cuda":
            peak = args.peak_tflops or peak_tflops(device, dtype)
            if peak:
                res["mfu"] = flops_per_token(raw, seq_len) * tps / (peak * 1e12)
            res["max_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30  # of the whole run so far
    base_tps = out["candidates"]["baseline"]["tokens_per_s"]
    base_flops = out["candidates"]["baseline"]["step_flops"]
    ref = times[cands[0][0]]
    for label, key, _ in cands:
        c = out["candidates"][label]
        c["ratio_to_baseline"] = c["tokens_per_s"] / base_tps
        c["flop_ratio"] = base_flops / c["step_flops"] if base_flops and c["step_flops"] else None
        c["quotient"] = c["ratio_to_baseline"] / c["flop_ratio"] if c["flop_ratio"] else None
        # tokens/s ratio round by round (the baseline's step time / this one's, same ABBA round): the
        # median with its distribution-free 95% interval, robust to a machine whose speed drifts
        med, lo, hi = median_interval([r / t for r, t in zip(ref, times[label]) if t > 0])
        c["paired_ratio"] = {"median": med, "low": lo, "high": hi, "rounds": len(ref)}
    first = out["candidates"][cands[nb][0]]  # the first DIFF backend, under the keys of one-backend runs
    out.update(diff=first, baseline=out["candidates"]["baseline"], ratio_diff_over_baseline=first["ratio_to_baseline"])
    return out


def _interval(paired: dict, flop_ratio) -> str:
    """``median [low, high]`` of a paired ratio divided by ``flop_ratio`` ("-" without one)."""
    if not flop_ratio or paired["low"] is None:
        return "-"
    return f"{paired['median'] / flop_ratio:.3f} [{paired['low'] / flop_ratio:.3f}, {paired['high'] / flop_ratio:.3f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--sizes", help="comma-separated model presets (default: tiny,cpu-5m on CPU; gpu-1b on CUDA)")
    p.add_argument("--attention", default="diff", choices=["diff", "diff_v2"])
    p.add_argument("--batch-size", type=int, help="sequences per step (default: 8 on CPU, 4 on CUDA)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 256 on CPU, 2048 on CUDA)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: float32 on CPU, bfloat16 autocast on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--peak-tflops", type=float, help="GPU peak for MFU (default: looked up by GPU name)")
    p.add_argument("--backends", nargs="+", default=["auto"],
                   help="DIFF attention backends, each timed against the same baseline (default: auto)")
    p.add_argument("--baselines", nargs="+", default=["auto"],
                   help="baseline attention backends (default: auto); the first is the reference of every ratio")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall time (default) or this process's CPU time (steadier on a shared CPU)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be at least 1 and --warmup at least 0, got {args.steps} and {args.warmup}")
    from difftx.attention.kernels import check_backend_name

    for b in [*args.backends, *args.baselines]:
        try:
            check_backend_name(b)
        except ValueError as e:
            p.error(str(e))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    if args.dtype == "auto":
        dtype = torch.bfloat16 if cuda else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    if dtype != torch.float32 and not cuda:
        p.error("bfloat16 on this CPU is hundreds of times slower than float32; benchmark CPU in float32")
    sizes = (args.sizes or ("gpu-1b" if cuda else "tiny,cpu-5m")).split(",")
    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"# training throughput, {where}, {dtype}, {args.clock} clock, {args.steps} timed steps per model, "
          f"alternating; baseline backend {args.baselines[0]}")
    print("| size | DIFF backend | batch x T | DIFF params | baseline params | DIFF tok/s | baseline tok/s | "
          "FLOP ratio | DIFF/baseline | quotient | paired DIFF/baseline [95%] | paired quotient [95%] |"
          + (" DIFF MFU | baseline MFU |" if cuda else ""))
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|" + ("---|---|" if cuda else ""))
    results = []
    for name in sizes:
        r = bench_size(name.strip(), args, device, dtype)
        results.append(r)
        b = r["candidates"]["baseline"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        for label, d in r["candidates"].items():
            if label == "baseline":
                continue
            shown = label.split("/", 1)[1] if label.startswith("diff/") else label
            row = (f"| {name} | {shown} | {r['batch_size']} x {r['seq_len']} | {d['params']:,} | {b['params']:,} | "
                   f"{d['tokens_per_s']:,.0f} | {b['tokens_per_s']:,.0f} | {fmt(d['flop_ratio'])} | "
                   f"{d['ratio_to_baseline']:.3f} | {fmt(d['quotient'])} | {_interval(d['paired_ratio'], 1.0)} | "
                   f"{_interval(d['paired_ratio'], d['flop_ratio'])} |")
            if cuda:
                row += f" {d.get('mfu', float('nan')):.1%} | {b.get('mfu', float('nan')):.1%} |"
            print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
