"""Offline compile report of the fused DIFF Triton kernels: no GPU needed, no timing.

For each component width ``d`` and target, compiles every kernel of
``difftx/attention/triton_kernel.py`` over a small grid of candidate tile configs (Triton ships
``ptxas`` and ``cuobjdump``) and prints, per kernel and config:

- registers per thread and spilled bytes (``REG`` and ``STACK`` of ``cuobjdump --dump-resource-usage``);
- shared memory, and whether it fits the target (227 KiB on sm_90, 163 KiB on sm_80);
- the number of Hopper ``wgmma`` instructions and of sm_80-style ``mma.sync`` instructions in the PTX
  (``wgmma`` needs 64 rows a warpgroup: the 32-row tiles of the old kernels used ``mma.sync``).

Kernels: ``fwd`` (forward), ``bwd`` (the 5-product atomic backward), ``bwd_dkq`` / ``bwd_dv`` (the
6-product ``atomic_dv`` backward), ``bwd_kv`` / ``bwd_q`` (the split 7-product backward); only the
forward and the atomic backward are compiled over the grid, the others at their defaults. The
32-row rows are references: they use ``mma.sync``, not ``wgmma``. The row marked ``*`` is
``block_config(d, arch=...)``'s choice; the line under each kernel names the config the selection rule
picks (among configs that use ``wgmma`` and fit shared memory: no value split, then the least
spilled bytes per owned row (a thread's spilled bytes x threads / rows), then the larger tile,
then fewer warps and stages; see :func:`pick`), so a change of compiler that moves the pick shows up here.
sm_80 compiles only the defaults, for reference.

Usage:
    python benchmarks/triton_offline.py                       # d 64 and 128, bf16, sm_90 grid + sm_80 defaults
    python benchmarks/triton_offline.py --d 128 --arch 90 --json offline.json
    python benchmarks/triton_offline.py --defaults-only       # only the chosen configs (fast)

A spill-free, wgmma-using config is a prerequisite, not a proof of speed: only GPU timings
(``benchmarks/gpu_suite.py``, which times the ``triton`` and ``triton_split`` backends) decide.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from difftx.attention import triton_kernel as tk  # noqa: E402

SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}

# (own, step, warps, stages, value split, one loop) for the forward; (own, step, warps, stages, one loop) for
# the backward. Two-loop rows (False) only where they compare with the default.
FWD_GRID = [(64, 32, 4, 2, 1, True), (64, 64, 4, 2, 1, True), (64, 32, 8, 2, 1, True), (64, 64, 8, 2, 1, True),
            (64, 32, 8, 2, 1, False), (64, 64, 8, 2, 1, False), (128, 32, 8, 2, 1, True), (128, 64, 8, 2, 1, True),
            (64, 64, 8, 3, 1, True), (64, 32, 4, 2, 2, True), (128, 64, 8, 2, 2, True), (64, 64, 16, 2, 1, True),
            (32, 16, 8, 2, 1, True)]
BWD_GRID = [(64, 16, 4, 2, True), (64, 16, 8, 2, False), (64, 32, 4, 2, True), (64, 32, 8, 2, True),
            (128, 16, 8, 2, True), (64, 64, 8, 2, True), (128, 32, 8, 2, True), (128, 64, 8, 2, True),
            (64, 16, 8, 3, True), (64, 16, 16, 2, True), (32, 16, 8, 2, True), (32, 16, 4, 2, True)]


def candidates(d: int, arch: int = 90, defaults_only: bool = False) -> list[tuple[str, tk.BlockConfig]]:
    """``(kernel, config)`` pairs to compile for width ``d``: the defaults first, then the grid."""
    base = tk.block_config(d, interpret=False, arch=arch)
    out = [(kernel, base) for kernel in tk.OFFLINE_KERNELS]
    if defaults_only:
        return out
    for m, n, w, s, sp, one in FWD_GRID:
        cfg = dataclasses.replace(base, fwd_own=m, fwd_step=n, fwd_warps=w, num_stages=s, fwd_split=sp, one_loop=one)
        if cfg != base:
            out.append(("fwd", cfg))
    for m, n, w, s, one in BWD_GRID:
        cfg = dataclasses.replace(base, bwd_own=m, bwd_step=n, bwd_warps=w, num_stages=s, one_loop=one)
        if cfg != base:
            out.append(("bwd", cfg))
    return out


def tiles(kernel: str, cfg: tk.BlockConfig) -> dict:
    """The fields of ``cfg`` that ``kernel`` uses."""
    prefix = {"fwd": "fwd", "bwd": "bwd", "bwd_dkq": "bwd", "bwd_dv": "dv", "bwd_kv": "kv", "bwd_q": "q"}[kernel]
    out = {"own": getattr(cfg, f"{prefix}_own"), "step": getattr(cfg, f"{prefix}_step"),
           "warps": getattr(cfg, f"{prefix}_warps"), "stages": cfg.num_stages}
    out["split"] = cfg.fwd_split if kernel == "fwd" else 1
    out["loops"] = 2 if kernel == "bwd_q" or not cfg.one_loop else 1  # the dQ kernel keeps its two loops
    return out


def report(d: int, dtype: str, arch: int, defaults_only: bool = False) -> list[dict]:
    base = tk.block_config(d, interpret=False, arch=arch)
    rows = []
    for kernel, cfg in candidates(d, arch, defaults_only or arch != 90):
        t0 = time.time()
        try:
            compiled = tk.compile_offline(d, dtype=dtype, arch=arch, config=cfg, which=(kernel,))[kernel]
            usage = tk.resource_usage(compiled)
            error = None
        except Exception as e:  # noqa: BLE001 - an out-of-resources compile is a row of the report
            usage, error = {"registers": None, "spilled": None, "shared": None, "wgmma": 0, "mma": 0}, \
                f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        t = tiles(kernel, cfg)
        per_row = None if usage["spilled"] is None else usage["spilled"] * 32 * t["warps"] // t["own"]
        rows.append({"d": d, "dtype": dtype, "arch": arch, "kernel": kernel, **t, **usage, "spilled_per_row": per_row,
                     "fits": usage["shared"] is not None and usage["shared"] <= SHARED_LIMIT[arch],
                     "default": tiles(kernel, cfg) == tiles(kernel, base), "error": error,
                     "compile_s": round(time.time() - t0, 1)})
    return rows


def pick(rows: list[dict]) -> dict | None:
    """The selection rule: among rows that compiled, fit and use ``wgmma``: no value split (it costs
    a third more forward products) where any, then the least spilling per owned row (spilled
    bytes a thread x threads / rows the program owns: per-thread bytes alone favour more warps,
    which spill less each but more in all), then the larger tile, then fewer warps and stages."""
    ok = [r for r in rows if r["error"] is None and r["fits"] and r["wgmma"] > 0 and r["spilled"] is not None]
    if not ok:
        return None
    return min(ok, key=lambda r: (r["split"], r["spilled_per_row"], -r["own"] * r["step"], -r["own"], r["warps"],
                                  r["stages"], r["loops"]))


def _fmt(v) -> str:
    return "?" if v is None else str(v)


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"\n## d {r0['d']}, {r0['dtype']}, sm_{r0['arch']}\n")
    print("| kernel | own x step | warps | stages | value split | loops | registers | spilled B | spilled B a row "
          "| shared KiB | wgmma | mma |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kernel in tk.OFFLINE_KERNELS:
        krows = [r for r in rows if r["kernel"] == kernel]
        for r in krows:
            mark = " *" if r["default"] else ""
            shared = "?" if r["shared"] is None else f"{r['shared'] / 1024:.0f}" + ("" if r["fits"] else " (over)")
            extra = f" ({r['error']})" if r["error"] else ""
            print(f"| {kernel}{mark} | {r['own']} x {r['step']} | {r['warps']} | {r['stages']} | {r['split']} | "
                  f"{r['loops']} | "
                  f"{_fmt(r['registers'])} | {_fmt(r['spilled'])} | {_fmt(r['spilled_per_row'])} | {shared} | "
                  f"{r['wgmma']} | {r['mma']}{extra} |")
        if len(krows) > 1:
            best = pick(krows)
            what = "none uses wgmma and fits" if best is None else (
                f"{best['own']} x {best['step']}, {best['warps']} warps, {best['stages']} stages, "
                f"split {best['split']}, {best['loops']} loop(s)")
            print(f"| {kernel}: rule picks {what} | | | | | | | | | | | |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128], help="component widths (default 64 128)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="targets (default 90 80; 80: defaults only)")
    ap.add_argument("--defaults-only", action="store_true", help="compile only block_config's choices")
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args(argv)
    for d in a.d:
        if not 1 <= d <= 256:
            raise SystemExit(f"--d: component width must be in 1..256, got {d}")
    for arch in a.arch:
        if arch not in SHARED_LIMIT:
            raise SystemExit(f"--arch: expected one of {sorted(SHARED_LIMIT)}, got {arch}")
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    all_rows = []
    for arch in a.arch:
        for d in a.d:
            rows = report(d, a.dtype, arch, a.defaults_only)
            print_table(rows)
            all_rows += rows
    if a.json:
        Path(a.json).write_text(json.dumps(all_rows, indent=1))
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
