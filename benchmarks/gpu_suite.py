"""The GPU suite of issue 57: one command that measures DIFF against its baseline on a GPU.

    PYTHONPATH=. python benchmarks/gpu_suite.py --out $OUT/suite.json     # <= 8 minutes on an H100 / H200
    PYTHONPATH=. python benchmarks/gpu_suite.py --sections correctness,attention --shapes goal,d64 --out r.json
    PYTHONPATH=. python benchmarks/gpu_suite.py --tiny --out /tmp/tiny.json       # every section, tiny, CPU

Sections, in order (``--sections`` picks some; ``env`` and ``goals`` always run, and ``attention``
brings ``correctness`` with it, because only candidates that passed it are timed):

- ``env``: the card, its compute capability and memory; torch, CUDA, cuDNN, Triton; git commit; command line.
- ``correctness``: every DIFF candidate (``kernels.BACKENDS`` at run time, less ``eager`` and ``chunked``,
  plus ``auto``) in bf16 against the float32 ``eager`` oracle on the same bf16-rounded inputs: the output,
  dq, dk, dv and dlambda within relative L2 :data:`TOLERANCE`; GQA with 2 and 4 heads a group; lengths
  that are no multiple of a tile; and the whole ``DiffAttention`` layer under bf16 autocast (output, dx
  and every parameter's gradient, the head norm's weight and the lambda vectors included). A candidate
  that fails anything is marked and left out of the timings (listed under ``excluded``).
- ``attention``: per shape, the baseline's SDPA call (``2H`` heads of width ``d``, causal) as the model
  makes it (``baseline/sdpa``) and with each SDPA backend forced (cuDNN, flash, efficient), plus
  ``flash_attn`` when importable, and every DIFF candidate that passed; the kernels each row ran, from
  one profiled call; forward, backward and forward + backward: medians of ``--repeats`` CUDA-event
  timings after ``--warmup`` rounds, all arms alternating in one loop (ABBA); ratio to the fastest
  baseline of that mode (named); TFLOP/s on executed and on useful FLOPs; peak memory; the tiles Triton's
  autotuner chose for the fused kernel (``triton_autotune``).
- ``training``: ``gpu-350m`` (d 64) and ``gpu-350m-d128`` (half the heads), eager and compiled, DIFF and
  baseline alternating; tokens/s, paired ratio, MFU, GPU time by category from one profiled step.
- ``decode``: one decoding step of a whole model (gpu-350m's shape), batch 1 and 8, cache T 1k and 4k.
- ``goals``: the issue's goals with the measured values.

The JSON (``--out``) is rewritten (atomically) after every section and shape, so a run that is
killed keeps what it measured. On CUDA each section runs in a process of its own (``--isolate``): a fault
that ends a process or loses its CUDA context ends that section's process only, and the section restarts
without the arm that made it (:func:`run_isolated`). ``--register FILE.py`` adds your own DIFF kernels as
candidates. ``choices`` holds one entry per (shape, mode) for ``auto``'s table
(``python -m difftx.attention.gpu_table merge suite.json``).

FLOPs. Unit: one causal product of the baseline, ``2 B (2H) (T^2 / 2) d`` (``2H`` heads of width ``d``
over half the square). The baseline's forward is 2 units (QK^T, PV) and its backward 5 (S again, dP, dV,
dQ, dK). Executed units per backend (:data:`PRODUCTS`, forward / backward):

- ``sdpa`` / ``sdpa_pad`` (q, k zero-padded to 2d, one call over 2H heads): 4 / 10 (2x the baseline);
- ``sdpa_halves`` (four calls at width d over H heads, one per map and value half): 4 / 10 (2x);
- ``sdpa_wide`` (two calls, q/k of width d, v of width 2d): QK 1 + PV 2 = 3 / S 1, dP 2, dV 2, dQ 1, dK 1 = 7;
- ``flex`` (two calls of H heads sharing the 2d value): 3 / 7;
- ``triton`` (the fused kernel, atomic backward: dQ by atomic adds) 3 / 5, ``triton_atomic_dv`` (dV in its own
  kernel) 3 / 6, ``triton_split`` (S and dP recomputed in a dQ kernel) 3 / 7: each declares its counts;
- a kernel function may declare its own with an attribute ``products = (fwd, bwd)``; otherwise unknown.

Useful FLOPs are the fused algorithm's for every DIFF candidate: 3 / 5 (so 1.5x forward, 8/7
forward + backward), the baseline's own for the baselines.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_throughput, run as a script or imported

from difftx.attention import AttentionMask, DiffAttention, kernels  # noqa: E402

TOLERANCE = 1e-2  # relative L2 against the float32 oracle
SECTIONS = ("env", "correctness", "attention", "training", "decode", "goals")
# each section's share of --budget-s; what one section leaves unused goes to the next ones
SHARES = {"env": 1, "correctness": 50, "attention": 140, "training": 240, "decode": 40, "goals": 1}
MODES = ("fwd+bwd", "fwd", "bwd")  # timed in this order: the goals read fwd+bwd
MODE_WEIGHTS = {"fwd+bwd": 1.0, "fwd": 0.4, "bwd": 1.0}  # each mode's share of a shape's time (about its cost)
MODE_OF_CHOICE = {"fwd+bwd": "train", "fwd": "infer"}
SKIPPED = ("eager", "chunked")  # CPU kernels, never candidates on a GPU

# executed causal products (forward, backward) in units of one baseline product (module docstring)
BASELINE_PRODUCTS = (2, 5)
USEFUL_PRODUCTS = (3, 5)
PRODUCTS = {"sdpa_pad": (4, 10), "sdpa_halves": (4, 10), "sdpa_wide": (3, 7), "flex": (3, 7), "triton": (3, 5),
            "triton_split": (3, 7), "sdpa": (4, 10)}  # sdpa: the pad form, where it has no forms

# dense bf16 tensor-core peaks, TFLOP/s, by a substring of the card's name (first match wins)
PEAK_BF16 = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200 NVL", 835.0), ("H200", 989.0),
             ("A100", 312.0))

# forced SDPA backends of the baseline: label -> (SDPBackend member, a substring of the kernels it runs)
SDPA_FORCED = {"cudnn": ("CUDNN_ATTENTION", ("cudnn",)), "flash": ("FLASH_ATTENTION", ("flash",)),
               "efficient": ("EFFICIENT_ATTENTION", ("fmha", "cutlass", "efficient", "mem_eff"))}

# GPU time categories of a training step: (category, substrings of kernel / op names), first match wins
CATEGORIES = (
    ("attention core", ("flash", "fmha", "attention", "attn", "sdpa", "_fwd_kernel", "_bwd_kv_kernel",
                        "_bwd_q_kernel", "_bwd_kernel")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("matrix products", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "triton_tem", "splitk",
                         "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    ("copies", ("memcpy", "memset", "copy", "catarray", "aten::cat", "transpose", "contiguous", "aten::clone")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "softmax", "norm", "triton_poi", "triton_red",
                     "triton_per", "unrolled", "index", "embedding", "cross_entropy", "nll", "aten::")),
)


@dataclass(frozen=True)
class Shape:
    """One attention core shape: ``B`` sequences of ``T`` tokens, ``H`` DIFF heads of two ``d``-wide
    components over ``Hkv`` kv groups (the baseline: ``2H`` heads of width ``d``, ``2Hkv`` kv heads)."""

    name: str
    B: int
    T: int
    H: int
    Hkv: int
    d: int


def attention_shapes(tiny: bool) -> list[Shape]:
    """The timed shapes, most important first: the goal shape, gpu-350m's, GQA, the T sweep."""
    if tiny:
        return [Shape("goal", 1, 40, 2, 2, 16), Shape("d64", 1, 32, 2, 2, 8), Shape("gqa2", 1, 40, 4, 2, 16),
                Shape("gqa4", 1, 40, 4, 1, 16), Shape("sweep-16", 4, 16, 2, 2, 16)]
    shapes = [Shape("goal", 4, 4096, 16, 16, 128), Shape("d64", 4, 2048, 8, 8, 64),
              Shape("gqa2", 4, 4096, 16, 8, 128), Shape("gqa4", 4, 4096, 16, 4, 128)]
    # T sweep at 16k tokens a batch (T 4096 is the goal shape)
    return shapes + [Shape(f"sweep-{T // 1024}k", 16384 // T, T, 16, 16, 128) for T in (1024, 2048, 8192, 16384)]


def correctness_cases(tiny: bool) -> list[Shape]:
    """Core checks: lengths that are no multiple of any tile, GQA with R = 2 and 4, both widths. On a GPU the
    lengths fall in the timed shapes' buckets of the Triton autotuner (powers of two), which then tunes once."""
    if tiny:
        return [Shape("mha-33", 1, 33, 2, 2, 16), Shape("gqa2-17", 2, 17, 4, 2, 16), Shape("gqa4-21", 1, 21, 4, 1, 8)]
    return [Shape("mha-4095", 1, 4095, 4, 4, 128), Shape("gqa2-2047", 1, 2047, 4, 2, 128),
            Shape("gqa4-2047", 1, 2047, 8, 2, 64)]


def layer_cases(tiny: bool) -> list[Shape]:
    """Whole-layer checks (``DiffAttention``, model width ``2 H d``)."""
    if tiny:
        return [Shape("layer-d16", 1, 19, 2, 1, 16)]
    return [Shape("layer-d128-gqa2", 2, 1023, 4, 2, 128), Shape("layer-d64", 1, 2047, 8, 8, 64)]


def select_shapes(shapes: list[Shape], spec: Optional[str]) -> list[Shape]:
    """``--shapes``: names (``goal``, ``d64``, ``gqa2``, ...) or groups (``gqa``, ``sweep``)."""
    if not spec:
        return shapes
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    known = {s.name for s in shapes} | {"gqa", "sweep"}
    bad = [w for w in wanted if w not in known]
    if bad:
        raise ValueError(f"--shapes: unknown shape(s) {bad}; choose from {sorted(known)}")
    return [s for s in shapes if s.name in wanted or s.name.rstrip("0123456789") in wanted
            or s.name.split("-")[0] in wanted]


# -- budget, timing, output ---------------------------------------------------------------------------------------


class Budget:
    """Deadlines: the run's, and each section's share of what is left (:data:`SHARES`)."""

    def __init__(self, total_s: float, sections: list[str]):
        self.end = time.monotonic() + total_s
        self.pending = list(sections)

    def left(self) -> float:
        return self.end - time.monotonic()

    def section(self, name: str) -> float:
        """The deadline of ``name``, which starts now: its share of the time left (minus infinity once the run's time
        is spent, so that every later check sees it passed, however fine the clock)."""
        shares = sum(SHARES[s] for s in self.pending)
        share = SHARES[name] / shares if shares else 1.0
        self.pending.remove(name)
        left = self.left()
        return time.monotonic() + left * share if left > 0 else float("-inf")


def split_deadline(deadline: float, weight: float, weights_left: float) -> float:
    """A part's deadline: its ``weight`` out of ``weights_left`` of the time until ``deadline``."""
    now = time.monotonic()
    if deadline <= now:  # spent: passed for every later check
        return float("-inf")
    return now + (deadline - now) * (weight / weights_left if weights_left else 1.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run: Callable[[], object], device: torch.device) -> Callable[[], float]:
    """Run ``run()`` between two timestamps; the returned function gives its milliseconds (on CUDA
    once the stream has passed the end event, i.e. after a synchronize)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        return lambda: start.elapsed_time(end)
    t0 = time.perf_counter()
    run()
    ms = (time.perf_counter() - t0) * 1e3
    return lambda: ms


@dataclass
class Timing:
    """An arm of :func:`time_arms`: ``prepare()`` (untimed) returns what ``run(state)`` (timed) needs;
    ``cleanup()`` (untimed) runs after it."""

    prepare: Callable[[], object]
    run: Callable[[object], object]
    cleanup: Callable[[], None] = lambda: None


def time_arms(arms: dict[str, Timing], repeats: int, warmup: int, device: torch.device,
              deadline: float) -> tuple[dict[str, list[float]], bool]:
    """Milliseconds of every arm, ``repeats`` rounds after ``warmup`` rounds, all arms in each round, the
    order reversed every round (ABBA); each timed call starts on an idle device. Past ``deadline`` the warm-up
    is cut short and the timing stops after at least one timed round; the flag says whether all ``repeats``
    rounds ran."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    rnd = 0
    while rnd < warmup + repeats:
        if time.monotonic() > deadline:
            if rnd < warmup:
                rnd = warmup  # go straight to one timed round
            elif rnd > warmup:
                break
        pending = []
        for name in order:
            arm = arms[name]
            state = arm.prepare()
            sync(device)  # each arm starts on an idle device: its launch overhead is not hidden behind another's
            pending.append((name, _timed(lambda: arm.run(state), device)))
            arm.cleanup()
        sync(device)
        if rnd >= warmup:
            for name, ms in pending:
                times[name].append(ms())
        order.reverse()
        rnd += 1
    return times, len(next(iter(times.values()), [])) >= repeats


def median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def paired_ratio(arm: list[float], ref: list[float]) -> dict:
    """Round-by-round ratio ``arm / ref`` (same ABBA round): median and distribution-free 95% interval."""
    from difftx.eval.stats import median_interval

    ratios = [a / r for a, r in zip(arm, ref) if r > 0]
    if not ratios:
        return {"median": None, "low": None, "high": None, "rounds": 0}
    med, lo, hi = median_interval(ratios)
    return {"median": med, "low": lo, "high": hi, "rounds": len(ratios)}


def fmt(value, spec: str = ".3f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """A markdown table (``None`` cells as ``-``), flushed at once."""
    lines = [f"\n### {title}", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("-" if c is None else str(c) for c in row) + " |" for row in rows]
    print("\n".join(lines), flush=True)


def short_error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


# -- a process per section ----------------------------------------------------------------------------------------

# errors after which a process's CUDA context is unusable (every later call fails the same way)
CONTEXT_ERRORS = ("illegal memory access", "an illegal instruction", "misaligned address", "launch failure",
                  "device-side assert", "hardware stack error", "illegal address", "launch timed out")
EXIT_CONTEXT_LOST = 3  # a section's process that lost its CUDA context saves and exits with this
MAX_RESTARTS = 4  # a section's process is restarted at most this often, each time without the arm that ended it
GRACE_S = 45.0  # a section's process still running this long past its deadline is killed
CHILD_FLAGS = ("--child", "--deadline")  # the internal flags of a section's process (not the user's command)


class ContextLost(BaseException):
    """A call left the CUDA context unusable. A BaseException, so that the handlers that record a failure and go
    on let it through: the section's process saves and exits, and :func:`run_isolated` restarts the section in a
    fresh one without the arm to blame."""


def context_lost(e: BaseException, device: torch.device) -> bool:
    """Whether ``e`` left ``device``'s context unusable: a CUDA error of :data:`CONTEXT_ERRORS` (also as the
    message of an error raised on CPU, which is how the tests send one), or on CUDA a trivial call failing after
    it."""
    if any(key in str(e).lower() for key in CONTEXT_ERRORS):
        return True
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception:  # noqa: BLE001  (any failure of the probe: the context is gone)
        return True
    return False


# -- profiler -----------------------------------------------------------------------------------------------------


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _trace(fn: Callable[[], None], device: torch.device) -> tuple[list[dict], object]:
    """Chrome-trace events of ``fn()`` under the profiler (CPU, and CUDA on a GPU) and the profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.remove(path)
    return [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))], prof


def kernels_by_label(events: list[dict], labels: list[str], device_type: str) -> dict[str, list[str]]:
    """Names of what ran inside each ``record_function(label)`` range, by total time (descending):
    on CUDA the device events (kernels, copies, sets), found through the correlation id of the launch that
    lies in the range, else by their own time in the range; on CPU the aten ops in the range."""
    ranges = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
              if e.get("cat") == "user_annotation" and e.get("name") in labels}

    def label_at(ts: float) -> Optional[str]:
        for label, (a, b) in ranges.items():
            if a <= ts <= b:
                return label
        return None

    totals: dict[str, dict[str, float]] = {label: {} for label in labels}
    if device_type == "cuda":
        launch = {e["args"]["correlation"]: e["ts"] for e in events
                  if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        for e in events:
            if e.get("cat") not in DEVICE_CATS:
                continue
            ts = launch.get(e.get("args", {}).get("correlation"), e["ts"])
            label = label_at(ts) or label_at(e["ts"])
            if label is not None:
                totals[label][e["name"]] = totals[label].get(e["name"], 0.0) + e.get("dur", 0)
    else:
        for e in events:
            if e.get("cat") == "cpu_op" and e["name"].startswith("aten::"):
                label = label_at(e["ts"])
                if label is not None:
                    totals[label][e["name"]] = totals[label].get(e["name"], 0.0) + e.get("dur", 0)
    return {label: sorted(t, key=t.get, reverse=True) for label, t in totals.items()}


def profile_arms(calls: dict[str, Callable[[], None]], device: torch.device) -> dict[str, list[str]]:
    """One profiled call of each arm (one profiler session, each call in its own ``record_function``
    range, synchronised inside it): the names of the kernels each ran (CPU: its aten ops)."""
    from torch.profiler import record_function

    labels = {name: f"gpu_suite::{name}" for name in calls}

    def run_all():
        for name, call in calls.items():
            with record_function(labels[name]):
                call()
                sync(device)

    events, _ = _trace(run_all, device)
    found = kernels_by_label(events, list(labels.values()), device.type)
    return {name: found[label] for name, label in labels.items()}


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def step_breakdown(events: list[dict], label: str, device_type: str, prof=None) -> dict:
    """Time by :data:`CATEGORIES` inside the ``label`` range, with each category's top names: on CUDA the
    device events' durations, their busy time (union) and the idle fraction ``1 - busy / wall``; on CPU the
    ops' self CPU time (no idle fraction)."""
    rng = next(((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                if e.get("cat") == "user_annotation" and e.get("name") == label), None)
    wall_us = None if rng is None else rng[1] - rng[0]
    by_name: dict[str, float] = {}
    busy = idle = None
    if device_type == "cuda":
        intervals = []
        for e in events:
            if e.get("cat") not in DEVICE_CATS:
                continue
            a, b = e["ts"], e["ts"] + e.get("dur", 0)
            if rng is not None:
                a, b = max(a, rng[0]), min(b, rng[1])
            if b > a:
                by_name[e["name"]] = by_name.get(e["name"], 0.0) + b - a
                intervals.append((a, b))
        if intervals:
            busy = _union_us(intervals)
            idle = None if not wall_us else max(0.0, 1.0 - busy / wall_us)
            source = "device events"
        else:  # the profiler saw no device activity (no CUPTI): nothing to divide
            source = "no device events recorded"
    else:
        for evt in prof.key_averages() if prof is not None else ():
            if evt.key != label and not evt.key.startswith("ProfilerStep"):
                by_name[evt.key] = by_name.get(evt.key, 0.0) + evt.self_cpu_time_total
        source = "cpu ops, self time"
    cats = {c: 0.0 for c, _ in CATEGORIES} | {"other": 0.0}
    top: dict[str, list[str]] = {c: [] for c in cats}
    for name in sorted(by_name, key=by_name.get, reverse=True):
        c = category(name)
        cats[c] += by_name[name]
        if len(top[c]) < 4 and by_name[name] > 0:
            top[c].append(name[:120])
    return {"source": source, "wall_ms": None if wall_us is None else wall_us / 1e3,
            "busy_ms": None if busy is None else busy / 1e3, "idle_fraction": idle,
            "ms_by_category": {c: v / 1e3 for c, v in cats.items()}, "top_by_category": top}


# -- the suite ----------------------------------------------------------------------------------------------------


class Suite:
    """The run's settings, device and results (written to ``out`` by :meth:`save`)."""

    def __init__(self, args, device: torch.device):
        self.args, self.device, self.tiny = args, device, args.tiny
        self.dtype = torch.bfloat16
        self.repeats = args.repeats if args.repeats is not None else (3 if args.tiny else 20)
        self.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
        self.results: dict = {"suite": "benchmarks/gpu_suite.py", "version": 1, "tolerance": TOLERANCE,
                              "sections": {}, "choices": []}

    @property
    def passed(self) -> Optional[dict]:
        """Candidate -> passed every correctness check (None: not checked); None where correctness did not end."""
        corr = self.results.get("correctness") or {}
        if "passed" not in corr:
            return None
        return {n: None if n in corr["not_checked"] else ok for n, ok in corr["passed"].items()}

    def save(self) -> None:
        from pathlib import Path

        from difftx.io import atomic_write, dumps_strict

        text = dumps_strict(self.results, indent=1, default=str)  # a NaN (a kernel's error) is null, with why
        atomic_write(self.args.out, lambda p: Path(p).write_text(text))

    def load(self) -> None:
        """The results so far, from ``out`` (a section's own process starts from what the run measured)."""
        with open(self.args.out) as f:
            self.results = json.load(f)

    def running(self, section: str, arm: Optional[str] = None, **where) -> None:
        """Say in the JSON, saved at once, what runs now: if the process ends here, the run reads it from the
        file, restarts the section without ``arm`` (a baseline or ``diff/NAME``), and names where it ended."""
        self.results["running"] = {"section": section, "arm": arm, **where}
        self.save()

    def crashed(self) -> dict:
        """``{arm: why}``: the arms that ended a section's process or its CUDA context; left out from then on."""
        return self.results.setdefault("crashed", {})

    def check_lost(self, e: BaseException, arm: Optional[str] = None) -> None:
        """Raise :class:`ContextLost` if ``e`` left the CUDA context unusable (every later call would fail): what
        runs (``arm``; None where no single arm is to blame) and the error are saved for the run to read."""
        if context_lost(e, self.device):
            self.results["lost"] = {"arm": arm, "error": short_error(e)}
            self.save()
            raise ContextLost(short_error(e)) from e

    def card(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def source(self) -> str:
        env = self.results.get("env", {})
        return f"gpu_suite {env.get('date', '')[:10]} {env.get('commit') or 'unknown'}".strip()


def diff_candidates(only: Optional[list[str]]) -> list[str]:
    """Every DIFF backend registered now, less the CPU ones, plus ``auto`` (``--candidates`` narrows)."""
    names = [n for n in kernels.BACKENDS if n not in SKIPPED] + ["auto"]
    return [n for n in names if only is None or n in only]


def diff_kernel(name: str) -> Callable:
    """The kernel function of a candidate; ``auto`` resolves per call (its choice may depend on the shape)."""
    if name == "auto":
        return lambda q, k, v, lam, mask, scale: kernels.resolve_backend("auto", q.device, q_len=q.shape[1])(
            q, k, v, lam, mask, scale)
    return kernels.BACKENDS[name]


def backend_name(fn) -> Optional[str]:
    return next((n for n, f in kernels.BACKENDS.items() if f is fn), None)


DISPATCHERS = ("auto", "sdpa")  # backends that hand each call to another (by device, shape, measured table)


def concrete_backend(name: str, inputs: tuple, training: bool, depth: int = 0) -> str:
    """The backend a dispatcher runs for a call on ``inputs`` ``(q, k, v, lam)``: ``auto`` -> what it resolves
    to (on CUDA the measured table's pick, :func:`difftx.attention.kernels.cuda_choice`), ``sdpa`` -> its form
    ``sdpa_<form>``; any other name as it is (also when the dispatcher cannot say)."""
    if name not in DISPATCHERS or depth > 3:
        return name
    q, k, v, lam = inputs if training else (t.detach() for t in inputs)
    try:
        if name == "auto":
            fn = kernels.resolve_backend("auto", q.device, q_len=q.shape[1])
            named = backend_name(fn)
            if named is None:
                named = kernels.cuda_choice(q, k, v, lam, AttentionMask())
        elif hasattr(kernels, "sdpa_form"):
            named = f"sdpa_{kernels.sdpa_form(q, k, v, lam)}"
        else:
            return name
    except Exception:  # noqa: BLE001  (a dispatcher of another version: its name stands)
        return name
    return concrete_backend(named, (q, k, v, lam), training, depth + 1)


def executed_products(name: str) -> Optional[tuple]:
    """``(fwd, bwd)`` executed units of a (concrete) DIFF backend: its kernel's ``products`` attribute, else
    :data:`PRODUCTS`; None when unknown."""
    declared = getattr(kernels.BACKENDS.get(name), "products", None)
    return tuple(declared) if declared else PRODUCTS.get(name)


def unit_flops(s: Shape) -> float:
    """One causal product of the baseline: ``2 B (2H) (T^2/2) d``."""
    return 2.0 * s.B * (2 * s.H) * (s.T * s.T / 2) * s.d


def mode_units(products: Optional[tuple], mode: str) -> Optional[float]:
    if products is None:
        return None
    return {"fwd": products[0], "bwd": products[1], "fwd+bwd": products[0] + products[1]}[mode]


# -- section: env -------------------------------------------------------------------------------------------------


def git_commit() -> Optional[str]:
    """HEAD's commit: from git, else read from ``.git`` (a copy of the tree without git installed), else None."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=root)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        head = open(os.path.join(root, ".git", "HEAD")).read().strip()
        if head.startswith("ref: "):
            return open(os.path.join(root, ".git", head[5:])).read().strip()
        return head or None
    except OSError:
        return None


def section_env(suite: Suite, deadline: float) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": [sys.executable, sys.argv[0], *user_argv(sys.argv[1:])],
           "commit": suite.args.commit or git_commit(),
           "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "device": str(suite.device),
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "backends": list(kernels.BACKENDS), "tiny": suite.tiny, "budget_s": suite.args.budget_s}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if suite.device.type == "cuda":
        p = torch.cuda.get_device_properties(suite.device)
        env.update(card=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2 ** 30, 1),
                   sms=p.multi_processor_count, peak_bf16_tflops=peak_tflops(p.name))
    else:
        env.update(card="cpu", capability=None, memory_gib=None, peak_bf16_tflops=None, threads=torch.get_num_threads())
    suite.results["env"] = env
    print_table("environment", ["what", "value"], [[k, v] for k, v in env.items() if k != "backends"]
                + [["DIFF backends", ", ".join(env["backends"])]])
    return {"status": "done"}


def peak_tflops(card: str) -> Optional[float]:
    return next((v for key, v in PEAK_BF16 if key in card), None)


# -- section: correctness -----------------------------------------------------------------------------------------


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64 (inf when not finite; the absolute error when ``b`` is 0)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return math.inf
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def _draw(shape, g: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal draws rounded to ``dtype``, returned in float32 (both sides of a check see the same values)."""
    return torch.randn(*shape, generator=g).to(dtype).float().to(device)


def upstream_grad(out_ref: torch.Tensor, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """The upstream gradient of a check: the oracle's output scaled to unit RMS plus unit noise, rounded to
    ``dtype``. With noise alone dlambda (a sum over every output element, as is the head norm's weight
    gradient per channel) would be a cancelling sum, whose relative error is ill-conditioned."""
    ref = out_ref.detach().float()
    scaled = ref / ref.pow(2).mean().sqrt().clamp_min(1e-12)
    return (scaled + _draw(ref.shape, g, ref.device, dtype)).to(dtype).float()


def check_core(suite: Suite, s: Shape, names: list[str]) -> list[dict]:
    """Each candidate's output, dq, dk, dv, dlambda against the float32 eager oracle."""
    device, dtype = suite.device, suite.dtype
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k = _draw((s.B, s.T, 2 * s.H, s.d), g, device, dtype), _draw((s.B, s.T, 2 * s.Hkv, s.d), g, device, dtype)
    v, lam = _draw((s.B, s.T, s.Hkv, 2 * s.d), g, device, dtype), torch.tensor(0.4, device=device)
    mask, scale = AttentionMask(), s.d ** -0.5
    go = None

    def run(fn, cast):
        nonlocal go
        leaves = [t.to(cast).requires_grad_() for t in (q, k, v)] + [lam.clone().requires_grad_()]
        out = fn(*leaves, mask, scale)
        go = upstream_grad(out, g, dtype) if go is None else go
        grads = torch.autograd.grad(out, leaves, go.to(out.dtype))
        return dict(zip(("out", "dq", "dk", "dv", "dlambda"), (out, *grads)))

    oracle = run(kernels.eager, torch.float32)
    return [_compare(suite, s, name, lambda name=name: run(diff_kernel(name), dtype), oracle) for name in names]


def check_layer(suite: Suite, s: Shape, names: list[str]) -> list[dict]:
    """The whole ``DiffAttention`` layer (float32 weights, ``dtype`` autocast, as in training) against itself
    in float32 with the eager kernel: output, dx and every parameter's gradient."""
    device, dtype = suite.device, suite.dtype
    torch.manual_seed(0)
    layer = DiffAttention(2 * s.H * s.d, s.H, 3, s.Hkv).to(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = _draw((s.B, s.T, 2 * s.H * s.d), g, device, dtype)
    params = dict(layer.named_parameters())
    go = None

    def run(backend, autocast):
        nonlocal go
        xi = x.clone().requires_grad_()
        ctx = torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext()
        with ctx:
            out = layer(xi, backend=backend)
        go = upstream_grad(out, g, dtype) if go is None else go
        grads = torch.autograd.grad(out, [xi, *params.values()], go.to(out.dtype))
        return dict(zip(["out", "dx", *(f"d{n}" for n in params)], (out, *grads)))

    oracle = run("eager", False)
    return [_compare(suite, s, name, lambda name=name: run(name, True), oracle) for name in names]


def _compare(suite: Suite, s: Shape, name: str, run: Callable[[], dict], oracle: dict) -> dict:
    row = {"candidate": name, "passed": False, "errors": {}, "error": None}
    suite.running("correctness", f"diff/{name}", case=s.name)
    try:
        got = run()
        sync(suite.device)  # a fault of this candidate's kernels surfaces here, not in the next one's
    except Exception as e:  # noqa: BLE001  (a failing candidate is recorded and excluded, the others go on)
        suite.check_lost(e, f"diff/{name}")
        row["error"] = short_error(e)
        row["traceback"] = traceback.format_exc()
        return row
    row["errors"] = {key: rel_l2(got[key], ref) for key, ref in oracle.items()}
    row["passed"] = all(err <= TOLERANCE for err in row["errors"].values())
    return row


def section_correctness(suite: Suite, deadline: float) -> dict:
    names = diff_candidates(suite.args.candidates)
    out = suite.results["correctness"] = {"tolerance": TOLERANCE, "dtype": str(suite.dtype).replace("torch.", ""),
                                          "oracle": "eager, float32", "candidates": names, "cases": []}
    crashed = {n: suite.crashed()[f"diff/{n}"] for n in names if f"diff/{n}" in suite.crashed()}
    if crashed:
        out["crashed"] = crashed  # checked no more: failed
    passed = {n: n not in crashed for n in names}
    checked = {n: n in crashed for n in names}
    cases = [("core", c) for c in correctness_cases(suite.tiny)] + [("layer", c) for c in layer_cases(suite.tiny)]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle in true float32
    try:
        status = _run_cases(suite, cases, names, passed, checked, out, deadline)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out["passed"] = {n: passed[n] and checked[n] for n in names}
    out["failed"] = [n for n in names if not out["passed"][n]]
    out["not_checked"] = [n for n in names if not checked[n]]
    print(f"\ncorrectness: passed {[n for n in names if out['passed'][n]]}, failed {out['failed']}", flush=True)
    return {"status": status}


def _run_cases(suite: Suite, cases: list, names: list[str], passed: dict, checked: dict, out: dict,
               deadline: float) -> str:
    status = "done"
    for kind, case in cases:
        if time.monotonic() > deadline:
            status = "partial: budget"
            out["cases"].append({"case": case.name, "kind": kind, "status": "skipped: budget"})
            continue
        check = check_core if kind == "core" else check_layer
        left = [n for n in names if passed[n]]  # a candidate that failed once is not timed: no more checks
        fresh_graphs()
        suite.running("correctness", case=case.name)
        try:
            rows = check(suite, case, left)
        except Exception as e:  # noqa: BLE001  (the oracle itself failed: nothing to compare with)
            suite.check_lost(e)
            out["cases"].append({"case": case.name, "kind": kind, "status": "error", "error": short_error(e),
                                 "traceback": traceback.format_exc()})
            continue
        out["cases"].append({"case": case.name, "kind": kind, "status": "done", **asdict(case), "rows": rows,
                             "not_run": [n for n in names if n not in left]})
        for r in rows:
            passed[r["candidate"]] &= r["passed"]
            checked[r["candidate"]] = True
        _print_case(kind, case, rows)
        if suite.device.type == "cuda":
            torch.cuda.empty_cache()
        suite.save()
    return status


def _print_case(kind: str, case: Shape, rows: list[dict]) -> None:
    keys = list(next((r["errors"] for r in rows if r["errors"]), {}))
    shown = keys if kind == "core" else [k for k in keys if k in ("out", "dx") or "lambda" in k or "subln" in k
                                         or k.endswith("proj.weight")]
    title = (f"correctness {kind} {case.name}: B {case.B}, T {case.T}, H {case.H}, Hkv {case.Hkv}, d {case.d} "
             f"(relative L2 vs float32 eager, tolerance {TOLERANCE:g})")
    body = [[r["candidate"], "yes" if r["passed"] else "NO"]
            + ([f"{r['errors'][k]:.1e}" for k in shown] if r["errors"] else [r["error"]] + [""] * (len(shown) - 1))
            for r in rows]
    print_table(title, ["candidate", "passed", *shown], body)


# -- section: attention -------------------------------------------------------------------------------------------


@dataclass
class Arm:
    """A timed attention call: ``call(*inputs)`` -> output, backward with ``grad``."""

    name: str
    kind: str  # "baseline" or "diff"
    call: Callable
    inputs: tuple
    grad: torch.Tensor
    expect: tuple = ()  # kernel-name substrings a forced baseline must show


def _sdpa_backend(attr: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, attr, None)


def baseline_arms(s: Shape, device: torch.device, dtype: torch.dtype) -> tuple[list[Arm], dict]:
    """The baseline's call as the model makes it (``kernels.sdpa`` over ``2H`` heads of width ``d``, causal,
    the ``(B, T, heads, d)`` layout transposed), the same with each SDPA backend forced, and ``flash_attn``.
    Returns the arms and ``{name: reason}`` for forced backends this PyTorch lacks."""
    from torch.nn.attention import sdpa_kernel

    mask, scale = AttentionMask(), s.d ** -0.5
    leaf = lambda *shape: torch.randn(*shape, device=device, dtype=dtype).requires_grad_()  # noqa: E731
    inputs = (leaf(s.B, s.T, 2 * s.H, s.d), leaf(s.B, s.T, 2 * s.Hkv, s.d), leaf(s.B, s.T, 2 * s.Hkv, s.d))
    grad = torch.randn(s.B, s.T, 2 * s.H, s.d, device=device, dtype=dtype)

    def model_call(q, k, v):
        return kernels.sdpa(q, k, v, None, mask, scale)

    arms, missing = [Arm("baseline/sdpa", "baseline", model_call, inputs, grad)], {}
    for label, (attr, expect) in SDPA_FORCED.items():
        backend = _sdpa_backend(attr)
        if backend is None:
            missing[f"baseline/{label}"] = f"torch.nn.attention.SDPBackend has no {attr}"
            continue

        def forced(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return model_call(q, k, v)

        arms.append(Arm(f"baseline/{label}", "baseline", forced, inputs, grad, expect))
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        missing["baseline/flash_attn"] = "flash_attn is not importable"
    else:
        arms.append(Arm("baseline/flash_attn", "baseline",
                        lambda q, k, v: flash_attn_func(q, k, v, causal=True, softmax_scale=scale), inputs, grad))
    return arms, missing


def diff_arms(s: Shape, names: list[str], device: torch.device, dtype: torch.dtype) -> list[Arm]:
    mask, scale = AttentionMask(), s.d ** -0.5
    leaf = lambda *shape: torch.randn(*shape, device=device, dtype=dtype).requires_grad_()  # noqa: E731
    inputs = (leaf(s.B, s.T, 2 * s.H, s.d), leaf(s.B, s.T, 2 * s.Hkv, s.d), leaf(s.B, s.T, s.Hkv, 2 * s.d),
              torch.tensor(0.4, device=device, requires_grad=True))
    grad = torch.randn(s.B, s.T, s.H, 2 * s.d, device=device, dtype=dtype)
    return [Arm(f"diff/{n}", "diff", lambda q, k, v, lam, fn=diff_kernel(n): fn(q, k, v, lam, mask, scale), inputs,
                grad) for n in names]


def _clear(arm: Arm) -> None:
    for t in arm.inputs:
        t.grad = None


def _fwd_bwd(arm: Arm) -> None:
    arm.call(*arm.inputs).backward(arm.grad)
    _clear(arm)


def mode_timing(arm: Arm, mode: str) -> Timing:
    if mode == "fwd":
        def run(_):
            with torch.no_grad():
                arm.call(*arm.inputs)
        return Timing(lambda: None, run)
    if mode == "bwd":
        return Timing(lambda: arm.call(*arm.inputs), lambda out: out.backward(arm.grad), lambda: _clear(arm))
    return Timing(lambda: None, lambda _: arm.call(*arm.inputs).backward(arm.grad), lambda: _clear(arm))


def peak_mib(arm: Arm, mode: str, device: torch.device) -> Optional[float]:
    """Peak memory of one call of ``mode`` above what was allocated before it (CUDA only). The untimed part
    (``bwd``'s forward) runs before the measurement: a backward's peak is above the forward's saved tensors."""
    if device.type != "cuda":
        return None
    from difftx.bench import peak_memory_mib

    t = mode_timing(arm, mode)
    prepared = t.prepare()
    try:
        return peak_memory_mib(lambda: t.run(prepared), device)
    finally:
        del prepared
        t.cleanup()


def run_shape(suite: Suite, s: Shape, deadline: float, res: dict) -> dict:
    """One shape: check that each arm runs, profile its kernels, time every mode, build the rows (in ``res``,
    which the results already hold, so that every save has what was measured)."""
    dev, dt = suite.device, suite.dtype
    res.update(status="running", unavailable={}, excluded={}, reference={}, rows=[])  # "done" at the end
    names = diff_candidates(suite.args.candidates)
    crashed = suite.crashed()
    for n in names:
        if f"diff/{n}" in crashed:
            res["excluded"][f"diff/{n}"] = f"ended its process: {crashed[f'diff/{n}']}"
    names = [n for n in names if f"diff/{n}" not in crashed]
    passed = suite.passed
    if passed is not None:
        for n in names:
            if passed.get(n) is not True:
                res["excluded"][f"diff/{n}"] = "failed correctness" if passed.get(n) is False else \
                    "correctness not checked (budget)"
        names = [n for n in names if passed.get(n) is True]
    else:
        res["correctness"] = "not checked"
    torch.manual_seed(0)
    bases, missing = baseline_arms(s, dev, dt)
    res["unavailable"].update(missing)
    for arm in [a for a in bases if a.name in crashed]:
        res["unavailable"][arm.name] = f"ended its process: {crashed[arm.name]}"
    arms = []
    # a first call each, with gradients and without (the forward alone is another compile, autotuner key, graph):
    # compiles and tunes outside the timed rounds, and sorts out what cannot run; each synchronised, so that a
    # fault shows at the arm that made it
    for arm in [a for a in bases if a.name not in crashed] + diff_arms(s, names, dev, dt):
        suite.running("attention", arm.name, shape=s.name)
        try:
            _fwd_bwd(arm)
            mode_timing(arm, "fwd").run(None)
            sync(dev)
            arms.append(arm)
        except Exception as e:  # noqa: BLE001
            suite.check_lost(e, arm.name)
            _clear(arm)
            res["unavailable" if arm.kind == "baseline" else "excluded"][arm.name] = short_error(e)
    suite.running("attention", shape=s.name)
    if not any(a.kind == "baseline" for a in arms):
        res["status"] = "error: no baseline ran"
        return res
    try:
        ran = profile_arms({a.name: (lambda a=a: _fwd_bwd(a)) for a in arms}, dev)
    except Exception as e:  # noqa: BLE001  (a profiler that cannot start leaves the kernels unnamed, not the timings)
        ran = {a.name: [] for a in arms}
        res["profiler_error"] = short_error(e)
    rows = {a.name: {"name": a.name, "kind": a.kind, "kernels": ran[a.name][:12], "modes": {}} for a in arms}
    res["rows"] = list(rows.values())  # filled in place, mode by mode
    for a in arms:
        if a.expect and dev.type == "cuda":  # None: no device events were recorded, so nothing to judge by
            rows[a.name]["fallback_suspected"] = None if not ran[a.name] else \
                not any(x in k.lower() for k in ran[a.name] for x in a.expect)
        if a.kind == "diff" and a.name[5:] in DISPATCHERS:
            rows[a.name]["resolves_to"] = {MODE_OF_CHOICE[m]: concrete_backend(a.name[5:], a.inputs, m != "fwd")
                                           for m in MODE_OF_CHOICE}
    unit = unit_flops(s)
    for i, mode in enumerate(MODES):
        if time.monotonic() > deadline:
            res["status"] = "partial: budget"
            res.setdefault("skipped_modes", []).append(mode)
            continue
        mode_deadline = split_deadline(deadline, MODE_WEIGHTS[mode], sum(MODE_WEIGHTS[m] for m in MODES[i:]))
        times, complete = time_arms({a.name: mode_timing(a, mode) for a in arms}, suite.repeats, suite.warmup, dev,
                                    mode_deadline)
        if not complete:
            res["status"] = "partial: budget"
        ms = {name: median(t) for name, t in times.items()}
        ref = fastest_baseline(rows, ms)
        res["reference"][mode] = ref
        for a in arms:
            products = BASELINE_PRODUCTS if a.kind == "baseline" else \
                executed_products(concrete_backend(a.name[5:], a.inputs, mode != "fwd"))
            useful = BASELINE_PRODUCTS if a.kind == "baseline" else USEFUL_PRODUCTS
            m = ms[a.name]
            exe = mode_units(products, mode)
            rows[a.name]["modes"][mode] = {
                "ms": m, "reps": len(times[a.name]), "ratio": m / ms[ref] if m and ref and ms[ref] else None,
                "paired_ratio": paired_ratio(times[a.name], times[ref])["median"] if ref else None,
                "tflops_executed": exe * unit / (m * 1e9) if exe and m else None,
                "tflops_useful": mode_units(useful, mode) * unit / (m * 1e9) if m else None,
                "peak_mib": peak_mib(a, mode, dev)}
        suite.save()
    if res["status"] == "running":
        res["status"] = "done"
    print_shape(s, res)
    return res


def fastest_baseline(rows: dict, ms: dict) -> Optional[str]:
    """The fastest baseline of a mode, every row that ran included. A forced SDPA backend cannot fall back (torch
    raises "No available kernel"), so ``fallback_suspected`` (its kernels' names lack the expected substring) is
    a note on the names, not a reason to leave the row out: leaving out the fastest baseline would flatter DIFF."""
    bases = [n for n, r in rows.items() if r["kind"] == "baseline" and ms.get(n)]
    return min(bases, key=lambda n: ms[n]) if bases else None


def print_shape(s: Shape, res: dict) -> None:
    title = (f"attention {s.name}: B {s.B}, T {s.T}, H {s.H} (baseline {2 * s.H}), Hkv {s.Hkv}, d {s.d}; "
             f"ratios to the fastest baseline ({', '.join(f'{m}: {r}' for m, r in res['reference'].items())})")
    body = []
    for r in res["rows"]:
        m = r["modes"]
        get = lambda mode, key, spec: fmt(m.get(mode, {}).get(key), spec)  # noqa: E731
        body.append([r["name"] + (" (fallback?)" if r.get("fallback_suspected") else ""),
                     " / ".join(get(md, "ms", ".3f") for md in ("fwd", "bwd", "fwd+bwd")),
                     " / ".join(get(md, "ratio", ".2f") for md in ("fwd", "bwd", "fwd+bwd")),
                     f"{get('fwd+bwd', 'tflops_executed', '.0f')} / {get('fwd+bwd', 'tflops_useful', '.0f')}",
                     get("fwd+bwd", "peak_mib", ".0f"), (r["kernels"] or ["-"])[0][:60]])
    print_table(title, ["candidate", "ms fwd / bwd / fwd+bwd", "x fwd / bwd / fwd+bwd",
                        "TFLOP/s fwd+bwd executed / useful", "peak MiB fwd+bwd", "top kernel"], body)
    for name, why in {**res["unavailable"], **res["excluded"]}.items():
        print(f"  not timed: {name}: {why}", flush=True)


def shape_choices(suite: Suite, res: dict) -> list[dict]:
    """``auto``'s entries for one shape: per mode, the fastest DIFF backend that passed correctness and its
    ratio to the fastest baseline, and every candidate's ratio. Dispatchers are no candidates: ``auto`` never,
    ``sdpa`` not where its forms ``sdpa_*`` were timed themselves."""
    out = []
    for mode, label in MODE_OF_CHOICE.items():
        ratios = {r["name"][5:]: r["modes"][mode]["ratio"] for r in res["rows"]
                  if r["kind"] == "diff" and r["modes"].get(mode, {}).get("ratio")}
        forms = any(n.startswith("sdpa_") for n in ratios)
        ratios = {n: x for n, x in ratios.items() if n != "auto" and not (n == "sdpa" and forms)}
        if not ratios:
            continue
        best = min(ratios, key=ratios.get)
        out.append({"card": suite.card(), "dtype": str(suite.dtype).replace("torch.", ""), "d": res["d"],
                    "T": res["T"], "mode": label, "backend": best, "ratio": ratios[best], "candidates": ratios,
                    "source": suite.source()})
    return out


def shape_weight(s: Shape, ref: Shape) -> float:
    """A shape's share of the section's time: its FLOPs relative to ``ref``'s plus a fixed part (first calls,
    profiling), doubled for the goal shapes (goal, d64), which are timed first."""
    cost = (s.B * s.T * s.T * s.H * s.d) / (ref.B * ref.T * ref.T * ref.H * ref.d) + 0.5
    return cost * (2.0 if s.name in ("goal", "d64") else 1.0)


def section_attention(suite: Suite, deadline: float) -> dict:
    """Every shape in turn. In a section's process that was restarted (:func:`run_isolated`), the shapes its
    earlier processes ended are kept as they are, and the shape it ended in runs again (without the arm to
    blame) or, where no single arm was, stays recorded as an error."""
    shapes = select_shapes(attention_shapes(suite.tiny), suite.args.shapes)
    prior = suite.results.get("attention") or {"shapes": []}
    ended = {e["shape"]: e for e in prior["shapes"] if e.get("status") != "running"}
    out = suite.results["attention"] = {"dtype": str(suite.dtype).replace("torch.", ""),
                                        "repeats": suite.repeats, "warmup": suite.warmup,
                                        "shapes": [e for e in prior["shapes"] if e["shape"] in ended]}
    out["triton_autotune"] = prior.get("triton_autotune")
    todo = [s for s in shapes if s.name not in ended]
    weights = [shape_weight(s, shapes[0]) for s in todo]
    seen = {(c["d"], c["T"]) for c in suite.results["choices"]}
    for i, s in enumerate(todo):
        if time.monotonic() > deadline:
            out["shapes"].append({"shape": s.name, **asdict(s), "status": "skipped: budget"})
            continue
        res = {"shape": s.name, **asdict(s), "status": "running"}
        out["shapes"].append(res)
        fresh_graphs()
        try:
            run_shape(suite, s, split_deadline(deadline, weights[i], sum(weights[i:])), res)
        except Exception as e:  # noqa: BLE001  (one shape failing does not end the section)
            suite.check_lost(e)
            res.update(status="error", error=short_error(e), traceback=traceback.format_exc())
            print(f"shape {s.name} failed: {res['error']}", flush=True)
        if res.get("rows") and s.Hkv == s.H and (s.d, s.T) not in seen:  # one entry per (d, T): MHA shapes
            seen.add((s.d, s.T))
            suite.results["choices"] += shape_choices(suite, res)
        if suite.device.type == "cuda":
            torch.cuda.empty_cache()
        tiles, known = triton_tiles(), out.get("triton_autotune") or []  # a restarted process's after the earlier's
        out["triton_autotune"] = None if tiles is None and not known else \
            known + [t for t in tiles or [] if t not in known]
        suite.save()
    statuses = [str(e["status"]) for e in out["shapes"]]
    status = "done" if all(x.startswith("done") for x in statuses) else \
        "partial: budget" if all(x.startswith(("done", "skipped: budget")) for x in statuses) else "partial"
    return {"status": status}


def fresh_graphs() -> None:
    """Drop Dynamo's compiled graphs before each attention shape and correctness case. The compiled flex attention
    compiles once per shape (and per gradient mode); past Dynamo's recompile limit (8 graphs) it would run its
    unfused form, which builds the whole score matrix (16 GiB a call at T 16k), and that would be timed as flex.
    Each shape compiles anew either way; the Triton kernels' compiles and autotuned tiles are not Dynamo's and
    stay."""
    torch._dynamo.reset()


def triton_tiles() -> Optional[list]:
    """The tiles, warps and stages Triton's autotuner chose so far for the fused kernel, per kernel and key, with
    every candidate's time (:func:`difftx.attention.triton_kernel.autotune_report`); None without Triton."""
    try:
        from difftx.attention import triton_kernel
    except ImportError:
        return None
    return triton_kernel.autotune_report()


# -- section: training --------------------------------------------------------------------------------------------


def training_sizes(tiny: bool) -> list[tuple[str, object, int, int]]:
    """``(name, DIFF config, batch, seq_len)``: gpu-350m (d 64) and the same width with half the heads (d 128)."""
    from difftx import preset

    if tiny:
        return [("test", preset("test"), 2, 16), ("test-d2x", preset("test", n_heads=1), 2, 16)]
    return [("gpu-350m", preset("gpu-350m"), 4, 2048), ("gpu-350m-d128", preset("gpu-350m", n_heads=4), 4, 2048)]


def section_training(suite: Suite, deadline: float) -> dict:
    sizes = training_sizes(suite.tiny)
    out = suite.results["training"] = {
        "flops_model": "PaLM: 6 N + 12 L D T per token (train_throughput.flops_per_token; N without the token "
                       "embedding, attention counted non-causal), the same for both arms",
        "peak_bf16_tflops": peak_tflops(suite.card()), "compile_backend": suite.args.compile_backend, "runs": []}
    state = {"compile_s": 5.0 if suite.tiny else 60.0}  # a guess (one model) until a compile was timed
    status = "done"
    # in order of importance: gpu-350m eager, compiled (the goals), then the d-128 size; each takes what it needs
    # of the section's time, and a compile that would not fit in what is left is skipped
    for name, cfg, batch, seq_len in sizes:
        try:
            train_size(suite, name, cfg, batch, seq_len, deadline, state, out["runs"])
        except Exception as e:  # noqa: BLE001
            suite.check_lost(e)
            running = [r for r in out["runs"] if r["size"] == name and r["status"] == "running"]
            err = {"status": "error", "error": short_error(e), "traceback": traceback.format_exc()}
            if running:
                running[-1].update(err)
            else:
                out["runs"].append({"size": name, **err})
            print(f"training {name} failed: {err['error']}", flush=True)
        if any(not str(r["status"]).startswith("done") for r in out["runs"] if r["size"] == name):
            status = "partial"
        suite.save()
    print_training(out["runs"])
    return {"status": status}


def train_size(suite: Suite, name: str, cfg, batch: int, seq_len: int, deadline: float, state: dict,
               runs: list) -> None:
    """Both arms of one size, eager then compiled (if the compile fits the time left); each run is appended to
    ``runs`` as it starts (status ``running``) and filled in as it is measured."""
    import train_throughput as tt

    from difftx import Transformer, baseline_config
    from difftx.training.config import TrainConfig
    from difftx.training.optim import build_optimizer

    dev = suite.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = cfg.replace(max_seq_len=max(seq_len, cfg.max_seq_len))
    cfgs = {"diff": cfg, "baseline": baseline_config(cfg)}
    models, opts = {}, {}
    tc = TrainConfig(model="test", seq_len=16, warmup_steps=0)
    for arm, c in cfgs.items():
        torch.manual_seed(0)
        models[arm] = Transformer(c).to(dev)
        opts[arm] = build_optimizer(models[arm], tc)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0)).to(dev)
    eager_step_s = None
    for mode in suite.args.train_modes:
        run = {"size": name, "mode": mode, "batch": batch, "seq_len": seq_len, "d": cfg.head_dim,
               "dtype": str(dtype).replace("torch.", ""), "status": "running"}
        runs.append(run)
        suite.running("training", size=name, mode=mode)  # a run killed while compiling says so
        left = deadline - time.monotonic()
        need = 0.0 if mode == "eager" else 2 * state["compile_s"] + 2 * (suite.warmup + suite.args.train_steps) * (
            eager_step_s or 0.0)
        if left <= 0 or need > left:
            run["status"] = f"skipped: budget (needs ~{need:.0f} s, {max(left, 0):.0f} s left)"
            continue
        steppers = {arm: (torch.compile(m, backend=suite.args.compile_backend) if mode == "compiled" else m)
                    for arm, m in models.items()}
        step = {arm: (lambda arm=arm: tt._step(steppers[arm], opts[arm], tokens, dtype, dev)) for arm in models}
        first = {}
        for arm in models:  # the first step compiles
            t0 = time.perf_counter()
            float(step[arm]().detach())
            first[arm] = time.perf_counter() - t0
        if mode == "compiled":
            run["compile_s"] = first
            state["compile_s"] = max(first.values())
        times, complete = time_arms({arm: Timing(lambda: None, lambda _, arm=arm: step[arm]()) for arm in models},
                                    suite.args.train_steps, suite.warmup, dev, deadline)
        tokens_per_step = batch * seq_len
        run["status"] = "done" if complete else "partial: budget"
        run["arms"] = {}
        for arm, m in models.items():
            sec = median(times[arm]) / 1e3
            tps = tokens_per_step / sec
            a = run["arms"][arm] = {"params": m.num_parameters(), "step_ms": sec * 1e3, "tokens_per_s": tps,
                                    "steps": len(times[arm])}
            peak = peak_tflops(suite.card())
            a["mfu"] = tt.flops_per_token(m, seq_len) * tps / (peak * 1e12) if peak and dev.type == "cuda" else None
        eager_step_s = eager_step_s or max(median(t) for t in times.values()) / 1e3
        run["ratio"] = run["arms"]["diff"]["tokens_per_s"] / run["arms"]["baseline"]["tokens_per_s"]
        # tokens/s DIFF / baseline = baseline time / DIFF time, round by round
        run["paired_ratio"] = paired_ratio(times["baseline"], times["diff"])
        run["profile"] = {arm: profile_step(lambda arm=arm: step[arm](), dev) for arm in models}
        run["attention_kernels"] = {arm: p.get("top_by_category", {}).get("attention core", [])
                                    for arm, p in run["profile"].items()}
        suite.save()
    del models, opts
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def profile_step(step: Callable[[], object], device: torch.device) -> dict:
    """GPU time by category of one training step, with the idle fraction (CPU: ops' self time)."""
    from torch.profiler import record_function

    label = "gpu_suite::step"

    def run():
        with record_function(label):
            step()
            sync(device)

    try:
        events, prof = _trace(run, device)
    except Exception as e:  # noqa: BLE001  (no profiler: the timings stand without the breakdown)
        return {"error": short_error(e)}
    return step_breakdown(events, label, device.type, prof)


def print_training(runs: list[dict]) -> None:
    body = []
    for r in runs:
        if "arms" not in r:
            body.append([r["size"], r.get("mode"), r["status"], None, None, None, None, None, None])
            continue
        d, b = r["arms"]["diff"], r["arms"]["baseline"]
        pr = r["paired_ratio"]
        prof = r["profile"]["diff"]
        cats = ", ".join(f"{c} {v:.1f}" for c, v in prof.get("ms_by_category", {}).items() if v) or \
            prof.get("error", "-")
        body.append([r["size"], r["mode"], r["status"], f"{d['tokens_per_s']:,.0f}", f"{b['tokens_per_s']:,.0f}",
                     f"{fmt(pr['median'])} [{fmt(pr['low'])}, {fmt(pr['high'])}]",
                     f"{fmt(d['mfu'], '.1%')} / {fmt(b['mfu'], '.1%')}", fmt(prof.get("idle_fraction"), ".0%"), cats])
    print_table("training steps (DIFF backend: the model's default; paired = DIFF / baseline tokens/s)",
                ["size", "mode", "status", "DIFF tok/s", "baseline tok/s", "paired [95%]", "MFU DIFF / baseline",
                 "DIFF idle", "DIFF ms by category"], body)


# -- section: decode ----------------------------------------------------------------------------------------------

# the model of the static (compiled) decode rows: gpu-350m's width and heads, 4 of its 24 layers, so that each
# model and length compiles in seconds (the ratio is per layer; the ordinary rows time all 24)
DECODE_STATIC_MODEL = dict(dim=1024, n_heads=8, n_layers=4)


def section_decode(suite: Suite, deadline: float) -> dict:
    """One decoding step of a whole model (``difftx.bench.bench_decode``), DIFF vs baseline, batch 1 and 8,
    cache T 1k and 4k (tiny: smaller).

    ``rows``: the ordinary cached step of gpu-350m's shape. ``static_rows``: the static step
    (:class:`difftx.model.StaticKVCache`, backend ``auto``, which is ``eager`` there: one read of K1, K2 and V),
    compiled with CUDA graphs on CUDA (``step: compiled``; ``cudagraph_skips`` counts compiled steps that did not
    become graphs) and run uncompiled on CPU (``step: static``, so the tiny run checks its code without a
    compiler), timed against the same model's ordinary step in one loop (``dynamic_*``: its times and ratio). The
    static rows use :data:`DECODE_STATIC_MODEL` (gpu-350m's width, fewer layers: each model and length is one
    compile), one call per length, after the ordinary rows of their batch; past the deadline rows are skipped."""
    from torch._dynamo.utils import counters

    from difftx.bench import bench_decode

    if suite.tiny:
        model = static_model = dict(dim=64, n_heads=2, n_layers=2)
        batches, lens, dtype = (1, 2), (16, 32), torch.float32
    else:
        model = dict(dim=1024, n_heads=8, n_layers=24)  # gpu-350m's shape (vocabulary 256)
        static_model = DECODE_STATIC_MODEL
        batches, lens, dtype = (1, 8), (1024, 4096), torch.bfloat16
    static_step = "compiled" if suite.device.type == "cuda" else "static"
    out = suite.results["decode"] = {"model": model, "dtype": str(dtype).replace("torch.", ""),
                                     "diff_backend": "auto", "baseline_backend": "auto", "rows": [],
                                     "static_step": static_step, "static_model": static_model, "static_rows": []}
    status = "done"

    def pair_row(rows, batch: int, step: str) -> list[dict]:
        """One row per length: DIFF vs baseline at ``step`` (rows of other steps: ``dynamic_*``)."""
        by_len: dict[int, dict] = {}
        for r in rows:
            kind, rest = r.name.split("/", 1)
            by_len.setdefault(r.seq_len, {})[(kind, rest.split(" ")[1] if " " in rest else "dynamic")] = r
        got = []
        for T, p in by_len.items():
            missing = [f"{kind}/{step}" for kind in ("diff", "baseline") if (kind, step) not in p]
            if missing:  # bench_decode leaves out a DIFF step whose first call failed (it says why on stdout)
                got.append({"batch": batch, "T": T, "step": step, "status": f"error: {', '.join(missing)} did not run"})
                continue
            d, b = p[("diff", step)], p[("baseline", step)]
            row = {"batch": batch, "T": T, "step": step, "status": "done", "diff_ms": d.ms, "baseline_ms": b.ms,
                   "ratio": d.ms / b.ms, "paired_ratio": d.paired, "paired_low": d.paired_low,
                   "paired_high": d.paired_high, "cache_mib": d.mem_mib}
            if step != "dynamic" and ("diff", "dynamic") in p and ("baseline", "dynamic") in p:
                dd, db = p[("diff", "dynamic")], p[("baseline", "dynamic")]
                row.update(dynamic_diff_ms=dd.ms, dynamic_baseline_ms=db.ms, dynamic_ratio=dd.ms / db.ms)
            got.append(row)
        return got

    common = dict(backends=["auto"], baselines=["auto"], device=str(suite.device), dtype=dtype,
                  repeats=max(suite.repeats, 3), warmup=suite.warmup, progress=False)
    for batch in batches:
        if time.monotonic() > deadline:
            out["rows"].append({"batch": batch, "status": "skipped: budget"})
            status = "partial: budget"
        else:
            suite.running("decode", batch=batch, step="dynamic")
            try:
                out["rows"] += pair_row(bench_decode(seq_lens=lens, batch=batch, **common, **model), batch, "dynamic")
            except Exception as e:  # noqa: BLE001  (recorded; the static rows still run)
                suite.check_lost(e)
                out["rows"].append({"batch": batch, "status": "error", "error": f"{type(e).__name__}: {e}"[:500],
                                    "traceback": traceback.format_exc()[-4000:]})
            suite.save()
        for T in sorted(lens, reverse=True):  # the longest first: batch 1's is the decode goal's row
            if time.monotonic() > deadline:
                out["static_rows"].append({"batch": batch, "T": T, "step": static_step, "status": "skipped: budget"})
                status = "partial: budget"
                continue
            skips = counters["inductor"]["cudagraph_skips"]
            suite.running("decode", batch=batch, T=T, step=static_step)
            try:  # the static step first: its baseline is the reference of the paired ratios
                rows = bench_decode(seq_lens=(T,), batch=batch, steps=(static_step, "dynamic"), **common,
                                    **static_model)
            except Exception as e:  # noqa: BLE001  (recorded; the ordinary rows stand)
                suite.check_lost(e)
                out["static_rows"].append({"batch": batch, "T": T, "step": static_step, "status": "error",
                                           "error": f"{type(e).__name__}: {e}"[:500],
                                           "traceback": traceback.format_exc()[-4000:]})
                status = "partial"
                continue
            got = pair_row(rows, batch, static_step)
            for r in got:  # compiled steps that did not become CUDA graphs (inductor says why in its log)
                r["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
            out["static_rows"] += got
            suite.save()
    if any(r["status"].startswith("error") for r in out["rows"] + out["static_rows"]):
        status = "partial"
    print_table("decode step (whole model; ratio = DIFF / baseline time, each step against its own baseline)",
                ["batch", "T", "step", "layers", "DIFF ms", "baseline ms", "ratio", "paired [95%]",
                 "dynamic ratio (same model)"],
                [[r["batch"], r.get("T"), r.get("step", "dynamic") if "diff_ms" in r else r["status"],
                  (static_model if "dynamic_ratio" in r else model)["n_layers"], fmt(r.get("diff_ms")),
                  fmt(r.get("baseline_ms")), fmt(r.get("ratio")),
                  f"{fmt(r.get('paired_ratio'))} [{fmt(r.get('paired_low'))}, {fmt(r.get('paired_high'))}]",
                  fmt(r.get("dynamic_ratio"))]
                 for r in out["rows"] + out["static_rows"]])
    return {"status": status}


# -- section: goals -----------------------------------------------------------------------------------------------


def _verdict(value, goal: float, stretch: Optional[float], lower_is_better: bool) -> str:
    if value is None:
        return "not measured"
    ok = (lambda x: value <= x) if lower_is_better else (lambda x: value >= x)
    if stretch is not None and ok(stretch):
        return "met (stretch too)"
    return "met" if ok(goal) else "not met"


def _core_ratio(results: dict, shape: str) -> tuple[Optional[float], str]:
    """The best fwd+bwd ratio of a DIFF candidate at ``shape``, and which (auto's ratio noted)."""
    res = next((s for s in results.get("attention", {}).get("shapes", []) if s.get("shape") == shape), None)
    if not res or not res.get("rows"):
        return None, ""
    ratios = {r["name"]: r["modes"]["fwd+bwd"]["ratio"] for r in res["rows"]
              if r["kind"] == "diff" and r["modes"].get("fwd+bwd", {}).get("ratio")}
    if not ratios:
        return None, ""
    best = min(ratios, key=ratios.get)
    auto = ratios.get("diff/auto")
    return ratios[best], f"{best} vs {res['reference'].get('fwd+bwd')}" + (f"; auto {auto:.2f}" if auto else "")


def section_goals(suite: Suite, deadline: float) -> dict:
    r = suite.results
    goals = []

    def add(what, value, goal, stretch, lower, note="", spec=".2f"):
        goals.append({"goal": what, "value": value, "target": goal, "stretch": stretch,
                      "verdict": _verdict(value, goal, stretch, lower), "note": note,
                      "shown": fmt(value, spec)})

    v, note = _core_ratio(r, "goal")
    add("attention core fwd+bwd, causal, bf16, T 4096, d 128 (x the fastest baseline)", v, 2.0, 1.6, True, note)
    v, note = _core_ratio(r, "d64")
    add("attention core fwd+bwd, same, d 64", v, 1.5, None, True, note)
    trains = [t for t in r.get("training", {}).get("runs", []) if "arms" in t]
    comp = next((t for t in trains if t["size"] == training_sizes(suite.tiny)[0][0] and t["mode"] == "compiled"), None)
    paired = comp["paired_ratio"]["median"] if comp else None
    add("gpu-350m training step, compiled, DIFF / baseline tokens/s", paired, 0.90, 0.93, False,
        "paired median" if comp else "")
    mfu = comp["arms"]["baseline"]["mfu"] if comp else None
    add("the baseline's MFU, compiled (gpu-350m)", mfu, 0.35, None, False, "PaLM FLOPs" if mfu is not None else "",
        ".1%")
    dec = [x for x in r.get("decode", {}).get("rows", []) if x.get("status") == "done"]
    one = [x for x in dec if x["batch"] == 1]
    row = max(one, key=lambda x: x["T"]) if one else None  # T 4096 on a GPU
    add(f"decode step, batch 1, T {row['T'] if row else 4096} (DIFF / baseline time)",
        (row["paired_ratio"] or row["ratio"]) if row else None, 1.10, None, True, "paired median" if row else "")
    static = [x for x in r.get("decode", {}).get("static_rows", [])
              if x.get("status") == "done" and x.get("batch") == 1 and x.get("step") == "compiled"]
    srow = max(static, key=lambda x: x["T"]) if static else None
    if srow is not None:  # the static step compiled with CUDA graphs: what decoding on a GPU should run
        add(f"decode step, batch 1, T {srow['T']}, static cache compiled (DIFF / baseline time)",
            srow.get("paired_ratio") or srow.get("ratio"), 1.10, None, True,
            "paired median; CUDA graphs, a 4-layer model of gpu-350m's width")
    corr = r.get("correctness")
    if corr and "passed" in corr:
        n, ok = len(corr["passed"]), sum(corr["passed"].values())
        goals.append({"goal": "correctness, every candidate and gradient, bf16 vs float32 oracle", "value": ok / n if n
                      else None, "target": f"within {TOLERANCE:g} relative L2", "stretch": None,
                      "verdict": "met" if n and ok == n else "not met", "shown": f"{ok}/{n} passed",
                      "note": ("failed: " + ", ".join(corr["failed"])) if corr["failed"] else ""})
    else:
        goals.append({"goal": "correctness, every candidate and gradient, bf16 vs float32 oracle", "value": None,
                      "target": f"within {TOLERANCE:g} relative L2", "stretch": None, "verdict": "not measured",
                      "shown": "-", "note": ""})
    r["goals"] = goals
    tiny = "; --tiny: tiny shapes, not the goals' sizes" if suite.tiny else ""
    print_table(f"goals ({suite.card()}{tiny})", ["goal", "measured", "target", "stretch", "verdict", "note"],
                [[g["goal"], g["shown"], g["target"], g["stretch"], g["verdict"], g["note"]] for g in goals])
    return {"status": "done"}


# -- main ---------------------------------------------------------------------------------------------------------


RUNNERS = {"env": section_env, "correctness": section_correctness, "attention": section_attention,
           "training": section_training, "decode": section_decode, "goals": section_goals}


def parse_sections(spec: Optional[str]) -> list[str]:
    if not spec:
        return list(SECTIONS)
    wanted = {w.strip() for w in spec.split(",") if w.strip()}
    bad = sorted(wanted - set(SECTIONS))
    if bad:
        raise ValueError(f"--sections: unknown section(s) {bad}; choose from {list(SECTIONS)}")
    if "attention" in wanted:
        wanted.add("correctness")  # only candidates that passed are timed
    wanted |= {"env", "goals"}
    return [s for s in SECTIONS if s in wanted]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_suite.json", help="the JSON file (rewritten after every section)")
    p.add_argument("--budget-s", type=float, default=None, help="time for the whole run (default 480; --tiny 120)")
    p.add_argument("--sections", help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--shapes", help="attention shapes: goal, d64, gqa2, gqa4, gqa, sweep, sweep-1k, ... (default all)")
    p.add_argument("--candidates", help="comma-separated DIFF backends to check and time (default: all registered "
                                        "but eager and chunked, plus auto)")
    p.add_argument("--register", action="append", default=[], metavar="FILE.py|MODULE",
                   help="import this first (a file or a module; repeatable): the DIFF kernels it registers with "
                        "difftx.attention.kernels.register_backend are candidates like the built-in ones")
    p.add_argument("--repeats", type=int, help="timed rounds per attention mode (default 20; --tiny 3)")
    p.add_argument("--warmup", type=int, help="untimed rounds first (default 5; --tiny 1)")
    p.add_argument("--train-steps", type=int, default=None, help="timed training steps per arm (default 20; --tiny 3)")
    p.add_argument("--train-modes", default="eager,compiled", help="training modes: eager, compiled or both")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; --tiny eager)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--isolate", default="auto", choices=["auto", "yes", "no"],
                   help="each section in a process of its own, restarted without an arm that ended it "
                        "(default auto: yes on CUDA, no on CPU)")
    p.add_argument("--commit", help="the commit to record where the tree is a copy without git (default: HEAD)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and few repeats (runs on CPU; the tests' form)")
    p.add_argument("--child", choices=SECTIONS, help=argparse.SUPPRESS)  # a section's process (run_isolated)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # its deadline, on the machine's monotonic clock
    return p


def register(specs: list[str]) -> None:
    """Import each ``--register`` file or module (its import registers its kernels)."""
    import importlib
    import importlib.util

    for spec in specs:
        if spec.endswith(".py"):
            if not os.path.isfile(spec):
                raise ValueError(f"--register: no such file: {spec}")
            name = "gpu_suite_registered_" + os.path.basename(spec)[:-3]
            loader = importlib.util.spec_from_file_location(name, spec)
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module
            try:
                loader.loader.exec_module(module)
            except Exception as e:  # noqa: BLE001  (any error of the user's file: one line, not a traceback)
                raise ValueError(f"--register: {spec} failed to import: {short_error(e)}") from e
        else:
            try:
                importlib.import_module(spec)
            except ImportError as e:
                raise ValueError(f"--register: cannot import {spec}: {e}") from e


def user_argv(argv: list[str]) -> list[str]:
    """``argv`` without the internal flags of a section's process."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in CHILD_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in CHILD_FLAGS)):
            out.append(a)
    return out


def run_section(suite: Suite, name: str, deadline: float) -> dict:
    """One section in this process: its runner's summary, or the error that ended it (the run goes on).
    :class:`ContextLost` passes through."""
    try:
        return RUNNERS[name](suite, deadline)
    except Exception as e:  # noqa: BLE001  (recorded; the next section still runs)
        info = {"status": "error", "error": short_error(e), "traceback": traceback.format_exc()}
        print(f"section {name} failed: {info['error']}", flush=True)
        return info


def _end_running(obj, why: str) -> None:
    """Every entry of a section's results still ``running`` when its process ended: an error, and why."""
    if isinstance(obj, dict):
        if obj.get("status") == "running":
            obj.update(status="error", error=why)
        for v in obj.values():
            _end_running(v, why)
    elif isinstance(obj, list):
        for v in obj:
            _end_running(v, why)


def _where(running: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in running.items() if v is not None) or "before it said"


def run_child(cmd: list[str], env: dict, timeout: float) -> Optional[int]:
    """Run a section's process in a session of its own; its exit code, or None when it was still running after
    ``timeout`` seconds and was killed with everything it started (compile workers included). Interrupted
    (Ctrl-C), it is killed the same way before the interruption goes on."""
    import signal

    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill()
        return None
    except BaseException:
        kill()
        raise


def run_isolated(suite: Suite, name: str, deadline: float, argv: list[str]) -> dict:
    """Section ``name`` in a process of its own (this script with ``--child``), which reads the results so far
    from ``--out`` and writes its own there. A process that ends otherwise than normally (a signal, an exit, its
    CUDA context lost, killed :data:`GRACE_S` past its deadline) is read from the file: the arm it was running
    (``running``) is left out of every later call, and the section restarts in a fresh process, at most
    :data:`MAX_RESTARTS` times, while its time lasts and not after a kill; where no single arm is to blame,
    attention goes on from its next shape and other sections end there. Each end is recorded in ``crashes``."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
    cmd = [sys.executable, os.path.abspath(__file__), *user_argv(argv), "--child", name, f"--deadline={deadline!r}"]
    restarts = 0
    while True:
        suite.results.pop("running", None)
        suite.results.pop("lost", None)
        suite.save()
        rc = run_child(cmd, env, max(0.0, deadline - time.monotonic()) + GRACE_S)
        killed = rc is None
        try:
            suite.load()
        except (OSError, ValueError) as e:  # what it wrote is lost; what the run had stands
            print(f"{name}: its results could not be read back ({short_error(e)})", flush=True)
        running = suite.results.pop("running", None) or {"section": name}
        lost = suite.results.pop("lost", None)
        if rc == 0:
            return suite.results["sections"].get(name, {"status": "done"})
        why = (f"its CUDA context was lost ({lost['error']})" if lost else
               f"it was still running {GRACE_S:.0f} s past its deadline and was killed" if killed else
               f"its process ended with exit code {rc}" + (f" (signal {-rc})" if rc < 0 else ""))
        arm = running.get("arm")
        crash = {"section": name, "exit": rc, "running": running, "why": why}
        suite.results.setdefault("crashes", []).append(crash)
        blamed = bool(arm) and arm not in suite.crashed()
        if blamed:  # left out of every later call, restarted or not
            suite.crashed()[arm] = why
            crash["left_out"] = arm
        again = restarts < MAX_RESTARTS and time.monotonic() < deadline and not killed
        if blamed and again:
            print(f"\n{name}: {why} in {_where(running)}; restarting the section without {arm}", flush=True)
        else:
            _end_running(suite.results.get(name), why)
            if not (again and name == "attention" and running.get("shape")):
                suite.save()
                print(f"\n{name}: {why} in {_where(running)}", flush=True)
                return {"status": "error", "error": f"{why} in {_where(running)}"}
            print(f"\n{name}: {why} in {_where(running)}; going on from the next shape", flush=True)
        restarts += 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    try:
        register(args.register)
        sections = parse_sections(args.sections)
        select_shapes(attention_shapes(args.tiny), args.shapes)
        args.candidates = None if not args.candidates else [c.strip() for c in args.candidates.split(",") if c.strip()]
        args.train_modes = [m.strip() for m in args.train_modes.split(",") if m.strip()]
        if not args.train_modes or not set(args.train_modes) <= {"eager", "compiled"}:
            raise ValueError(f"--train-modes: choose eager, compiled or both, got {args.train_modes}")
        known = set(kernels.BACKENDS) | {"auto"}
        if args.candidates and not set(args.candidates) <= known:
            raise ValueError(f"--candidates: unknown backend(s) {sorted(set(args.candidates) - known)}; "
                             f"registered: {sorted(known)}")
        for name in ("repeats", "warmup", "train_steps"):
            value = getattr(args, name)
            if value is not None and value < (0 if name == "warmup" else 1):
                raise ValueError(f"--{name.replace('_', '-')}: must be at least {0 if name == 'warmup' else 1}, "
                                 f"got {value}")
        if args.budget_s is not None and not args.budget_s > 0:
            raise ValueError(f"--budget-s: must be positive, got {args.budget_s}")
    except ValueError as e:
        p.error(str(e))
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if not cuda and not args.tiny:
        p.error("no CUDA device: the full suite needs a GPU; run --tiny on CPU")
    args.budget_s = args.budget_s or (120.0 if args.tiny else 480.0)
    args.train_steps = args.train_steps or (3 if args.tiny else 20)
    args.compile_backend = args.compile_backend or ("eager" if args.tiny else "inductor")
    suite = Suite(args, torch.device("cuda" if cuda else "cpu"))
    if args.child:  # a section's process: its part of the results, in the run's file
        if args.deadline is None:
            p.error("--child: internal, given with --deadline by the run itself")
        suite.load()
        try:
            info = run_section(suite, args.child, args.deadline)
        except ContextLost as e:  # saved; end at once: exit handlers that touch the lost context could hang
            print(f"section {args.child}: the CUDA context was lost ({e}); this process ends", flush=True)
            sys.stderr.flush()
            os._exit(EXIT_CONTEXT_LOST)
        suite.results.pop("running", None)
        suite.results["sections"][args.child] = info
        suite.save()
        return 0
    isolate = args.isolate == "yes" or (args.isolate == "auto" and cuda)
    budget = Budget(args.budget_s, sections)
    print(f"# gpu_suite: sections {', '.join(sections)}; budget {args.budget_s:.0f} s; JSON {args.out}"
          + ("; a process per section" if isolate else ""), flush=True)
    for name in sections:
        deadline = budget.section(name)
        t0 = time.monotonic()
        print(f"\n## {name} ({max(0.0, deadline - t0):.0f} s)", flush=True)
        if isolate and name != "goals":  # goals only reads the results
            info = run_isolated(suite, name, deadline, argv)
        else:
            try:
                info = run_section(suite, name, deadline)
            except ContextLost as e:  # in one process every later call would fail too: the sections still say so
                info = {"status": "error", "error": f"the CUDA context was lost: {e}"}
            suite.results.pop("running", None)
            suite.results.pop("lost", None)
        info.update(elapsed_s=round(time.monotonic() - t0, 2), budget_s=round(max(0.0, deadline - t0), 2))
        suite.results["sections"][name] = info
        suite.save()
    for c in suite.results.get("crashes", []):
        print(f"# {c['section']}: {c['why']} in {_where(c['running'])}"
              + (f"; {c['left_out']} left out from then on" if c.get("left_out") else ""), flush=True)
    print(f"\n# gpu_suite: done; JSON {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
