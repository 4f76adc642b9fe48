"""Attention modules: projections, parameters and the per-head norm (SPEC sections 1-2).

The attention core itself is a kernel from :mod:`difftx.attention.kernels`; modules only
arrange tensors for it. Legend: ``B`` batch, ``T`` new tokens, ``S`` keys (cache + new),
``D`` model width, ``H`` differential heads, ``Hkv`` kv groups, ``d`` component width.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from ..ops import LambdaFunction, NoContext, at_least_fp32, rms_norm
from .kernels import check_backend_name, resolve_backend
from .masks import AttentionMask
from .rope import apply_rope, rope_angles


def lambda_init_for_layer(layer_idx: int) -> float:
    """The paper's depth schedule: ``0.8 - 0.6 * exp(-0.3 * l)`` with ``l`` counted from 0."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _check_heads(dim: int, n_heads: int, n_kv_heads: Optional[int], components: int,
                 across_groups: bool = False) -> tuple[int, int]:
    """Validate head counts for a module whose heads have ``components`` parts of width ``d``;
    return ``(n_kv_heads, d)``. ``across_groups`` words the group rule as V2's pairing rule."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    _check_positive("n_heads", n_heads)
    _check_positive("n_kv_heads", n_kv_heads)
    parts = f"{components}*n_heads" if components > 1 else "n_heads"
    if dim % (components * n_heads):
        raise ValueError(f"dim: {dim} must be divisible by {parts}={components * n_heads}")
    if n_heads % n_kv_heads:
        if across_groups:
            raise ValueError(
                f"n_kv_heads: {2 * n_heads} query heads in {n_kv_heads} kv groups would pair heads across groups; "
                f"diff_v2 needs n_heads ({n_heads}) divisible by n_kv_heads ({n_kv_heads})")
        raise ValueError(f"n_heads: {n_heads} must be divisible by n_kv_heads={n_kv_heads}")
    d = dim // (components * n_heads)
    if d % 2:
        raise ValueError(f"dim: the head width dim/({parts})={d} must be even for rotary embeddings")
    return n_kv_heads, d


def _rms_head_norm(o: Tensor, weight: Optional[Tensor], scale: float, eps: float) -> Tensor:
    """``scale * RMSNorm(o) * weight`` over the last dimension of ``o`` ``(..., H, w)``, computed in
    float32 (float64 for float64 inputs) and returned in ``o``'s dtype; ``weight`` ``(w,)``, or stacked
    ``(K, w)`` with ``o`` ``(K, ..., H, w)``. ``weight=None``: no norm, just ``scale * o``."""
    if weight is None:
        return o * scale if scale != 1.0 else o
    acc = at_least_fp32(o.dtype)
    of = o if o.dtype == acc else o.to(acc)
    w = weight * scale if scale != 1.0 else weight  # the gain with the scale folded in
    w = w if w.dtype == acc else w.to(acc)
    out = rms_norm(of, w, eps, mean_square=False)
    return out if out.dtype == o.dtype else out.to(o.dtype)


class LayerKV:
    """One layer's KV cache: preallocated buffers, filled left to right.

    Stored head-major, ``(B, heads, S_max, width)``, and handed to kernels as ``(B, S, heads, width)``
    views: each head's keys are then one strided matrix, so a kernel's batched matmul reads the
    cache in place instead of copying it on every decoding step.

    ``v_parts > 1`` stores each value row as that many contiguous pieces of ``width / v_parts``:
    the value buffer is ``(B, heads * v_parts, S_max, width / v_parts)`` and :meth:`update` hands
    the values to kernels as a ``(B, S, heads, v_parts, width / v_parts)`` view. DIFF V1 uses
    ``v_parts=2`` on CPU (its ``2d``-wide value as two ``d``-wide halves, the baseline's layout),
    so that a decoding step's ``A V`` is ``d``-wide matrix-vector products over contiguous rows;
    kernels that do not read this form get the joined ``(B, S, heads, width)`` values (a copy).
    """

    def __init__(self, k: Tensor, v: Tensor, v_parts: int = 1):
        self.k, self.v = k, v  # (B, heads, S_max, width); v: (B, heads * v_parts, S_max, width / v_parts)
        self.v_parts = v_parts

    @classmethod
    def empty(cls, batch: int, max_len: int, k_shape: tuple[int, int], v_shape: tuple[int, int], device=None,
              dtype=None, v_parts: int = 1) -> "LayerKV":
        """Zeroed buffers for ``max_len`` positions of keys ``(heads, width)`` and values ``(heads, width)``,
        the values stored in ``v_parts`` contiguous pieces per row (see the class)."""
        (kh, kd), (vh, vd) = k_shape, v_shape
        if v_parts < 1 or vd % v_parts:
            raise ValueError(f"v_parts: {v_parts} does not divide the value width {vd}")
        return cls(torch.zeros(batch, kh, max_len, kd, device=device, dtype=dtype),
                   torch.zeros(batch, vh * v_parts, max_len, vd // v_parts, device=device, dtype=dtype), v_parts)

    def update(self, pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write new ``k``, ``v`` ``(B, T, heads, width)`` at ``pos``; return everything up to ``pos + T``
        as ``(B, S, heads, width)`` views (values ``(B, S, heads, v_parts, width / v_parts)`` when
        ``v_parts > 1``)."""
        end = pos + k.shape[1]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache is full: {end} tokens do not fit in its {self.k.shape[2]} positions")
        self.k[:, :, pos:end] = k.transpose(1, 2)
        P = self.v_parts
        if P == 1:
            self.v[:, :, pos:end] = v.transpose(1, 2)
            return self.k[:, :, :end].transpose(1, 2), self.v[:, :, :end].transpose(1, 2)
        B, T, H, w = v.shape
        self.v[:, :, pos:end] = v.reshape(B, T, H * P, w // P).transpose(1, 2)
        vs = self.v[:, :, :end]  # (B, H*P, S, w/P)
        return self.k[:, :, :end].transpose(1, 2), vs.unflatten(1, (H, P)).permute(0, 3, 1, 2, 4)


class _AttentionBase(nn.Module):
    """Shared plumbing: q/k/v/out projections, RoPE, cache and kernel dispatch.

    An attention kind is a subclass that says what it adds around the shared core, through four
    members that the model's forward here and the stacked trainer (:mod:`difftx.training.stacked`)
    both read, so a kind is written once:

    - ``components``: softmax maps per head that the core combines, 2 for ``A1 - lambda A2``, else 1;
    - ``extra_proj``: the name of one more linear map of the block's normed input read beside q, k and
      v (a gate, V2's lambda), or None;
    - :meth:`kernel_lambda`: the core's lambda (None for one map);
    - :meth:`finish`: each head's output before ``out_proj``, from the core's output and the extra
      projection's.

    :meth:`finish` and :meth:`kernel_lambda` read the module's own parameters, which in a stack carry a
    leading ``K`` (:mod:`difftx.ops` broadcasts them). :meth:`from_config` builds the module of one layer
    of a :class:`~difftx.config.ModelConfig`; a line in :data:`ATTENTIONS` names the kind for the config.
    """

    components = 1
    extra_proj: Optional[str] = None

    def __init__(self, dim: int, q_heads: int, kv_heads: int, v_groups: int, head_dim: int, v_width: int,
                 out_in: int, rope_theta: float, backend: str):
        super().__init__()
        check_backend_name(backend)
        self.dim, self.head_dim, self.rope_theta, self.backend = dim, head_dim, rope_theta, backend
        self.q_heads, self.kv_heads, self.v_groups, self.v_width = q_heads, kv_heads, v_groups, v_width
        self.q_proj = nn.Linear(dim, q_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.v_groups * v_width, bias=False)
        self.out_proj = nn.Linear(out_in, dim, bias=False)

    def cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of the cached keys and values."""
        return (self.kv_heads, self.head_dim), (self.v_groups, self.v_width)

    def cache_value_parts(self, device=None) -> int:
        """Contiguous pieces each cached value row is stored in on ``device`` (see :class:`LayerKV`)."""
        return 1

    def _qkv(self, x: Tensor, positions: Optional[Tensor], cache: Optional[LayerKV], offset: int):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.q_heads, self.head_dim)  # (B, T, Hq, d)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)  # (B, T, Hk, d)
        v = self.v_proj(x).view(B, T, self.v_groups, self.v_width)  # (B, T, Hv, dv)
        if positions is None:
            positions = torch.arange(offset, offset + T, device=x.device)[None]  # (1, T)
        cos, sin = rope_angles(positions, self.head_dim, self.rope_theta, at_least_fp32(x.dtype))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(offset, k, v)  # (B, S, ...)
        return q, k, v

    def forward(self, x: Tensor, *, positions: Optional[Tensor] = None, mask: Optional[AttentionMask] = None,
                cache: Optional[LayerKV] = None, backend: Optional[str] = None, return_maps: bool = False):
        """Self-attention over ``x`` ``(B, T, D)``.

        ``positions`` ``(B|1, T)`` are the RoPE positions (default ``offset..offset+T-1``);
        ``mask`` defaults to causal; with ``cache``, new keys are written at
        ``mask.q_offset`` and the queries attend to the whole cached prefix.
        ``return_maps`` (eager backend only) also returns :class:`AttentionMaps`.
        """
        mask = mask if mask is not None else AttentionMask()
        if not isinstance(mask, AttentionMask):
            raise TypeError(f"mask: expected a difftx.AttentionMask, got {type(mask).__name__}; describe padding or "
                            f"packed documents as difftx.AttentionMask(key_valid=..., doc_ids=...)")
        if cache is None and mask.q_offset != 0:
            raise ValueError("mask.q_offset is only meaningful with a KV cache")
        q, k, v = self._qkv(x, positions, cache, mask.q_offset)
        mask.check(x.shape[0], x.shape[1], k.shape[1])
        kernel = resolve_backend(("eager" if return_maps else self.backend) if backend is None else backend, x.device,
                                 q_len=x.shape[1])
        if v.dim() == 5 and not getattr(kernel, "split_values", False):
            v = v.flatten(3)  # a cache's split value rows, joined (a copy) for kernels that need whole rows
        return self._attend(x, q, k, v, mask, kernel, return_maps)

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "_AttentionBase":  # pragma: no cover - abstract
        """The module of layer ``layer_idx`` of a model of ``config`` (a :class:`~difftx.config.ModelConfig`)."""
        raise NotImplementedError

    def kernel_lambda(self) -> Optional[Tensor]:
        """The lambda the core subtracts the second map with: None for one map per head."""
        return None

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """Each head's output ``(..., heads, width)`` before ``out_proj``, from the core's ``out``
        ``(..., core heads, value width)`` and the ``extra_proj`` output ``(..., columns)`` (None without
        one); leading dimensions ``(B, T)``, or ``(K, N)`` for a stack."""
        return out

    def _attend(self, x, q, k, v, mask, kernel, return_maps):
        res = kernel(q, k, v, self.kernel_lambda(), mask, 1.0 / math.sqrt(self.head_dim), return_maps=return_maps)
        out, maps = res if return_maps else (res, None)
        extra = getattr(self, self.extra_proj)(x) if self.extra_proj else None
        out = self.finish(out, extra).flatten(2)  # (B, T, D)
        out = self.out_proj(out if out.dtype == x.dtype else out.to(x.dtype))
        return (out, maps) if return_maps else out


class StandardAttention(_AttentionBase):
    """Multi-head (GQA) softmax attention: the parameter-matched baseline of SPEC section 1.

    ``use_subln=True`` adds a per-head RMSNorm over each ``d``-wide head output before
    ``out_proj`` (one learnable gain ``subln.weight`` of width ``d`` shared by the heads, eps
    ``norm_eps``, computed in float32): paper Table 6's "Transformer + per-head norm". There is
    no ``(1 - lambda_init)`` factor (that belongs to DIFF's lambda).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, rope_theta: float = 10000.0, *,
                 backend: str = "auto", use_subln: bool = False, norm_eps: float = 1e-5):
        n_kv_heads, d = _check_heads(dim, n_heads, n_kv_heads, 1)
        super().__init__(dim, n_heads, n_kv_heads, n_kv_heads, d, d, dim, rope_theta, backend)
        self.n_heads, self.n_kv_heads, self.norm_eps = n_heads, n_kv_heads, norm_eps
        self.subln = nn.RMSNorm(d, eps=norm_eps, elementwise_affine=True) if use_subln else None

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "StandardAttention":
        c = config
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend, use_subln=c.uses_head_norm,
                   norm_eps=c.norm_eps)

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """The kernel's per-head output ``(..., H, d)``, normalised if ``subln``."""
        return out if self.subln is None else _rms_head_norm(out, self.subln.weight, 1.0, self.norm_eps)


GATES = ("elementwise", "headwise")


class GatedAttention(StandardAttention):
    """Output-gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models").

    Standard multi-head (GQA) attention whose per-head output ``Y`` (before ``out_proj``) is
    multiplied by ``sigmoid(x W_g)``, ``x`` the block's normalised input (what the q/k/v
    projections read). ``gate="elementwise"``: ``W_g: D -> H*d``, one gate per head and channel;
    ``gate="headwise"``: ``W_g: D -> H``, one scalar per head. ``W_g`` is ``gate_proj.weight``
    (no bias), initialised like the other projections; the sigmoid and the product run in float32.
    """

    extra_proj = "gate_proj"

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, rope_theta: float = 10000.0, *,
                 backend: str = "auto", gate: str = "elementwise"):
        if gate not in GATES:
            raise ValueError(f"gate: must be one of {GATES}, got {gate!r}")
        super().__init__(dim, n_heads, n_kv_heads, rope_theta, backend=backend)
        self.gate = gate
        self.gate_proj = nn.Linear(dim, n_heads * self.head_dim if gate == "elementwise" else n_heads, bias=False)

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "GatedAttention":
        c = config
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend, gate=c.gate_kind)

    def gate_values(self, x: Tensor) -> Tensor:
        """``sigmoid(x W_g)`` in float32 (float64 for float64 inputs): ``(B, T, H, d)`` elementwise,
        ``(B, T, H, 1)`` head-wise."""
        return self._gate(self.gate_proj(x))

    def _gate(self, logits: Tensor) -> Tensor:
        return torch.sigmoid(logits.to(at_least_fp32(logits.dtype))).unflatten(-1, (self.n_heads, -1))

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """The kernel's per-head output times its gate ``sigmoid(x W_g)`` (``extra`` is ``x W_g``)."""
        g = self._gate(extra)
        return (out.to(g.dtype) * g).to(out.dtype)


class DiffAttention(_AttentionBase):
    """Differential attention, V1 (SPEC section 1), in the paper's exact form.

    ``n_heads`` differential heads of two ``d``-wide components each (``d = dim / (2 n_heads)``),
    ``n_kv_heads`` kv groups; ``lambda_init`` defaults to the depth schedule of ``layer_idx``.

    ``use_subln=False``: no per-head RMSNorm (an ablation). ``subtract=False``: the
    no-subtraction control, lambda fixed at 0, so ``O_h = (1 - lambda_init) RMSNorm(A1 V)``; the
    lambda vectors are not created, and the kernels receive ``lam = 0`` (every backend computes
    the second map and multiplies it by zero: DIFF's cost and maps, exactly zero gradient into the
    second components' q/k projection rows).
    """

    components = 2

    def __init__(self, dim: int, n_heads: int, layer_idx: int, n_kv_heads: Optional[int] = None,
                 rope_theta: float = 10000.0, *, backend: str = "auto", norm_eps: float = 1e-5,
                 lambda_init: Optional[float] = None, use_subln: bool = True, subtract: bool = True):
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx: must be a non-negative integer, got {layer_idx!r}")
        n_kv_heads, d = _check_heads(dim, n_heads, n_kv_heads, 2)
        super().__init__(dim, 2 * n_heads, 2 * n_kv_heads, n_kv_heads, d, 2 * d, dim, rope_theta, backend)
        self.n_heads, self.n_kv_heads, self.layer_idx, self.norm_eps = n_heads, n_kv_heads, layer_idx, norm_eps
        self.lambda_init = lambda_init_for_layer(layer_idx) if lambda_init is None else float(lambda_init)
        self.subtract = bool(subtract)
        if self.subtract:
            self.lambda_q1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.lambda_k1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.lambda_q2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.lambda_k2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.subln = nn.RMSNorm(2 * d, eps=norm_eps, elementwise_affine=True) if use_subln else None
        self.reset_lambda()

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "DiffAttention":
        c = config
        return cls(c.dim, c.n_heads, layer_idx, c.n_kv_heads, c.rope_theta, backend=c.backend, norm_eps=c.norm_eps,
                   lambda_init=c.lambda_init, use_subln=c.uses_head_norm, subtract=c.subtract)

    def cache_value_parts(self, device=None) -> int:
        """2 on CPU: the cached ``2d``-wide values are kept as two contiguous ``d``-wide halves per group,
        which a decoding step's ``A V`` reads faster there (docs/kernels.md, "Decode step"); 1 elsewhere
        (the GPU kernels read whole rows)."""
        return 2 if device is None or torch.device(device).type == "cpu" else 1

    def lambda_parameters(self) -> tuple[Tensor, ...]:
        """``(lambda_q1, lambda_k1, lambda_q2, lambda_k2)``; empty for the no-subtraction control."""
        return (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2) if self.subtract else ()

    def reset_lambda(self, std: float = 0.1) -> None:
        for p in self.lambda_parameters():
            nn.init.normal_(p, mean=0.0, std=std)

    def lambda_full(self) -> Tensor:
        """The re-parameterised lambda, a float32 scalar (float64 for float64 parameters).

        Without gradients (decoding) the value is cached until a lambda parameter changes (in-place
        updates bump its version counter; ``.to()`` and loading give it new storage). The
        no-subtraction control (``subtract=False``) returns a constant zero that needs no gradient."""
        if not self.subtract:
            w = self.q_proj.weight
            acc = at_least_fp32(w.dtype)
            zero = self.__dict__.get("_lambda_zero")
            if zero is None or zero.dtype != acc or zero.device != w.device:
                zero = self.__dict__["_lambda_zero"] = torch.zeros((), dtype=acc, device=w.device)
            return zero
        params = self.lambda_parameters()
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return LambdaFunction.apply(*params, self.lambda_init)
        key = (self.lambda_init, *((p._version, p.data_ptr(), p.dtype, p.device) for p in params))
        cached = self.__dict__.get("_lambda_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                value = LambdaFunction.forward(NoContext, *params, self.lambda_init)
                cached = self.__dict__["_lambda_cache"] = (key, value)
        return cached[1]

    def head_norm(self, o: Tensor) -> Tensor:
        """``(1 - lambda_init) * RMSNorm_2d(o)`` on ``o`` ``(..., H, 2d)``, computed in float32."""
        return _rms_head_norm(o, None if self.subln is None else self.subln.weight, 1.0 - self.lambda_init,
                              self.norm_eps)

    def kernel_lambda(self) -> Tensor:
        return self.lambda_full()

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        return self.head_norm(out)


class DiffAttentionV2(_AttentionBase):
    """Differential attention, V2 (SPEC section 2).

    ``2 n_heads`` query heads of width ``d = dim / n_heads`` over ``n_kv_heads`` kv heads;
    pair ``(2j, 2j+1)`` gives output head ``j`` as ``a_2j - sigmoid(lambda_proj(x))_j a_2j+1``.
    Both members of a pair share a kv group, which needs ``n_heads % n_kv_heads == 0``.
    """

    extra_proj = "lambda_proj"

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, rope_theta: float = 10000.0, *,
                 backend: str = "auto"):
        n_kv_heads, d = _check_heads(dim, n_heads, n_kv_heads, 1, across_groups=True)
        super().__init__(dim, 2 * n_heads, n_kv_heads, n_kv_heads, d, d, n_heads * d, rope_theta, backend)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.lambda_proj = nn.Linear(dim, n_heads, bias=False)

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "DiffAttentionV2":
        c = config
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend)

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """Pairs ``(2j, 2j+1)`` of the kernel's ``2H`` heads as ``a_2j - sigmoid(x W_lambda)_j a_2j+1``
        (``extra`` is ``x W_lambda``)."""
        lam = torch.sigmoid(extra.to(at_least_fp32(extra.dtype)))[..., None]  # (..., H, 1)
        return (out[..., 0::2, :].to(lam.dtype) - lam * out[..., 1::2, :].to(lam.dtype)).to(out.dtype)


ATTENTIONS: dict[str, type[_AttentionBase]] = {
    "diff": DiffAttention,
    "diff_v2": DiffAttentionV2,
    "standard": StandardAttention,
    "gated": GatedAttention,
}
"""The attention kinds a :class:`~difftx.config.ModelConfig` can name (``attention``), by name. A new kind is
one subclass of the attention base (its ``from_config``, ``components``, ``extra_proj``, ``kernel_lambda``,
``finish``) and one line here; the model and the stacked trainer need nothing else."""
