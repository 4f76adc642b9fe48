"""``difftx generate``: sample a continuation of a prompt from a checkpoint (KV-cached)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint",
                       description="Load a checkpoint folder (or a run folder: its latest checkpoint) with its "
                                   "tokenizer and continue a prompt, using the KV cache.")
    p.add_argument("checkpoint", help="checkpoint folder (…/checkpoints/step_N) or run folder")
    p.add_argument("--prompt", default="", help="text to continue (default: empty, i.e. a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 decodes greedily")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="override the checkpoint's tokenizer ('byte' or a path)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from ..checkpoint import CheckpointError
    from ..training.inference import generate_text

    try:
        text = generate_text(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             tokenizer=args.tokenizer, device=args.device)
    except CheckpointError as e:
        print(f"difftx generate: error: {e}", file=sys.stderr)
        return 2
    print(args.prompt + text)
    return 0
