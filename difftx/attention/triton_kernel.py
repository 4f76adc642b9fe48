"""Fused differential attention (V1) in Triton: both maps in one pass, forward and backward.

The kernel implements the ``triton`` backend with the signature of
:mod:`difftx.attention.kernels`::

    triton_attention(q, k, v, lam, mask, scale, return_maps=False)  # -> (B, T, H, 2d)

Legend: ``B`` batch, ``T`` queries (= keys ``S`` under a causal mask), ``H`` differential heads,
``Hkv`` kv groups, ``R = H // Hkv``, ``d`` component width. Inputs keep the project layout:
``q (B, T, 2H, d)`` (sub-heads ``2h``, ``2h+1`` are the components of head ``h``),
``k (B, S, 2Hkv, d)``, ``v (B, S, Hkv, 2d)``; head ``h`` reads keys ``2g``, ``2g+1`` and value
``g`` of group ``g = h // R`` by index arithmetic, so nothing is repeated or copied.

Design (SPEC sections 1 and 6):

- **Forward.** One program owns a block of query rows of one head (and, with
  ``BlockConfig.fwd_split = 2``, one ``d``-wide half of the ``2d``-wide value). It walks the key
  tiles once; each K tile pair and V tile is loaded once and used for both maps. Each map keeps
  its own online softmax (running max ``m_c``, running sum ``l_c``) and its own float32
  accumulator, because the two maps rescale independently. At the end
  ``O = acc1 / l1 - lam * acc2 / l2``; the per-row log-sum-exp of both maps is stored for the
  backward pass, and so is the second map's normalised output ``O2`` (it gives the backward
  pass both ``O1 = O + lam * O2`` and ``dlam = -sum(dO * O2)``).
- **Causal block skipping.** Key tiles wholly after the query block are never visited. With
  ``BlockConfig.one_loop`` (the default on GPUs) the others run in one loop that masks every
  tile; without it, tiles wholly before the block run without any mask in a first loop and only
  the diagonal tiles build a mask (two loops hold more registers: see :func:`block_config`).
- **Backward** (recomputing the maps from the stored log-sum-exp): with ``P_c`` the two maps,
  ``dP = dO V^T`` is shared by both maps, ``dS1 = P1 * (dP - delta1)``,
  ``dS2 = -lam * P2 * (dP - delta2)`` with ``delta_c = rowsum(dO * O_c)``,
  ``dV = (P1 - lam * P2)^T dO``, ``dK_c = scale * dS_c^T Q_c``, ``dQ_c = scale * dS_c K_c``.
  Three forms, chosen by ``bwd`` (backends ``triton``, ``triton_atomic_dv``, ``triton_split``):

  - ``"atomic"`` (default, 5 products): one kernel owns a key tile of one kv group, loops over
    the group's ``R`` heads and the query tiles, keeps dK1, dK2, dV in registers and adds each
    query tile's dQ1, dQ2 into a float32 buffer with ``tl.atomic_add`` (cast at the end).
  - ``"atomic_dv"`` (6 products): the same kernel without dV (fewer registers), then a dV kernel
    over the same key tiles that recomputes both maps.
  - ``"split"`` (7 products): the dK/dV kernel above without dQ, then a dQ kernel that owns a
    query tile and recomputes the scores and ``dP`` over the key tiles (no atomics).

  ``dlam`` is a reduction done in PyTorch.
- Softmax statistics, accumulators and ``lam`` are float32 whatever the input dtype
  (float16 / bfloat16 on GPU; float32 for testing, with exact "ieee" dot products).
- **Tiles** come from :func:`block_config` (fixed, vetted offline for sm_90) or, on a real GPU
  when no config is passed, from ``triton.autotune`` over a few vetted configs, cached per
  (d, bucket of T, dtype, causal); see :data:`AUTOTUNE`.
- **torch.compile**: the kernels are called through two custom ops (``difftx::triton_diff_fwd``,
  ``difftx::triton_diff_bwd``) with fake implementations and a registered autograd formula, so a
  model on this backend traces without graph breaks.

Cost (units of one causal ``T x T x d`` product per head pair, docs/kernels.md): the baseline
(FlashAttention-2 over ``2H`` heads of width ``d``) does 2 forward + 5 backward = 7; this kernel
does 3 forward (one ``QK^T`` for both maps, two ``2d``-wide ``PV``) + 5 backward (atomic form)
= 8, a floor of 8/7 = 1.14x (forward alone 1.5x). The ``atomic_dv`` backward does 6 (9, 1.29x),
the split backward 7 (10, 1.43x); ``fwd_split = 2`` recomputes ``QK^T`` per value half (4 forward
units).

Anything the kernel does not cover is delegated to :func:`kernels.sdpa`, so the backend is
always safe to select: standard attention (``lam is None``), masks other than plain causal
self-attention or no mask at all (padding, packed documents, a KV-cache offset), CPU tensors
(unless Triton's interpreter is on), other dtypes and component widths over 256.
``return_maps=True`` raises, as for the other fast backends (use ``backend="eager"``).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same kernels run on
CPU tensors through Triton's interpreter, with small blocks; that is how the tests check them.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from difftx.attention import kernels
from difftx.attention.masks import AttentionMask

# Read once, when the kernels below are decorated: Triton chooses compiled or interpreted
# functions at decoration time, so this module follows the environment it was imported in.
INTERPRET: bool = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else (
    os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))

_LOG2E = 1.4426950408889634
_MAX_D = 256  # widest component the kernels accept (q, k, v tiles of two maps stay in registers)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BWD_MODES = ("atomic", "atomic_dv", "split")
BWD: str = "atomic"
"""The backward form used when a call does not name one: ``"atomic"`` (5 products in one kernel,
dQ by atomic adds), ``"atomic_dv"`` (6: the same without dV, whose registers it saves, then a dV
kernel that recomputes the maps) or ``"split"`` (7: dK/dV, then a dQ kernel). The ``triton_split``
and ``triton_atomic_dv`` backends always use theirs."""

AUTOTUNE: bool = not INTERPRET and os.environ.get("DIFFTX_TRITON_AUTOTUNE", "1").lower() not in ("0", "false", "off")
"""Autotune the forward and the atomic backward over :func:`autotune_configs` on a real GPU when a
call passes no ``config`` (the first call of each (d, T bucket, dtype, causal) key times every
candidate; later calls reuse the winner). Off under the interpreter, or with
``DIFFTX_TRITON_AUTOTUNE=0``; then :func:`block_config` gives fixed tiles."""


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch settings of the kernels.

    Each kernel's program *owns* ``*_own`` rows and steps through the other side ``*_step`` at
    a time: the forward kernel owns query rows and steps through keys; the atomic backward
    (``bwd_*``; in the ``atomic_dv`` form its dK/dQ kernel, with ``dv_*`` for its dV kernel) and
    the split backward's dK/dV kernel (``kv_*``) own keys and step through queries; the split
    backward's dQ kernel (``q_*``) owns query rows and steps through keys.
    ``*_own`` must be a multiple of ``*_step`` (the causal split into unmasked and diagonal
    tiles relies on it); all tile sizes are powers of two. ``fwd_split`` (1 or 2): the forward
    computes the ``2d``-wide output in that many column blocks, one program each (halves the
    accumulators' registers, recomputes ``QK^T`` per block). ``one_loop``: the forward and the
    kernels that own keys walk the other side in one loop that masks every tile, instead of
    unmasked tiles and then the diagonal ones (two software-pipelined loops hold more registers).
    """

    fwd_own: int
    fwd_step: int
    kv_own: int
    kv_step: int
    q_own: int
    q_step: int
    fwd_warps: int = 4
    kv_warps: int = 4
    q_warps: int = 4
    num_stages: int = 2
    bwd_own: int = 32
    bwd_step: int = 16
    bwd_warps: int = 4
    fwd_split: int = 1
    dv_own: int = 32
    dv_step: int = 16
    dv_warps: int = 4
    one_loop: bool = False

    def __post_init__(self) -> None:
        for kind in ("fwd", "kv", "q", "bwd", "dv"):
            own, step = getattr(self, f"{kind}_own"), getattr(self, f"{kind}_step")
            for name, value in ((f"{kind}_own", own), (f"{kind}_step", step)):
                if value < 1 or value & (value - 1):
                    raise ValueError(f"{name}: must be a power of two, got {value}")
            if own % step:
                raise ValueError(f"{kind}_own: {own} must be a multiple of {kind}_step={step}")
        for name in ("fwd_warps", "kv_warps", "q_warps", "bwd_warps", "dv_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}: must be a power of two, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: must be at least 1, got {self.num_stages}")
        if not isinstance(self.one_loop, bool):
            object.__setattr__(self, "one_loop", bool(self.one_loop))  # from_list gives 0 / 1
        if self.fwd_split not in (1, 2):
            raise ValueError(f"fwd_split: must be 1 or 2, got {self.fwd_split}")

    def to_list(self) -> list[int]:
        """The fields as integers in declaration order (how the custom op carries a config)."""
        return [int(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> "BlockConfig":
        return cls(*values)


# Interpreter blocks are tiny so that short test sequences still span several tiles.
INTERPRET_CONFIG = BlockConfig(fwd_own=16, fwd_step=8, kv_own=16, kv_step=8, q_own=16, q_step=8,
                               fwd_warps=1, kv_warps=1, q_warps=1, num_stages=1,
                               bwd_own=16, bwd_step=8, bwd_warps=1, dv_own=16, dv_step=8, dv_warps=1)


def block_config(d: int, interpret: bool = INTERPRET, arch: int = 90) -> BlockConfig:
    """Fixed tile sizes for component width ``d`` on compute capability ``arch`` (90 = H100/H200,
    80 = A100), for bfloat16 / float16; used wherever autotuning is off.

    Not timed: no GPU was available when they were chosen. ``benchmarks/triton_offline.py``
    compiles each kernel offline for sm_90 over a grid of tile shapes, warps and stages, and reads
    registers and spilled bytes (``cuobjdump --dump-resource-usage``), shared memory, and whether
    the PTX uses Hopper's ``wgmma`` (64 rows a warpgroup, so tiles of at least 64 rows; smaller
    tiles fall back to ``mma.sync``). The rule, for the forward and the atomic backward: among
    configs that use ``wgmma`` and fit shared memory, no value split, then the least spilled bytes
    per owned row (a thread's spilled bytes x threads / rows the program owns), then the larger
    tile, then fewer warps and stages. The split backward keeps its earlier tiles (it is the
    reference). All configs walk the other side in one masked loop (``one_loop``): the two loops
    of before (unmasked tiles, then the diagonal) spill more, e.g. 1,952 against 1,352 bytes for
    the d=128 atomic backward at (64, 16). Triton 3.9, bf16, causal, sm_90 (docs/kernels.md has
    the table):

    - d <= 64: forward (64, 64), 8 warps, no spills; atomic backward (64, 16), 8 warps: 264
      spilled bytes a thread, 1,056 a key row (every 64-key backward tile spills; (32, 16)
      without wgmma spills none).
    - d <= 128: forward (64, 32), 8 warps, 128 spilled bytes (a d=128 differential head holds two
      ``2d``-wide float32 accumulators a row, the state of a d=256 standard head); atomic backward
      (64, 16), 4 warps, 2,272 bytes a thread = 4,544 a key row (8 warps: 5,408; (128, 16), 8
      warps: 5,120; (64, 32), 8 warps: 6,592; (32, 16) without wgmma: 3,648). The ``atomic_dv``
      form's kernels spill 984 (dK/dQ) and 40 (dV, (64, 32), 8 warps) bytes a thread.
    - d <= 256: small tiles without ``wgmma`` (every 64-row config spills heavily).
    - Before sm_90 (no ``wgmma``), the atomic backward's kernels take (32, 16) tiles: at (64, 32), two loops,
      ptxas spills 824 bytes on sm_80 at d = 64 and, at d = 128, falls back to 32 registers
      with 4,840 spilled bytes; (32, 16) spills 80 and 408.

    Spilling is a proxy: the autotuner (:data:`AUTOTUNE`) times the wgmma choice against the
    smaller mma.sync tiles on the GPU (:func:`autotune_configs`).
    """
    if interpret:
        return INTERPRET_CONFIG
    bwd = dict(bwd_own=64, bwd_step=16, bwd_warps=8 if d <= 64 else 4, dv_own=64, dv_step=32, dv_warps=8) \
        if arch >= 90 else dict(bwd_own=32, bwd_step=16, bwd_warps=8, dv_own=32, dv_step=16, dv_warps=8)
    bwd["one_loop"] = True
    if d <= 64:
        return BlockConfig(fwd_own=64, fwd_step=64, kv_own=32, kv_step=16, q_own=64, q_step=32,
                           fwd_warps=8, kv_warps=8, q_warps=8, num_stages=2, **bwd)
    if d <= 128:
        return BlockConfig(fwd_own=64, fwd_step=32, kv_own=32, kv_step=16, q_own=32, q_step=32,
                           fwd_warps=8, kv_warps=8, q_warps=4, num_stages=2, **bwd)
    return BlockConfig(fwd_own=32, fwd_step=16, kv_own=16, kv_step=16, q_own=32, q_step=16,
                       fwd_warps=8, kv_warps=8, q_warps=8, bwd_own=16, bwd_step=16, bwd_warps=8,
                       dv_own=16, dv_step=16, dv_warps=8)


def autotune_configs(d: int, arch: int = 90) -> tuple[list[BlockConfig], list[BlockConfig]]:
    """Candidate configs ``(forward, atomic backward)`` that :data:`AUTOTUNE` times on the GPU
    for width ``d``: :func:`block_config`'s choice first, then other configs with little spilling
    in ``benchmarks/triton_offline.py``'s sm_90 report (wgmma ones, the two-loop form of the
    default, and the (32, 16) tile with ``mma.sync``, which spills least). Only the forward fields (``fwd_*``,
    ``fwd_split``) of the first list and the ``bwd_*`` fields of the second matter."""
    base = block_config(d, interpret=False, arch=arch)
    # (own, step, warps, value split, one loop); no value split (it would change the executed products
    # the backends declare)
    if d <= 64:
        fwd = [(64, 64, 8, 1, True), (64, 64, 8, 1, False), (64, 32, 8, 1, True), (128, 64, 8, 1, True)]
        bwd = [(64, 16, 8, True), (64, 16, 8, False), (64, 32, 8, True), (32, 16, 8, True)]
    elif d <= 128:
        fwd = [(64, 32, 8, 1, True), (64, 32, 8, 1, False), (64, 64, 8, 1, True), (32, 16, 8, 1, True)]
        bwd = [(64, 16, 4, True), (64, 16, 8, True), (128, 16, 8, True), (32, 16, 8, True)]
    else:
        return [base], [base]
    if arch < 90:  # the fixed choice first
        bwd = [(32, 16, 8, True)] + [c for c in bwd if c != (32, 16, 8, True)]
    fwds = [dataclasses.replace(base, fwd_own=m, fwd_step=n, fwd_warps=w, fwd_split=sp, one_loop=one)
            for m, n, w, sp, one in fwd]
    bwds = [dataclasses.replace(base, bwd_own=m, bwd_step=n, bwd_warps=w, one_loop=one) for m, n, w, one in bwd]
    return fwds, bwds


# ----------------------------------------------------------------------------------------------
# tile loads and stores


@triton.jit
def _load_tile(ptrs, rows, n_rows, cols, N_COLS: tl.constexpr, PADDED: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a ``(rows, cols)`` tile; rows past ``n_rows`` (checked only if ``CHECK_ROWS``) and
    (if ``PADDED``) columns past ``N_COLS`` read 0. Masks are built only where they can be needed."""
    if CHECK_ROWS:
        if PADDED:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if PADDED:
            tile = tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _store_tile(ptrs, value, rows, n_rows, cols, N_COLS: tl.constexpr, PADDED: tl.constexpr):
    """Store a ``(rows, cols)`` tile, skipping rows past ``n_rows`` and (if ``PADDED``) columns
    past ``N_COLS``."""
    if PADDED:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS))
    else:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=rows[:, None] < n_rows)


# ----------------------------------------------------------------------------------------------
# forward


@triton.jit
def _fwd_tiles(acc1, acc2, l1, l2, m1, m2, q1, q2, k_ptr, v_ptr, sks, skh, svs,
               offs_m, offs_n, offs_d, offs_dv, S, qk_scale, lo, hi,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """Key tiles ``lo..hi`` (step ``BLOCK_N``) for one query block, both maps.

    Scores live in the log2 domain (``qk_scale`` = scale * log2 e) so ``exp2`` does the work.
    ``MASKED`` tiles may hold keys past ``S`` or (``CAUSAL``) after a query; others hold none.
    ``offs_dv`` are this program's value columns (all ``2d``, or one half).
    """
    for n0 in range(lo, hi, BLOCK_N):
        offs_k = n0 + offs_n
        k_tile = k_ptr + offs_k[:, None] * sks + offs_d[None, :]
        # (BLOCK_N, BLOCK_D) keys of map 1 and of map 2 (the next sub-head); unmasked tiles are in range
        k1 = _load_tile(k_tile, offs_k, S, offs_d, D, BLOCK_D != D, MASKED)
        k2 = _load_tile(k_tile + skh, offs_k, S, offs_d, D, BLOCK_D != D, MASKED)
        v = _load_tile(v_ptr + offs_k[:, None] * svs + offs_dv[None, :], offs_k, S, offs_dv,
                       2 * D, BLOCK_D != D, MASKED)  # (BLOCK_N, columns)
        s1 = tl.dot(q1, tl.trans(k1), input_precision=PREC) * qk_scale  # (BLOCK_M, BLOCK_N)
        s2 = tl.dot(q2, tl.trans(k2), input_precision=PREC) * qk_scale
        if MASKED:
            allowed = offs_k[None, :] < S
            if CAUSAL:
                allowed = allowed & (offs_k[None, :] <= offs_m[:, None])
            s1 = tl.where(allowed, s1, float("-inf"))
            s2 = tl.where(allowed, s2, float("-inf"))
        # map 1: new running max, rescale what was accumulated, add this tile
        m1_new = tl.maximum(m1, tl.max(s1, 1))
        p1 = tl.math.exp2(s1 - m1_new[:, None])
        alpha1 = tl.math.exp2(m1 - m1_new)
        l1 = l1 * alpha1 + tl.sum(p1, 1)
        acc1 = acc1 * alpha1[:, None] + tl.dot(p1.to(v.dtype), v, input_precision=PREC)
        m1 = m1_new
        # map 2: the same with its own statistics, sharing the K/V tiles loaded above
        m2_new = tl.maximum(m2, tl.max(s2, 1))
        p2 = tl.math.exp2(s2 - m2_new[:, None])
        alpha2 = tl.math.exp2(m2 - m2_new)
        l2 = l2 * alpha2 + tl.sum(p2, 1)
        acc2 = acc2 * alpha2[:, None] + tl.dot(p2.to(v.dtype), v, input_precision=PREC)
        m2 = m2_new
    return acc1, acc2, l1, l2, m1, m2


@triton.jit
def _fwd_kernel(Q, K, V, LAM, O, O2, LSE,
                sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sob, sot, soh,
                T, S, H, R, qk_scale, T_BUCKET,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                STORE_AUX: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr, ONE_LOOP: tl.constexpr = False):
    """Grid ``(cdiv(T, BLOCK_M), B * H, SPLIT)``: one block of query rows of one head, value
    columns ``[c * BLOCK_DV / SPLIT, (c + 1) * BLOCK_DV / SPLIT)`` of column block ``c``.
    ``ONE_LOOP``: one loop that masks every key tile, instead of unmasked tiles then the masked
    ones (fewer registers: two pipelined loops hold more live state). ``T_BUCKET`` is unused: it
    is the autotuner's key for the length."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    col = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    g = h // R
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if SPLIT == 1:
        offs_dv = tl.arange(0, BLOCK_DV)
    else:
        offs_dv = col * (BLOCK_DV // SPLIT) + tl.arange(0, BLOCK_DV // SPLIT)

    q_tile = Q + b * sqb + (2 * h) * sqh + offs_m[:, None] * sqt + offs_d[None, :]
    q1 = _load_tile(q_tile, offs_m, T, offs_d, D, BLOCK_D != D, True)  # (BLOCK_M, BLOCK_D) component 1
    q2 = _load_tile(q_tile + sqh, offs_m, T, offs_d, D, BLOCK_D != D, True)  # component 2
    k_ptr = K + b * skb + (2 * g) * skh
    v_ptr = V + b * svb + g * svh

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DV // SPLIT], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_DV // SPLIT], tl.float32)

    if CAUSAL:  # T == S: keys before the block are all visible, the diagonal is masked
        full_end = m0
        end = tl.minimum(m0 + BLOCK_M, S)
    else:
        full_end = (S // BLOCK_N) * BLOCK_N
        end = S
    if ONE_LOOP:
        full_end = 0
    else:
        acc1, acc2, l1, l2, m1, m2 = _fwd_tiles(acc1, acc2, l1, l2, m1, m2, q1, q2, k_ptr, v_ptr, sks, skh, svs,
                                                offs_m, offs_n, offs_d, offs_dv, S, qk_scale, 0, full_end,
                                                D, BLOCK_D, BLOCK_N, False, CAUSAL, PREC)
    acc1, acc2, l1, l2, m1, m2 = _fwd_tiles(acc1, acc2, l1, l2, m1, m2, q1, q2, k_ptr, v_ptr, sks, skh, svs,
                                            offs_m, offs_n, offs_d, offs_dv, S, qk_scale, full_end, end,
                                            D, BLOCK_D, BLOCK_N, True, CAUSAL, PREC)

    lam = tl.load(LAM)
    o2 = acc2 / l2[:, None]
    o = acc1 / l1[:, None] - lam * o2  # (BLOCK_M, columns)
    rows = offs_m < T
    o_off = b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :]
    _store_tile(O + o_off, o, offs_m, T, offs_dv, 2 * D, BLOCK_D != D)
    if STORE_AUX:
        _store_tile(O2 + o_off, o2, offs_m, T, offs_dv, 2 * D, BLOCK_D != D)
        if SPLIT == 1 or col == 0:
            lse_ptr = LSE + (b * H + h) * 2 * T + offs_m  # LSE (B, H, 2, T), log2 units
            tl.store(lse_ptr, m1 + tl.math.log2(l1), mask=rows)
            tl.store(lse_ptr + T, m2 + tl.math.log2(l2), mask=rows)


# ----------------------------------------------------------------------------------------------
# backward: dK, dV (and, in the atomic form, dQ)


@triton.jit
def _bwd_kv_tiles(dk1, dk2, dv, k1, k2, v, q_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, sqt, sqh, sdot,
                  offs_k, offs_d, offs_dv, T, lam, sm_scale, qk_scale, lo, hi,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                  DQ_ATOMIC: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr):
    """Query tiles ``lo..hi`` against one key tile, in transposed form ``(BLOCK_N, BLOCK_M)``.

    Query rows past ``T`` read a log-sum-exp of +inf, so their probabilities are exactly 0.
    ``MASKED`` tiles cross the causal diagonal. ``DV``: accumulate dV; ``DK``: form dP and dS and
    accumulate dK1, dK2; with ``DQ_ATOMIC`` (needs ``DK``) each query tile's
    ``dQ_c = scale * dS_c K_c`` is also added into the float32 buffer at ``dq_ptr`` (strides of Q).
    """
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows = offs_m < T
        q_tile = q_ptr + offs_m[:, None] * sqt + offs_d[None, :]
        q1 = _load_tile(q_tile, offs_m, T, offs_d, D, BLOCK_D != D, True)  # (BLOCK_M, BLOCK_D)
        q2 = _load_tile(q_tile + sqh, offs_m, T, offs_d, D, BLOCK_D != D, True)
        do = _load_tile(do_ptr + offs_m[:, None] * sdot + offs_dv[None, :], offs_m, T, offs_dv,
                        2 * D, BLOCK_D != D, True)  # (BLOCK_M, BLOCK_DV)
        lse1 = tl.load(lse_ptr + offs_m, mask=rows, other=float("inf"))
        lse2 = tl.load(lse_ptr + T + offs_m, mask=rows, other=float("inf"))
        p1 = tl.math.exp2(tl.dot(k1, tl.trans(q1), input_precision=PREC) * qk_scale - lse1[None, :])  # (BN, BM)
        p2 = tl.math.exp2(tl.dot(k2, tl.trans(q2), input_precision=PREC) * qk_scale - lse2[None, :])
        if MASKED:
            allowed = offs_m[None, :] >= offs_k[:, None]
            p1 = tl.where(allowed, p1, 0.0)
            p2 = tl.where(allowed, p2, 0.0)
        if DV:
            dv += tl.dot((p1 - lam * p2).to(do.dtype), do, input_precision=PREC)  # (BN, BLOCK_DV)
        if DK:
            delta1 = tl.load(delta_ptr + offs_m, mask=rows, other=0.0)
            delta2 = tl.load(delta_ptr + T + offs_m, mask=rows, other=0.0)
            dp = tl.dot(v, tl.trans(do), input_precision=PREC)  # (BN, BM) = (dO V^T)^T, shared by both maps
            ds1 = (p1 * (dp - delta1[None, :])).to(q1.dtype)
            ds2 = (-lam * p2 * (dp - delta2[None, :])).to(q2.dtype)
            dk1 += tl.dot(ds1, q1, input_precision=PREC)
            dk2 += tl.dot(ds2, q2, input_precision=PREC)
            if DQ_ATOMIC:
                dq_tile = dq_ptr + offs_m[:, None] * sqt + offs_d[None, :]
                if BLOCK_D != D:
                    dq_mask = rows[:, None] & (offs_d[None, :] < D)
                else:
                    dq_mask = rows[:, None]
                dq1 = tl.dot(tl.trans(ds1), k1, input_precision=PREC) * sm_scale  # (BM, BLOCK_D)
                tl.atomic_add(dq_tile, dq1, mask=dq_mask, sem="relaxed")
                dq2 = tl.dot(tl.trans(ds2), k2, input_precision=PREC) * sm_scale
                tl.atomic_add(dq_tile + sqh, dq2, mask=dq_mask, sem="relaxed")
    return dk1, dk2, dv


@triton.jit
def _bwd_kv_kernel(Q, K, V, DO, LAM, LSE, DELTA, DK_, DV_, DQ,
                   sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sdob, sdot, sdoh,
                   T, S, H, R, sm_scale, qk_scale, T_BUCKET,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   DQ_ATOMIC: tl.constexpr, PREC: tl.constexpr, DK: tl.constexpr = True, DV: tl.constexpr = True,
                   ONE_LOOP: tl.constexpr = False):
    """Grid ``(cdiv(S, BLOCK_N), B * Hkv)``: one key tile of one group, summed over its R heads.
    Computes dK (if ``DK``) and dV (if ``DV``); with ``DQ_ATOMIC`` it also adds dQ into the float32
    buffer ``DQ`` (laid out like Q); otherwise ``DQ`` is not touched. ``ONE_LOOP`` (causal): one
    loop that masks every query tile instead of the diagonal tiles then the unmasked ones.
    ``T_BUCKET`` is unused: it is the autotuner's key for the length."""
    pid_n = tl.program_id(0)
    bg = tl.program_id(1)
    Hkv = H // R
    b = (bg // Hkv).to(tl.int64)
    g = (bg % Hkv).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_k = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k_off = b * skb + (2 * g) * skh + offs_k[:, None] * sks + offs_d[None, :]
    k1 = _load_tile(K + k_off, offs_k, S, offs_d, D, BLOCK_D != D, True)  # (BLOCK_N, BLOCK_D)
    k2 = _load_tile(K + k_off + skh, offs_k, S, offs_d, D, BLOCK_D != D, True)
    v_off = b * svb + g * svh + offs_k[:, None] * svs + offs_dv[None, :]
    v = _load_tile(V + v_off, offs_k, S, offs_dv, 2 * D, BLOCK_D != D, True)  # (BLOCK_N, BLOCK_DV); unused without DK
    lam = tl.load(LAM)

    dk1 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for r in range(0, R):
        h = g * R + r
        q_ptr = Q + b * sqb + (2 * h) * sqh
        dq_ptr = DQ + b * sqb + (2 * h) * sqh
        do_ptr = DO + b * sdob + h * sdoh
        lse_ptr = LSE + (b * H + h) * 2 * T
        delta_ptr = DELTA + (b * H + h) * 2 * T
        if CAUSAL and ONE_LOOP:  # queries before n0 see none of these keys
            dk1, dk2, dv = _bwd_kv_tiles(dk1, dk2, dv, k1, k2, v, q_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr,
                                         sqt, sqh, sdot, offs_k, offs_d, offs_dv, T, lam, sm_scale, qk_scale,
                                         n0, T, D, BLOCK_D, BLOCK_M, True, DQ_ATOMIC, DK, DV, PREC)
        elif CAUSAL:  # queries before n0 see none of these keys; from n0 + BLOCK_N on they see all
            diag_end = tl.minimum(n0 + BLOCK_N, T)
            dk1, dk2, dv = _bwd_kv_tiles(dk1, dk2, dv, k1, k2, v, q_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr,
                                         sqt, sqh, sdot, offs_k, offs_d, offs_dv, T, lam, sm_scale, qk_scale,
                                         n0, diag_end, D, BLOCK_D, BLOCK_M, True, DQ_ATOMIC, DK, DV, PREC)
            dk1, dk2, dv = _bwd_kv_tiles(dk1, dk2, dv, k1, k2, v, q_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr,
                                         sqt, sqh, sdot, offs_k, offs_d, offs_dv, T, lam, sm_scale, qk_scale,
                                         diag_end, T, D, BLOCK_D, BLOCK_M, False, DQ_ATOMIC, DK, DV, PREC)
        else:  # keys past S read 0 and have no probability mass: they add nothing to dQ
            dk1, dk2, dv = _bwd_kv_tiles(dk1, dk2, dv, k1, k2, v, q_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr,
                                         sqt, sqh, sdot, offs_k, offs_d, offs_dv, T, lam, sm_scale, qk_scale,
                                         0, T, D, BLOCK_D, BLOCK_M, False, DQ_ATOMIC, DK, DV, PREC)
    # dK and dV share q/k strides with K and V: the caller allocates them like K and V
    if DK:
        _store_tile(DK_ + k_off, dk1 * sm_scale, offs_k, S, offs_d, D, BLOCK_D != D)
        _store_tile(DK_ + k_off + skh, dk2 * sm_scale, offs_k, S, offs_d, D, BLOCK_D != D)
    if DV:
        _store_tile(DV_ + v_off, dv, offs_k, S, offs_dv, 2 * D, BLOCK_D != D)


# ----------------------------------------------------------------------------------------------
# backward, split form: dQ


@triton.jit
def _bwd_q_tiles(dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, k_ptr, v_ptr, sks, skh, svs,
                 offs_m, offs_d, offs_dv, S, lam, qk_scale, lo, hi,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """Key tiles ``lo..hi`` for one query tile."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_k = n0 + tl.arange(0, BLOCK_N)
        k_tile = k_ptr + offs_k[:, None] * sks + offs_d[None, :]
        k1 = _load_tile(k_tile, offs_k, S, offs_d, D, BLOCK_D != D, MASKED)  # (BLOCK_N, BLOCK_D)
        k2 = _load_tile(k_tile + skh, offs_k, S, offs_d, D, BLOCK_D != D, MASKED)
        v = _load_tile(v_ptr + offs_k[:, None] * svs + offs_dv[None, :], offs_k, S, offs_dv,
                       2 * D, BLOCK_D != D, MASKED)  # (BLOCK_N, BLOCK_DV)
        p1 = tl.math.exp2(tl.dot(q1, tl.trans(k1), input_precision=PREC) * qk_scale - lse1[:, None])  # (BM, BN)
        p2 = tl.math.exp2(tl.dot(q2, tl.trans(k2), input_precision=PREC) * qk_scale - lse2[:, None])
        if MASKED:
            allowed = offs_k[None, :] < S
            if CAUSAL:
                allowed = allowed & (offs_k[None, :] <= offs_m[:, None])
            p1 = tl.where(allowed, p1, 0.0)
            p2 = tl.where(allowed, p2, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)  # (BM, BN) = dO V^T
        ds1 = p1 * (dp - delta1[:, None])
        ds2 = -lam * p2 * (dp - delta2[:, None])
        dq1 += tl.dot(ds1.to(k1.dtype), k1, input_precision=PREC)
        dq2 += tl.dot(ds2.to(k2.dtype), k2, input_precision=PREC)
    return dq1, dq2


@triton.jit
def _bwd_q_kernel(Q, K, V, DO, LAM, LSE, DELTA, DQ,
                  sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sdob, sdot, sdoh,
                  T, S, H, R, sm_scale, qk_scale,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    """Grid ``(cdiv(T, BLOCK_M), B * H)``: dQ of one query tile of one head (both components)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    g = h // R
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m < T

    q_off = b * sqb + (2 * h) * sqh + offs_m[:, None] * sqt + offs_d[None, :]
    q1 = _load_tile(Q + q_off, offs_m, T, offs_d, D, BLOCK_D != D, True)  # (BLOCK_M, BLOCK_D)
    q2 = _load_tile(Q + q_off + sqh, offs_m, T, offs_d, D, BLOCK_D != D, True)
    do = _load_tile(DO + b * sdob + h * sdoh + offs_m[:, None] * sdot + offs_dv[None, :], offs_m, T, offs_dv,
                    2 * D, BLOCK_D != D, True)  # (BLOCK_M, BLOCK_DV)
    stat = (b * H + h) * 2 * T + offs_m
    lse1 = tl.load(LSE + stat, mask=rows, other=float("inf"))
    lse2 = tl.load(LSE + stat + T, mask=rows, other=float("inf"))
    delta1 = tl.load(DELTA + stat, mask=rows, other=0.0)
    delta2 = tl.load(DELTA + stat + T, mask=rows, other=0.0)
    lam = tl.load(LAM)
    k_ptr = K + b * skb + (2 * g) * skh
    v_ptr = V + b * svb + g * svh

    dq1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        full_end = m0
        end = tl.minimum(m0 + BLOCK_M, S)
    else:
        full_end = (S // BLOCK_N) * BLOCK_N
        end = S
    dq1, dq2 = _bwd_q_tiles(dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, k_ptr, v_ptr, sks, skh, svs,
                            offs_m, offs_d, offs_dv, S, lam, qk_scale, 0, full_end, D, BLOCK_D, BLOCK_N, False, CAUSAL,
                            PREC)
    dq1, dq2 = _bwd_q_tiles(dq1, dq2, q1, q2, do, lse1, lse2, delta1, delta2, k_ptr, v_ptr, sks, skh, svs,
                            offs_m, offs_d, offs_dv, S, lam, qk_scale, full_end, end, D, BLOCK_D, BLOCK_N, True, CAUSAL,
                            PREC)
    # dQ is allocated like Q, so it shares Q's strides
    _store_tile(DQ + q_off, dq1 * sm_scale, offs_m, T, offs_d, D, BLOCK_D != D)
    _store_tile(DQ + q_off + sqh, dq2 * sm_scale, offs_m, T, offs_d, D, BLOCK_D != D)


# ----------------------------------------------------------------------------------------------
# host side: launches, autotuning


def _widths(d: int) -> tuple[int, int]:
    """Padded tile widths for ``d`` and ``2d`` (powers of two, at least 16 for tensor cores)."""
    block_d = max(16, triton.next_power_of_2(d))
    return block_d, 2 * block_d


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs are for testing: exact products rather than TF32
    return "ieee" if dtype == torch.float32 else "tf32"


def _length_bucket(n: int) -> int:
    """The autotuner's key for a length: the next power of two (so 4095 and 4096 share a config)."""
    return triton.next_power_of_2(max(n, 1))


def _width_class(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else _MAX_D


_TUNERS: dict = {}
"""Autotuners by ``(kind, width class)``, built on first use (``kind`` "fwd" or "bwd")."""


def make_autotuner(kind: str, configs: Sequence[BlockConfig], do_bench: Optional[Callable] = None):
    """A ``triton.autotune`` wrapper of the forward (``kind="fwd"``, the ``fwd_*`` fields of each
    config) or of the atomic backward (``kind="bwd"``, the ``bwd_*`` fields), keyed on
    ``(D, T_BUCKET, CAUSAL)`` and the tensors' dtypes. The backward's float32 ``DQ`` buffer is reset
    to zero before every timed trial and before the winner's run (``reset_to_zero``): the kernel
    accumulates into it with atomic adds. ``do_bench`` replaces Triton's timer (tests use it under
    the interpreter)."""
    if kind == "fwd":
        tconfigs = [triton.Config(dict(BLOCK_M=c.fwd_own, BLOCK_N=c.fwd_step, SPLIT=c.fwd_split, ONE_LOOP=c.one_loop),
                                  num_warps=c.fwd_warps, num_stages=c.num_stages) for c in configs]
        return triton.autotune(configs=tconfigs, key=["D", "T_BUCKET", "CAUSAL", "STORE_AUX"],
                               do_bench=do_bench)(_fwd_kernel)
    if kind == "bwd":
        tconfigs = [triton.Config(dict(BLOCK_N=c.bwd_own, BLOCK_M=c.bwd_step, ONE_LOOP=c.one_loop),
                                  num_warps=c.bwd_warps, num_stages=c.num_stages) for c in configs]
        return triton.autotune(configs=tconfigs, key=["D", "T_BUCKET", "CAUSAL"], reset_to_zero=["DQ"],
                               do_bench=do_bench)(_bwd_kv_kernel)
    raise ValueError(f"kind: expected 'fwd' or 'bwd', got {kind!r}")


def _arch(device: torch.device) -> int:
    """Compute capability of ``device`` as an integer (90 for a non-CUDA device: the interpreter)."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _tuner(kind: str, d: int, device: torch.device):
    """The autotuner for ``kind`` at width ``d`` on ``device``, or None when :data:`AUTOTUNE` is off."""
    if not AUTOTUNE:
        return None
    arch = _arch(device)
    key = (kind, _width_class(d)) if arch >= 90 else (kind, _width_class(d), arch)
    if key not in _TUNERS:
        fwd, bwd = autotune_configs(d, arch)
        _TUNERS[key] = make_autotuner(kind, fwd if kind == "fwd" else bwd)
    return _TUNERS[key]


def autotune_report() -> list[dict]:
    """What the autotuner chose so far in this process, one entry per kernel and key:
    ``{"kernel", "key", "config", "timings_ms"}`` (``config``: the tile sizes, warps and stages that
    won; ``timings_ms``: every candidate's median time of the last tuning run of that kernel, where
    Triton kept it). For the GPU suite's record of which tiles its ``triton`` rows ran."""
    out = []
    for (kind, *_), tuner in sorted(_TUNERS.items(), key=lambda kv: str(kv[0])):
        timings = getattr(tuner, "configs_timings", None) or {}
        for key, config in tuner.cache.items():
            out.append({"kernel": kind, "key": [str(k) for k in key],
                        "config": dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages),
                        "timings_ms": {str(c): (t[0] if isinstance(t, (list, tuple)) else t)
                                       for c, t in timings.items()}})
    return out


def _diff_forward(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, scale: float, causal: bool, store_aux: bool,
                  config: Optional[BlockConfig]):
    """``O`` and, if ``store_aux``, ``O2`` and the log-sum-exps ``(B, H, 2, T)`` (else empty)."""
    B, T, H2, d = q.shape
    S = k.shape[1]
    H, Hkv = H2 // 2, v.shape[2]
    o = torch.empty(B, T, H, 2 * d, device=q.device, dtype=q.dtype)  # (B, T, H, 2d)
    o2 = torch.empty_like(o) if store_aux else o.new_empty(0)
    lse = torch.empty(B, H, 2, T, device=q.device, dtype=torch.float32) if store_aux else \
        torch.empty(0, device=q.device, dtype=torch.float32)
    block_d, block_dv = _widths(d)
    args = (q, k, v, lam, o, o2 if store_aux else o, lse if store_aux else o,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            T, S, H, H // Hkv, scale * _LOG2E, _length_bucket(max(T, S)))
    consts = dict(D=d, BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=causal, STORE_AUX=store_aux,
                  PREC=_precision(q.dtype))
    tuner = _tuner("fwd", d, q.device) if config is None else None
    if tuner is not None:
        tuner[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H, meta["SPLIT"])](*args, **consts)
    else:
        config = config or block_config(d, arch=_arch(q.device))
        _fwd_kernel[(triton.cdiv(T, config.fwd_own), B * H, config.fwd_split)](
            *args, **consts, BLOCK_M=config.fwd_own, BLOCK_N=config.fwd_step, SPLIT=config.fwd_split,
            ONE_LOOP=config.one_loop, num_warps=config.fwd_warps, num_stages=config.num_stages)
    return o, o2, lse


def _diff_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, o: Tensor, o2: Tensor, lse: Tensor,
                   scale: float, causal: bool, config: Optional[BlockConfig], bwd: str):
    """``dq, dk, dv, dlam``; ``q``, ``k``, ``v`` contiguous (the gradients share their strides)."""
    B, T, H2, d = q.shape
    S = k.shape[1]
    H, Hkv = H2 // 2, v.shape[2]
    do = do if do.stride(-1) == 1 else do.contiguous()
    # delta_c = rowsum(dO * O_c) with O1 = O + lam * O2; dlam = -sum(dO * O2)
    dof, o2f = do.float(), o2.float()
    delta2 = (dof * o2f).sum(-1)  # (B, T, H)
    delta1 = (dof * (o.float() + lam * o2f)).sum(-1)
    delta = torch.stack([delta1, delta2], dim=1).permute(0, 3, 1, 2).contiguous()  # (B, H, 2, T)
    dlam = -delta2.sum()

    dk, dv = torch.empty_like(k), torch.empty_like(v)  # contiguous, like k, v
    block_d, block_dv = _widths(d)
    common = dict(D=d, BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=causal, PREC=_precision(q.dtype))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    sizes = (T, S, H, H // Hkv, scale, scale * _LOG2E)
    if bwd in ("atomic", "atomic_dv"):
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # strides of q (both contiguous)
        args = (q, k, v, do, lam, lse, delta, dk, dv, dq_acc, *strides, *sizes, _length_bucket(max(T, S)))
        separate_dv = bwd == "atomic_dv"
        tuner = _tuner("bwd", d, q.device) if config is None and not separate_dv else None
        if tuner is not None:
            tuner[lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hkv)](*args, DQ_ATOMIC=True, **common)
        else:
            config = config or block_config(d, arch=_arch(q.device))
            _bwd_kv_kernel[(triton.cdiv(S, config.bwd_own), B * Hkv)](
                *args, BLOCK_M=config.bwd_step, BLOCK_N=config.bwd_own, DQ_ATOMIC=True, DV=not separate_dv,
                ONE_LOOP=config.one_loop, num_warps=config.bwd_warps, num_stages=config.num_stages, **common)
            if separate_dv:
                _bwd_kv_kernel[(triton.cdiv(S, config.dv_own), B * Hkv)](
                    *args, BLOCK_M=config.dv_step, BLOCK_N=config.dv_own, DQ_ATOMIC=False, DK=False,
                    ONE_LOOP=config.one_loop, num_warps=config.dv_warps, num_stages=config.num_stages, **common)
        dq = dq_acc if q.dtype == torch.float32 else dq_acc.to(q.dtype)
        return dq, dk, dv, dlam
    config = config or block_config(d, arch=_arch(q.device))
    dq = torch.empty_like(q)
    _bwd_kv_kernel[(triton.cdiv(S, config.kv_own), B * Hkv)](
        q, k, v, do, lam, lse, delta, dk, dv, dq, *strides, *sizes, _length_bucket(max(T, S)),
        BLOCK_M=config.kv_step, BLOCK_N=config.kv_own, DQ_ATOMIC=False, ONE_LOOP=config.one_loop,
        num_warps=config.kv_warps, num_stages=config.num_stages, **common)
    _bwd_q_kernel[(triton.cdiv(T, config.q_own), B * H)](
        q, k, v, do, lam, lse, delta, dq, *strides, *sizes,
        BLOCK_M=config.q_own, BLOCK_N=config.q_step, num_warps=config.q_warps, num_stages=config.num_stages,
        **common)
    return dq, dk, dv, dlam


# ----------------------------------------------------------------------------------------------
# custom ops (torch.compile traces the backend without graph breaks)


@torch.library.custom_op("difftx::triton_diff_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, scale: float, causal: bool, store_aux: bool,
            config: list[int], bwd: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(O, O2, LSE)`` of the fused forward; ``O2`` and ``LSE`` are empty unless ``store_aux``.
    ``config`` is :meth:`BlockConfig.to_list` or empty (default tiles or autotuning); ``bwd`` is
    carried for the backward."""
    return _diff_forward(q, k, v, lam, scale, causal, store_aux, BlockConfig.from_list(config) if config else None)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, lam, scale, causal, store_aux, config, bwd):
    B, T, H2, d = q.shape
    o = q.new_empty(B, T, H2 // 2, 2 * d)
    if store_aux:
        return o, torch.empty_like(o), q.new_empty(B, H2 // 2, 2, T, dtype=torch.float32)
    return o, q.new_empty(0), q.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("difftx::triton_diff_bwd", mutates_args=())
def _bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lam: Tensor, o: Tensor, o2: Tensor, lse: Tensor,
            scale: float, causal: bool, config: list[int], bwd: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dlam)`` of the fused backward (``bwd`` "atomic" or "split")."""
    return _diff_backward(do, q, k, v, lam, o, o2, lse, scale, causal,
                          BlockConfig.from_list(config) if config else None, bwd)


@_bwd_op.register_fake
def _bwd_fake(do, q, k, v, lam, o, o2, lse, scale, causal, config, bwd):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), lam.new_empty(())


def _setup_context(ctx, inputs, output):
    q, k, v, lam, scale, causal, store_aux, config, bwd = inputs
    o, o2, lse = output
    if store_aux:
        ctx.save_for_backward(q, k, v, lam, o, o2, lse)
    ctx.mark_non_differentiable(o2, lse)
    ctx.scale, ctx.causal, ctx.config, ctx.bwd = scale, causal, config, bwd


def _backward(ctx, do, _do2, _dlse):
    q, k, v, lam, o, o2, lse = ctx.saved_tensors
    dq, dk, dv, dlam = _bwd_op(do, q, k, v, lam, o, o2, lse, ctx.scale, ctx.causal, ctx.config, ctx.bwd)
    return dq, dk, dv, dlam, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# the backend


def unsupported_reason(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], mask: AttentionMask) -> Optional[str]:
    """Why the fused kernel cannot take this call (then it goes to ``kernels.sdpa``), or ``None``."""
    if lam is None:
        return "standard attention (lam is None)"
    if lam.numel() != 1:
        return f"lam must be a scalar, got shape {tuple(lam.shape)}"
    if v.shape[-1] != 2 * q.shape[-1]:
        return f"value width {v.shape[-1]} is not 2d = {2 * q.shape[-1]} (the fused kernel takes DIFF's values)"
    if not (q.is_cuda or INTERPRET):
        return f"tensors on {q.device.type} (the kernel needs CUDA, or TRITON_INTERPRET=1)"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        return f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype} (want one of float16, bfloat16, float32)"
    T, S, d = q.shape[1], k.shape[1], q.shape[-1]
    if d > _MAX_D:
        return f"component width d={d} is over {_MAX_D}"
    if not (mask.is_plain_causal(T, S) or mask.is_unmasked()):
        return "mask other than plain causal self-attention or none (padding, documents, cache offset)"
    if T == 0 or S == 0 or q.shape[0] == 0:
        return "empty input"
    return None


def triton_attention(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], mask: AttentionMask, scale: float,
                     return_maps: bool = False, config: Optional[BlockConfig] = None,
                     bwd: Optional[str] = None) -> Tensor:
    """The ``triton`` backend: fused differential attention, or ``kernels.sdpa`` where unsupported.

    ``q (B, T, 2H, d)``, ``k (B, S, 2Hkv, d)``, ``v (B, S, Hkv, 2d)``, ``lam`` a float32 scalar
    tensor (its gradient is computed). Returns ``(A1 - lam * A2) V`` as ``(B, T, H, 2d)`` in the
    dtype of ``q``. ``config`` fixes the tiles (default: autotuned on a GPU where :data:`AUTOTUNE`
    is on, else :func:`block_config`); ``bwd`` the backward form (default :data:`BWD`).
    """
    if return_maps:
        raise ValueError("the 'triton' backend does not return attention maps; use backend='eager'")
    bwd = BWD if bwd is None else bwd
    if bwd not in BWD_MODES:
        raise ValueError(f"bwd: expected one of {BWD_MODES}, got {bwd!r}")
    if unsupported_reason(q, k, v, lam, mask) is not None:
        return kernels.sdpa(q, k, v, lam, mask, scale)
    B, T, H2, d = q.shape
    if k.shape != (B, k.shape[1], k.shape[2], d) or v.shape != (B, k.shape[1], k.shape[2] // 2, 2 * d):
        raise ValueError(f"triton backend: expected k (B, S, 2Hkv, d) and v (B, S, Hkv, 2d) for q {tuple(q.shape)}, "
                         f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if H2 % 2 or (H2 // 2) % v.shape[2]:
        raise ValueError(f"triton backend: {H2} query sub-heads do not form heads over {v.shape[2]} kv groups")
    # no-ops for the projections' outputs; the gradients are then allocated with the same strides
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    lam = lam.reshape(()).to(device=q.device, dtype=torch.float32)  # differentiable: grads flow to the caller's lam
    # decided here: inside the op autograd is switched off
    store_aux = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, lam))
    o, _, _ = _fwd_op(q, k, v, lam, float(scale), bool(mask.causal), store_aux,
                      config.to_list() if config is not None else [], bwd)
    return o


def triton_split_attention(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], mask: AttentionMask,
                           scale: float, return_maps: bool = False, config: Optional[BlockConfig] = None) -> Tensor:
    """The ``triton_split`` backend: :func:`triton_attention` with the 7-product two-kernel backward
    (for timing it against the default atomic backward)."""
    return triton_attention(q, k, v, lam, mask, scale, return_maps=return_maps, config=config, bwd="split")


def triton_atomic_dv_attention(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], mask: AttentionMask,
                               scale: float, return_maps: bool = False,
                               config: Optional[BlockConfig] = None) -> Tensor:
    """The ``triton_atomic_dv`` backend: :func:`triton_attention` with the 6-product backward
    (dK and atomic dQ in one kernel, dV in another; fewer registers a kernel than ``atomic``)."""
    return triton_attention(q, k, v, lam, mask, scale, return_maps=return_maps, config=config, bwd="atomic_dv")


# ----------------------------------------------------------------------------------------------
# offline compilation (no GPU needed)

OFFLINE_KERNELS = ("fwd", "bwd", "bwd_dkq", "bwd_dv", "bwd_kv", "bwd_q")


def compile_offline(d: int, dtype: str = "bf16", arch: int = 90, causal: bool = True,
                    config: Optional[BlockConfig] = None, which: Sequence[str] = OFFLINE_KERNELS) -> dict:
    """Compile the kernels for an NVIDIA target without a GPU (Triton ships ``ptxas``).

    ``dtype`` is a Triton type name (``bf16``, ``fp16``, ``fp32``), ``arch`` the compute
    capability as an integer (80 = A100, 90 = H100). ``which``: any of ``fwd`` (forward),
    ``bwd`` (the atomic backward), ``bwd_dkq`` and ``bwd_dv`` (the ``atomic_dv`` backward),
    ``bwd_kv`` and ``bwd_q`` (the split backward). Returns
    ``{kernel name: CompiledKernel}``; each has ``asm["ptx"]``, ``asm["cubin"]`` and
    ``metadata.shared`` (bytes of shared memory); :func:`resource_usage` reads registers and
    spills. Used by the tests, ``benchmarks/triton_offline.py`` and
    ``benchmarks/gpu_attention.py --compile-only``.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"dtype: expected 'bf16', 'fp16' or 'fp32', got {dtype!r}")
    unknown = set(which) - set(OFFLINE_KERNELS)
    if unknown:
        raise ValueError(f"which: unknown {sorted(unknown)} (choose from {OFFLINE_KERNELS})")
    config = config or block_config(d, interpret=False, arch=arch)
    block_d, block_dv = _widths(d)
    prec = "ieee" if dtype == "fp32" else "tf32"
    common = dict(D=d, BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=causal, PREC=prec)
    loop = dict(ONE_LOOP=config.one_loop)
    stats = {"LAM": "*fp32", "LSE": "*fp32", "DELTA": "*fp32"}
    jobs = {
        "fwd": (_fwd_kernel, ("Q", "K", "V", "O", "O2"), ("qk_scale",),
                dict(common, **loop, BLOCK_M=config.fwd_own, BLOCK_N=config.fwd_step, STORE_AUX=True,
                     SPLIT=config.fwd_split),
                config.fwd_warps),
        "bwd": (_bwd_kv_kernel, ("Q", "K", "V", "DO", "DK_", "DV_"), ("sm_scale", "qk_scale"),
                dict(common, **loop, BLOCK_M=config.bwd_step, BLOCK_N=config.bwd_own, DQ_ATOMIC=True),
                config.bwd_warps),
        "bwd_dkq": (_bwd_kv_kernel, ("Q", "K", "V", "DO", "DK_", "DV_"), ("sm_scale", "qk_scale"),
                    dict(common, **loop, BLOCK_M=config.bwd_step, BLOCK_N=config.bwd_own, DQ_ATOMIC=True, DV=False),
                    config.bwd_warps),
        "bwd_dv": (_bwd_kv_kernel, ("Q", "K", "V", "DO", "DK_", "DV_"), ("sm_scale", "qk_scale"),
                   dict(common, **loop, BLOCK_M=config.dv_step, BLOCK_N=config.dv_own, DQ_ATOMIC=False, DK=False),
                   config.dv_warps),
        "bwd_kv": (_bwd_kv_kernel, ("Q", "K", "V", "DO", "DK_", "DV_", "DQ"), ("sm_scale", "qk_scale"),
                   dict(common, **loop, BLOCK_M=config.kv_step, BLOCK_N=config.kv_own, DQ_ATOMIC=False),
                   config.kv_warps),
        "bwd_q": (_bwd_q_kernel, ("Q", "K", "V", "DO", "DQ"), ("sm_scale", "qk_scale"),
                  dict(common, BLOCK_M=config.q_own, BLOCK_N=config.q_step), config.q_warps),
    }
    out = {}
    for name in which:
        fn, tensors, floats, constexprs, warps = jobs[name]
        signature = {}
        for arg in fn.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg in tensors:
                signature[arg] = f"*{dtype}"
            elif arg in stats or arg == "DQ":  # the atomic backward's dQ buffer is float32
                signature[arg] = "*fp32"
            else:
                signature[arg] = "fp32" if arg in floats else "i32"
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        out[name] = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                   options=dict(num_warps=warps, num_stages=config.num_stages))
    return out


def resource_usage(compiled) -> dict:
    """What an offline-compiled kernel uses: ``registers`` and ``spilled`` bytes (``REG`` and
    ``STACK`` of ``cuobjdump --dump-resource-usage``, None if the tool is missing), ``shared``
    memory in bytes, and the number of ``wgmma`` (Hopper warpgroup) and ``mma`` (sm_80 style)
    matrix instructions in the PTX."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    fields: dict = {}
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        try:
            usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        finally:
            os.unlink(f.name)
        line = next((ln for ln in usage.splitlines() if "REG:" in ln), "")
        fields = dict(kv.split(":", 1) for kv in line.split() if ":" in kv)
    ptx = compiled.asm["ptx"]
    return {"registers": int(fields["REG"]) if "REG" in fields else None,
            "spilled": int(fields["STACK"]) if "STACK" in fields else None,
            "shared": int(compiled.metadata.shared),
            "wgmma": ptx.count("wgmma.mma_async"), "mma": ptx.count("mma.sync")}


# Matrix-product units (forward, backward) each backend executes, read by benchmarks/gpu_suite.py
# (one causal T x T x d product per head pair; the baseline's FlashAttention does (2, 5)).
triton_attention.products = (3, 5)  # the default backward form, BWD = "atomic"
triton_atomic_dv_attention.products = (3, 6)
triton_split_attention.products = (3, 7)


def register() -> None:
    """Add ``triton`` (default backward :data:`BWD`, autotuned on a GPU), ``triton_atomic_dv`` and
    ``triton_split`` (the other backward forms, fixed tiles) to the backend table
    (``resolve_backend('auto', cuda)`` prefers ``triton``)."""
    def declines(*call):  # one check for the three (looked up at call time: a test may replace it)
        return unsupported_reason(*call)

    for name, fn in (("triton", triton_attention), ("triton_split", triton_split_attention),
                     ("triton_atomic_dv", triton_atomic_dv_attention)):
        kernels.register_backend(name, fn, declines=declines)
