"""``difftx import``: a Hugging Face DiffLlama / Llama / Mistral / Qwen2 folder to a difftx model folder.

(The module is ``import_`` because ``import`` is a Python keyword; the subcommand is ``import``.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .args import check_not_input


def register(sub) -> None:
    p = sub.add_parser(
        "import", help="import a local Hugging Face DiffLlama / Llama / Mistral / Qwen2 folder as a difftx model",
        description="Convert a local Hugging Face model folder (config.json + safetensors) into a difftx model "
                    "folder: DiffLlama -> attention='diff', Llama -> attention='standard', Mistral -> "
                    "attention='standard' when its sliding_window is null or at least max_position_embeddings "
                    "(a shorter window is refused: difftx attends to the whole context), Qwen2 -> "
                    "attention='standard' with q/k/v biases (qkv_bias; a sliding window shorter than the context is "
                    "refused likewise). The result loads with "
                    "difftx.checkpoint.load_model and fine-tunes with `difftx train --init-from`. Nothing is "
                    "downloaded.")
    p.add_argument("hf_dir", help="Hugging Face model folder (local)")
    p.add_argument("out_checkpoint", help="output difftx model folder (created; an existing one must be empty, "
                                          "see --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_CHECKPOINT when it is a non-empty folder (refused otherwise; never a folder "
                        "holding a run, a comparison or a study, at any depth)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..interop.hf import import_hf, replaced  # lazy: torch; --help stays fast

    check_not_input(args.out_checkpoint, "OUT", {"the transformers folder": args.hf_dir}, folder=True)
    gone = replaced(Path(args.out_checkpoint)) if args.overwrite else None
    out = import_hf(args.hf_dir, args.out_checkpoint, overwrite=args.overwrite)
    if gone:
        print(f"replaced {gone}")
    print(f"imported {args.hf_dir} -> {out} (difftx model folder)")
    return 0
