"""Attention benchmark: DIFF layers (each backend) against the parameter-matched baseline.

Both sides are whole attention layers (projections, RoPE, core, norm, output projection).
Timings alternate between the candidates inside one loop, so a machine that slows down
mid-run slows every candidate alike, and each ratio is measured side by side.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from .attention import BACKENDS, DiffAttention, StandardAttention


@dataclass
class BenchRow:
    seq_len: int
    mode: str  # "fwd" or "fwd+bwd"
    name: str  # "baseline/sdpa" or "diff/<backend>"
    ms: float  # median over repeats
    ratio: float  # ms / baseline ms of the same seq_len and mode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step(layer, x: torch.Tensor, backend: str, mode: str) -> None:
    if mode == "fwd":
        with torch.no_grad():
            layer(x, backend=backend)
    else:
        out = layer(x, backend=backend)
        out.backward(torch.ones_like(out))


def bench_attention(seq_lens: Sequence[int] = (256, 512, 1024), dim: int = 512, n_heads: int = 4,
                    n_kv_heads: Optional[int] = None, batch: int = 1, backends: Optional[Sequence[str]] = None,
                    modes: Sequence[str] = ("fwd", "fwd+bwd"), repeats: int = 10, warmup: int = 2,
                    device: str = "cpu", dtype: torch.dtype = torch.float32, layer_idx: int = 4,
                    clock: str = "wall", progress: bool = True) -> list[BenchRow]:
    """Median milliseconds per call of each candidate; ``ratio`` is DIFF / baseline.

    ``clock="cpu"`` measures this process's CPU time (all threads) instead of wall time: on
    a CPU shared with other work it is far steadier, at the price of not counting idle waits.
    """
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock: must be 'wall' or 'cpu', got {clock!r}")
    timer = time.perf_counter if clock == "wall" else time.process_time
    dev = torch.device(device)
    if backends is None:  # every registered backend that runs natively on this device
        backends = [b for b in BACKENDS if dev.type == "cuda" or b != "triton"]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown or unavailable backend(s) {unknown}; registered: {sorted(BACKENDS)}")
    torch.manual_seed(0)
    diff = DiffAttention(dim, n_heads, layer_idx, n_kv_heads).to(dev, dtype)
    base = StandardAttention(dim, 2 * n_heads, None if n_kv_heads is None else 2 * n_kv_heads).to(dev, dtype)
    candidates = [("baseline/sdpa", base, "sdpa")] + [(f"diff/{b}", diff, b) for b in backends]
    rows: list[BenchRow] = []
    for T in seq_lens:
        x = torch.randn(batch, T, dim, device=dev, dtype=dtype, requires_grad=True)
        for mode in modes:
            times: dict[str, list[float]] = {name: [] for name, _, _ in candidates}
            for rep in range(warmup + repeats):
                for name, layer, backend in candidates:  # alternate: same conditions for all
                    _sync(dev)
                    t0 = timer()
                    _step(layer, x, backend, mode)
                    _sync(dev)
                    if rep >= warmup:
                        times[name].append(timer() - t0)
            base_ms = statistics.median(times["baseline/sdpa"]) * 1e3
            for name, _, _ in candidates:
                ms = statistics.median(times[name]) * 1e3
                rows.append(BenchRow(T, mode, name, ms, ms / base_ms))
                if progress:
                    print(f"  T={T:6d} {mode:8s} {name:16s} {ms:9.2f} ms  x{ms / base_ms:.2f}", flush=True)
            for layer in (diff, base):
                layer.zero_grad(set_to_none=True)
    return rows


def format_table(rows: Sequence[BenchRow]) -> str:
    lines = ["| T | mode | layer | ms | / baseline |", "|---:|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.seq_len} | {r.mode} | {r.name} | {r.ms:.2f} | {r.ratio:.2f} |")
    return "\n".join(lines)


def save_rows(rows: Sequence[BenchRow], path: str, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=2)
