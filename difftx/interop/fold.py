"""Exact folds into a plain Llama (``difftx export --as llama``, ``export_hf(..., fold="llama")``).

Some kinds compute a function that a ``LlamaForCausalLM`` computes with other weights. :func:`to_llama` writes
those weights: a ``standard`` config and difftx state dict, which :func:`~difftx.interop.hf.to_hf_state` then
lays out for transformers. Legend: ``H`` heads, ``Hkv`` kv groups, ``d`` head width, ``D`` model width.

- ``standard`` (no per-head norm, no ``out_scale``): nothing to fold.
- ``temperature``: head ``h``'s logits are ``exp(t_h) q.k / sqrt(d)``. The factor scales the query, and RoPE is a
  rotation (linear), so it goes into ``q_proj``'s ``d`` rows of head ``h``: ``q_proj[h] *= exp(t_h)``.
- ``dex``: a selected head outputs ``A V (I - lambda W)``, and ``out_proj`` follows. So the map goes into
  ``out_proj``'s ``d`` input columns of head ``h``: ``out_proj[:, h] = out_proj[:, h] (I - lambda W)^T``. With GQA
  a value serves several heads, so ``v_proj`` cannot take it.
- ``converted``: where lambda is exactly 0 in every layer (as at conversion), each head computes
  ``A1 V``: the source's attention. The negative component's q/k rows (and biases) and the lambda vectors are
  dropped.

A model with q/k/v biases (``qkv_bias``: a converted Qwen2) folds the same way; the biases are kept, so the folded
config is a ``standard`` one with ``qkv_bias``, which export writes as a ``Qwen2ForCausalLM`` (Llama's architecture
plus those biases: ``LlamaForCausalLM`` has no switch for q/k/v biases without one on ``o_proj``).

lambda is computed as the model computes it (:class:`~difftx.ops.LambdaFunction`, float32 for float32 or lower
weights), ``lambda_init`` included. A fold is computed in float64 and cast to the weights' dtype.

Anything else is refused in one line naming the kind and the field (:class:`ConversionError`): a kind with a
second softmax map, a gate or a per-head norm, NoPE, a ``converted`` model whose lambda moved, a model in the
middle of a lambda warm-up, a kind of your own.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..config import ModelConfig
from ..ops import at_least_fp32, lambda_value
from .remote import builtin_kind
from .state import ConversionError, _check_shapes, _expected_state

FOLDS = ("llama",)  # what `--as` / fold= accepts
PREFIX = "--as llama"
LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")

# built-in kinds with no exact fold, and why (a kind of your own gets the generic line)
_NO_FOLD = {
    "diff": "each head subtracts a second softmax map (A1 - lambda A2) V and normalises per head, which no Llama "
            "computes; export it without --as (DiffLlamaForCausalLM computes it exactly)",
    "diff_v2": "each head subtracts a second softmax map scaled by the token-dependent sigmoid(lambda_proj(x)), "
               "which no Llama computes",
    "gated": "each head is multiplied by sigmoid(x W_g), which depends on the input: no fixed weights compute it",
}


def check_fold(fold: Optional[str], remote_code: Optional[bool]) -> None:
    """Refuse a ``fold`` other than None or ``"llama"``, and ``"llama"`` with ``remote_code=True``."""
    if fold is None:
        return
    if fold not in FOLDS:
        raise ConversionError(f"--as: must be one of {list(FOLDS)}, got {fold!r}")
    if remote_code:
        raise ConversionError(f"{PREFIX} writes a plain LlamaForCausalLM folder without custom code, --remote-code "
                              f"writes difftx's modeling code: choose one")


def _refuse(config: ModelConfig, reason: str) -> ConversionError:
    return ConversionError(f"{PREFIX}: attention={config.attention!r}: {reason}")


def _kind(config: ModelConfig) -> str:
    """The built-in kind of ``config`` that has a fold, else a refusal naming why not."""
    kind = builtin_kind(config)
    if kind is None:
        raise _refuse(config, f"{config.kind_class.__name__} is a kind of your own; --as llama folds the built-in "
                              f"kinds standard, temperature, dex, and converted at lambda 0")
    if kind in _NO_FOLD:
        raise _refuse(config, _NO_FOLD[kind])
    if kind == "standard" and config.out_scale is not None:
        raise _refuse(config, f"out_scale={config.out_scale!r} is not folded (a constant head scale, an ablation's "
                              f"setting; --as llama folds learned maps only): export it without --as")
    if kind == "standard" and config.uses_head_norm:
        raise _refuse(config, "head_norm=true: a per-head RMSNorm is not linear, so no Llama weights compute it")
    if not config.rope:
        raise _refuse(config, "rope=false (NoPE): a Llama always rotates q and k by RoPE")
    return kind


def layer_lambda(config: ModelConfig, state: dict[str, Tensor], layer: int) -> Tensor:
    """Layer ``layer``'s lambda as the model computes it: ``exp(lq1.lk1) - exp(lq2.lk2) + lambda_init`` in float32
    (float64 for float64 vectors)."""
    a = f"layers.{layer}.attn."
    vectors = [state[a + n] for n in LAMBDAS]
    acc = at_least_fp32(vectors[0].dtype)
    with torch.no_grad():
        return lambda_value(*(v.to(acc) for v in vectors), float(config.lambda_init or 0.0))


def _cast(new: Tensor, like: Tensor) -> Tensor:
    return new.to(like.dtype).contiguous()


def _fold_temperature(config: ModelConfig, state: dict[str, Tensor], out: dict[str, Tensor]) -> None:
    H, d = config.n_heads, config.head_dim
    for i in range(config.n_layers):
        a = f"layers.{i}.attn."
        q = state[a + "q_proj.weight"]
        scale = state[a + "log_temperature"].double().exp()  # (H,)
        out[a + "q_proj.weight"] = _cast((q.double().view(H, d, -1) * scale[:, None, None]).view(H * d, -1), q)


def _fold_dex(config: ModelConfig, state: dict[str, Tensor], out: dict[str, Tensor]) -> None:
    H, d = config.n_heads, config.head_dim
    heads = config.options_dict()["heads"]
    for i in range(config.n_layers):
        a = f"layers.{i}.attn."
        selected: Sequence[int] = range(H) if heads is None else heads[i]
        if not selected:
            continue
        lam = layer_lambda(config, state, i).double()
        m = torch.eye(d, dtype=torch.float64) - lam * state[a + "dex_map"].double()  # O_h -> O_h (I - lambda W)
        o = state[a + "out_proj.weight"]
        cols = o.double().view(-1, H, d).clone()  # (D, H, d): head h's input columns
        for h in selected:
            cols[:, h] = cols[:, h] @ m.T
        out[a + "out_proj.weight"] = _cast(cols.view(-1, H * d), o)


def _fold_converted(config: ModelConfig, state: dict[str, Tensor], out: dict[str, Tensor]) -> None:
    d, D = config.head_dim, config.dim
    for i in range(config.n_layers):
        lam = float(layer_lambda(config, state, i))
        if lam != 0.0:
            raise _refuse(config, f"layer {i}'s lambda is {lam:.6g}, not 0 (lambda_init={config.lambda_init or 0}): "
                                  f"the second softmax map is subtracted, so the folded model would compute a "
                                  f"different function")
    for i in range(config.n_layers):
        a = f"layers.{i}.attn."
        for name, groups in (("q_proj.weight", config.n_heads), ("k_proj.weight", config.kv_groups)):
            w = state[a + name]  # rows (groups, c, d): c = 0 the source's component
            out[a + name] = w.view(groups, 2, d, D)[:, 0].reshape(groups * d, D).contiguous()
            if config.qkv_bias:  # the bias entries of those rows
                b = state[a + name.replace(".weight", ".bias")]
                out[a + name.replace(".weight", ".bias")] = b.view(groups, 2, d)[:, 0].reshape(groups * d).contiguous()


_FOLDS = {"standard": None, "temperature": _fold_temperature, "dex": _fold_dex, "converted": _fold_converted}


def to_llama(config: ModelConfig, state: dict[str, Tensor], *, source: str = "state dict",
             lambda_scales: Sequence[float] = ()) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``(standard config, its difftx state dict)`` of a Llama that computes what ``config`` with ``state``
    computes (see the module doc), or :class:`ConversionError` in one line. ``lambda_scales``: each layer's
    lambda warm-up factor when the model is in memory (a factor other than 1 is refused: a saved model subtracts
    its whole lambda). ``state`` is checked against ``config`` first (``source`` names it)."""
    kind = _kind(config)
    _check_shapes(state, _expected_state(config), source)
    moving = [(i, s) for i, s in enumerate(lambda_scales) if s != 1.0]
    if moving and kind in ("dex", "converted"):
        i, s = moving[0]
        raise _refuse(config, f"layer {i}'s lambda_scale is {s} (a lambda warm-up in progress): the model in memory "
                              f"subtracts lambda times that factor, a saved one its whole lambda; save it after the "
                              f"warm-up, or export its folder")
    llama = config.plain(attention="standard")  # export_hf checks that a transformers class computes it
    expected = _expected_state(llama)
    out = {k: v for k, v in state.items() if k in expected}
    fold = _FOLDS[kind]
    if fold is not None:
        fold(config, state, out)
    _check_shapes(out, expected, f"{source} folded")
    return llama, out
