"""The ``dex`` attention kind: a pretrained model's attention with a differential operation on the value side of
selected heads, after DEX (Kong, Jang and Kwak 2025, "Understanding Differential Transformer Unchains Pretrained
Self-Attentions", arXiv 2505.16333; issue 40).

A model made by ``difftx convert --method dex`` keeps its source's ``H`` heads of width ``d = dim / H``, their
queries, keys and values (GQA as in the source), and so each head's ONE softmax map ``A_h``. A selected head
``h`` subtracts a learned map of its own output::

    O_h = A_h V_h - lambda * (A_h V_h) W  =  A_h V_h (I - lambda W)        (h selected)
    O_h = A_h V_h                                                          (h not selected)

``W`` is one learned ``d x d`` map per layer, shared by the layer's selected heads (``dex_map``); ``A_h (V_h W)``
equals ``(A_h V_h) W``, so it is applied to the head's output, after the attention core, and the KV cache holds
the source's keys and values. ``lambda`` is one scalar per layer, re-parameterised as in DIFF V1:
``lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init``, ``lambda_init = 0`` unless set (an offset reached by the
trainer's lambda warm-up, ``TrainConfig.lambda_warmup``, which scales lambda by its factor ``lambda_scale``).

Function at conversion: the lambda vectors start as two equal pairs (``lq2 = lq1``, ``lk2 = lk1``, ``N(0, 0.1)``),
so lambda is exactly 0 and every head computes the source's attention. ``W`` starts as the identity: a selected
head then computes ``(1 - lambda) A_h V_h``, and lambda's gradient, ``-<dL/dO_h, O_h W>`` summed over the selected
heads, is not 0. With ``W = 0`` both gradients would vanish (``dL/dW`` is proportional to lambda, ``dL/dlambda`` to
``W``) and neither would ever move. ``W`` moves once lambda does.

The head selection is the kind's option ``heads``: for each layer, the indices of its selected heads (``None``:
every head of every layer). ``ModelConfig(attention="dex", options={"heads": [[0, 2], [1], ...]})``.

Since ``I - lambda W`` is linear and ``out_proj`` follows, a DEX head's operation could be folded into
``out_proj``: with ``out_proj`` trained too it adds no function the source could not compute, only another
parameterisation of it (the learning dynamics DEX is about). Export writes difftx's own modeling code
(``trust_remote_code``), which keeps lambda and W; ``export --as llama`` writes the fold, a plain Llama
(:meth:`DexAttention.llama_fold`).
The parameter-matched baseline is the source: standard attention with the same heads.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from ..ops import at_least_fp32, stacked_like
from .converted import ConvertedAttention, saved_lambda
from .kernels import AttentionMaps
from .modules import AttentionKind, DiffAttention


def _heads_error(rule: str) -> ValueError:
    return ValueError(f"ModelConfig.options: heads {rule}")


@dataclasses.dataclass
class DexOptions:
    """``heads``: per layer, the indices of the heads that take the differential operation (each list sorted,
    without repeats; an empty list leaves a layer as the source's), or None for every head of every layer."""

    heads: Optional[list] = None

    def __post_init__(self) -> None:
        h = self.heads
        if h is None:
            return
        if not isinstance(h, (list, tuple)) or not all(isinstance(layer, (list, tuple)) for layer in h):
            raise _heads_error(f"must be a list with one list of head indices per layer, or null (every head), "
                               f"got {h!r}")
        for i, layer in enumerate(h):
            if any(isinstance(j, bool) or not isinstance(j, int) or j < 0 for j in layer):
                raise _heads_error(f"layer {i}: head indices must be non-negative integers, got {list(layer)!r}")
            if list(layer) != sorted(set(layer)):
                raise _heads_error(f"layer {i}: head indices must be sorted and without repeats, got {list(layer)!r}")


class DexAttention(ConvertedAttention):
    """A pretrained model's standard attention with DEX's value-side difference on selected heads (see the module
    doc): ``n_heads`` heads of width ``d = dim / n_heads`` over ``n_kv_heads`` kv groups, one softmax map each;
    a selected head's output ``A V`` becomes ``A V (I - lambda W)``, ``W`` (``dex_map``) one ``d x d`` map per
    layer, ``lambda`` DIFF V1's re-parameterised scalar (``lambda_init`` 0 unless set), no per-head norm."""

    components = 1  # one softmax map per head: the difference is taken on the value side
    width_parts = 1
    Options = DexOptions
    remote_kind = "dex"

    def __init__(self, dim: int, n_heads: int, layer_idx: int, n_kv_heads: Optional[int] = None,
                 rope_theta: float = 10000.0, *, backend: str = "auto", norm_eps: float = 1e-5,
                 lambda_init: Optional[float] = None, heads: Optional[list] = None, qkv_bias: bool = False):
        super().__init__(dim, n_heads, layer_idx, n_kv_heads, rope_theta, backend=backend, norm_eps=norm_eps,
                         lambda_init=lambda_init, qkv_bias=qkv_bias)  # one query/key component per head
        DexOptions(heads)
        if heads is None:
            self.selected = tuple(range(n_heads))
        elif layer_idx >= len(heads) or any(j >= n_heads for j in heads[layer_idx]):
            raise _heads_error(f"has no valid entry for layer {layer_idx} of {n_heads} heads, got {heads!r}")
        else:
            self.selected = tuple(heads[layer_idx])
        self.dex_map = nn.Parameter(torch.eye(self.head_dim, dtype=torch.float32))

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        heads = config.options_dict()["heads"]
        if heads is None:
            return
        if len(heads) != config.n_layers:
            raise _heads_error(f"has {len(heads)} layer lists, the model has n_layers={config.n_layers}")
        for i, layer in enumerate(heads):
            if any(j >= config.n_heads for j in layer):
                raise _heads_error(f"layer {i}: {list(layer)} names a head beyond n_heads={config.n_heads}")

    @classmethod
    def parameter_delta(cls, config) -> list[tuple[str, int, str]]:
        d = config.head_dim
        return [("dex_map (W: one d x d map per layer, shared by its selected heads)", d * d, "d²"),
                ("lambda_q1, lambda_k1, lambda_q2, lambda_k2", 4 * d, "4·d")]

    @classmethod
    def hf_refusal(cls, config) -> Optional[str]:
        return ("attention='dex' cannot be exported: no transformers class applies a learned map (I - lambda W) to "
                "selected heads' outputs; the map is linear and folds into o_proj: export --as llama writes that "
                "Llama (the same function, lambda and W forgotten), and without --no-remote-code difftx's own code")

    llama_fold_multiplies = True  # (I - lambda W) into o_proj's columns

    @classmethod
    def llama_fold(cls, config, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A selected head outputs ``A V (I - lambda W)``, and ``out_proj`` follows. So the map goes into
        ``out_proj``'s ``d`` input columns of head ``h``: ``out_proj[:, h] = out_proj[:, h] (I - lambda W)^T``.
        With GQA a value serves several heads, so ``v_proj`` cannot take it."""
        H, d, out = config.n_heads, config.head_dim, {}
        heads = config.options_dict()["heads"]
        for i in range(config.n_layers):
            a = f"layers.{i}.attn."
            selected = range(H) if heads is None else heads[i]
            if not selected:
                continue
            lam = saved_lambda(config, state, i).double()
            m = torch.eye(d, dtype=torch.float64) - lam * state[a + "dex_map"].double()  # O_h -> O_h (I - lambda W)
            o = state[a + "out_proj.weight"]
            cols = o.double().view(-1, H, d).clone()  # (D, H, d): head h's input columns
            for h in selected:
                cols[:, h] = cols[:, h] @ m.T
            out[a + "out_proj.weight"] = cols.view(-1, H * d).to(o.dtype).contiguous()
        return out

    def init_parameters(self, draw: Callable[[str, float], None], std: float) -> None:
        """The projections as every kind's; ``dex_map`` the identity; ``lambda_q1``, ``lambda_k1`` ``N(0, 0.1)``
        and the second pair equal to the first (``lambda`` exactly 0, with a gradient)."""
        super().init_parameters(draw, std)
        if not self.dex_map.is_meta:
            with torch.no_grad():
                self.dex_map.copy_(torch.eye(self.head_dim))

    def kernel_lambda(self) -> None:
        """None: the core computes one softmax map per head and subtracts nothing (see :meth:`value_lambda`)."""
        return None

    def value_lambda(self) -> Tensor:
        """``lambda_scale * lambda``, the factor of ``A V W`` in a selected head: the trainer's warm-up factor
        (``TrainConfig.lambda_warmup``) times the re-parameterised lambda; ``(K,)`` in a stack."""
        return DiffAttention.kernel_lambda(self)

    def capture_maps(self, x: Tensor, maps: AttentionMaps) -> tuple[Tensor, Optional[Tensor]]:
        """Each head's softmax map (the one applied to its values) and the scalar lambda of the value side."""
        return maps.effective, self.value_lambda().detach()

    def _mask(self, device, dtype) -> Tensor:
        """``(H, 1)``: 1 for a selected head, 0 for the others."""
        if torch.compiler.is_compiling():  # a constant of the graph, not a tensor kept on the module
            return torch.tensor([[float(h in self.selected)] for h in range(self.n_heads)], device=device, dtype=dtype)
        key = (device, dtype)
        cached = self.__dict__.get("_dex_mask")
        if cached is None or cached[0] != key:
            mask = torch.zeros(self.n_heads, 1, device=device, dtype=dtype)
            mask[list(self.selected)] = 1.0
            cached = self.__dict__["_dex_mask"] = (key, mask)
        return cached[1]

    def finish(self, out: Tensor, extra: Optional[Tensor]) -> Tensor:
        """``O (I - lambda W)`` for the selected heads of the core's ``out`` ``(..., H, d)`` (leading ``(B, T)``,
        or ``(K, B, T)`` in a stack with ``(K,)`` lambdas and ``(K, d, d)`` maps), computed in float32; the other
        heads' outputs unchanged."""
        if not self.selected:
            return out
        acc = at_least_fp32(out.dtype)
        o = out if out.dtype == acc else out.to(acc)
        w = stacked_like(self.dex_map, o, 2)
        lam = stacked_like(self.value_lambda(), o, 0)
        if len(self.selected) < self.n_heads:
            lam = lam * self._mask(o.device, acc)
        res = o - lam.to(acc) * torch.matmul(o, w if w.dtype == acc else w.to(acc))
        return res if res.dtype == out.dtype else res.to(out.dtype)
