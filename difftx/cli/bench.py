"""``difftx bench``: time DIFF attention layers against the parameter-matched baseline."""

from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from .args import (
    check_device, check_not_input, check_not_owned, check_output_file, check_plot_format, plot_file, positive_int,
)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=[256, 512, 1024], help="sequence lengths")
    p.add_argument("--dim", type=positive_int, default=512, help="model width D (default 512)")
    p.add_argument("--heads", type=positive_int, default=4,
                   help="differential heads H; the baseline gets 2H (default 4)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="kv groups Hkv (default: H)")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--backends", nargs="+", default=None,
                   help="DIFF backends to time (default: all that run natively on the device; on CPU not "
                        "triton or flex)")
    p.add_argument("--baselines", nargs="+", default=["sdpa"],
                   help="backends of the baseline (2H standard heads); the first is the reference of the ratio "
                        "column (default: sdpa)")
    p.add_argument("--memory", action="store_true",
                   help="also measure each candidate's peak memory above the call's start (MiB; on CPU with "
                        "PyTorch's memory profiler, one extra untimed call each; always measured on CUDA)")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--repeats", type=positive_int, default=10,
                   help="timed rounds per length and mode, every candidate once per round (default 10); from 6 "
                        "on, each row also gives the median per-round ratio to the reference with its 95%% "
                        "interval (distribution-free)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where available, else cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall time (default) or this process's CPU time (steadier on a shared CPU)")
    p.add_argument("--decode", action="store_true",
                   help="time one decoding step of a whole model whose KV cache holds T tokens (T = each "
                        "--seq-lens value), instead of attention layers")
    p.add_argument("--layers", type=positive_int, default=2, help="--decode: layers of the model (default 2)")
    p.add_argument("--steps", nargs="+", default=None, choices=["dynamic", "static", "compiled"],
                   help="--decode: which decoding steps to time, side by side (default dynamic): the ordinary "
                        "cached step, the static step (a preallocated cache written at a tensor position, "
                        "attention over the whole buffer; rows '<backend> static') and the static step under "
                        "torch.compile (on CUDA with CUDA graphs, mode reduce-overhead; rows '<backend> compiled')")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: PyTorch's choice)")
    p.add_argument("--json", default=None, help="also write the rows and machine facts to this JSON file")
    p.add_argument("--plot", default=None, help="also plot time and ratio against T to this PNG (needs matplotlib)")
    p.add_argument("--overwrite", action="store_true",
                   help="let --json / --plot replace a file of a run, checkpoint or tokenizer (refused otherwise)")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark DIFF attention against the parameter-matched baseline",
                       description="Time whole attention layers, DIFF (each backend) vs the baseline with 2H "
                                   "heads (SDPA), forward and forward+backward, alternating in one run; or, with "
                                   "--decode, one decoding step of a whole model with a KV cache of T tokens.")
    _add_arguments(p)
    p.set_defaults(func=run_checked)


def run_checked(args: argparse.Namespace) -> int:
    """:func:`run`, after refusing a ``--json`` / ``--plot`` path that cannot be written (before
    the timing, not after it)."""
    args.plot = plot_file(getattr(args, "plot", None))
    for flag in ("json", "plot"):
        check_output_file(getattr(args, flag, None), f"--{flag}")
        check_not_owned(getattr(args, flag, None), f"--{flag}", getattr(args, "overwrite", False))
        check_not_input(getattr(args, flag, None), f"--{flag}", {})
    json_out, plot = getattr(args, "json", None), getattr(args, "plot", None)
    if json_out is not None and plot is not None and Path(json_out).resolve() == Path(plot).resolve():
        raise ValueError(f"--json {json_out} and --plot {plot}: the same file; the plot would replace the rows: "
                         f"give two paths")
    check_plot_format(plot, "--plot")
    return run(args)


def run(args: argparse.Namespace) -> int:
    import torch  # lazy: torch; --help stays fast

    from ..bench import bench_attention, bench_decode, format_table, save_rows  # lazy: torch; --help stays fast

    dtype = getattr(torch, args.dtype)
    # resolved and checked here, not at parse time: `difftx --help` need not import torch
    args.device = check_device("auto" if args.device is None else args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cpu" and dtype != torch.float32:
        raise ValueError("--dtype: use float32 on CPU (bf16/fp16 have no fast CPU kernels here)")
    what = f"decode step, {args.layers}-layer model" if args.decode else "attention layer"
    print(f"difftx bench ({what}): D={args.dim} H={args.heads} (baseline {2 * args.heads} heads) batch={args.batch} "
          f"{args.dtype} on {args.device}, {args.clock} clock, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    steps = getattr(args, "steps", None)
    if steps is not None and not args.decode:
        raise ValueError("--steps: only with --decode (it picks the decoding steps to time)")
    if args.decode:
        rows = bench_decode(args.seq_lens, args.dim, args.heads, args.kv_heads, args.batch, args.layers,
                            args.backends, args.repeats, device=args.device, dtype=dtype, clock=args.clock,
                            baselines=args.baselines, steps=steps or ("dynamic",))
    else:
        rows = bench_attention(args.seq_lens, args.dim, args.heads, args.kv_heads, args.batch, args.backends,
                               args.modes, args.repeats, device=args.device, dtype=dtype, clock=args.clock,
                               baselines=args.baselines, memory=args.memory)
    print()
    print(format_table(rows))
    if args.json:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
                "processor": platform.processor(), **{k: v for k, v in vars(args).items() if k != "func"}}
        save_rows(rows, args.json, meta)
    if args.plot:
        from ..eval.plots import plot_benchmark  # lazy: torch; --help stays fast

        plot_benchmark([asdict(r) for r in rows], args.plot, title=f"DIFF vs baseline: {what}, D={args.dim}, "
                                                                   f"{args.dtype}, {args.device}")
        print(f"plot: {args.plot}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/attention.py", description=__doc__)
    _add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
