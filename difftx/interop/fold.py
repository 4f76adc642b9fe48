"""Exact folds into a plain Llama (``difftx export --as llama``, ``export_hf(..., fold="llama")``).

Some kinds compute a function that a ``LlamaForCausalLM`` computes with other weights. Each kind says so itself:
its ``llama_fold`` writes those weights, or its ``llama_refusal`` says why there are none
(:class:`~difftx.attention.AttentionKind`). :func:`to_llama` asks the kind, checks what every fold needs, and
returns a ``standard`` config with its difftx state dict, which :func:`~difftx.interop.hf.to_hf_state` then lays
out for transformers. The built-in folds: ``standard`` (no per-head norm, no ``out_scale``) nothing to fold;
``temperature`` into ``q_proj``; ``dex`` into ``out_proj``; ``converted`` where lambda is exactly 0 in every layer
(its negative components dropped).

A model with q/k/v biases (``qkv_bias``: a converted Qwen2) folds the same way; the biases are kept, so the folded
config is a ``standard`` one with ``qkv_bias``, which export writes as a ``Qwen2ForCausalLM`` (Llama's architecture
plus those biases: ``LlamaForCausalLM`` has no switch for q/k/v biases without one on ``o_proj``).

lambda is computed as the model computes it (:class:`~difftx.ops.LambdaFunction`, float32 for float32 or lower
weights), ``lambda_init`` included. A fold is computed in float64 and cast to the weights' dtype.

Anything else is refused in one line naming the kind and the field (:class:`ConversionError`): the kind's own
reason (a second softmax map, a gate, a per-head norm, a ``converted`` model whose lambda moved), NoPE, a model
in the middle of a lambda warm-up, a kind with no fold (one of your own).
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from ..attention.registry import BUILTIN_KINDS
from ..config import ModelConfig
from .state import ConversionError, _check_shapes, _expected_state

FOLDS = ("llama",)  # what `--as` / fold= accepts
PREFIX = "--as llama"


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


def refusal(config: ModelConfig) -> Optional[str]:
    """Why ``config`` has no exact fold into a plain Llama (one line, without the prefix), or None: the kind's own
    reason, a kind with no fold, NoPE."""
    kind = config.kind_class
    reason = kind.llama_refusal(config)
    if reason is None and kind.llama_fold is None:
        folding = ", ".join(name for name, cls in BUILTIN_KINDS.items() if cls.llama_fold is not None)
        reason = (f"{kind.__name__} is a kind of your own with no fold (llama_fold); --as llama folds the built-in "
                  f"kinds {folding}")
    if reason is None and not config.rope:
        reason = "rope=false (NoPE): a Llama always rotates q and k by RoPE"
    return reason


def to_llama(config: ModelConfig, state: dict[str, Tensor], *, source: str = "state dict",
             lambda_scales: Sequence[float] = ()) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``(standard config, its difftx state dict)`` of a Llama that computes what ``config`` with ``state``
    computes (see the module doc), or :class:`ConversionError` in one line. ``lambda_scales``: each layer's
    lambda warm-up factor when the model is in memory (a factor other than 1 is refused: a saved model subtracts
    its whole lambda). ``state`` is checked against ``config`` first (``source`` names it)."""
    reason = refusal(config)
    if reason is not None:
        raise _refuse(config, reason)
    _check_shapes(state, _expected_state(config), source)
    moving = [(i, s) for i, s in enumerate(lambda_scales) if s != 1.0]
    if moving:  # only a kind with a lambda has a warm-up factor
        i, s = moving[0]
        raise _refuse(config, f"layer {i}'s lambda_scale is {s} (a lambda warm-up in progress): the model in memory "
                              f"subtracts lambda times that factor, a saved one its whole lambda; save it after the "
                              f"warm-up, or export its folder")
    llama = config.plain(attention="standard")  # export_hf checks that a transformers class computes it
    expected = _expected_state(llama)
    out = {k: v for k, v in state.items() if k in expected}
    try:
        out.update(config.kind_class.llama_fold(config, state))
    except ValueError as e:  # the kind's refusal of these weights
        raise _refuse(config, str(e)) from e
    _check_shapes(out, expected, f"{source} folded")
    return llama, out
