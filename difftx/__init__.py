"""difftx: the Differential Transformer (Ye et al., ICLR 2025, and V2), complete and tested."""

__version__ = "0.1.0"

from .attention import AttentionMask, DiffAttention, DiffAttentionV2, StandardAttention  # noqa: E402
from .config import PRESETS, ModelConfig, baseline_config, preset  # noqa: E402
from .model import KVCache, Transformer, lm_loss  # noqa: E402

__all__ = [
    "AttentionMask", "DiffAttention", "DiffAttentionV2", "KVCache", "ModelConfig", "PRESETS", "StandardAttention",
    "Transformer", "baseline_config", "lm_loss", "preset", "__version__",
]
