"""Differential attention (V1, V2), the standard baseline, output-gated attention, and their kernels."""

from .kernels import BACKENDS, AttentionMaps, backend_names, register_backend, resolve_backend
from .masks import AttentionMask
from .modules import (ATTENTIONS, DiffAttention, DiffAttentionV2, GatedAttention, LayerKV, StandardAttention,
                      lambda_init_for_layer)

try:  # optional fused kernel: registers the "triton" backend when Triton is installed
    from .triton_kernel import register as _register_triton
except ImportError:
    pass
else:
    _register_triton()

__all__ = [
    "ATTENTIONS", "AttentionMask", "AttentionMaps", "BACKENDS", "DiffAttention", "DiffAttentionV2", "GatedAttention",
    "LayerKV", "StandardAttention", "backend_names", "lambda_init_for_layer", "register_backend", "resolve_backend",
]
