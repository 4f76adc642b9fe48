"""Benchmarks of DIFF against the parameter-matched baseline.

- :func:`bench_attention`: whole attention layers (projections, RoPE, core, norm, output
  projection), forward and forward + backward, one row per DIFF backend.
- :func:`bench_decode`: one decoding step of a whole model whose KV cache holds ``T`` tokens
  (SPEC section 6: both read KV caches of the same size, and a decode step is memory-bound, so
  DIFF can match the baseline there).

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
from .arm_table import PRIMARY

DIFF, BASELINE = PRIMARY  # the two models a row names: "baseline/sdpa", "diff/<backend>"


@dataclass
class BenchRow:
    seq_len: int
    mode: str  # "fwd" or "fwd+bwd"
    name: str  # "baseline/sdpa" or "diff/<backend>"
    ms: float  # median over repeats
    ratio: float  # ms / baseline ms of the same seq_len and mode
    mem_mib: Optional[float] = None  # decode: the KV cache; CUDA attention: peak allocated memory
    # median over rounds of (this call's time / the baseline's time in the same round), with its
    # distribution-free 95% interval (difftx.eval.stats.median_interval; None below 6 rounds)
    paired: Optional[float] = None
    paired_low: Optional[float] = None
    paired_high: Optional[float] = None


def peak_memory_mib(fn, device: torch.device) -> float:
    """Peak memory (MiB) allocated by ``fn()`` above what was allocated when it started.

    CUDA: the allocator's peak statistic. CPU: PyTorch's profiler with ``profile_memory`` records
    every allocation and free of the CPU allocator; the peak is the maximum of their running sum.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    mem = sorted((e["ts"], e["args"]["Bytes"]) for e in events
                 if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0)
    cur = peak = 0
    for _, nbytes in mem:
        cur += nbytes
        peak = max(peak, cur)
    return peak / 2 ** 20


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
                    clock: str = "wall", progress: bool = True, baselines: Sequence[str] = ("sdpa",),
                    memory: bool = False) -> list[BenchRow]:
    """Median milliseconds per call of each candidate; ``ratio`` is candidate / first baseline.

    ``baselines``: backends of the baseline layer (the first is the reference of ``ratio``).
    ``memory``: also measure each candidate's peak memory (one extra, untimed call each; on CUDA
    it is always measured). ``clock="cpu"`` measures this process's CPU time (all threads) instead
    of wall time: on a CPU shared with other work it is far steadier, at the price of not counting
    idle waits.
    """
    timer, dev, backends = _setup(clock, device, backends)
    baselines = _check_baselines(baselines)
    torch.manual_seed(0)
    diff = DiffAttention(dim, n_heads, layer_idx, n_kv_heads).to(dev, dtype)
    base = StandardAttention(dim, 2 * n_heads, None if n_kv_heads is None else 2 * n_kv_heads).to(dev, dtype)
    candidates = ([(f"{BASELINE}/{b}", base, b) for b in baselines]
                  + [(f"{DIFF}/{b}", diff, b) for b in backends])
    rows: list[BenchRow] = []
    for T in seq_lens:
        x = torch.randn(batch, T, dim, device=dev, dtype=dtype, requires_grad=True)
        for mode in modes:
            calls = {name: (lambda layer=layer, backend=backend: _step(layer, x, backend, mode))
                     for name, layer, backend in candidates}
            peaks: dict[str, float] = {}
            if memory or dev.type == "cuda":
                for name, call in _runnable(calls, quiet=True).items():
                    peaks[name] = peak_memory_mib(call, dev)
                    for layer in (diff, base):
                        layer.zero_grad(set_to_none=True)
            rows += _time_alternating(calls, T, mode, repeats, warmup, dev, timer, progress, peaks)
            for layer in (diff, base):
                layer.zero_grad(set_to_none=True)
    return rows


def _time_alternating(calls: dict, T: int, mode: str, repeats: int, warmup: int, dev: torch.device, timer,
                      progress: bool, mem_mib: dict[str, float]) -> list[BenchRow]:
    """Median time of each call (alternating, after ``warmup`` rounds) as rows with the ratio to
    the first call (a baseline); ``mem_mib`` gives a row's memory."""
    calls = _runnable(calls)
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    for rep in range(warmup + repeats):
        for name, call in order:  # alternate: same conditions for all
            _sync(dev)
            t0 = timer()
            call()
            _sync(dev)
            if rep >= warmup:
                times[name].append(timer() - t0)
        order.reverse()  # ABBA: no candidate always runs first
    from .eval.stats import median_interval

    ref = times[next(iter(calls))]
    base_ms = statistics.median(ref) * 1e3
    rows = []
    for name in calls:
        ms = statistics.median(times[name]) * 1e3
        paired = median_interval([t / r for t, r in zip(times[name], ref) if r > 0])  # a 0 s reading has no ratio
        rows.append(BenchRow(T, mode, name, ms, ms / base_ms, mem_mib.get(name), *paired))
        if progress:
            ci = "" if paired[1] is None else f"  paired x{paired[0]:.3f} [{paired[1]:.3f}, {paired[2]:.3f}]"
            print(f"  T={T:6d} {mode:8s} {name:16s} {ms:9.3f} ms  x{ms / base_ms:.2f}{ci}", flush=True)
    return rows


def _runnable(calls: dict, quiet: bool = False) -> dict:
    """``calls`` without the DIFF candidates that fail on their first call (each is reported with
    its error unless ``quiet``, so one backend that cannot run a shape does not end the benchmark)."""
    kept = {}
    for name, call in calls.items():
        try:
            call()
        except Exception as e:  # noqa: BLE001  (reported, then the candidate is left out)
            if name.startswith(BASELINE):
                raise
            first = (str(e).strip().splitlines() or [""])[0][:200]
            if not quiet:
                print(f"  skipped {name}: {type(e).__name__}: {first}", flush=True)
            continue
        kept[name] = call
    return kept


# the decoding steps bench_decode times: the ordinary cached step, the static step (StaticKVCache), and the
# static step compiled (on CUDA with CUDA graphs); a row's name carries the step after its backend
DECODE_STEPS = ("dynamic", "static", "compiled")


def bench_decode(seq_lens: Sequence[int] = (256, 1024, 4096), dim: int = 512, n_heads: int = 4,
                 n_kv_heads: Optional[int] = None, batch: int = 1, n_layers: int = 2,
                 backends: Optional[Sequence[str]] = None, repeats: int = 20, warmup: int = 3,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, clock: str = "wall",
                 progress: bool = True, baselines: Sequence[str] = ("sdpa",), steps: Sequence[str] = ("dynamic",),
                 compile_opts: Optional[dict] = None) -> list[BenchRow]:
    """Median milliseconds of one decoding step (one new token per sequence) of a whole
    ``n_layers`` model, DIFF (each backend) vs its baseline, with the KV cache holding ``T``
    tokens; ``mem_mib`` is each model's KV cache at that length (equal by construction).

    ``steps`` (:data:`DECODE_STEPS`): ``dynamic`` the ordinary cached step (rows ``diff/<backend>``); ``static``
    the static step over a cache of ``T + 1`` positions (``diff/<backend> static``; backends that cannot run it
    are left out); ``compiled`` that step under ``torch.compile`` (:func:`difftx.decode.compile_options`, updated
    by ``compile_opts``; on CUDA CUDA graphs; ``diff/<backend> compiled``), compiled once per model and length
    before the timing. Every row's ratio is to the first baseline row."""
    from .attention.cache import static_backend
    from .config import ModelConfig, baseline_config
    from .decode import static_decoder
    from .model import KVCache, StaticKVCache, Transformer

    timer, dev, backends = _setup(clock, device, backends)
    baselines = _check_baselines(baselines)
    bad = [s for s in steps if s not in DECODE_STEPS]
    if bad or not steps:
        raise ValueError(f"steps: each must be one of {DECODE_STEPS}, got {list(steps)}")
    cfg = ModelConfig(vocab_size=256, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      attention="diff", max_seq_len=max(seq_lens) + 1)
    torch.manual_seed(0)
    models = {DIFF: Transformer(cfg).to(dev, dtype).eval(),
              BASELINE: Transformer(baseline_config(cfg)).to(dev, dtype).eval()}

    def static_ok(backend: str) -> bool:
        try:
            static_backend(backend)
            return True
        except ValueError:
            return False

    candidates = []  # (name, kind, backend, step)
    for step_kind in steps:
        suffix = "" if step_kind == "dynamic" else f" {step_kind}"
        for kind, names in ((BASELINE, baselines), (DIFF, backends)):
            for b in names:
                if step_kind == "dynamic" or static_ok(b):
                    candidates.append((f"{kind}/{b}{suffix}", kind, b, step_kind))
                elif progress:
                    print(f"  skipped {kind}/{b}{suffix}: {b!r} cannot run a static step", flush=True)
    rows: list[BenchRow] = []
    for T in seq_lens:
        prompt = torch.randint(0, cfg.vocab_size, (batch, T), device=dev)
        nxt = torch.randint(0, cfg.vocab_size, (batch, 1), device=dev)
        caches, statics, mem = {}, {}, {}
        with torch.no_grad():
            for kind, model in models.items():
                caches[kind] = KVCache(model, batch, T + 1)
                model(prompt, cache=caches[kind])  # prefill (not timed)
                statics[kind] = StaticKVCache(model, batch, T + 1, kv=caches[kind])  # the same buffers
                mib = sum(t.numel() * t.element_size() for lay in caches[kind].layers for t in (lay.k, lay.v)) / 2 ** 20
                mem.update({name: mib for name, k, _, _ in candidates if k == kind})

        def dynamic(kind: str, backend: str) -> None:
            caches[kind].length = T  # overwrite the same slot: every call decodes at length T
            with torch.no_grad():
                models[kind](nxt, cache=caches[kind], backend=backend)

        def static(kind: str, fn) -> None:
            statics[kind].set_length(T)  # the same slot, as the dynamic step
            with torch.no_grad():
                fn(nxt)

        calls = {}
        for name, kind, backend, step_kind in candidates:
            if step_kind == "dynamic":
                calls[name] = lambda kind=kind, backend=backend: dynamic(kind, backend)
            else:
                opts = False if step_kind == "static" else (dict(compile_opts) if compile_opts else True)
                fn = static_decoder(models[kind], statics[kind], backend=backend, compile=opts)
                calls[name] = lambda kind=kind, fn=fn: static(kind, fn)
        # each compiled candidate is one more graph of the same step function: room for all of them
        dyn = torch._dynamo.config
        limit = "recompile_limit" if hasattr(dyn, "recompile_limit") else "cache_size_limit"  # its older name
        with dyn.patch(**{limit: max(64, 4 * len(candidates) * len(seq_lens))}):
            rows += _time_alternating(calls, T, "decode", repeats, max(warmup, 3 if "compiled" in steps else 0),
                                      dev, timer, progress, mem)
        caches.clear()  # free this length's caches before the next prefill
        statics.clear()
    return rows


def _check_baselines(baselines: Sequence[str]) -> list[str]:
    baselines = list(baselines)
    if not baselines:
        raise ValueError("baselines: name at least one backend for the baseline")
    unknown = [b for b in baselines if b != "auto" and b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown or unavailable baseline backend(s) {unknown}; registered: {sorted(BACKENDS)}")
    return baselines


def _setup(clock: str, device: str, backends: Optional[Sequence[str]]):
    """``(timer, device, backends)``: validated clock and backends (default: every backend that
    runs natively on the device; on CPU not ``triton`` (a GPU kernel) nor ``flex`` (PyTorch's
    eager reference form there, without a backward pass); name them to time them anyway)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock: must be 'wall' or 'cpu', got {clock!r}")
    dev = torch.device(device)
    if backends is None:
        backends = [b for b in BACKENDS if dev.type == "cuda" or b not in ("triton", "flex")]
    unknown = [b for b in backends if b != "auto" and b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown or unavailable backend(s) {unknown}; registered: {sorted(BACKENDS)}")
    return (time.perf_counter if clock == "wall" else time.process_time), dev, list(backends)


def format_table(rows: Sequence[BenchRow]) -> str:
    mem = any(r.mem_mib is not None for r in rows)
    lines = ["| T | mode | candidate | ms | / baseline | paired / baseline [95%] |"
             + (" MiB | MiB / baseline |" if mem else ""),
             "|---:|---|---|---:|---:|---|" + ("---:|---:|" if mem else "")]
    first: dict = {}
    for r in rows:
        ref = first.setdefault((r.seq_len, r.mode), r)  # the first row of a length and mode is the reference
        tail = ""
        if mem:
            rel = r.mem_mib / ref.mem_mib if r.mem_mib is not None and ref.mem_mib else None
            tail = (f" {r.mem_mib:.3g} |" if r.mem_mib is not None else " - |") + \
                (f" {rel:.2f} |" if rel is not None else " - |")
        paired = "-" if r.paired_low is None else f"{r.paired:.3f} [{r.paired_low:.3f}, {r.paired_high:.3f}]"
        lines.append(f"| {r.seq_len} | {r.mode} | {r.name} | {r.ms:.3f} | {r.ratio:.2f} | {paired} |" + tail)
    return "\n".join(lines)


def save_rows(rows: Sequence[BenchRow], path: str, meta: dict) -> None:
    """Write the rows as JSON to ``path`` (atomically; a failed write names the file and the cause)."""
    from pathlib import Path

    from .checkpoint import atomic_write

    text = json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2)
    atomic_write(path, lambda p: Path(p).write_text(text))
