"""Training throughput: DIFF vs its parameter-matched baseline, full optimizer steps.

Usage:
    python benchmarks/train_throughput.py                      # CPU: presets tiny and cpu-5m
    python benchmarks/train_throughput.py --sizes cpu-17m --steps 10 --batch-size 16
    python benchmarks/train_throughput.py --device cuda        # GPU: gpu-1b, bf16, with MFU
    python benchmarks/train_throughput.py --device cuda --backends triton sdpa flex   # one row per backend

Both models of a size are built side by side and stepped *alternately* (DIFF, baseline,
baseline, DIFF, ...), so a neighbour that slows the machine down slows both equally; the
ratio is the number to read. With several ``--backends`` the one DIFF model takes one step
per backend in each round. A step is forward + backward + gradient clipping + AdamW on
random tokens (data loading is not measured). Tokens/s is the median over the timed steps.

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


def bench_size(name: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    diff_cfg = preset(name, attention=args.attention, max_seq_len=max(args.seq_len, preset(name).max_seq_len))
    cfgs = {"diff": diff_cfg, "baseline": baseline_config(diff_cfg)}
    models, opts = {}, {}
    tc = TrainConfig(model=name, seq_len=min(args.seq_len, diff_cfg.max_seq_len), warmup_steps=0)
    for key, cfg in cfgs.items():
        torch.manual_seed(0)
        m = Transformer(cfg).to(device)
        models[key] = torch.compile(m) if args.compile else m
        opts[key] = build_optimizer(m, tc)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, diff_cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
    # one DIFF model and optimizer, stepped once per backend in turn (step time does not depend on the weights)
    cands = [("baseline", "baseline", None)] + [(f"diff/{b}", "diff", b) for b in args.backends]
    for label, key, backend in list(cands[1:]):  # a backend that cannot train this model is reported, not fatal
        try:
            _step(models[key], opts[key], tokens, dtype, device, backend)
        except Exception as e:  # noqa: BLE001
            opts[key].zero_grad(set_to_none=True)
            print(f"# {name}: skipped {label}: {type(e).__name__}: {str(e).strip()[:200]}", flush=True)
            cands.remove((label, key, backend))
    if len(cands) == 1:
        raise SystemExit(f"{name}: no DIFF backend could run a training step")
    times: dict[str, list[float]] = {label: [] for label, _, _ in cands}
    order = list(cands)
    for i in range(args.warmup + args.steps):
        for label, key, backend in order:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss = _step(models[key], opts[key], tokens, dtype, device, backend)
            float(loss.detach())  # waits for the step on any device
            if i >= args.warmup:
                times[label].append(time.perf_counter() - t0)
        order.reverse()  # ABBA: no candidate always runs first
    tokens_per_step = args.batch_size * args.seq_len
    out = {"size": name, "attention": args.attention, "batch_size": args.batch_size, "seq_len": args.seq_len,
           "candidates": {}}
    for label, key, _ in cands:
        raw = models[key]._orig_mod if args.compile else models[key]
        tps = tokens_per_step / statistics.median(times[label])
        res = out["candidates"][label] = {"params": raw.num_parameters(), "tokens_per_s": tps}
        if device.type == "cuda":
            peak = args.peak_tflops or peak_tflops(device, dtype)
            if peak:
                res["mfu"] = flops_per_token(raw, args.seq_len) * tps / (peak * 1e12)
            res["max_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30  # of the whole run so far
    base_tps = out["candidates"]["baseline"]["tokens_per_s"]
    for label, key, _ in cands:
        out["candidates"][label]["ratio_to_baseline"] = out["candidates"][label]["tokens_per_s"] / base_tps
    first = out["candidates"][cands[1][0]]  # the first DIFF backend, under the keys of one-backend runs
    out.update(diff=first, baseline=out["candidates"]["baseline"], ratio_diff_over_baseline=first["ratio_to_baseline"])
    return out


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
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    from difftx.attention.kernels import check_backend_name

    for b in args.backends:
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
    args.batch_size = args.batch_size or (4 if cuda else 8)
    args.seq_len = args.seq_len or (2048 if cuda else 256)
    sizes = (args.sizes or ("gpu-1b" if cuda else "tiny,cpu-5m")).split(",")
    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"# training throughput, {where}, {dtype}, batch {args.batch_size} x {args.seq_len}, "
          f"{args.steps} timed steps per model, alternating")
    print("| size | DIFF backend | DIFF params | baseline params | DIFF tok/s | baseline tok/s | DIFF/baseline |"
          + (" DIFF MFU | baseline MFU |" if cuda else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if cuda else ""))
    results = []
    for name in sizes:
        r = bench_size(name.strip(), args, device, dtype)
        results.append(r)
        b = r["candidates"]["baseline"]
        for label, d in r["candidates"].items():
            if label == "baseline":
                continue
            row = (f"| {name} | {label.split('/', 1)[1]} | {d['params']:,} | {b['params']:,} | "
                   f"{d['tokens_per_s']:,.0f} | {b['tokens_per_s']:,.0f} | {d['ratio_to_baseline']:.3f} |")
            if cuda:
                row += f" {d.get('mfu', float('nan')):.1%} | {b.get('mfu', float('nan')):.1%} |"
            print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
