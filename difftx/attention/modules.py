"""Attention modules: projections, parameters and the per-head norm (SPEC sections 1-2).

The attention core itself is a kernel from :mod:`difftx.attention.kernels`; modules only
arrange tensors for it. Legend: ``B`` batch, ``T`` new tokens, ``S`` keys (cache + new),
``D`` model width, ``H`` differential heads, ``Hkv`` kv groups, ``d`` component width.
"""

from __future__ import annotations

import dataclasses
import math
from contextvars import ContextVar
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ..ops import LambdaFunction, at_least_fp32, is_mapped, lambda_value, linear, records_grad, rms_norm
from .kernels import BACKENDS, AttentionMaps, check_backend_name, resolve_backend
from .cache import LayerKV, static_backend
from .masks import AttentionMask
from .rope import apply_rope, rope_angles


LAMBDA_INIT_STD = 0.1  # the lambda vectors' initial draw, N(0, 0.1) (the paper's)


def lambda_init_for_layer(layer_idx: int) -> float:
    """The paper's depth schedule: ``0.8 - 0.6 * exp(-0.3 * l)`` with ``l`` counted from 0."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def head_output_scale(out_scale, layer_idx: int, default: float) -> float:
    """The constant a head's output is multiplied by at layer ``layer_idx`` (``ModelConfig.out_scale``): ``default``
    (the kind's own) for None, ``1 - lambda_init_for_layer(layer_idx)`` for ``"schedule"``, else the number."""
    if out_scale is None:
        return float(default)
    if out_scale == "schedule":  # ModelConfig's OUT_SCALE_SCHEDULE
        return 1.0 - lambda_init_for_layer(layer_idx)
    return float(out_scale)


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
    out = rms_norm(of, w, eps, mean_square=False)  # compiled: plain ops that fuse with the core's combine
    return out if out.dtype == o.dtype else out.to(o.dtype)


# The values kept for the KV cache a forward writes into (its LayerKV.kept): set by AttentionKind.forward for the
# duration of a call with a cache, None otherwise (see _inference_value).
_KEPT: ContextVar[Optional[dict]] = ContextVar("difftx_kept_inference_values", default=None)


def _inference_value(module: nn.Module, slot: str, params: tuple, extra, compute: Callable[[], Tensor]) -> Tensor:
    """``compute()``, a value of ``params`` and ``extra`` alone, without gradients.

    In a forward that writes into a KV cache the value is kept with that layer's cache (:attr:`LayerKV.kept`, under
    ``slot``) while the parameters keep their version counters and storage (an in-place update bumps the counter,
    ``.to()`` and loading give new storage): decoding computes lambda and the head norm's gain once per generation,
    not once per token. Every other call computes it (a forward without a cache, one that fills a cache from its
    first position, one on a new cache): a write through ``p.data`` (an EMA update, a hand-made loader) moves no
    version counter, so a value kept on the module itself outlived it. While torch.compile traces, ``compute()``
    too: a compiled graph neither reads version counters and data pointers nor keeps a value across calls."""
    if torch.compiler.is_compiling():  # first: Dynamo cannot trace ContextVar.get
        return compute()
    kept = _KEPT.get()
    if kept is None:
        return compute()
    key = (id(module), extra, params[0].dtype, *((p._version, p.data_ptr()) for p in params))
    hit = kept.get(slot)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = kept[slot] = (key, compute())
    return hit[1]


# methods a kind may define without leaving the stack's fast path: they build or describe the module, not its forward
_CONSTRUCTION = frozenset({"__init__", "from_config", "check_config", "baseline_config", "parameter_delta", "hf_refusal",
                           "llama_refusal", "llama_fold", "init_parameters", "capture_maps", "lambda_reading",
                           "extra_repr", "cache_shapes", "cache_value_parts"})


BUILTIN_KINDS: dict[str, type] = {}
"""The built-in kinds, name to class: the kinds difftx defines (not registered from ``--kinds`` or your code),
filled by :mod:`difftx.attention.registry` as it registers them (it also imports the kinds defined in their own
modules, :mod:`difftx.attention.converted` and :mod:`difftx.attention.dex`). Their own rules apply to these
classes only."""


class AttentionKind(nn.Module):
    """An attention kind: q/k/v/out projections, RoPE, cache and kernel dispatch, and the hooks a kind
    overrides. docs/attention-kinds.md walks through writing one.

    The forward (written once here, run by the model, and by a stack of models with a leading ``K`` on
    every weight, :mod:`difftx.training.stacked`) reads four members:

    - ``components``: softmax maps per head that the core combines, 2 for ``A1 - lambda A2``, else 1;
    - ``extra_proj``: the name of one more linear map of the block's normed input read beside q, k and
      v (a gate, V2's lambda), or None;
    - :meth:`kernel_lambda`: the core's lambda (None for one map);
    - :meth:`finish`: each head's output before ``out_proj``, from the core's output and the extra
      projection's;

    and a kind may override :meth:`_qkv` or :meth:`forward` itself (a stack then runs it under
    ``torch.vmap``, see :meth:`stacks_natively`). What a kind implies elsewhere is asked of the class:
    :meth:`from_config` (its module in a model), :meth:`check_config` (its options), :meth:`baseline_config`
    (its parameter-matched baseline) and :meth:`parameter_delta` (what it adds to it, row by row),
    :meth:`init_parameters` (its initialisation), the export members (``hf_model_type`` / :meth:`hf_refusal`: a
    transformers class; ``remote_kind``: difftx's modeling file; :meth:`llama_fold` / :meth:`llama_refusal`: a
    plain Llama with other weights), :meth:`capture_maps` (attention maps for the evaluations) and
    :meth:`lambda_reading` (the lambda the metrics log). :func:`~difftx.attention.registry.register_attention`
    names a kind for :class:`~difftx.config.ModelConfig`.
    """

    components = 1
    # d-wide parts of the model width per head, dim = width_parts * n_heads * d; None: components (DIFF's heads are
    # two d-wide halves of a 2d-wide head; ConvertedAttention's two components share one d-wide value: 1)
    width_parts: Optional[int] = None
    extra_proj: Optional[str] = None
    rope = True  # RoPE on q and k; False: no positional encoding at all (NoPE; ModelConfig.rope, set by the model)
    kind: str = ""  # its name in ATTENTIONS (set by register_attention)
    hf_model_type: Optional[str] = None  # the transformers model_type that computes exactly this kind, if any
    config_fields: frozenset = frozenset()  # built-in option fields of ModelConfig this kind reads
    head_norm_default = False  # whether ModelConfig.head_norm=None means a per-head norm for this kind
    Options: Optional[type] = None  # the kind's options (a dataclass validating itself): ModelConfig.options
    # its class in difftx's modeling file (KINDS in difftx/interop/remote/modeling_difftx.py), the name export
    # writes as the folder's attention; None: the file does not compute the kind, and export with it is refused
    remote_kind: Optional[str] = None
    # its exact fold into a plain Llama (export --as llama): a classmethod (config, state dict) -> the tensors that
    # the Llama (config.plain(attention="standard")) holds otherwise (see llama_refusal); None: no fold
    llama_fold = None
    # whether that fold multiplies weights (temperature, dex): exact in float32, rounded in bf16/fp16 (export warns)
    llama_fold_multiplies = False

    # what a kind asserts about itself alone: its parameters beyond its baseline, how it is exported. A kind built
    # on another (a subclass) does not inherit these from its parent: unless it defines them, it starts from
    # AttentionKind's defaults (parameters counted from the modules; no export, no fold), whatever it is built on
    OWN_RULES = ("parameter_delta", "hf_refusal", "hf_model_type", "remote_kind", "llama_refusal", "llama_fold",
                 "llama_fold_multiplies")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in AttentionKind.OWN_RULES:
            if name not in cls.__dict__:
                setattr(cls, name, AttentionKind.__dict__[name])

    def __init__(self, dim: int, q_heads: int, kv_heads: int, v_groups: int, head_dim: int, v_width: int,
                 out_in: int, rope_theta: float, backend: str, *, qkv_bias: bool = False):
        super().__init__()
        check_backend_name(backend)
        self.dim, self.head_dim, self.rope_theta, self.backend = dim, head_dim, rope_theta, backend
        self.q_heads, self.kv_heads, self.v_groups, self.v_width = q_heads, kv_heads, v_groups, v_width
        qkv_bias = bool(qkv_bias)  # biases on q, k and v (ModelConfig.qkv_bias, Qwen2's), added before RoPE
        self.q_proj = nn.Linear(dim, q_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.v_groups * v_width, bias=qkv_bias)
        self.out_proj = nn.Linear(out_in, dim, bias=False)

    @classmethod
    def stacks_natively(cls) -> bool:
        """True when a stack can run this kind's code with its weights' leading ``K`` (the fast path of
        :mod:`difftx.training.stacked`): no method of a built-in kind is overridden outside the built-in
        kinds (construction, ``from_config``, initialisation and options excepted). Any other kind is
        stacked by ``torch.vmap`` over the one model, which runs its code as written."""
        builtin = set(BUILTIN_KINDS.values())
        methods = {n for c in cls.__mro__ if c in builtin or c is AttentionKind for n, v in vars(c).items()
                   if callable(v) or isinstance(v, (classmethod, staticmethod, property))}
        for c in cls.__mro__:
            if c in builtin or c is AttentionKind:
                return True
            if any(n in methods and n not in _CONSTRUCTION for n in vars(c)):
                return False
        return False

    def cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of the cached keys and values."""
        return (self.kv_heads, self.head_dim), (self.v_groups, self.v_width)

    def cache_value_parts(self, device=None) -> int:
        """Contiguous pieces each cached value row is stored in on ``device`` (see :class:`LayerKV`)."""
        return 1

    def _qkv(self, x: Tensor, positions: Optional[Tensor], cache: Optional[LayerKV], offset: int):
        """q, k, v ``(..., T, heads, width)`` of ``x`` ``(..., T, D)`` (each projection's bias added, if any), q and
        k then rotated; with a cache, k and v of the whole cached prefix. A stack's leading ``K`` rides along
        (:func:`difftx.ops.linear`)."""
        T = x.shape[-2]
        qp, kp, vp = self.q_proj, self.k_proj, self.v_proj
        q = linear(x, qp.weight, bias=qp.bias).unflatten(-1, (self.q_heads, self.head_dim))  # (..., T, Hq, d)
        k = linear(x, kp.weight, bias=kp.bias).unflatten(-1, (self.kv_heads, self.head_dim))  # (..., T, Hk, d)
        v = linear(x, vp.weight, bias=vp.bias).unflatten(-1, (self.v_groups, self.v_width))  # (..., T, Hv, dv)
        if self.rope:
            if positions is None:
                positions = (offset + torch.arange(T, device=x.device) if isinstance(offset, Tensor)  # static step
                             else torch.arange(offset, offset + T, device=x.device))[None]  # (1, T)
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

        In a stack's module tree (weights with a leading ``K``) ``x`` is ``(K, B, T, D)`` and ``mask``
        describes the kernel's ``K * B`` sequences, each model's lambda applied to its own.
        """
        mask = mask if mask is not None else AttentionMask()
        if not isinstance(mask, AttentionMask):
            raise TypeError(f"mask: expected a difftx.AttentionMask, got {type(mask).__name__}; describe padding or "
                            f"packed documents as difftx.AttentionMask(key_valid=..., doc_ids=...)")
        if cache is None and (mask.is_static or mask.q_offset != 0):
            raise ValueError("mask.q_offset is only meaningful with a KV cache")
        q, k, v = self._qkv(x, positions, cache, mask.q_offset)
        if k.dtype != q.dtype:  # a cache kept in another dtype than the model computes in: read in the model's
            k, v = k.to(q.dtype), v.to(q.dtype)
        lead = q.shape[:-3]  # (B,), or (K, B) in a stack
        q, k, v = (t.flatten(0, len(lead) - 1) for t in (q, k, v))  # the kernel's batch: every sequence
        mask.check(q.shape[0], q.shape[1], k.shape[1])
        name = ("eager" if return_maps else self.backend) if backend is None else backend
        if mask.is_static:  # a static decoding step: a backend that reads the dense mask (auto: eager)
            check_backend_name(name)
            kernel = BACKENDS[static_backend(name)]
        else:
            kernel = resolve_backend(name, x.device, q_len=q.shape[1])
        if v.dim() == 5 and not getattr(kernel, "split_values", False):
            v = v.flatten(3)  # a cache's split value rows, joined (a copy) for kernels that need whole rows
        if cache is None or torch.compiler.is_compiling():
            return self._attend(x, q, k, v, mask, kernel, return_maps)
        if isinstance(mask.q_offset, int) and mask.q_offset == 0:  # the cache filled from its start: a new text
            cache.kept.clear()
        kept = _KEPT.set(cache.kept)  # lambda and the head norm's gain, kept for this cache (_inference_value)
        try:
            return self._attend(x, q, k, v, mask, kernel, return_maps)
        finally:
            _KEPT.reset(kept)

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "AttentionKind":
        """The module of layer ``layer_idx`` of a model of ``config`` (a :class:`~difftx.config.ModelConfig`).
        The default suits a kind whose ``__init__`` takes what :class:`StandardAttention`'s takes, plus its
        :attr:`Options` fields as keywords."""
        c = config
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend, **c.options_dict())

    # -- what a kind implies ---------------------------------------------------------------------------------
    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError unless ``config`` suits this kind: by default, its ``options`` must build
        :attr:`Options` (a kind without one takes none)."""
        options = config.options or {}
        if cls.Options is None:
            if options:
                raise ValueError(f"ModelConfig.options: attention={config.attention!r} takes no options, got "
                                 f"{sorted(options)}")
            return
        try:
            cls.Options(**options)
        except TypeError as e:
            raise ValueError(f"ModelConfig.options: {e} (attention={config.attention!r} takes "
                             f"{[f.name for f in dataclasses.fields(cls.Options)]})") from None

    @classmethod
    def baseline_config(cls, config):
        """The parameter-matched baseline of ``config``: by default standard attention with heads of this kind's
        query/key width (``components`` of them per head of this kind) and its options at their defaults."""
        C = cls.components
        return config.plain(attention="standard", n_heads=C * config.n_heads, n_kv_heads=C * config.kv_groups)

    @classmethod
    def parameter_delta(cls, config) -> list[tuple[str, int, str]]:
        """What one layer of ``config`` holds beyond its :meth:`baseline_config`'s, as ``(parameters and why, count,
        formula)`` rows (the formula in ``D``, ``H``, ``d``, or the count itself). By default: each parameter of
        the layer's attention module that the baseline's lacks or holds with another size (counted from the two
        modules, built without weights)."""
        base = cls.baseline_config(config)
        with torch.device("meta"):
            ours = dict(cls.from_config(config, 0).named_parameters())
            theirs = dict(base.kind_class.from_config(base, 0).named_parameters())
        rows = []
        for name in sorted(set(ours) | set(theirs)):
            a = ours[name].numel() if name in ours else 0
            b = theirs[name].numel() if name in theirs else 0
            if a != b:
                why = (f"{cls.__name__} only, shape {tuple(ours[name].shape)}" if name not in theirs else
                       f"the baseline only, shape {tuple(theirs[name].shape)}" if name not in ours else
                       f"shape {tuple(ours[name].shape)} against the baseline's {tuple(theirs[name].shape)}")
                rows.append((f"{name} ({why})", a - b, str(a - b)))
        return rows

    @classmethod
    def hf_refusal(cls, config) -> Optional[str]:
        """Why ``config`` cannot be exported to Hugging Face transformers exactly, or None when it can (then
        :attr:`hf_model_type` names the transformers class)."""
        return (f"attention={config.attention!r} cannot be exported: no transformers model computes it "
                f"({cls.__name__} is not Llama's or DiffLlama's attention)")

    @classmethod
    def llama_refusal(cls, config) -> Optional[str]:
        """Why ``config`` has no exact fold into a plain Llama (``difftx export --as llama``), in one line without
        the kind's name, or None (then :attr:`llama_fold` computes it; a kind without one is refused all the
        same). The fold of a kind that has one is a classmethod ``llama_fold(config, state)``: ``state`` a difftx
        state dict of ``config``; it returns the tensors (by difftx name) that the Llama computing the same function
        holds otherwise, computed in float64 and cast to the weights' dtype (``{}``: the same weights); the
        weights it does not return are kept where the Llama has them, and dropped elsewhere. It raises
        ``ValueError`` (one line) where these weights do not fold."""
        return None

    def set_lambda_scale(self, scale: float) -> None:
        """The trainer's lambda warm-up factor (``TrainConfig.lambda_warmup``): a kind with a lambda subtracts
        ``scale * lambda`` until it is set back to 1; a kind without one has nothing to scale."""

    def init_parameters(self, draw: Callable[[str, float], None], std: float) -> None:
        """Initialise the projections: ``draw(name, std)`` fills the parameter ``name`` (of this module) from
        the model's paired normal draw (the same values in every arm holding that name). A kind extends this
        for parameters it adds (:class:`DiffAttention`: the lambda vectors); parameters a kind creates in its
        own ``__init__`` keep what it gave them unless it draws them here. The q/k/v biases (``qkv_bias``) start
        at zero."""
        for name in ("q_proj", "k_proj", "v_proj", "out_proj", *((self.extra_proj,) if self.extra_proj else ())):
            draw(f"{name}.weight", std)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            if proj.bias is not None and not proj.bias.is_meta:
                nn.init.zeros_(proj.bias)
        subln = getattr(self, "subln", None)
        if isinstance(subln, nn.RMSNorm):
            nn.init.ones_(subln.weight)

    def capture_maps(self, x: Tensor, maps: AttentionMaps) -> tuple[Tensor, Optional[Tensor]]:
        """``(effective, lam)`` for :mod:`difftx.eval.capture` from the eager kernel's ``maps`` of one call on
        ``x``: the map applied to the values ``(B, heads, T, S)`` and the lambda (None without one)."""
        return maps.effective, None

    def lambda_reading(self, gather: Callable[[Tensor], Tensor] = lambda p: p) -> Optional[float]:
        """The learned lambda the training metrics log for this layer, or None (``gather`` assembles a sharded
        parameter)."""
        return None

    def kernel_lambda(self) -> Optional[Tensor]:
        """The lambda the core subtracts the second map with: None for one map per head."""
        return None

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """Each head's output ``(..., heads, width)`` before ``out_proj``, from the core's ``out``
        ``(..., core heads, value width)`` and the ``extra_proj`` output ``(..., columns)`` (None without
        one); leading dimensions ``(B, T)``, or ``(K, N)`` for a stack."""
        return out

    def _attend(self, x, q, k, v, mask, kernel, return_maps):
        lam = self.kernel_lambda()  # a stack's: one per model, for its group of sequences
        res = kernel(q, k, v, lam, mask, 1.0 / math.sqrt(self.head_dim), return_maps=return_maps)
        out, maps = res if return_maps else (res, None)
        out = out.view(*x.shape[:-1], *out.shape[2:])  # (..., T, heads, width)
        extra = linear(x, getattr(self, self.extra_proj).weight) if self.extra_proj else None
        out = self.finish(out, extra).flatten(-2)  # (..., T, D)
        out = linear(out if out.dtype == x.dtype else out.to(x.dtype), self.out_proj.weight)
        return (out, maps) if return_maps else out


class StandardAttention(AttentionKind):
    """Multi-head (GQA) softmax attention: the parameter-matched baseline of SPEC section 1.

    ``use_subln=True`` adds a per-head RMSNorm over each ``d``-wide head output before
    ``out_proj`` (one learnable gain ``subln.weight`` of width ``d`` shared by the heads, eps
    ``norm_eps``, computed in float32): paper Table 6's "Transformer + per-head norm". There is
    no ``(1 - lambda_init)`` factor (that belongs to DIFF's lambda) unless ``out_scale`` gives one:
    each head's output (normalised or not) is then multiplied by that constant, the control that
    separates DIFF's subtraction from its output scale (``ModelConfig.out_scale``).
    ``qkv_bias=True``: biases on the q/k/v projections, added before RoPE (Qwen2's attention).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, rope_theta: float = 10000.0, *,
                 backend: str = "auto", use_subln: bool = False, norm_eps: float = 1e-5, out_scale: float = 1.0,
                 qkv_bias: bool = False):
        n_kv_heads, d = _check_heads(dim, n_heads, n_kv_heads, 1)
        super().__init__(dim, n_heads, n_kv_heads, n_kv_heads, d, d, dim, rope_theta, backend, qkv_bias=qkv_bias)
        self.n_heads, self.n_kv_heads, self.norm_eps = n_heads, n_kv_heads, norm_eps
        self.subln = nn.RMSNorm(d, eps=norm_eps, elementwise_affine=True) if use_subln else None
        self.out_scale = float(out_scale)

    hf_model_type = "llama"  # with qkv_bias: Qwen2 (Llama plus q/k/v biases; difftx.interop.hf)
    remote_kind = "standard"
    config_fields = frozenset({"head_norm", "out_scale", "qkv_bias"})

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "StandardAttention":
        c = config
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend, use_subln=c.uses_head_norm,
                   norm_eps=c.norm_eps, out_scale=head_output_scale(c.out_scale, layer_idx, 1.0), qkv_bias=c.qkv_bias,
                   **c.options_dict())

    @classmethod
    def baseline_config(cls, config):
        """Plain standard attention with the same heads: itself without its per-head norm; for ``gated``, the heads
        without the gate (``W_g`` is all it adds); for a kind built on it, the heads without what it adds."""
        return config.plain(attention="standard")

    @classmethod
    def parameter_delta(cls, config) -> list[tuple[str, int, str]]:
        if not config.uses_head_norm:
            return []
        return [("subln.weight (per-head RMSNorm gain over the d-wide head)", config.head_dim, "d")]

    @classmethod
    def hf_refusal(cls, config) -> Optional[str]:
        if config.uses_head_norm:
            return ("attention='standard' with head_norm=True cannot be exported exactly: Llama has no per-head "
                    "RMSNorm between the attention and o_proj, and the norm is not linear, so it cannot be folded "
                    "into the weights.")
        if config.out_scale is not None:
            return (f"attention='standard' with out_scale={config.out_scale!r} is not exported: Llama has no head "
                    f"output scale (it would fold into o_proj, a reparameterisation this export does not write).")
        return None

    @classmethod
    def llama_refusal(cls, config) -> Optional[str]:
        if config.out_scale is not None:
            return (f"out_scale={config.out_scale!r} is not folded (a constant head scale, an ablation's setting; "
                    f"--as llama folds learned maps only): export it without --as")
        if config.uses_head_norm:
            return "head_norm=true: a per-head RMSNorm is not linear, so no Llama weights compute it"
        return None

    @classmethod
    def llama_fold(cls, config, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Nothing to fold: the same weights."""
        return {}

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """The kernel's per-head output ``(..., H, d)``, normalised if ``subln``, times ``out_scale``."""
        return _rms_head_norm(out, None if self.subln is None else self.subln.weight, self.out_scale, self.norm_eps)


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

    hf_model_type = None
    remote_kind = "gated"
    config_fields = frozenset({"gate"})

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "GatedAttention":
        c = config
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend, gate=c.gate_kind,
                   **c.options_dict())

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if config.gate is not None and config.gate not in GATES:
            raise ValueError(f"ModelConfig.gate: must be one of {GATES} (or null: 'elementwise'), got {config.gate!r}")

    @classmethod
    def parameter_delta(cls, config) -> list[tuple[str, int, str]]:
        D, H, d = config.dim, config.n_heads, config.head_dim
        if config.gate_kind == "elementwise":
            return [("gate_proj (elementwise W_g: D -> H·d)", D * H * d, "D·H·d")]
        return [("gate_proj (head-wise W_g: D -> H)", D * H, "D·H")]

    @classmethod
    def hf_refusal(cls, config) -> Optional[str]:
        return (f"attention='gated' (gate={config.gate_kind!r}) cannot be exported: Llama has no output gate on its "
                "attention heads (sigmoid(x W_g) multiplying each head before o_proj), and no transformers Llama or "
                "DiffLlama class computes one; Qwen3-Next's gated attention also changes the projections, norms and "
                "RoPE, so it is no exact equivalent either.")

    @classmethod
    def llama_refusal(cls, config) -> Optional[str]:
        return "each head is multiplied by sigmoid(x W_g), which depends on the input: no fixed weights compute it"

    def _gate(self, logits: Tensor) -> Tensor:
        """``sigmoid(x W_g)`` from ``x W_g``, in float32 (float64 for float64 inputs): ``(B, T, H, d)``
        elementwise, ``(B, T, H, 1)`` head-wise."""
        return torch.sigmoid(logits.to(at_least_fp32(logits.dtype))).unflatten(-1, (self.n_heads, -1))

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """The kernel's per-head output times its gate ``sigmoid(x W_g)`` (``extra`` is ``x W_g``)."""
        g = self._gate(extra)
        return (out.to(g.dtype) * g).to(out.dtype)


class TemperatureAttention(StandardAttention):
    """Standard multi-head (GQA) attention with a learned softmax temperature per head: head ``h``'s logits
    ``q·k / sqrt(d)`` are multiplied by ``exp(t_h)`` (``log_temperature``, one value per query head, 0 at
    initialisation: the baseline's function). The control of the question "does DIFF only sharpen its
    attention?": it can sharpen (or flatten) each head's map, and cannot subtract one map from another. ``H``
    parameters per layer more than the baseline."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, rope_theta: float = 10000.0, *,
                 backend: str = "auto"):
        super().__init__(dim, n_heads, n_kv_heads, rope_theta, backend=backend)
        self.log_temperature = nn.Parameter(torch.zeros(n_heads))

    hf_model_type = None
    remote_kind = "temperature"
    config_fields = frozenset()

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "TemperatureAttention":
        c = config
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend, **c.options_dict())

    @classmethod
    def parameter_delta(cls, config) -> list[tuple[str, int, str]]:
        return [("log_temperature (one learned log-temperature per head)", config.n_heads, "H")]

    @classmethod
    def hf_refusal(cls, config) -> Optional[str]:
        return ("attention='temperature' cannot be exported as such: Llama scales every head's logits by 1/sqrt(d); "
                "export --as llama folds each head's learned temperature into q_proj (the same function, the "
                "temperature forgotten), and without --no-remote-code difftx's own code keeps it")

    llama_fold_multiplies = True  # exp(t_h) into q_proj's rows

    @classmethod
    def llama_fold(cls, config, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Head ``h``'s logits are ``exp(t_h) q.k / sqrt(d)``. The factor scales the query, and RoPE is a rotation
        (linear), so it goes into ``q_proj``'s ``d`` rows of head ``h``: ``q_proj[h] *= exp(t_h)``."""
        H, d, out = config.n_heads, config.head_dim, {}
        for i in range(config.n_layers):
            a = f"layers.{i}.attn."
            q = state[a + "q_proj.weight"]
            scale = state[a + "log_temperature"].double().exp()  # (H,)
            out[a + "q_proj.weight"] = (q.double().view(H, d, -1) * scale[:, None, None]).view(H * d, -1).to(
                q.dtype).contiguous()
        return out

    def _qkv(self, x: Tensor, positions: Optional[Tensor], cache: Optional[LayerKV], offset: int):
        """The baseline's q, k, v with each head's q scaled by ``exp(t_h)`` (a stack's ``(K, H)`` temperatures
        scale each model's own queries)."""
        q, k, v = super()._qkv(x, positions, cache, offset)
        t = self.log_temperature.exp()  # (H,) or (K, H) in a stack
        lead = t.shape[:-1]
        t = t.reshape(*lead, *([1] * (q.dim() - len(lead) - 2)), t.shape[-1], 1)  # (..., 1, 1, H, 1)
        return (q.to(t.dtype) * t).to(q.dtype), k, v


class DiffAttention(AttentionKind):
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
                 lambda_init: Optional[float] = None, use_subln: bool = True, subtract: bool = True,
                 out_scale: Optional[float] = None):
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx: must be a non-negative integer, got {layer_idx!r}")
        n_kv_heads, d = _check_heads(dim, n_heads, n_kv_heads, 2)
        super().__init__(dim, 2 * n_heads, 2 * n_kv_heads, n_kv_heads, d, 2 * d, dim, rope_theta, backend)
        self.n_heads, self.n_kv_heads, self.layer_idx, self.norm_eps = n_heads, n_kv_heads, layer_idx, norm_eps
        self.lambda_init = lambda_init_for_layer(layer_idx) if lambda_init is None else float(lambda_init)
        # each head's output scale: the paper's 1 - lambda_init unless given (ModelConfig.out_scale decouples them)
        self.out_scale = 1.0 - self.lambda_init if out_scale is None else float(out_scale)
        self.subtract = bool(subtract)
        if self.subtract:
            self.lambda_q1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.lambda_k1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.lambda_q2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
            self.lambda_k2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.subln = nn.RMSNorm(2 * d, eps=norm_eps, elementwise_affine=True) if use_subln else None
        self.reset_lambda()

    hf_model_type = "diffllama"
    remote_kind = "diff"
    config_fields = frozenset({"lambda_init", "use_subln", "subtract", "head_norm", "out_scale"})
    # the factor the trainer ramps lambda by during a warm-up (TrainConfig.lambda_warmup, set_lambda_scale); an
    # attribute of the module, never saved: a model loaded or built subtracts its full lambda. The eager forward
    # reads the number; a compiled one reads the same factor as a float32 scalar tensor (_lambda_factor, a plain
    # attribute: not a buffer, so neither saved nor loaded), an input of the graph, so a warm-up that changes it
    # every step does not recompile
    lambda_scale: float = 1.0
    _lambda_factor: Optional[Tensor] = None
    head_norm_default = True

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "DiffAttention":
        c = config
        return cls(c.dim, c.n_heads, layer_idx, c.n_kv_heads, c.rope_theta, backend=c.backend, norm_eps=c.norm_eps,
                   lambda_init=c.lambda_init, use_subln=c.uses_head_norm, subtract=c.subtract,
                   out_scale=None if c.out_scale is None else head_output_scale(c.out_scale, layer_idx, 1.0),
                   **c.options_dict())

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        v = config.lambda_init
        if v is None:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"ModelConfig.lambda_init: must be a finite number or null, got {v!r}")
        if not 0 < v < 1:  # the output is scaled by (1 - lambda_init): 0 at 1, sign flipped above
            raise ValueError(f"ModelConfig.lambda_init: must be in (0, 1) (each DIFF head's output is scaled by "
                             f"1 - lambda_init, which is 0 at 1 and negative above), got {v!r}")

    @classmethod
    def baseline_config(cls, config):
        """Standard attention with ``2H`` heads of width ``d`` and ``2Hkv`` kv heads, the same projections and
        RoPE; parameters equal up to the lambda vectors and ``subln`` gains. The DIFF options are dropped."""
        return config.plain(attention="standard", n_heads=2 * config.n_heads, n_kv_heads=2 * config.kv_groups)

    @classmethod
    def parameter_delta(cls, config) -> list[tuple[str, int, str]]:
        d, rows = config.head_dim, []
        if config.subtract:
            rows.append(("lambda_q1, lambda_k1, lambda_q2, lambda_k2", 4 * d, "4·d"))
        if config.uses_head_norm:
            rows.append(("subln.weight (per-head RMSNorm gain over the 2d-wide head)", 2 * d, "2·d"))
        return rows

    @classmethod
    def hf_refusal(cls, config) -> Optional[str]:
        if not config.subtract:
            return ("subtract=False (the no-subtraction control, lambda fixed at 0) cannot be exported faithfully: "
                    "DiffLlama always subtracts lambda * A2 V with a learned lambda = exp(lambda_q1.lambda_k1) - "
                    "exp(lambda_q2.lambda_k2) + lambda_init; its vectors could make lambda 0 only up to rounding, "
                    "and the result would train as DIFF, not as the control.")
        if config.out_scale is not None:
            return (f"out_scale={config.out_scale!r} cannot be exported exactly: DiffLlama scales each head by "
                    f"1 - lambda_init with lambda_init from the layer index (0.8 - 0.6*exp(-0.3*l)).")
        if not config.uses_head_norm:
            return ("head_norm=False (use_subln=False) cannot be exported exactly: DiffLlama always applies its "
                    "per-head RMSNorm to (A1 - lambda A2) V, and a model trained without that norm computes a "
                    "different function.")
        if config.lambda_init is not None:
            bad = [i for i in range(config.n_layers)
                   if not math.isclose(config.lambda_init, lambda_init_for_layer(i), rel_tol=0, abs_tol=1e-12)]
            if bad:
                return (f"lambda_init={config.lambda_init} (a constant override) cannot be exported exactly: "
                        f"DiffLlama derives lambda_init from the layer index as 0.8 - 0.6*exp(-0.3*l) (both the "
                        f"offset of lambda and the (1 - lambda_init) scale), which differs at layer(s) {bad[:8]}.")
        return None

    @classmethod
    def llama_refusal(cls, config) -> Optional[str]:
        return ("each head subtracts a second softmax map (A1 - lambda A2) V and normalises per head, which no Llama "
                "computes; export it without --as (DiffLlamaForCausalLM computes it exactly)")

    def init_parameters(self, draw: Callable[[str, float], None], std: float) -> None:
        """The projections as every kind's; the lambda vectors ``N(0, 0.1)`` (the paper's)."""
        super().init_parameters(draw, std)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2") if self.subtract else ():
            draw(name, LAMBDA_INIT_STD)

    def capture_maps(self, x: Tensor, maps: AttentionMaps) -> tuple[Tensor, Optional[Tensor]]:
        """``A1 - lambda A2`` and the scalar lambda."""
        return maps.effective, self.kernel_lambda().detach()

    def lambda_reading(self, gather: Callable[[Tensor], Tensor] = lambda p: p) -> Optional[float]:
        """``exp(q1.k1) - exp(q2.k2) + lambda_init`` from the gathered vectors (0 for the no-subtraction
        control)."""
        if not self.subtract:
            return 0.0
        with torch.no_grad():
            return float(lambda_value(*(gather(p).float() for p in self.lambda_parameters()), self.lambda_init))

    def cache_value_parts(self, device=None) -> int:
        """2 on CPU: the cached ``2d``-wide values are kept as two contiguous ``d``-wide halves per group,
        which a decoding step's ``A V`` reads faster there (docs/kernels.md, "Decode step"); 1 elsewhere
        (the GPU kernels read whole rows)."""
        return 2 if device is None or torch.device(device).type == "cpu" else 1

    def lambda_parameters(self) -> tuple[Tensor, ...]:
        """``(lambda_q1, lambda_k1, lambda_q2, lambda_k2)``; empty for the no-subtraction control."""
        if not self.subtract:
            return ()
        ps = self._parameters  # read directly: nn.Module's attribute fallback costs a decoding step's microseconds
        return ps["lambda_q1"], ps["lambda_k1"], ps["lambda_q2"], ps["lambda_k2"]

    def reset_lambda(self, std: float = LAMBDA_INIT_STD) -> None:  # construction's draw (the model redraws them paired)
        for p in self.lambda_parameters():
            nn.init.normal_(p, mean=0.0, std=std)

    def lambda_full(self) -> Tensor:
        """The re-parameterised lambda, a float32 scalar (float64 for float64 parameters).

        Without gradients, in a forward that writes into a KV cache (decoding), the value is kept with that cache
        until a lambda parameter changes (``_inference_value``). The no-subtraction control (``subtract=False``)
        returns a constant zero that needs no gradient."""
        if not self.subtract:
            w = self.q_proj.weight
            acc = at_least_fp32(w.dtype)
            if torch.compiler.is_compiling():  # a constant of the graph, not a tensor kept on the module
                return torch.zeros((), dtype=acc, device=w.device)
            zero = self.__dict__.get("_lambda_zero")
            if zero is None or zero.dtype != acc or zero.device != w.device:
                zero = self.__dict__["_lambda_zero"] = torch.zeros((), dtype=acc, device=w.device)
            return zero
        params = self.lambda_parameters()
        if records_grad(*params) or is_mapped(params[0]):
            return lambda_value(*params, self.lambda_init)
        return _inference_value(self, "_lambda_cache", params, self.lambda_init,
                                lambda: LambdaFunction.forward(*params, self.lambda_init)[0])

    def head_norm(self, o: Tensor) -> Tensor:
        """``out_scale * RMSNorm_2d(o)`` on ``o`` ``(..., H, 2d)``, computed in float32; ``out_scale`` is the
        paper's ``1 - lambda_init`` unless the config decouples it. Without gradients the gain with the scale folded in
        is one call of PyTorch's ``rms_norm`` (the same values), the gain kept with a KV cache as lambda is."""
        w = None if self.subln is None else self.subln.weight
        if w is None or w.dim() != 1 or o.dtype != w.dtype or o.dtype not in (torch.float32, torch.float64) \
                or records_grad(o, w) or is_mapped(w) or torch.compiler.is_compiling():
            return _rms_head_norm(o, w, self.out_scale, self.norm_eps)
        gain = _inference_value(self, "_gain_cache", (w,), self.out_scale,
                                lambda: w * self.out_scale if self.out_scale != 1.0 else w)
        return torch.rms_norm(o, (o.shape[-1],), gain, self.norm_eps)

    def set_lambda_scale(self, scale: float) -> None:
        """Set the warm-up factor: the number, and the tensor a compiled forward reads (updated in place, on the
        device of the module's weights)."""
        self.lambda_scale = float(scale)
        device = self.q_proj.weight.device
        factor = self._lambda_factor
        if factor is None or factor.device != device:
            self._lambda_factor = torch.full((), self.lambda_scale, dtype=torch.float32, device=device)
        elif not factor.is_meta:
            with torch.no_grad():
                factor.fill_(self.lambda_scale)

    def kernel_lambda(self) -> Tensor:
        """``lambda_scale * lambda``: the trainer's warm-up factor (``TrainConfig.lambda_warmup``) times the
        re-parameterised lambda; the factor is 1 outside a warm-up and is not saved with the model. Traced by
        torch.compile after :meth:`set_lambda_scale` has run, the product with the factor's tensor (the same
        float32 product): a graph that does not depend on the factor's value."""
        lam = self.lambda_full()
        if torch.compiler.is_compiling():
            factor = self._lambda_factor
            if factor is not None and factor.device == lam.device:
                return lam * factor
        return lam if self.lambda_scale == 1.0 else lam * self.lambda_scale

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        return self.head_norm(out)


class DiffAttentionV2(AttentionKind):
    """Differential attention, V2 (SPEC section 2).

    ``2 n_heads`` query heads of width ``d = dim / n_heads`` over ``n_kv_heads`` kv heads;
    pair ``(2j, 2j+1)`` gives output head ``j`` as ``a_2j - sigmoid(lambda_proj(x))_j a_2j+1``.
    Both members of a pair share a kv group, which needs ``n_heads % n_kv_heads == 0``.
    """

    extra_proj = "lambda_proj"
    remote_kind = "diff_v2"

    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, rope_theta: float = 10000.0, *,
                 backend: str = "auto"):
        n_kv_heads, d = _check_heads(dim, n_heads, n_kv_heads, 1, across_groups=True)
        super().__init__(dim, 2 * n_heads, n_kv_heads, n_kv_heads, d, d, n_heads * d, rope_theta, backend)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.lambda_proj = nn.Linear(dim, n_heads, bias=False)

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "DiffAttentionV2":
        c = config
        return cls(c.dim, c.n_heads, c.n_kv_heads, c.rope_theta, backend=c.backend, **c.options_dict())

    @classmethod
    def baseline_config(cls, config):
        """Standard attention with ``H`` heads of width ``d`` and ``Hkv`` kv heads (the V2 paper's comparison;
        V2 has ``D·H·d + D·H`` more attention parameters per layer)."""
        return config.plain(attention="standard", n_heads=config.n_heads, n_kv_heads=config.kv_groups)

    @classmethod
    def parameter_delta(cls, config) -> list[tuple[str, int, str]]:
        D, H, d = config.dim, config.n_heads, config.head_dim
        return [("q_proj rows of the second query head of each pair", D * H * d, "D·H·d"),
                ("lambda_proj (W_lambda: D -> H)", D * H, "D·H")]

    @classmethod
    def hf_refusal(cls, config) -> Optional[str]:
        return ("attention='diff_v2' cannot be exported: transformers has no Differential Transformer V2 class. "
                "DiffLlama implements V1 only (two softmax maps per head over a 2d-wide value, a scalar lambda "
                "from lambda_q1..k2, a per-head RMSNorm and the (1 - lambda_init) factor), while V2 pairs "
                "d-wide query heads with a token-dependent sigmoid(lambda_proj(x)) and has no norm; no "
                "permutation of weights turns one into the other. Export a 'diff' (V1) or 'standard' model instead.")

    @classmethod
    def llama_refusal(cls, config) -> Optional[str]:
        return ("each head subtracts a second softmax map scaled by the token-dependent sigmoid(lambda_proj(x)), "
                "which no Llama computes")

    def capture_maps(self, x: Tensor, maps: AttentionMaps) -> tuple[Tensor, Optional[Tensor]]:
        """The kernel's maps are the ``2H`` plain softmax maps; the output mixes pairs per query row:
        ``a_2j - sigmoid(x W_lambda)_j a_2j+1``, and lambda is ``(B, T, H)``."""
        lam = torch.sigmoid(linear(x, self.lambda_proj.weight).float()).detach()  # (B, T, H)
        probs = maps.probs.float()
        return probs[:, 0::2] - lam.permute(0, 2, 1)[..., None] * probs[:, 1::2], lam

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """Pairs ``(2j, 2j+1)`` of the kernel's ``2H`` heads as ``a_2j - sigmoid(x W_lambda)_j a_2j+1``
        (``extra`` is ``x W_lambda``)."""
        lam = torch.sigmoid(extra.to(at_least_fp32(extra.dtype)))[..., None]  # (..., H, 1)
        return (out[..., 0::2, :].to(lam.dtype) - lam * out[..., 1::2, :].to(lam.dtype)).to(out.dtype)

