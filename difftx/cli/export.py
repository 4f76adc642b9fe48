"""``difftx export``: a difftx model folder to another toolkit's format (Hugging Face for now)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .args import check_not_input

FORMATS = ("hf",)
FOLDS = ("llama",)  # difftx.interop.fold.FOLDS (not imported here: --help stays light)


def register(sub) -> None:
    p = sub.add_parser(
        "export", help="export a model folder to Hugging Face transformers (DiffLlama / Llama / Qwen2 / difftx's code)",
        description="Convert a difftx model or checkpoint folder (config.json + model.safetensors) into a "
                    "Hugging Face folder that transformers.AutoModelForCausalLM.from_pretrained loads: 'diff' -> "
                    "DiffLlamaForCausalLM and 'standard' -> LlamaForCausalLM (Qwen2ForCausalLM with q/k/v biases), "
                    "without custom code; every other "
                    "built-in kind (diff_v2, gated, temperature, converted, dex, NoPE, DIFF's ablations, 'standard' "
                    "with a per-head norm or output scale) -> DifftxForCausalLM, whose code (modeling_difftx.py, "
                    "configuration_difftx.py, needing torch and transformers, not difftx) is written beside the "
                    "weights and loads with trust_remote_code=True. A kind registered beyond the built-in ones is "
                    "refused before anything is written. --as llama writes a plain LlamaForCausalLM (Qwen2ForCausalLM "
                    "with q/k/v biases; no custom "
                    "code) for a model a Llama computes exactly with other weights: 'temperature' (exp(t_h) folded "
                    "into q_proj), 'dex' (I - lambda W folded into o_proj), 'converted' with lambda exactly 0 in every "
                    "layer (its source's weights), plain 'standard'; any other model is refused in one line. The "
                    "tokenizer (tokenizer.json, or difftx's byte tokenizer converted to one) is written beside the "
                    "model. See docs/interop.md.")
    p.add_argument("checkpoint", help="difftx model or checkpoint folder, or a training run folder (its latest "
                                       "checkpoint)")
    p.add_argument("out_dir", help="output folder (created; an existing one must be empty, see --overwrite)")
    p.add_argument("--format", choices=FORMATS, default="hf", help="output format (default: hf)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="take the tokenizer from DIR (default: the checkpoint's tokenizer/ folder, else the "
                        "checkpoint folder)")
    p.add_argument("--remote-code", action=argparse.BooleanOptionalAction, default=None,
                   help="--remote-code: write difftx's modeling code for every kind, 'diff' and 'standard' too; "
                        "--no-remote-code: write DiffLlama / Llama only, refusing the rest (default: DiffLlama / "
                        "Llama where they compute the model exactly, else difftx's code)")
    p.add_argument("--as", dest="fold", choices=FOLDS, default=None,
                   help="llama: fold the model into a plain LlamaForCausalLM computing the same function (temperature, "
                        "dex, converted at lambda 0, standard); refused in one line where the function would change "
                        "(default: no fold)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR when it is a non-empty folder (refused otherwise: nothing is overwritten; "
                        "never a folder holding a run, a comparison or a study, at any depth)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..interop.fold import check_fold  # lazy: torch; --help stays fast
    from ..interop.hf import export_hf, replaced, resolve_model_folder  # lazy: torch; --help stays fast

    check_fold(args.fold, args.remote_code)
    check_not_input(args.out_dir, "OUT_DIR", {"the checkpoint": args.checkpoint, "--tokenizer": args.tokenizer},
                    folder=True)
    src = resolve_model_folder(args.checkpoint)
    gone = replaced(Path(args.out_dir)) if args.overwrite else None
    out = export_hf(args.checkpoint, args.out_dir, tokenizer_dir=args.tokenizer, overwrite=args.overwrite,
                    remote_code=args.remote_code, fold=args.fold)
    if gone:
        print(f"replaced {gone}")
    what = f" (checkpoint {src.name})" if Path(args.checkpoint).resolve() != src.resolve() else ""
    remote = (out / "modeling_difftx.py").is_file()
    how = "difftx's modeling code: load with trust_remote_code=True" if remote else "no custom code"
    if args.fold:
        arch = json.loads((out / "config.json").read_text()).get("architectures") or ["a Llama"]
        how = f"folded into a {arch[0]} computing the same function, {how}"
    print(f"exported {args.checkpoint}{what} -> {out} (Hugging Face transformers, {how})")
    return 0
