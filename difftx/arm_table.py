"""The arm table: the names of the arms a paired comparison can hold, what each is, the sets of them a comparison
can ask for, the pair a comparison answers first and what reports call its arms. Plain data, no torch: the command
line, the reports and the plots read it without loading a model. How each arm's config is derived from a DIFF V1
config is :func:`difftx.config.arm_config`'s."""

from __future__ import annotations

# the pair a comparison answers first unless its preset names another: DIFF against its parameter-matched baseline;
# every study reads an arm against the second (the reference arm)
PRIMARY = ("diff", "baseline")
ARM_LABELS = {"diff": "DIFF", "baseline": "baseline"}  # what reports call the built-in primary arms
ARM_WORDS = {"diff": "DIFF", "baseline": "Transformer (baseline)"}  # and in a sentence
# the arms that are the paper's two models (its tables' numbers are keyed by these names: DIFF, Transformer)
PAPER_MODELS = {"diff": "DIFF", "baseline": "Transformer"}

ARMS: dict[str, str] = {
    "baseline": "standard attention, 2H heads of width d (baseline_config): the parameter-matched baseline",
    "diff": "DIFF V1 as configured (paper defaults: depth-schedule lambda_init, per-head norm)",
    "diff_v2": "DIFF V2 with 2H output heads of width d (4H query heads, 2Hkv kv heads): its baseline is 'baseline'",
    "gated": "the baseline's heads with an elementwise output gate sigmoid(x W_g), W_g: D -> 2H·d (Qiu et al. 2025)",
    "gated_headwise": "the baseline's heads with a head-wise output gate, W_g: D -> 2H",
    "gated_matched": "the elementwise-gated arm with a narrower SwiGLU (hidden width less D·2H·d / 3D), so that "
                     "its parameter count matches the baseline's to within one hidden unit per layer",
    "no_subtraction": "DIFF with lambda fixed at 0: the second map is not subtracted (no lambda parameters)",
    "diff_no_head_norm": "DIFF without the per-head RMSNorm (paper Table 6)",
    "diff_lambda_0.8": "DIFF with a constant lambda_init = 0.8 (paper Table 6)",
    "diff_lambda_0.5": "DIFF with a constant lambda_init = 0.5 (paper Table 6)",
    "diff_lambda_0.2": "DIFF with a constant lambda_init = 0.2 (its output scale 1 - lambda_init = 0.8)",
    "diff_lambda_0.4": "DIFF with a constant lambda_init = 0.4 (output scale 0.6)",
    "diff_lambda_0.6": "DIFF with a constant lambda_init = 0.6 (output scale 0.4)",
    "diff_out_0.2": "DIFF with the depth schedule's lambda_init and each head's output scaled by 0.2 instead of "
                    "1 - lambda_init (the scale of lambda_init 0.8, without its lambda)",
    "diff_lambda_0.8_out_0.8": "DIFF with lambda_init = 0.8 and each head's output scaled by 0.8 instead of 0.2 "
                               "(the lambda of 0.8, without its scale)",
    "baseline_out_0.2": "the baseline with each head's output scaled by 0.2 (DIFF lambda_init 0.8's scale, no "
                        "subtraction)",
    "baseline_out_0.8": "the baseline with each head's output scaled by 0.8",
    "baseline_out_schedule": "the baseline with each head's output scaled by 1 - the depth schedule's lambda_init "
                             "(DIFF's own scale, no subtraction)",
    "baseline_head_norm_out_0.2": "the baseline with a per-head RMSNorm and each head's output scaled by 0.2",
    "baseline_head_norm_out_0.8": "the baseline with a per-head RMSNorm and each head's output scaled by 0.8",
    "baseline_head_norm_out_schedule": "the baseline with a per-head RMSNorm scaled by 1 - the depth schedule's "
                                       "lambda_init (DIFF's norm and scale, no subtraction)",
    "baseline_head_norm": "the baseline (2H heads of width d) with a per-head RMSNorm",
    "baseline_wide": "standard attention, H heads of width 2d (paper Table 6: Transformer 8 x 256)",
    "baseline_wide_head_norm": "standard attention, H heads of width 2d, with a per-head RMSNorm "
                               "(paper Table 6: + GroupNorm)",
    "temperature": "the baseline's heads with a learned softmax temperature per head (exp(t_h) times the logits, "
                   "t_h = 0 at initialisation): does DIFF only sharpen?",
    "diff_nope": "DIFF without RoPE (NoPE: no positional encoding)",
    "baseline_nope": "the baseline without RoPE (NoPE: no positional encoding)",
}

ARM_SETS: dict[str, tuple[str, ...]] = {
    "default": ("baseline", "diff"),
    # paper Table 6, in its order, and the baseline with the per-head norm at DIFF's head count
    "paper-ablations": ("baseline", "baseline_wide", "baseline_wide_head_norm", "diff", "diff_no_head_norm",
                        "diff_lambda_0.8", "diff_lambda_0.5", "baseline_head_norm"),
    # other ways to remove attention noise, and the control that removes DIFF's subtraction
    "alternatives": ("baseline", "diff", "diff_v2", "gated", "gated_matched", "gated_headwise", "no_subtraction"),
    # recall-cpu's arms and the controls of its question: does DIFF only sharpen? is RoPE's pattern the noise?
    "recall-controls": ("baseline", "diff", "diff_lambda_0.8", "temperature", "diff_nope", "baseline_nope"),
    # the regime map's ingredients (docs/compare.md "The regime map"): lambda_init as a constant, the output scale
    # decoupled from it, the per-head norm, and the baseline with the same scales, with and without the norm
    "regime": ("baseline", "diff", "diff_lambda_0.2", "diff_lambda_0.4", "diff_lambda_0.6", "diff_lambda_0.8",
               "diff_out_0.2", "diff_lambda_0.8_out_0.8", "diff_no_head_norm", "baseline_out_0.2", "baseline_out_0.8",
               "baseline_head_norm", "baseline_head_norm_out_0.2", "baseline_head_norm_out_0.8"),
    # the subtraction against the scale alone: lambda_init 0.8, its scale without the lambda, its lambda without
    # the scale, and the baseline at both scales
    "regime-scale": ("baseline", "diff", "diff_lambda_0.8", "diff_out_0.2", "diff_lambda_0.8_out_0.8",
                     "baseline_out_0.2", "baseline_out_0.8", "baseline_head_norm_out_0.2"),
    "all": tuple(ARMS),
}
