"""Differential attention (V1, V2), the standard baseline, output-gated attention, attention with a learned
temperature per head, a converted model's attention (and its DEX-style variant), and their kernels."""

from .kernels import BACKENDS, AttentionMaps, backend_names, register_backend, resolve_backend
from .masks import AttentionMask
from .cache import LayerKV
from .converted import ConvertedAttention
from .dex import DexAttention
from .modules import (AttentionKind, DiffAttention, DiffAttentionV2, GatedAttention, StandardAttention,
                      TemperatureAttention, lambda_init_for_layer)
from .registry import ATTENTIONS, load_kinds, register_attention

try:  # optional fused kernel: registers the "triton" backend when Triton is installed
    from .triton_kernel import register as _register_triton
except ImportError:
    pass
else:
    _register_triton()

__all__ = [
    "ATTENTIONS", "AttentionKind", "AttentionMask", "AttentionMaps", "BACKENDS", "ConvertedAttention", "DexAttention",
    "DiffAttention", "DiffAttentionV2", "GatedAttention", "LayerKV", "StandardAttention", "TemperatureAttention",
    "backend_names", "lambda_init_for_layer", "load_kinds",
    "register_attention", "register_backend", "resolve_backend",
]

