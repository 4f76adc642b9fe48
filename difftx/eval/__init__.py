"""The paper's evaluations (SPEC section 5), one small module per task.

- :mod:`.capture`: attention maps / hidden states of a forward, from outside the model
- :mod:`.lm`: token NLL, bits per byte, NLL by position (and beyond the training length), AR-hit split
- :mod:`.needle`: multi-needle retrieval, synthetic and natural-language forms, grid evaluation
- :mod:`.attention_noise`: attention to the answer and attention noise per layer
- :mod:`.outliers`: top-k / median of |attention logits| and |hidden states|
- :mod:`.quant`: absmax-quantised attention logits as a backend
- :mod:`.icl`: in-context learning order robustness
- :mod:`.stats`: paired bootstrap CI and verdicts; :mod:`.diagnostics`: lambda, head redundancy
- :mod:`.plots`: PNG plots (matplotlib, optional ``eval`` extra)

See ``docs/evaluation.md`` for definitions.
"""

from .attention_noise import attention_to_answer, layer_mass, role_mass
from .capture import AttentionCapture, CapturedMaps, capture_attention, layer_lambdas
from .diagnostics import head_redundancy, model_head_redundancy
from .icl import ICLBlock, evaluate_icl_instances
from .lm import LMResult, ar_hit_mask, bits_per_byte, evaluate_lm, length_extrapolation, token_nll
from .needle import NeedleBlock, NeedleResult, evaluate_needles, make_needle_sample
from .needle_text import evaluate_needles_text
from .outliers import MagnitudeStats, activation_outliers, magnitude_stats
from .quant import absmax_quantize, quantization_sweep, quantized_kernel, register_quantized_backend
from .stats import PairedEstimate, paired_estimate, verdict

__all__ = [
    "AttentionCapture", "CapturedMaps", "ICLBlock", "LMResult", "MagnitudeStats", "NeedleBlock", "NeedleResult",
    "PairedEstimate", "absmax_quantize", "activation_outliers", "ar_hit_mask", "attention_to_answer",
    "bits_per_byte", "capture_attention", "evaluate_icl_instances", "evaluate_lm", "evaluate_needles",
    "evaluate_needles_text", "head_redundancy", "layer_lambdas", "layer_mass", "length_extrapolation",
    "magnitude_stats", "make_needle_sample", "model_head_redundancy", "paired_estimate", "quantization_sweep",
    "quantized_kernel", "register_quantized_backend", "role_mass", "token_nll", "verdict",
]
