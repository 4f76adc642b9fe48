"""Where a stacked training step's time goes, and the floor that its matrix products set for a comparison.

Usage:
    python benchmarks/step_floor.py                        # cpu preset, both arms, stacks of 8 (make demo's)
    python benchmarks/step_floor.py --k 4 --steps 96 --arms diff
    python benchmarks/step_floor.py --json floor.json

For each arm it builds the preset's stack of K models, draws K seeds' batches of the comparison's own
mixture (needle, LM and ICL batches in the preset's proportions), and times
:func:`difftx.training.stacked.train_step` on them (one thread, after warm-up steps):

- ``ms per model-step`` by batch kind and over the mixture (the mean a comparison pays per step), and the
  drawing of the batches (``CompareLoader.next_batch``), which is not part of the step;
- under ``torch.profiler`` with input shapes: the matrix products (``bmm``, ``baddbmm``, ``mm``,
  ``addmm`` and their in-place forms), their share of the step's operator time, their FLOPs
  (``2 b m n k`` each) and the rate they ran at;
- this core's float32 peak: a 1024^3 ``torch.mm``, median of 9.

From these it prints the floor of the preset's training: every model-step of every seed and arm
(``steps x seeds x arms``) spread over ``--cores`` processes, with the products run at the measured
peak and nothing else costing anything. The rest of the step (softmax, norms, activations, AdamW,
copies: memory-bound elementwise work) is what stacking and fusing can shrink; the products are not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

GEMMS = ("aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::mm", "aten::addmm", "aten::addmm_")


def gemm_flops(name: str, shapes: list) -> int:
    """FLOPs (``2 b m n k``) of one matrix product from the profiler's input shapes: ``bmm(A, B)``,
    ``mm(A, B)``, ``baddbmm(C, A, B)``, ``addmm(C, A, B)`` (``A`` ``(b, m, k)`` or ``(m, k)``)."""
    a, b = (shapes[0], shapes[1]) if name in ("aten::bmm", "aten::mm") else (shapes[1], shapes[2])
    batch = a[0] if len(a) == 3 else 1
    m, k = a[-2], a[-1]
    n = b[-1]
    return 2 * batch * m * n * k


def peak_gflops(n: int = 1024, repeats: int = 9) -> float:
    """One thread's float32 ``torch.mm`` rate on ``n x n`` matrices (median of ``repeats``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(ts) / 1e9


def measure(plan, arm: str, k: int, steps: int, warmup: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from difftx import Transformer
    from difftx.compare.stream import CompareStream
    from difftx.training.optim import build_optimizer
    from difftx.training.stacked import StackedTransformer, train_step

    cfg = plan.arms[arm]
    tc = plan.schedule.train_config(model=cfg, batch_size=plan.mixture.batch_size, seed=0, out_dir="unused",
                                    device="cpu", world_size=1, progress=False)
    models = []
    for seed in range(k):
        torch.manual_seed(seed)
        models.append(Transformer(cfg))
    stack = StackedTransformer.from_models(models)
    opt = build_optimizer(stack, tc)
    loaders = [CompareStream(plan.mixture, plan.space, seed).make_loader(batch_size=plan.mixture.batch_size)
               for seed in range(k)]
    t = time.process_time()
    batches = [[[loader.next_batch() for loader in loaders]] for _ in range(warmup + steps)]
    draw_ms = (time.process_time() - t) / (k * len(batches)) * 1000
    for b in batches[:warmup]:
        train_step(stack, opt, b, tc.lr, tc.grad_clip)
    by_kind: dict[str, list[float]] = {}
    for b in batches[warmup:]:
        t = time.process_time()
        train_step(stack, opt, b, tc.lr, tc.grad_clip)
        by_kind.setdefault(b[0][0].kind, []).append((time.process_time() - t) / k * 1000)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for b in batches[warmup:]:
            train_step(stack, opt, b, tc.lr, tc.grad_clip)
    gemm_us = other_us = 0.0
    flops = 0
    for e in prof.key_averages(group_by_input_shape=True):
        if not e.key.startswith("aten::"):
            continue
        if e.key in GEMMS:
            gemm_us += e.self_cpu_time_total
            flops += gemm_flops(e.key, e.input_shapes) * e.count
        else:
            other_us += e.self_cpu_time_total
    model_steps = k * steps
    mean_ms = statistics.fmean(x for v in by_kind.values() for x in v)
    share = gemm_us / (gemm_us + other_us)
    return {"arm": arm, "k": k, "steps": steps, "ms_per_model_step": mean_ms,
            "by_kind": {kind: {"steps": len(v), "median_ms": statistics.median(v)} for kind, v in by_kind.items()},
            "draw_ms": draw_ms, "gemm_share": share, "gemm_ms": mean_ms * share,
            "gemm_gflop": flops / model_steps / 1e9,
            "gemm_gflops_rate": flops / model_steps / 1e9 / (mean_ms * share / 1000)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu", help="compare preset (default cpu, make demo's)")
    p.add_argument("--arms", default="diff,baseline", help="arms (comma-separated)")
    p.add_argument("--k", type=int, default=8, help="models per stack (default 8: make demo's seeds)")
    p.add_argument("--seeds", type=int, default=8, help="seeds of the comparison the floor is for (default 8)")
    p.add_argument("--steps", type=int, default=64, help="timed steps (default 64: 8 of the mixture's cycles)")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    p.add_argument("--cores", type=int, default=2, help="processes training side by side (default 2)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if min(args.k, args.steps, args.seeds, args.cores) < 1 or args.warmup < 0:
        p.error("--k, --steps, --seeds and --cores must be positive, --warmup non-negative")

    from difftx.compare.presets import get_preset
    from difftx.training.stacked import tune_allocator

    torch.set_num_threads(1)
    tune_allocator()
    plan = get_preset(args.preset).resolve()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(plan.arms))
    if unknown:
        p.error(f"--arms: {unknown} not in the preset's arms {sorted(plan.arms)}")
    peak = peak_gflops()
    rows = [measure(plan, arm, args.k, args.steps, args.warmup) for arm in arms]
    print(f"preset {args.preset}, stacks of {args.k}, {args.steps} timed steps, one thread; "
          f"float32 peak of this core: {peak:.1f} GFLOP/s")
    print(f"{'arm':10s} {'ms/model-step':>13s} {'by kind (median ms)':30s} {'GEMM share':>10s} "
          f"{'GEMM GFLOP':>10s} {'GEMM rate':>10s} {'at peak ms':>10s} {'draw ms':>8s}")
    for r in rows:
        kinds = ", ".join(f"{kind} {v['median_ms']:.1f}" for kind, v in sorted(r["by_kind"].items()))
        r["gemm_at_peak_ms"] = r["gemm_gflop"] / peak * 1000
        print(f"{r['arm']:10s} {r['ms_per_model_step']:13.1f} {kinds:30s} {r['gemm_share']:10.0%} "
              f"{r['gemm_gflop']:10.3f} {r['gemm_gflops_rate']:10.1f} {r['gemm_at_peak_ms']:10.1f} "
              f"{r['draw_ms']:8.2f}")
    steps = plan.schedule.steps
    n_arms = len(plan.arms)
    per_step = statistics.fmean(r["gemm_at_peak_ms"] for r in rows)
    now = statistics.fmean(r["ms_per_model_step"] + r["draw_ms"] for r in rows)
    floor_s = steps * args.seeds * n_arms * per_step / 1000 / args.cores
    now_s = steps * args.seeds * n_arms * now / 1000 / args.cores
    print(f"\ntraining {args.seeds} seeds x {n_arms} arms x {steps:,} steps on {args.cores} cores: "
          f"{now_s / 60:.1f} min at these step times (one process alone per core), "
          f"{floor_s / 60:.1f} min for the matrix products alone at peak")
    if args.json:
        from difftx.io import dumps_strict

        with open(args.json, "w") as f:
            f.write(dumps_strict({"peak_gflops": peak, "rows": rows, "floor_s": floor_s, "now_s": now_s,
                                  "preset": args.preset, "seeds": args.seeds, "cores": args.cores}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
