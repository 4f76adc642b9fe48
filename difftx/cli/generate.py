"""``difftx generate``: sample a continuation of a prompt from a checkpoint (KV-cached)."""

from __future__ import annotations

import argparse

from .args import check_device, non_negative_float, non_negative_int, positive_int, probability, seed_int


def register(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint",
                       description="Load a checkpoint folder (or a run folder: its latest checkpoint) with its "
                                   "tokenizer and continue a prompt, using the KV cache.")
    p.add_argument("checkpoint", help="checkpoint folder (…/checkpoints/step_N) or run folder")
    p.add_argument("--prompt", default="", help="text to continue (default: empty, i.e. a new document)")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=200,
                   help="most tokens to add (default 200; refused when their KV cache would not fit in memory)")
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 decodes greedily")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=probability, default=None, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer, for a model folder without one saved ('byte' or a path); one other than "
                        "the tokenizer saved with the checkpoint is refused")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..generation import CacheTooLargeError  # lazy: torch; --help stays fast
    from ..training.inference import check_utf8, generate_text  # lazy: torch; --help stays fast

    check_utf8(args.prompt, "--prompt")
    device = check_device(args.device)  # before loading anything
    try:
        text = generate_text(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             tokenizer=args.tokenizer, device=device)
    except CacheTooLargeError as e:
        n = args.max_new_tokens
        raise ValueError(str(e).replace(f"max_new_tokens={n}", f"--max-new-tokens {n}", 1)) from None
    print(args.prompt + text)
    return 0
