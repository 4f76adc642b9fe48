"""The ``converted`` attention kind: a pretrained model's standard attention made differential (issue 40).

A model converted by :func:`difftx.interop.convert.convert_model` keeps its source's ``H`` heads of width
``d = dim / H`` and its kv groups (GQA as in the source). Each head gains a second query/key component of
the same width ``d``, the *negative* one, and keeps ONE ``d``-wide value, the source head's::

    O_h = (softmax(Q1 K1^T / sqrt(d)) - lambda * softmax(Q2 K2^T / sqrt(d))) V

``Q1``/``K1`` are the source head's query and key. ``lambda`` is one scalar per layer, re-parameterised
as in DIFF V1: ``lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init``, with ``lambda_init = 0`` by default
(``ModelConfig.lambda_init`` in ``[0, 1)`` is an offset, reached from 0 by a lambda warm-up in training,
``TrainConfig.lambda_warmup``: the model as loaded subtracts it).

Function at conversion: the lambda vectors start as two equal pairs (``lq2 = lq1``, ``lk2 = lk1``, drawn
``N(0, 0.1)`` as DIFF's). Then ``lambda`` is exactly 0, so each head computes the source's attention,
while lambda's gradient is not 0 (with all four vectors at zero it would be, and lambda would never move).

No per-head norm: ``RMSNorm(O_h)`` differs from ``O_h``, so a norm would change the function at step 0.
DIFF's ``(1 - lambda_init)`` factor is 1 here. ``head_norm=True`` is refused by the config.

Layout (rows of the projections, RoPE on every ``d``-wide query/key sub-head as in every difftx kind)::

    q_proj   (H,   c, d): sub-head 2h + c, c = 0 the positive (source) component, c = 1 the negative one
    k_proj   (Hkv, c, d): sub-head 2g + c, the same pairing per kv group
    v_proj   (Hkv, d):    the source's values
    out_proj columns (H, d): the source's

With ``qkv_bias`` (a Qwen2 source) each projection's bias has the layout of its rows, and is added before RoPE.

This is the kernels' differential contract with a value as wide as q and k (``dv = d``): ``eager``,
``chunked``, ``sdpa`` and ``flex`` take it; the fused ``triton`` kernel is written for DIFF's ``2d``-wide
values and hands these calls to ``sdpa``. The parameter-matched baseline is the source: standard attention
with the same heads.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ..ops import at_least_fp32, lambda_value
from .modules import LAMBDA_INIT_STD, AttentionKind, DiffAttention, _check_heads

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def saved_lambda(config, state: dict[str, Tensor], layer: int) -> Tensor:
    """Layer ``layer``'s lambda in ``state``, a state dict of ``config`` (a ``converted`` or ``dex`` model), as the
    model computes it: ``exp(lq1.lk1) - exp(lq2.lk2) + lambda_init`` (``lambda_init`` 0 unless set) in float32
    (float64 for float64 vectors)."""
    a = f"layers.{layer}.attn."
    vectors = [state[a + n] for n in LAMBDAS]
    acc = at_least_fp32(vectors[0].dtype)
    with torch.no_grad():
        return lambda_value(*(v.to(acc) for v in vectors), float(config.lambda_init or 0.0))


class ConvertedAttention(DiffAttention):
    """A converted model's attention (see the module doc): ``n_heads`` heads of width ``d = dim / n_heads``
    over ``n_kv_heads`` kv groups, each with two ``d``-wide query/key components and one ``d``-wide value;
    ``lambda = exp(lq1.lk1) - exp(lq2.lk2)`` + ``lambda_init`` (0 unless set), no per-head norm."""

    width_parts = 1  # a head's output is d wide: dim = n_heads * d, as in the source
    hf_model_type = None
    remote_kind = "converted"
    config_fields = frozenset({"lambda_init", "qkv_bias"})
    head_norm_default = False

    def __init__(self, dim: int, n_heads: int, layer_idx: int, n_kv_heads: Optional[int] = None,
                 rope_theta: float = 10000.0, *, backend: str = "auto", norm_eps: float = 1e-5,
                 lambda_init: Optional[float] = None, qkv_bias: bool = False):
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx: must be a non-negative integer, got {layer_idx!r}")
        n_kv_heads, d = _check_heads(dim, n_heads, n_kv_heads, 1)
        C = self.components  # query/key components per head: 2 here, 1 for a kind with one map (dex)
        AttentionKind.__init__(self, dim, C * n_heads, C * n_kv_heads, n_kv_heads, d, d, dim, rope_theta, backend,
                               qkv_bias=qkv_bias)
        self.n_heads, self.n_kv_heads, self.layer_idx, self.norm_eps = n_heads, n_kv_heads, layer_idx, norm_eps
        self.lambda_init = 0.0 if lambda_init is None else float(lambda_init)
        self.subtract = True
        self.lambda_q1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.lambda_k1 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.lambda_q2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.lambda_k2 = nn.Parameter(torch.zeros(d, dtype=torch.float32))
        self.subln = None
        self.reset_lambda()

    @classmethod
    def from_config(cls, config, layer_idx: int) -> "ConvertedAttention":
        c = config
        return cls(c.dim, c.n_heads, layer_idx, c.n_kv_heads, c.rope_theta, backend=c.backend, norm_eps=c.norm_eps,
                   lambda_init=c.lambda_init, qkv_bias=c.qkv_bias, **c.options_dict())

    @classmethod
    def check_config(cls, config) -> None:
        AttentionKind.check_config.__func__(cls, config)
        v = config.lambda_init
        if v is None:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 1:
            raise ValueError(f"ModelConfig.lambda_init: a converted model's lambda offset must be in [0, 1) (0, the "
                             f"default, keeps the source's function; a larger one is reached by a lambda warm-up, "
                             f"TrainConfig.lambda_warmup), got {v!r}")

    @classmethod
    def baseline_config(cls, config):
        """The source: standard attention with the same ``H`` heads of width ``d`` and ``Hkv`` kv groups."""
        return config.plain(attention="standard")

    @classmethod
    def parameter_delta(cls, config) -> list[tuple[str, int, str]]:
        D, H, Hkv, d = config.dim, config.n_heads, config.kv_groups, config.head_dim
        rows = [("q_proj rows of the negative query components", D * H * d, "D·H·d"),
                ("k_proj rows of the negative key components", D * Hkv * d, str(D * Hkv * d))]
        if config.qkv_bias:
            rows += [("q_proj.bias entries of the negative query components", H * d, "H·d"),
                     ("k_proj.bias entries of the negative key components", Hkv * d, str(Hkv * d))]
        return rows + [("lambda_q1, lambda_k1, lambda_q2, lambda_k2", 4 * d, "4·d")]

    @classmethod
    def hf_refusal(cls, config) -> Optional[str]:
        return ("attention='converted' cannot be exported: no transformers class computes it. DiffLlama's heads "
                "read a value twice as wide as their query/key, apply a per-head RMSNorm and scale by "
                "(1 - lambda_init) with lambda_init from its depth schedule; a converted head has a d-wide value, "
                "no norm and lambda_init 0, and the norm is not linear, so no choice of weights makes one the other "
                "(at lambda exactly 0 export --as llama writes its source; without --no-remote-code difftx's own "
                "code keeps it)")

    @classmethod
    def llama_fold(cls, config, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Where lambda is exactly 0 in every layer (as at conversion) each head computes ``A1 V``: the source's
        attention. The negative component's q/k rows (and biases) are dropped, and the lambda vectors with them.
        A layer whose lambda is not 0 is refused."""
        d, D = config.head_dim, config.dim
        for i in range(config.n_layers):
            lam = float(saved_lambda(config, state, i))
            if lam != 0.0:
                raise ValueError(f"layer {i}'s lambda is {lam:.6g}, not 0 (lambda_init={config.lambda_init or 0}): "
                                 f"the second softmax map is subtracted, so the folded model would compute a "
                                 f"different function")
        out = {}
        for i in range(config.n_layers):
            a = f"layers.{i}.attn."
            for name, groups in (("q_proj.weight", config.n_heads), ("k_proj.weight", config.kv_groups)):
                w = state[a + name]  # rows (groups, c, d): c = 0 the source's component
                out[a + name] = w.view(groups, 2, d, D)[:, 0].reshape(groups * d, D).contiguous()
                if config.qkv_bias:  # the bias entries of those rows
                    bias = a + name.replace(".weight", ".bias")
                    out[bias] = state[bias].view(groups, 2, d)[:, 0].reshape(groups * d).contiguous()
        return out

    def init_parameters(self, draw: Callable[[str, float], None], std: float) -> None:
        """The projections as every kind's; ``lambda_q1``, ``lambda_k1`` ``N(0, 0.1)`` and the second pair equal
        to the first (``lambda`` exactly 0 at initialisation, with a gradient)."""
        AttentionKind.init_parameters(self, draw, std)
        draw("lambda_q1", LAMBDA_INIT_STD)
        draw("lambda_k1", LAMBDA_INIT_STD)
        self._pair_lambda()

    def reset_lambda(self, std: float = LAMBDA_INIT_STD) -> None:
        nn.init.normal_(self.lambda_q1, mean=0.0, std=std)
        nn.init.normal_(self.lambda_k1, mean=0.0, std=std)
        self._pair_lambda()

    def _pair_lambda(self) -> None:
        with torch.no_grad():
            self.lambda_q2.copy_(self.lambda_q1)
            self.lambda_k2.copy_(self.lambda_k1)

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """Each head's ``(A1 - lambda A2) V`` as the core computed it: no norm, and no ``(1 - lambda_init)`` scale
        (DIFF's scale belongs to its norm)."""
        return out

    def cache_value_parts(self, device=None) -> int:
        """1: the cached values are ``d`` wide, one piece per row."""
        return 1
