"""A difftx model as a transformers causal LM, for ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` (``difftx export`` copies this file beside the weights).

Self-contained: it imports only torch, transformers and the standard library, so the folder loads where difftx is
not installed. It computes every built-in difftx attention kind, written from difftx's equations (docs/design.md,
docs/interop.md); the parameter names are difftx's own under ``model.`` (``lm_head.weight`` apart), so the weights
are difftx's state dict unchanged. Legend: ``B`` batch, ``T`` new tokens, ``S`` keys (cached + new), ``D`` model
width, ``H`` the config's ``n_heads``, ``G`` kv groups, ``d`` the query/key (sub-)head width, ``C`` the softmax maps
a head combines (2 for ``A1 - lambda A2``, else 1), ``R`` heads per kv group.

Each layer's attention: ``q``, ``k``, ``v`` projections of the block's normed input ``x`` (each with a bias when
``qkv_bias``, added before RoPE, as Qwen2 adds it; ``out_proj`` has none); RoPE (GPT-J pairs
``(2i, 2i+1)``, frequency ``theta^(-2i/d)``) on every ``d``-wide query and key head unless ``rope`` is false;
query sub-head ``h*C + c`` (head ``h = g*R + r``) reads key sub-head ``g*C + c`` and the value of group ``g``;
each map ``softmax(q k^T / sqrt(d))`` in float32; then the kind's own step before ``out_proj``.

What differs by kind is one class per kind in :data:`KINDS`, named by the config's ``attention``: its widths
and constants, the parameters it adds, its step on the queries, its step before ``out_proj`` and a new model's
draw. difftx's kinds name their class here (``remote_kind``), and difftx's tests check that every built-in kind
has one.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import transformers
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_difftx import DifftxConfig

_V5 = int(transformers.__version__.split(".")[0]) >= 5
# the output field holding the cache: "cache" in recent transformers, "past_key_values" before
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
LAMBDA_INIT_STD = 0.1  # the lambda vectors' draw for a new model (the paper's)


def lambda_init_for_layer(layer_idx: int) -> float:
    """The depth schedule ``0.8 - 0.6 exp(-0.3 l)``, ``l`` counted from 0."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def _head_scale(out_scale, layer_idx: int, default: float) -> float:
    if out_scale is None:
        return float(default)
    if out_scale == "schedule":
        return 1.0 - lambda_init_for_layer(layer_idx)
    return float(out_scale)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class DifftxRMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps)


class _Positions:
    """The RoPE positions ``(B|1, T)`` of one forward call, with the rotation's cos and sin computed once per head
    width, theta and dtype and shared by every layer's queries and keys."""

    def __init__(self, ids: torch.Tensor):
        self.ids, self._angles = ids, {}

    def angles(self, d: int, theta: float, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``(B|1, T, 1, d/2)`` of the angles ``pos * theta^(-2i/d)``."""
        key = (d, theta, acc)
        if key not in self._angles:
            inv_freq = theta ** (-torch.arange(0, d, 2, device=self.ids.device, dtype=acc) / d)  # (d/2,)
            ang = self.ids.to(acc)[..., None] * inv_freq  # (B|1, T, d/2)
            self._angles[key] = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        return self._angles[key]


def _rope(x: torch.Tensor, positions: _Positions, theta: float) -> torch.Tensor:
    """``x`` ``(B, T, heads, d)`` rotated pair by pair: ``(x0, x1)`` by angle ``pos * theta^(-2i/d)``."""
    acc = _acc(x.dtype)
    cos, sin = positions.angles(x.shape[-1], theta, acc)
    x0, x1 = x.to(acc).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


class Kind:
    """One layer's attention of one kind (``config.attention``): widths, head counts and constants from the config,
    the parameters the kind adds, and its steps. This base is what every kind shares: ``d``-wide heads with one
    softmax map each, no lambda, no norm, no scale."""

    maps = 1  # C: the softmax maps a head combines (2 for A1 - lambda A2)
    queries_per_head = 1  # query sub-heads per head: C, or diff_v2's two one-map heads
    wide = 1  # a head's output width in d: 2 for DIFF V1 (dim = 2 H d, a 2d-wide value per group)

    def __init__(self, c: DifftxConfig, layer_idx: int):
        H = c.n_heads
        G = H if c.n_kv_heads is None else c.n_kv_heads
        self.name, self.H, self.groups = c.attention, H, G
        d = self.d = c.dim // (self.wide * H)
        self.C = self.maps
        self.q_heads = self.queries_per_head * H
        self.kv_heads = self.C * G
        self.v_width = self.wide * d
        self.out_in = self.q_heads // self.C * self.v_width  # out_proj's input width
        self.lambdas = False  # the four lambda vectors
        self.lambda_init = 0.0 if c.lambda_init is None else float(c.lambda_init)
        self.norm_width, self.scale = None, 1.0  # the per-head RMSNorm's width (None: no norm), the head scale

    def add_parameters(self, attn: nn.Module, dim: int) -> None:
        """The parameters the kind adds to ``attn`` beside q/k/v/out, the lambda vectors and the norm."""

    def queries(self, attn: nn.Module, q: torch.Tensor) -> torch.Tensor:
        """The rotated queries ``(B, T, heads, d)`` as the core reads them."""
        return q

    def finish(self, attn: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Each head's output before ``out_proj`` (float32), from the core's ``(B, T, heads, dv)``: the per-head
        RMSNorm with its gain times the scale, or the scale alone."""
        if self.norm_width is not None:
            w = attn.subln.weight * self.scale if self.scale != 1.0 else attn.subln.weight
            return _rms(out, w.to(out.dtype), attn.subln.eps)
        return out * self.scale if self.scale != 1.0 else out

    def init(self, attn: nn.Module, fill) -> None:
        """A new model's draw of the kind's own parameters (``fill(p, how)`` leaves loaded ones alone): the lambda
        vectors ``N(0, 0.1)``."""
        if self.lambdas:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                fill(getattr(attn, name), lambda p: p.normal_(0.0, LAMBDA_INIT_STD))


class StandardKind(Kind):
    """``standard``: ``A V``, then the per-head RMSNorm (``head_norm``, gain ``subln``) and ``out_scale`` if set."""

    def __init__(self, c: DifftxConfig, layer_idx: int):
        super().__init__(c, layer_idx)
        self.norm_width = self.d if c.head_norm else None
        self.scale = _head_scale(c.out_scale, layer_idx, 1.0)


class TemperatureKind(Kind):
    """``temperature``: each head's queries times ``exp(log_temperature[h])``."""

    def add_parameters(self, attn, dim):
        attn.log_temperature = nn.Parameter(torch.zeros(self.H))

    def queries(self, attn, q):
        t = attn.log_temperature.exp()
        return (q.to(t.dtype) * t.view(1, 1, -1, 1)).to(q.dtype)

    def init(self, attn, fill):
        super().init(attn, fill)
        fill(attn.log_temperature, lambda p: p.zero_())


class GatedKind(Kind):
    """``gated``: ``A V * sigmoid(x W_g)``, elementwise (``H*d`` gates) or head-wise (``H``)."""

    def __init__(self, c: DifftxConfig, layer_idx: int):
        super().__init__(c, layer_idx)
        self.gate = c.gate or "elementwise"

    def add_parameters(self, attn, dim):
        attn.gate_proj = nn.Linear(dim, self.H * self.d if self.gate == "elementwise" else self.H, bias=False)

    def finish(self, attn, out, x):
        g = torch.sigmoid(attn.gate_proj(x).to(out.dtype)).unflatten(-1, (self.H, -1))
        return out * g


class DiffKind(Kind):
    """``diff`` (V1): ``C = 2``, a ``2d``-wide value per group, ``(A1 - lambda A2) V``, ``lambda = exp(lq1.lk1) -
    exp(lq2.lk2) + lambda_init`` (``lambda_init`` the constant, or ``0.8 - 0.6 exp(-0.3 l)``), then the per-head
    RMSNorm over ``2d`` (unless ``head_norm``/``use_subln`` is false) times ``1 - lambda_init`` (or ``out_scale``);
    ``subtract=false``: lambda is 0 and there are no lambda vectors."""

    maps, queries_per_head, wide = 2, 2, 2

    def __init__(self, c: DifftxConfig, layer_idx: int):
        super().__init__(c, layer_idx)
        self.lambdas = bool(c.subtract)
        self.lambda_init = lambda_init_for_layer(layer_idx) if c.lambda_init is None else float(c.lambda_init)
        self.norm_width = 2 * self.d if (c.use_subln if c.head_norm is None else c.head_norm) else None
        self.scale = _head_scale(c.out_scale, layer_idx, 1.0 - self.lambda_init)


class DiffV2Kind(Kind):
    """``diff_v2``: ``2H`` one-map heads of width ``d``; output head ``j`` is ``a_2j - sigmoid(x W_lambda)_j
    a_2j+1``."""

    queries_per_head = 2

    def __init__(self, c: DifftxConfig, layer_idx: int):
        super().__init__(c, layer_idx)
        self.out_in = self.H * self.d

    def add_parameters(self, attn, dim):
        attn.lambda_proj = nn.Linear(dim, self.H, bias=False)

    def finish(self, attn, out, x):
        lam = torch.sigmoid(attn.lambda_proj(x).to(out.dtype))[..., None]  # (B, T, H, 1)
        return out[..., 0::2, :] - lam * out[..., 1::2, :]


class ConvertedKind(Kind):
    """``converted``: as ``diff`` with a ``d``-wide value, ``lambda_init`` 0 unless set, no norm and no scale; a new
    model's second pair of lambda vectors equals the first (lambda exactly 0, with a gradient)."""

    maps, queries_per_head = 2, 2

    def __init__(self, c: DifftxConfig, layer_idx: int):
        super().__init__(c, layer_idx)
        self.lambdas = True

    def init(self, attn, fill):
        super().init(attn, fill)
        fill(attn.lambda_q2, lambda p: p.copy_(attn.lambda_q1))
        fill(attn.lambda_k2, lambda p: p.copy_(attn.lambda_k1))


class DexKind(ConvertedKind):
    """``dex``: one map per head; a selected head (``options.heads``, default all) gives ``A V (I - lambda W)``;
    lambda and its start as ``converted``'s, ``W`` (``dex_map``) the identity in a new model."""

    maps, queries_per_head = 1, 1

    def __init__(self, c: DifftxConfig, layer_idx: int):
        super().__init__(c, layer_idx)
        heads = (c.options or {}).get("heads")
        self.selected = tuple(range(self.H)) if heads is None else tuple(heads[layer_idx])

    def add_parameters(self, attn, dim):
        attn.dex_map = nn.Parameter(torch.eye(self.d))

    def finish(self, attn, out, x):
        if not self.selected:
            return out
        lam = attn.lambda_value().to(out.dtype)
        if len(self.selected) < self.H:
            mask = torch.zeros(self.H, 1, dtype=out.dtype, device=out.device)
            mask[list(self.selected)] = 1.0
            lam = lam * mask
        return out - lam * torch.matmul(out, attn.dex_map.to(out.dtype))

    def init(self, attn, fill):
        super().init(attn, fill)
        fill(attn.dex_map, lambda p: p.copy_(torch.eye(p.shape[0])))


# the kinds this file computes, by difftx's name (config.attention): difftx's built-in kinds
KINDS = {"standard": StandardKind, "gated": GatedKind, "temperature": TemperatureKind, "diff": DiffKind,
         "diff_v2": DiffV2Kind, "converted": ConvertedKind, "dex": DexKind}


def kind_of(config: DifftxConfig, layer_idx: int) -> Kind:
    """Layer ``layer_idx``'s :class:`Kind`, or a one-line error naming the kinds this file computes."""
    cls = KINDS.get(config.attention)
    if cls is None:
        raise ValueError(f"DifftxConfig: attention={config.attention!r} is not a kind this modeling file computes "
                         f"(it computes {tuple(KINDS)})")
    return cls(config, layer_idx)


class DifftxAttention(nn.Module):
    def __init__(self, config: DifftxConfig, layer_idx: int):
        super().__init__()
        s = self.kind = kind_of(config, layer_idx)
        D, d = config.dim, s.d
        self.layer_idx, self.rope, self.rope_theta = layer_idx, bool(config.rope), float(config.rope_theta)
        bias = bool(getattr(config, "qkv_bias", False))
        self.q_proj = nn.Linear(D, s.q_heads * d, bias=bias)
        self.k_proj = nn.Linear(D, s.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(D, s.groups * s.v_width, bias=bias)
        self.out_proj = nn.Linear(s.out_in, D, bias=False)
        if s.lambdas:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                setattr(self, name, nn.Parameter(torch.zeros(d)))
        if s.norm_width is not None:
            self.subln = DifftxRMSNorm(s.norm_width, config.norm_eps)
        s.add_parameters(self, D)

    def lambda_value(self, reuse: bool = False) -> torch.Tensor:
        """``exp(lq1.lk1) - exp(lq2.lk2) + lambda_init`` in float32 (or wider). Without gradients the value is kept;
        with ``reuse`` (a decoding step: a forward that extends a cached prefix) it is read back while the lambda
        vectors keep their version counters and storage: once per generation, not per token. Other calls (the
        prompt's forward among them) compute it, so a write through ``p.data``, which moves no version counter,
        is read by the next generation."""
        params = (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2)
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in params)
        key = None if grad else tuple((p._version, p.data_ptr(), p.dtype) for p in params)
        if reuse and key is not None and key == self.__dict__.get("_lambda_key"):
            return self.__dict__["_lambda"]
        acc = _acc(self.lambda_q1.dtype)
        q1, k1, q2, k2 = (p.to(acc) for p in params)
        value = torch.exp(torch.dot(q1, k1)) - torch.exp(torch.dot(q2, k2)) + self.kind.lambda_init
        if key is not None:
            self.__dict__["_lambda_key"], self.__dict__["_lambda"] = key, value
        return value

    def forward(self, x: torch.Tensor, positions: _Positions, allowed: Optional[torch.Tensor],
                cache: Optional[Cache]) -> torch.Tensor:
        s, d = self.kind, self.kind.d
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, s.q_heads, d)
        k = self.k_proj(x).view(B, T, s.kv_heads, d)
        v = self.v_proj(x).view(B, T, s.groups, s.v_width)
        if self.rope:
            q, k = _rope(q, positions, self.rope_theta), _rope(k, positions, self.rope_theta)
        q = s.queries(self, q)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, width): the cache's layout
        decoding = cache is not None and cache.get_seq_length(self.layer_idx) > 0  # a prefix is cached
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # the whole prefix: (B, heads, S, width)
        S, G, C = k.shape[2], s.groups, s.C
        R = s.q_heads // (C * G)
        acc = _acc(q.dtype)
        # the R heads of a group share its keys and values: their rows stacked in one product (no broadcast copies)
        qg = q.to(acc).view(B, T, G, R, C, d).permute(0, 2, 4, 3, 1, 5).reshape(B, G, C, R * T, d)
        kg = k.to(acc).reshape(B, G, C, S, d)
        logits = torch.matmul(qg, kg.transpose(-1, -2)).mul_(1.0 / math.sqrt(d))  # (B, G, C, R*T, S)
        if allowed is not None:
            logits.view(B, G, C, R, T, S).masked_fill_(~allowed[:, None, None, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if C == 2 and s.lambdas:
            eff = probs[:, :, 0] - self.lambda_value(decoding) * probs[:, :, 1]  # (B, G, R*T, S)
        else:  # one map (or DIFF's no-subtraction control: lambda is 0)
            eff = probs[:, :, 0]
        out = torch.matmul(eff, v.to(acc)).view(B, G, R, T, -1)  # (B, G, R, T, dv)
        out = out.permute(0, 3, 1, 2, 4).reshape(B, T, G * R, -1)  # (B, T, heads, dv), head g*R + r
        out = s.finish(self, out, x)
        return self.out_proj(out.flatten(-2).to(x.dtype))


class DifftxMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DifftxBlock(nn.Module):
    """Pre-norm block: ``x + Attn(RMSNorm(x))``, then ``x + SwiGLU(RMSNorm(x))``."""

    def __init__(self, config: DifftxConfig, layer_idx: int):
        super().__init__()
        hidden = config.ffn_hidden or 64 * math.ceil(8 * config.dim / 3 / 64)
        self.attn_norm = DifftxRMSNorm(config.dim, config.norm_eps)
        self.attn = DifftxAttention(config, layer_idx)
        self.mlp_norm = DifftxRMSNorm(config.dim, config.norm_eps)
        self.mlp = DifftxMLP(config.dim, hidden)

    def forward(self, x, positions, allowed, cache):
        x = x + self.attn(self.attn_norm(x), positions, allowed, cache)
        return x + self.mlp(self.mlp_norm(x))


class DifftxPreTrainedModel(PreTrainedModel):
    config_class = DifftxConfig
    base_model_prefix = "model"
    _no_split_modules = ["DifftxBlock"]
    supports_gradient_checkpointing = False
    _supports_cache_class = True  # transformers 4.x
    _supports_static_cache = False

    def _init_weights(self, module: nn.Module) -> None:
        """A new model's draw, as difftx's ``init="normal"``: linear maps and embeddings ``N(0, init_std)``, unit
        gains, zero q/k/v biases, and each kind's own parameters as its :meth:`Kind.init` draws them. Weights loaded
        from the folder are left as they are."""
        def fill(p, how):
            if p is not None and not getattr(p, "_is_hf_initialized", False):
                with torch.no_grad():
                    how(p)

        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            fill(module.weight, lambda p: p.normal_(0.0, std))
            fill(getattr(module, "bias", None), lambda p: p.zero_())
        elif isinstance(module, DifftxRMSNorm):
            fill(module.weight, lambda p: p.fill_(1.0))
        elif isinstance(module, DifftxAttention):
            module.kind.init(module, fill)


def _output(cls, cache_obj, **fields):
    return cls(**fields, **{_CACHE_FIELD: cache_obj})


def _new_cache(config: DifftxConfig) -> Cache:
    try:
        return DynamicCache(config=config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


class DifftxModel(DifftxPreTrainedModel):
    def __init__(self, config: DifftxConfig):
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DifftxBlock(config, i) for i in range(config.n_layers))
        self.norm = DifftxRMSNorm(config.dim, config.norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.tok_embeddings

    def set_input_embeddings(self, value):
        self.tok_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache=None, return_dict=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(f"the cache must be a transformers Cache (e.g. DynamicCache), got {type(cache).__name__}")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = _new_cache(self.config)
        x = self.tok_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        S = past + T
        if position_ids is None:
            position_ids = torch.arange(past, S, device=x.device)[None]
        if kwargs.get("output_attentions", self.config.output_attentions):
            raise ValueError("output_attentions: not returned by this model's code (a differential head has two "
                             "maps); difftx.eval.capture.AttentionCapture reads them from the difftx model")
        hidden = kwargs.get("output_hidden_states")
        hidden = () if (self.config.output_hidden_states if hidden is None else hidden) else None
        allowed = self._allowed(attention_mask, B, T, S, past, x.device)
        positions = _Positions(position_ids)
        for block in self.layers:
            hidden = None if hidden is None else (*hidden, x)  # the embeddings, then each block's input
            x = block(x, positions, allowed, cache if use_cache else None)
        x = self.norm(x)
        hidden = None if hidden is None else (*hidden, x)  # and the last block's output, normed (as Llama's)
        out = _output(BaseModelOutputWithPast, cache if use_cache else None, last_hidden_state=x, hidden_states=hidden)
        return out if return_dict is not False else out.to_tuple()

    @staticmethod
    def _allowed(mask, B: int, T: int, S: int, past: int, device) -> Optional[torch.Tensor]:
        """``(B|1, T, S)`` bool: which keys each new token attends to (causal, and the 2-D padding mask's real
        tokens; a 4-D mask ``(B, 1, T, S)``, boolean or additive, as given). A row that would see no key sees
        every key instead (a padding row: finite, and never read). None when every new token sees every key (one
        token after its cache, no padding mask): nothing to mask."""
        if mask is None and T == 1:
            return None
        if mask is not None and mask.dim() == 4:
            allowed = mask[:, 0].bool() if mask.dtype == torch.bool else mask[:, 0] == 0
        else:
            allowed = (torch.arange(S, device=device)[None] <= torch.arange(past, S, device=device)[:, None])[None]
            if mask is not None:
                if tuple(mask.shape) != (B, S):
                    raise ValueError(f"attention_mask must have shape {(B, S)} (cached + new tokens), "
                                     f"got {tuple(mask.shape)}")
                allowed = allowed & mask.bool()[:, None, :]
        return allowed | ~allowed.any(-1, keepdim=True)


class DifftxForCausalLM(DifftxPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.tok_embeddings.weight"} if _V5 else ["lm_head.weight"]

    def __init__(self, config: DifftxConfig):
        super().__init__(config)
        self.model = DifftxModel(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def set_input_embeddings(self, value):
        self.model.tok_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, cache=None, logits_to_keep=0, return_dict=None,
                **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache,
                         cache=cache if cache is not None else past_key_values,
                         **{k: kwargs[k] for k in ("output_hidden_states", "output_attentions") if k in kwargs})
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        else:
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:  # next-token cross-entropy, labels aligned with input_ids (-100: ignored)
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        res = _output(CausalLMOutputWithPast, getattr(out, _CACHE_FIELD), loss=loss, logits=logits,
                      hidden_states=out.hidden_states)
        return res if return_dict is not False else res.to_tuple()
